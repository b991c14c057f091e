// Q6_K with Q8_K activations (matvec_q8.cu): 210-byte native blocks (2-byte aligned), ql[128] @0, qh[64] @128,
// int8 scales[16] @192, fp16 d @208: value 128h + 32k + l (k < 4, l < 32) = (low nibble of ql[64h + 32 (k & 1) +
// l], >> 4 if k >= 2) | ((qh[32h + l] >> 2k) & 3) << 4, minus 32; scale sc[(128h + 32k + l) / 16].
// Lane p (8 per block): h = p / 4, l0 = 8 (p % 4): values 128h + 32k + l0 .. +8 for k = 0..3 (each 8 inside one
// 16-value scale group); sum(sc (v - 32) y) = sum(sc (v y - 32 y)) per group, exact.
#define Q8_FMT 2
#define LPB 8
#define HAS_MIN 0
__device__ __forceinline__ void lane_sums(const float* sc, const u8* __restrict__ blk, const i8* __restrict__ y,
                                          const i16* __restrict__ ys, const i16* __restrict__ yt, const int p,
                                          int* S, int* M, const bool wide) {
    (void)wide;
    (void)sc; (void)ys; (void)yt;
    const int h = p >> 2, l0 = 8 * (p & 3);
    u32 qa[2], qb[2], qh[2], sw[2];
    load_words(blk + 64 * h + l0, qa, 8);
    load_words(blk + 64 * h + 32 + l0, qb, 8);
    load_words(blk + 128 + 32 * h + l0, qh, 8);
    load_words(blk + 192 + 8 * h, sw, 8);
    const unsigned long long scw = (unsigned long long)sw[0] | ((unsigned long long)sw[1] << 32);
    const int sel = l0 >> 4;
    int tot = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 yv[2];
        load_words_v((const u8*)(y + 128 * h + 32 * k + l0), yv, 8);
        u32 v[2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
            v[i] = ((((k & 1) ? qb[i] : qa[i]) >> (4 * (k >> 1))) & 0x0f0f0f0fu) | (((qh[i] >> (2 * k)) & 0x03030303u) << 4);
        const int scale = (int)(i8)((scw >> (8 * (2 * k + sel))) & 0xffu);
        tot += scale * (dot8(v, yv, 0) - 32 * sum8(yv));
    }
    *S = tot;
    *M = 0;
}
__device__ __forceinline__ void blk_scales(const float* sc, const u8* __restrict__ blk, float* dw, float* dm) {
    (void)sc;
    *dw = h2f(ld16(blk + 208));
    *dm = 0.0f;
}
