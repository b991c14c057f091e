// Q6_K (id 14): block_q6_K = ql[128] (low 4 bits) + qh[64] (high 2 bits) + int8 scales[16] +
// fp16 d @208, 256 values; native block. y = (d * scale) * (q - 32)
// (ggml-quants.c dequantize_row_q6_K).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const u8* ql = q;
    const u8* qh = q + 128;
    const i8* scs = (const i8*)(q + 192);
    const float d = h2f(ld16(q + 208));
    const int h = sub >> 2, k = sub & 3;
    u32 lq[8], hq[8];
    load_words(ql + 64 * h + 32 * (k & 1), lq, 32);
    const int lsh = 4 * (k >> 1);
    load_words(qh + 32 * h, hq, 32);
    const int hsh = 2 * k;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float D = d * (float)(int)scs[2 * sub + half];
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int ll = 16 * half + l;
            const int v = ((byte_of(lq, ll) >> lsh) & 15) | (((byte_of(hq, ll) >> hsh) & 3) << 4);
            y[ll] = D * i2f(v - 32);
        }
    }
}
