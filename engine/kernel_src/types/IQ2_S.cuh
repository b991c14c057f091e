// IQ2_S (id 22): block_iq2_s = fp16 d + qs[64] (32 grid index low bytes, then 32 sign bytes) +
// qh[8] (index high bits) + scales[8], 256 values; native block. gguf-py
// IQ2_S.dequantize_blocks: db = (d * (0.5 + scale)) * 0.25, value = (db * grid) * sign
// (ggml-quants.c dequantize_row_iq2_s).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u8* qs = q + 2;
    const u8* signs = q + 34;
    const u8* qh = q + 66;
    const u8* scales = q + 74;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int scv = (scales[sub] >> (4 * half)) & 15;
        float db = d * (0.5f + (float)scv);
        db = db * 0.25f;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const int l = 4 * sub + 2 * half + m;
            const u32 idx = (u32)qs[l] | ((((u32)qh[l >> 2] >> (2 * (l & 3))) & 3u) << 8);
            const unsigned long long g = grid_entry8(iq2s_grid, idx);
            const u32 sg = signs[l];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float w = db * i2f(grid_byte(g, j));
                y[16 * half + 8 * m + j] = ((sg >> j) & 1u) ? -w : w;
            }
        }
    }
}
