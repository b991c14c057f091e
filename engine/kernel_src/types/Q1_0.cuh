// Q1_0 (id 41): block_q1_0 = fp16 d + qs[16], 128 values; engine form: sc[0] = d, q = qs.
// Bit j of the 128 -> d or -d (ggml-quants.c dequantize_row_q1_0: bit ? d : neg_d; gguf-py 0.19.0
// lacks the type: equals strata.packer.dequant_own.dequantize_q1_0 bit for bit).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
    const float nd = -d;
    const u8* qb = q + 4 * sub;
#pragma unroll
    for (int j = 0; j < 32; ++j) y[j] = ((qb[j >> 3] >> (j & 7)) & 1) ? d : nd;
}
