// Q4_K (id 12): block_q4_K = fp16 d, fp16 dmin + scales[12] (8 x 6-bit scale + 8 x 6-bit min,
// scale_min_k4) + qs[128] nibbles, 256 values; native block. Chunk sub = sub-block g of 32:
// y = (d * sc) * q - (dmin * m) (ggml-quants.c dequantize_row_q4_K).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q)), dmin = h2f(ld16(q + 2));
    const u8* s = q + 4;
    const u8* qs = q + 16;
    const int g = sub;
    int scv, mv;
    scale_min_k4(s, g, &scv, &mv);
    const float D = d * (float)scv;
    const float DM = dmin * (float)mv;
    u32 qq[8];
    load_words(qs + 32 * (g >> 1), qq, 32);
    const int sh = 4 * (g & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = D * u2f((u32)(byte_of(qq, l) >> sh) & 15u) - DM;
}
