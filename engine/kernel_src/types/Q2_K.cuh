// Q2_K (id 10): block_q2_K = scales[16] (lo 4 bits scale, hi 4 bits min) + qs[64] (2-bit) +
// fp16 d @80 + fp16 dmin @82, 256 values; native block. Chunk sub (32 values) = 2 sub-blocks
// of 16: y = (d * sc) * q - dmin * m (ggml-quants.c dequantize_row_q2_K).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const u8* scales = q;
    const u8* qs = q + 16;
    const float d = h2f(ld16(q + 80)), dmin = h2f(ld16(q + 82));
    const int h = sub >> 2, sh = 2 * (sub & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s = 2 * sub + half;
        const float dl = d * (float)(scales[s] & 15);
        const float ml = dmin * (float)(scales[s] >> 4);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int ll = 16 * half + l;
            y[ll] = dl * u2f((u32)(qs[32 * h + ll] >> sh) & 3u) - ml;
        }
    }
}
