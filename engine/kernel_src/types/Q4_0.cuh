// Q4_0 (id 2): block_q4_0 = fp16 d + qs[16], 32 values (ggml-common.h); engine form: sc[0] = d,
// q = qs. y[j] = d * ((qs[j] & 15) - 8), y[j + 16] = d * ((qs[j] >> 4) - 8)
// (ggml-quants.c dequantize_row_q4_0, gguf-py Q4_0.dequantize_blocks).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
    u32 b[4];
    load_words(q, b, 16);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = d * i2f((int)(byte_of(b, j) & 15) - 8);
        y[j + 16] = d * i2f((int)(byte_of(b, j) >> 4) - 8);
    }
}
