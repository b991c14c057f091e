// IQ4_NL (id 20): block_iq4_nl = fp16 d + qs[16] nibbles indexing kvalues_iq4nl[16], 32 values;
// engine form: sc[0] = d, q = qs. y[j] = d * kvalues[qs[j] & 15], y[j + 16] = d * kvalues[qs[j] >> 4]
// (ggml-quants.c dequantize_row_iq4_nl; the table comes from gguf-py IQ4_NL.kvalues).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = d * i2f(kvalues_iq4nl[q[j] & 15]);
        y[j + 16] = d * i2f(kvalues_iq4nl[q[j] >> 4]);
    }
}
