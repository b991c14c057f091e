// IQ2_XXS (id 16): block_iq2_xxs = fp16 d + qs[32] u16; per 32 values 2 x u32: 4 grid indices
// (u8 into iq2xxs_grid) + 4 x 7-bit sign indices (ksigns_iq2xs) + 4-bit scale; native block.
// db = (d * (0.5 + scale)) * 0.25, y = db * grid, negated by the sign bit
// (ggml-quants.c dequantize_row_iq2_xxs; gguf-py IQ2_XXS.dequantize_blocks).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u8* p = q + 2 + 8 * sub;
    const u32 a0 = ld32(p), a1 = ld32(p + 4);
    float db = d * (0.5f + (float)(a1 >> 28));
    db = db * 0.25f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned long long g = grid_entry8(iq2xxs_grid, (a0 >> (8 * l)) & 255u);
        const u32 sg = ksigns_iq2xs[(a1 >> (7 * l)) & 127u];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float v = db * i2f(grid_byte(g, j));
            y[8 * l + j] = ((sg >> j) & 1u) ? -v : v;
        }
    }
}
