// Q8_0 (id 8): block_q8_0 = fp16 d + int8 qs[32]; engine form: sc[0] = d, q = qs.
// y[j] = qs[j] * d (ggml-quants.c dequantize_row_q8_0; gguf-py computes x * d in this order).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
    u32 b[8];
    load_words(q, b, 32);
#pragma unroll
    for (int j = 0; j < 32; ++j) y[j] = i2f((int)(i8)byte_of(b, j)) * d;
}
