// IQ4_NL with Q8_0 activations (matvec_q8.cu): engine form sc[0] = fp32(d), payload = qs[16]: value j =
// kvalues_iq4nl[qs[j] & 15], value j + 16 = kvalues_iq4nl[qs[j] >> 4] (int8). Lanes as Q4_0.
#define Q8_FMT 1
#define LPB 4
#define HAS_MIN 0
__device__ __forceinline__ void lane_sums(const float* sc, const u8* __restrict__ q, const i8* __restrict__ y,
                                          const i16* __restrict__ ys, const i16* __restrict__ yt, const int p,
                                          int* S, int* M, const bool wide) {
    (void)sc; (void)ys; (void)yt;
    u32 w[2], yv[2];
    load_weight_words(wide, q + 8 * (p & 1), w, 8);
    load_words_v((const u8*)(y + 8 * p), yv, 8);
    const int sh = 4 * (p >> 1);
    u32 v[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int b = 0; b < 4; ++b) v[i] |= (u32)(u8)kvalues_iq4nl[(w[i] >> (8 * b + sh)) & 15u] << (8 * b);
    *S = dot8(v, yv, 0);
    *M = 0;
}
