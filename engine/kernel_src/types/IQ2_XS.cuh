// IQ2_XS (id 17): block_iq2_xs = fp16 d + qs[32] u16 (9-bit index into iq2xs_grid, 7-bit sign
// index) + scales[8] (2 x 4-bit), 256 values; native block. db = (d * (0.5 + scale)) * 0.25,
// y = db * grid, negated by the sign bit (ggml-quants.c dequantize_row_iq2_xs).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u8* qs = q + 2;
    const u8* scales = q + 66;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s = 2 * sub + half;
        const int scv = (scales[s >> 1] >> (4 * (s & 1))) & 15;
        float db = d * (0.5f + (float)scv);
        db = db * 0.25f;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const u32 v = ld16(qs + 2 * (2 * s + m));
            const unsigned long long g = grid_entry8(iq2xs_grid, v & 511u);
            const u32 sg = ksigns_iq2xs[v >> 9];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float w = db * i2f(grid_byte(g, j));
                y[16 * half + 8 * m + j] = ((sg >> j) & 1u) ? -w : w;
            }
        }
    }
}
