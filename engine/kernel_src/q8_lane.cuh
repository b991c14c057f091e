// Helpers of the q8 lane code (q8/<TYPE>.cuh), concatenated before it by assembly.q8_type_source (after the type's
// generated defines): 8-value integer dots and the widened types' block scale. Integers only: exact in any order.

// c + the dot of 8 weight bytes (two words w, signed bytes) with 8 activation bytes (two words yv).
__device__ __forceinline__ int dot8(const u32* w, const u32* yv, const int c) {
    return dp4a((int)w[1], (int)yv[1], dp4a((int)w[0], (int)yv[0], c));
}
// The sum of 8 activation bytes (two words yv): the offset term of the types whose values carry a bias.
__device__ __forceinline__ int sum8(const u32* yv) {
    return dp4a(0x01010101, (int)yv[1], dp4a(0x01010101, (int)yv[0], 0));
}
#if NF > 0
// Widened types (Q4_0, Q5_0, Q8_0, IQ4_NL): the engine form's f32 scale plane holds fp32 of the block's fp16 d - the
// value the CPU kernel widens from the native block; no min.
__device__ __forceinline__ void blk_scales(const float* sc, const u8* __restrict__ q, float* dw, float* dm) {
    (void)q;
    *dw = sc[0];
    *dm = 0.0f;
}
#endif
