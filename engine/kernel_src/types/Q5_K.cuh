// Q5_K (id 13): block_q5_K = fp16 d, fp16 dmin + scales[12] + qh[32] (bit 4) + qs[128], 256 values;
// native block. y = (d * sc) * (nibble | hbit << 4) - (dmin * m) (ggml-quants.c dequantize_row_q5_K).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q)), dmin = h2f(ld16(q + 2));
    const u8* s = q + 4;
    const u8* qh = q + 16;
    const u8* qs = q + 48;
    const int g = sub;
    int scv, mv;
    scale_min_k4(s, g, &scv, &mv);
    const float D = d * (float)scv;
    const float DM = dmin * (float)mv;
    u32 qq[8], hh[8];
    load_words(qs + 32 * (g >> 1), qq, 32);
    load_words(qh, hh, 32);
    const int sh = 4 * (g & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int v = ((byte_of(qq, l) >> sh) & 15) | (((byte_of(hh, l) >> g) & 1) << 4);
        y[l] = D * u2f((u32)v) - DM;
    }
}
