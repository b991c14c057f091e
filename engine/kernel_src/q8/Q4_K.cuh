// Q4_K with Q8_K activations (matvec_q8.cu): 144-byte native blocks, fp16 d @0, dmin @2, scales[12] @4
// (8 6-bit scales + 8 6-bit mins, get_scale_min_k4), qs[128] @16: value 64j + l = qs[32j + l] & 15,
// 64j + 32 + l = qs[32j + l] >> 4 (l < 32); w = d * sc * q - dmin * m per 32 values.
// Lane p (8 per block): j = p / 2, half h = p % 2: bytes qs[32j + 16h .. +16), i.e. values 64j + 16h + i (low
// nibbles, sub-block 2j) and 64j + 32 + 16h + i (high nibbles, sub-block 2j + 1); the even lane adds the mins.
#define Q8_FMT 2
#define LPB 8
#define HAS_MIN 1
__device__ __forceinline__ void lane_sums(const float* sc, const u8* __restrict__ blk, const i8* __restrict__ y,
                                          const i16* __restrict__ ys, const i16* __restrict__ yt, const int p,
                                          int* S, int* M, const bool wide) {
    (void)sc; (void)ys;
    const int j = p >> 1, h = p & 1;
    u32 w[4], s[3], yl[4], yh[4];
    load_weight_words(wide, blk + 16 + 32 * j + 16 * h, w, 16);
    load_words(blk + 4, s, 12);
    load_words_v((const u8*)(y + 64 * j + 16 * h), yl, 16);
    load_words_v((const u8*)(y + 64 * j + 32 + 16 * h), yh, 16);
    int dl = 0, dh = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        dl = dp4a((int)(w[k] & 0x0f0f0f0fu), (int)yl[k], dl);
        dh = dp4a((int)((w[k] >> 4) & 0x0f0f0f0fu), (int)yh[k], dh);
    }
    int sc0, m0, sc1, m1;
    scale_min_k4_words(s, 2 * j, &sc0, &m0);
    scale_min_k4_words(s, 2 * j + 1, &sc1, &m1);
    *S = sc0 * dl + sc1 * dh;
    *M = h ? 0 : m0 * (int)yt[2 * j] + m1 * (int)yt[2 * j + 1];
}
__device__ __forceinline__ void blk_scales(const float* sc, const u8* __restrict__ blk, float* dw, float* dm) {
    (void)sc;
    *dw = h2f(ld16(blk));
    *dm = h2f(ld16(blk + 2));
}
