// Q4_1 (id 3): block_q4_1 = fp16 d, fp16 m + qs[16], 32 values; engine form: sc = {d, m}, q = qs.
// y[j] = d * (qs[j] & 15) + m, y[j + 16] = d * (qs[j] >> 4) + m (ggml-quants.c dequantize_row_q4_1).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0], m = sc[1];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = d * i2f(q[j] & 15) + m;
        y[j + 16] = d * i2f(q[j] >> 4) + m;
    }
}
