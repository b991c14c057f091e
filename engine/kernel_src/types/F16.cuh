// F16 (id 1): plain IEEE fp16 values; load_w(b, i) = value i widened to f32 (h2f, exact).
__device__ __forceinline__ float load_w(const u8* b, i64 i) { return h2f(((const u16*)b)[i]); }
