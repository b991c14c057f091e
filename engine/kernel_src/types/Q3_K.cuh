// Q3_K (id 11): block_q3_K = hmask[32] + qs[64] (low 2 bits) + scales[12] (16 x 6-bit, -32) +
// fp16 d @108, 256 values; native block. y = (d * (scale - 32)) * (q - (hbit ? 0 : 4))
// (ggml-quants.c dequantize_row_q3_K).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const u8* hm = q;
    const u8* qs = q + 32;
    const u8* scales = q + 96;
    const float d = h2f(ld16(q + 108));
    const int h = sub >> 2, sh = 2 * (sub & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s = 2 * sub + half;
        const int low = s < 8 ? (scales[s] & 15) : (scales[s - 8] >> 4);
        const int high = (scales[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
        const float dl = d * (float)((low | (high << 4)) - 32);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int ll = 16 * half + l;
            const int ql = (qs[32 * h + ll] >> sh) & 3;
            const int hb = (hm[ll] >> sub) & 1;
            y[ll] = dl * i2f(ql - ((hb ^ 1) << 2));
        }
    }
}
