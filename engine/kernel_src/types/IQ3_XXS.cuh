// IQ3_XXS (id 18): block_iq3_xxs = fp16 d + qs[64] grid indices (iq3xxs_grid) + 8 x u32
// (4 x 7-bit sign index + 4-bit scale), 256 values; native block. db = (d * (0.5 + scale)) * 0.5,
// y = db * grid, negated by the sign bit (ggml-quants.c dequantize_row_iq3_xxs).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u8* qs = q + 2 + 8 * sub;
    const u32 a = ld32(q + 66 + 4 * sub);
    float db = d * (0.5f + (float)(a >> 28));
    db = db * 0.5f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 sg = ksigns_iq2xs[(a >> (7 * l)) & 127u];
        const u32 g1 = grid_entry4(iq3xxs_grid, qs[2 * l]), g2 = grid_entry4(iq3xxs_grid, qs[2 * l + 1]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float v1 = db * i2f((int)((g1 >> (8 * j)) & 255u));
            const float v2 = db * i2f((int)((g2 >> (8 * j)) & 255u));
            y[8 * l + j] = ((sg >> j) & 1u) ? -v1 : v1;
            y[8 * l + 4 + j] = ((sg >> (j + 4)) & 1u) ? -v2 : v2;
        }
    }
}
