// Q5_0 with Q8_0 activations (matvec_q8.cu): engine form sc[0] = fp32(d), payload = qh (u32 LE) || qs[16]: value
// j = ((qs[j] & 15) | bit j of qh << 4) - 16, value j + 16 = ((qs[j] >> 4) | bit j + 16 of qh << 4) - 16.
// Lane p (4 per block): values 8p .. 8p + 8 (nibbles as Q4_0, high bits 8p .. 8p + 8 of qh); the -16 through
// 16 sum(y), exact.
#define Q8_FMT 1
#define LPB 4
#define HAS_MIN 0
__device__ __forceinline__ void lane_sums(const float* sc, const u8* __restrict__ q, const i8* __restrict__ y,
                                          const i16* __restrict__ ys, const i16* __restrict__ yt, const int p,
                                          int* S, int* M, const bool wide) {
    (void)wide;
    (void)sc; (void)ys; (void)yt;
    u32 w[2], yv[2], qh;
    load_words(q, &qh, 4);
    load_words(q + 4 + 8 * (p & 1), w, 8);
    load_words_v((const u8*)(y + 8 * p), yv, 8);
    const int sh = 4 * (p >> 1);
    const u32 bits = (qh >> (8 * p)) & 0xffu;
    u32 v[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 hb = bits >> (4 * i);  // bits of values 4i .. 4i + 3 of this lane
        const u32 hi = ((hb & 1u) | ((hb & 2u) << 7) | ((hb & 4u) << 14) | ((hb & 8u) << 21)) << 4;
        v[i] = ((w[i] >> sh) & 0x0f0f0f0fu) | hi;
    }
    *S = dot8(v, yv, 0) - 16 * sum8(yv);
    *M = 0;
}
