// Q5_1 (id 7): block_q5_1 = fp16 d, fp16 m + qh[4] + qs[16], 32 values; engine form: sc = {d, m},
// q = qh || qs. y = d * (nibble | high bit << 4) + m (ggml-quants.c dequantize_row_q5_1).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0], m = sc[1];
    const u32 qh = ld32(q);
    const u8* qs = q + 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const u32 lo = (qs[j] & 15) | (((qh >> j) & 1u) << 4);
        const u32 hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * i2f((int)lo) + m;
        y[j + 16] = d * i2f((int)hi) + m;
    }
}
