// Q8_0 with Q8_0 activations (matvec_q8.cu): engine form sc[0] = fp32(d), payload = qs[32] (int8 values).
// Lane p (4 per block): values 8p .. 8p + 8.
#define Q8_FMT 1
#define LPB 4
#define HAS_MIN 0
__device__ __forceinline__ void lane_sums(const float* sc, const u8* __restrict__ q, const i8* __restrict__ y,
                                          const i16* __restrict__ ys, const i16* __restrict__ yt, const int p,
                                          int* S, int* M, const bool wide) {
    (void)sc; (void)ys; (void)yt;
    u32 w[2], yv[2];
    load_weight_words(wide, q + 8 * p, w, 8);
    load_words_v((const u8*)(y + 8 * p), yv, 8);
    *S = dot8(w, yv, 0);
    *M = 0;
}
