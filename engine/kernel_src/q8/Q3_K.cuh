// Q3_K with Q8_K activations (matvec_q8.cu): 110-byte native blocks (2-byte aligned), hmask[32] @0, qs[64] @32,
// scales[12] @96 (16 6-bit scales, minus 32: dequantize_row_q3_K's unpacking), fp16 d @108: value 32c + l
// (c < 8, l < 32) = ((qs[32 (c >> 2) + l] >> 2 (c & 3)) & 3) - (bit c of hmask[l] ? 0 : 4); scale per 16 values.
// Lane p (8 per block): h = p / 4, l0 = 8 (p % 4): values 32 (4h + k) + l0 .. +8 for k = 0..3; the dot runs on
// v' = q2 | hbit << 2 (0..7) and takes 4 sum(y) off per group, exact.
#define Q8_FMT 2
#define LPB 8
#define HAS_MIN 0
__device__ __forceinline__ void lane_sums(const float* sc, const u8* __restrict__ blk, const i8* __restrict__ y,
                                          const i16* __restrict__ ys, const i16* __restrict__ yt, const int p,
                                          int* S, int* M, const bool wide) {
    (void)wide;
    (void)sc; (void)ys; (void)yt;
    const int h = p >> 2, l0 = 8 * (p & 3);
    u32 q[2], hm[2], s[3];
    load_words(blk + 32 + 32 * h + l0, q, 8);
    load_words(blk + l0, hm, 8);
    load_words(blk + 96, s, 12);
    // the 16 6-bit scales as bytes (ggml kmask1 0x03030303, kmask2 0x0f0f0f0f): 0..7 in u01, 8..15 in u23
    const u32 u0 = (s[0] & 0x0f0f0f0fu) | (((s[2] >> 0) & 0x03030303u) << 4);
    const u32 u1 = (s[1] & 0x0f0f0f0fu) | (((s[2] >> 2) & 0x03030303u) << 4);
    const u32 u2 = ((s[0] >> 4) & 0x0f0f0f0fu) | (((s[2] >> 4) & 0x03030303u) << 4);
    const u32 u3 = ((s[1] >> 4) & 0x0f0f0f0fu) | (((s[2] >> 6) & 0x03030303u) << 4);
    const unsigned long long scw = h ? ((unsigned long long)u2 | ((unsigned long long)u3 << 32))
                                     : ((unsigned long long)u0 | ((unsigned long long)u1 << 32));
    const int sel = l0 >> 4;
    int tot = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 yv[2];
        load_words_v((const u8*)(y + 128 * h + 32 * k + l0), yv, 8);
        u32 v[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) v[i] = ((q[i] >> (2 * k)) & 0x03030303u) | (((hm[i] >> (4 * h + k)) & 0x01010101u) << 2);
        const int scale = (int)((scw >> (8 * (2 * k + sel))) & 0xffu) - 32;
        tot += scale * (dot8(v, yv, 0) - 4 * sum8(yv));
    }
    *S = tot;
    *M = 0;
}
__device__ __forceinline__ void blk_scales(const float* sc, const u8* __restrict__ blk, float* dw, float* dm) {
    (void)sc;
    *dw = h2f(ld16(blk + 108));
    *dm = 0.0f;
}
