// F32 (id 0): plain IEEE f32 values; load_w(b, i) = value i.
__device__ __forceinline__ float load_w(const u8* b, i64 i) { return ((const float*)b)[i]; }
