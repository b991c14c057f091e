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
// A weight's bytes for lane_sums: wide loads (load_words_v) where the weight is in device memory (wide = true), word
// loads (load_words) where it is a host-tier expert read over PCIe through the mapping - there the wide loads were
// measured slower (30B-A3B, no expert resident: the step 29.1 -> 38.8 ms; in VRAM they were faster: 3.94 -> 3.70 ms;
// bench/results/h200-2026-12-02v-*, -02r-profile.log). The same words either way.
__device__ __forceinline__ void load_weight_words(const bool wide, const u8* __restrict__ p, u32* w, const int n) {
    if (wide)
        load_words_v(p, w, n);
    else
        load_words(p, w, n);
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
