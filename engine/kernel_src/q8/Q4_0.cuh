// Q4_0 with Q8_0 activations (matvec_q8.cu): engine form sc[0] = fp32(d), payload = qs[16]: value j =
// (qs[j] & 15) - 8, value j + 16 = (qs[j] >> 4) - 8. Lane p (4 per block): values 8p .. 8p + 8 = the low
// (p < 2) or high (p >= 2) nibbles of qs[8 (p & 1) .. +8); sum((n - 8) y) = sum(n y) - 8 sum(y), exact.
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
    const u32 v[2] = {(w[0] >> sh) & 0x0f0f0f0fu, (w[1] >> sh) & 0x0f0f0f0fu};
    *S = dot8(v, yv, 0) - 8 * sum8(yv);
    *M = 0;
}
