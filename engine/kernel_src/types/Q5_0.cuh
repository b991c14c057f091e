// Q5_0 (id 6): block_q5_0 = fp16 d + qh[4] (bit 4 of each value, u32 LE) + qs[16], 32 values;
// engine form: sc[0] = d, q = qh || qs. y = d * ((nibble | high bit << 4) - 16)
// (ggml-quants.c dequantize_row_q5_0).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
    const u32 qh = ld32(q);
    const u8* qs = q + 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int lo = (int)((qs[j] & 15) | (((qh >> j) & 1u) << 4));
        const int hi = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
        y[j] = d * i2f(lo - 16);
        y[j + 16] = d * i2f(hi - 16);
    }
}
