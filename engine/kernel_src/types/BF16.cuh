// BF16 (id 30; the pool's F32-from-BF16 re-rounded to 16 bits by engine form): load_w(b, i) =
// u16 << 16 (ggml_compute_bf16_to_fp32, exact).
__device__ __forceinline__ float load_w(const u8* b, i64 i) { return __uint_as_float(((u32)((const u16*)b)[i]) << 16); }
