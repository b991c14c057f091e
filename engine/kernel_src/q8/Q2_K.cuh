// Q2_K with Q8_K activations (matvec_q8.cu): 84-byte native blocks, scales[16] @0 (low nibble: scale, high
// nibble: min of 16 values), qs[64] @16, fp16 d @80, dmin @82: value 32c + l (c < 8, l < 32) =
// (qs[32 (c >> 2) + l] >> 2 (c & 3)) & 3; w = d * sc * q - dmin * m.
// Lane p (8 per block): h = p / 4, l0 = 8 (p % 4): values 32 (4h + k) + l0 .. +8 for k = 0..3 (group
// g = 8h + 2k + l0 / 16); lanes with l0 = 0 or 16 also add their 4 groups' min * (sum of y per 16).
#define Q8_FMT 2
#define LPB 8
#define HAS_MIN 1
__device__ __forceinline__ void lane_sums(const float* sc, const u8* __restrict__ blk, const i8* __restrict__ y,
                                          const i16* __restrict__ ys, const i16* __restrict__ yt, const int p,
                                          int* S, int* M, const bool wide) {
    (void)wide;
    (void)sc; (void)yt;
    const int h = p >> 2, l0 = 8 * (p & 3);
    u32 q[2], sw[2];
    load_words(blk + 16 + 32 * h + l0, q, 8);
    load_words(blk + 8 * h, sw, 8);
    const unsigned long long scw = (unsigned long long)sw[0] | ((unsigned long long)sw[1] << 32);
    const int sel = l0 >> 4;
    int tot = 0, mt = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 yv[2];
        load_words_v((const u8*)(y + 128 * h + 32 * k + l0), yv, 8);
        const u32 v[2] = {(q[0] >> (2 * k)) & 0x03030303u, (q[1] >> (2 * k)) & 0x03030303u};
        const int b = (int)((scw >> (8 * (2 * k + sel))) & 0xffu);
        tot += (b & 15) * dot8(v, yv, 0);
        if ((l0 & 8) == 0) mt += (b >> 4) * (int)ys[8 * h + 2 * k + sel];
    }
    *S = tot;
    *M = mt;
}
__device__ __forceinline__ void blk_scales(const float* sc, const u8* __restrict__ blk, float* dw, float* dm) {
    (void)sc;
    *dw = h2f(ld16(blk + 80));
    *dm = h2f(ld16(blk + 82));
}
