// Q2_0 (id 42): block_q2_0 = fp16 d + qs[16], 64 values; engine form: sc[0] = d, q = qs.
// 2-bit q of the 64 -> (float)(q - 1) * d (ggml-quants.c dequantize_row_q2_0; gguf-py 0.19.0
// lacks the type: equals strata.packer.dequant_own.dequantize_q2_0 bit for bit).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
    const u8* qb = q + 8 * sub;
#pragma unroll
    for (int j = 0; j < 32; ++j) y[j] = i2f((int)((qb[j >> 2] >> (2 * (j & 3))) & 3) - 1) * d;
}
