// IQ4_XS (id 23): block_iq4_xs = fp16 d + scales_h u16 + scales_l[4] (8 x 6-bit, -32) + qs[128]
// nibbles indexing kvalues_iq4nl, 256 values; native block. y = (d * (ls - 32)) * kvalues[nibble]
// (ggml-quants.c dequantize_row_iq4_xs).
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u32 sh = ld16(q + 2);
    const u8* sl = q + 4;
    const u8* qs = q + 8 + 16 * sub;
    const int ls = ((sl[sub >> 1] >> (4 * (sub & 1))) & 15) | (((sh >> (2 * sub)) & 3u) << 4);
    const float dl = d * (float)(ls - 32);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = dl * i2f(kvalues_iq4nl[qs[j] & 15]);
        y[j + 16] = dl * i2f(kvalues_iq4nl[qs[j] >> 4]);
    }
}
