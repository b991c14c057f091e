// The exact kernel's inner block for Q4_K and Q6_K with AVX2 (strata.engine.cpu.kernels; concatenated
// before cpu_driver.c, which calls exact_block8 when EXACT_BLOCK8 is defined).
//
// The arithmetic is the exact kernel's, unchanged (cpu_driver.c row_exact, the GPU's warp_dot): for each
// of a block's 8 chunks of 32 values (the vector lanes), s = s + w[i] * x[i] for i = 0..31 in order, with
// w[i] = D * (float)q - DM (Q4_K) or D * (float)(q - 32) (Q6_K) exactly as types/<T>.cuh deq_chunk
// computes it (each product and difference rounded to f32, no FMA). What differs is only how the values
// reach the lanes: instead of dequantizing 8 chunks one after the other and transposing 8 x 32 floats,
// the block's quant bytes are transposed once (byte i of the four 32-byte rows of qs / ql into one
// 32-bit word) and value i of all 8 chunks is cut out of that word with one variable shift per lane.
// tests/test_engine_cpu_q8.py compares this build with the scalar build (STRATA_SCALAR) bit for bit.
//
// Block layouts (ggml-common.h): block_q4_K = fp16 d, fp16 dmin, scales[12], qs[128]; sub-block g's
// value i is (qs[32 * (g >> 1) + i] >> 4 * (g & 1)) & 15 = (word_i >> 4 g) & 15 with
// word_i = qs[i] | qs[32 + i] << 8 | qs[64 + i] << 16 | qs[96 + i] << 24.
// block_q6_K = ql[128], qh[64], int8 scales[16], fp16 d; chunk c = 4 h + k (h = c >> 2, k = c & 3):
// low 4 bits (ql[64 h + 32 (k & 1) + i] >> 4 (k >> 1)) & 15, high 2 bits (qh[32 h + i] >> 2 k) & 3,
// scale scales[2 c + (i >= 16)] (ggml-quants.c dequantize_row_q6_K).

// Shared with the q8 kernels (cpu_q8.c, cpu_q8_dots.c, concatenated after this file):
// unaligned little-endian loads - one instruction on x86 (the SIMD builds), the prelude's portable byte loads in
// the scalar build (any host, the same values) - and the Q4_K / Q5_K scale unpacking.
#if defined(__AVX2__) && !defined(STRATA_SCALAR)
static inline u32 q8_ld32(const u8* p) { u32 v; memcpy(&v, p, 4); return v; }
static inline u32 q8_ld16(const u8* p) { unsigned short v; memcpy(&v, p, 2); return v; }
#else
#define q8_ld32 ld32
#define q8_ld16 ld16
#endif
// fp16 -> f32, exact: F16C's conversion where the SIMD build has it, else the prelude's h2f (the same value).
static inline float q8_h2f(u32 h) {
#if defined(__AVX2__) && !defined(STRATA_SCALAR) && defined(__F16C__)
    return _cvtsh_ss((unsigned short)h);
#else
    return h2f(h);
#endif
}

#if defined(STRATA_T_Q4_K) || defined(STRATA_T_Q5_K)
// The 8 scales and 8 mins (6 bits each) of scales[12] as bytes 0..7 and 8..15 of u[4] (little-endian words):
// get_scale_min_k4 (ggml-quants.c) for g = 0..7, by the word masks of ggml-cpu/quants.c
// ggml_vec_dot_q4_K_q8_K_generic (kmask1 0x3f3f3f3f, kmask2 0x0f0f0f0f, kmask3 0x03030303).
static inline void k4_scales(const u8* s, u32* u) {
    const u32 a = q8_ld32(s), b = q8_ld32(s + 4), c = q8_ld32(s + 8);
    u[0] = a & 0x3f3f3f3fu;                                                  // scales 0..3
    u[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);             // scales 4..7
    u[2] = b & 0x3f3f3f3fu;                                                  // mins 0..3
    u[3] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);      // mins 4..7
}
static inline int k4_byte(const u32* u, int i) { return (int)((u[i >> 2] >> (8 * (i & 3))) & 0xffu); }
#endif

#if defined(__AVX2__) && !defined(STRATA_SCALAR) && (defined(STRATA_T_Q4_K) || defined(STRATA_T_Q6_K))
#define EXACT_BLOCK8 1

// words[i] = r0[i] | r1[i] << 8 | r2[i] << 16 | r3[i] << 24 for i < 32 (four rows of 32 bytes).
static inline void transpose_bytes_4x32(const u8* r0, const u8* r1, const u8* r2, const u8* r3, u32* words) {
    const __m256i a0 = _mm256_loadu_si256((const __m256i*)r0), a1 = _mm256_loadu_si256((const __m256i*)r1);
    const __m256i a2 = _mm256_loadu_si256((const __m256i*)r2), a3 = _mm256_loadu_si256((const __m256i*)r3);
    const __m256i l01 = _mm256_unpacklo_epi8(a0, a1), h01 = _mm256_unpackhi_epi8(a0, a1);
    const __m256i l23 = _mm256_unpacklo_epi8(a2, a3), h23 = _mm256_unpackhi_epi8(a2, a3);
    const __m256i w0 = _mm256_unpacklo_epi16(l01, l23);  // i = 0..3 | 16..19 (per 128-bit half)
    const __m256i w1 = _mm256_unpackhi_epi16(l01, l23);  // 4..7 | 20..23
    const __m256i w2 = _mm256_unpacklo_epi16(h01, h23);  // 8..11 | 24..27
    const __m256i w3 = _mm256_unpackhi_epi16(h01, h23);  // 12..15 | 28..31
    _mm256_storeu_si256((__m256i*)(words + 0), _mm256_permute2x128_si256(w0, w1, 0x20));
    _mm256_storeu_si256((__m256i*)(words + 8), _mm256_permute2x128_si256(w2, w3, 0x20));
    _mm256_storeu_si256((__m256i*)(words + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
    _mm256_storeu_si256((__m256i*)(words + 24), _mm256_permute2x128_si256(w2, w3, 0x31));
}

#if defined(STRATA_T_Q4_K)
// D[g] = d * scale_g, DM[g] = dmin * min_g for the 8 sub-blocks (k4_scales' bytes widened to f32 in 8 lanes: the
// scalar d * (float)scv of deq_chunk, lane by lane).
static inline void q4k_scales8(const u8* b, __m256* D, __m256* DM) {
    u32 u[4];
    k4_scales(b + 4, u);
    const __m128i bytes = _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);  // registers, not memory
    *D = _mm256_mul_ps(_mm256_set1_ps(q8_h2f(q8_ld16(b))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    *DM = _mm256_mul_ps(_mm256_set1_ps(q8_h2f(q8_ld16(b + 2))),
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
}
#else
// D0[c] = d * scales[2c], D1[c] = d * scales[2c + 1] (int8) for the 8 chunks (deq_chunk's d * (float)(int)scs[..]).
static inline void q6k_scales8(const u8* b, __m256* D0, __m256* D1) {
    const __m128i sc = _mm_loadu_si128((const __m128i*)(b + 192));
    const __m128i eo = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256 d = _mm256_set1_ps(q8_h2f(q8_ld16(b + 208)));
    *D0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eo)));
    *D1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(eo, 8))));
}
#endif

// Lanes of s[j] = the 32-term sums of the 8 chunks of block blk[j] (native bytes), j < NB (1 or 2), against x
// laid out as exact_prep does: value i of chunk k at xx[j][8 i + k]. Two blocks run in one loop so that their
// chains of additions (each s[j] is 32 dependent adds, the add's latency bounds one chain) overlap.
#define EXACT_BLOCKS(NB)                                                                                          \
    static inline void exact_block8_##NB(const u8* const* blk, const float* const* xx, __m256* s) {              \
        u32 words[NB][32];                                                                                        \
        __m256 vd[NB][2], vm[NB];                                                                                 \
        EXACT_PREP(NB)                                                                                            \
        for (int j = 0; j < NB; ++j) s[j] = _mm256_setzero_ps();                                                  \
        for (int i = 0; i < 32; ++i)                                                                              \
            for (int j = 0; j < NB; ++j) s[j] = _mm256_add_ps(s[j], _mm256_mul_ps(EXACT_W(j, i), _mm256_loadu_ps(xx[j] + 8 * i))); \
    }

#if defined(STRATA_T_Q4_K)
// per block: D = d * sc, DM = dmin * m per sub-block g (lane g); word_i's nibble g is value i of sub-block g
#define EXACT_PREP(NB)                                                                                            \
    for (int j = 0; j < NB; ++j) {                                                                                \
        const u8* qs = blk[j] + 16;                                                                               \
        transpose_bytes_4x32(qs, qs + 32, qs + 64, qs + 96, words[j]);                                            \
        q4k_scales8(blk[j], &vd[j][0], &vm[j]);                                                                   \
        vd[j][1] = vd[j][0];                                                                                      \
    }                                                                                                             \
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m15 = _mm256_set1_epi32(15);
#define EXACT_W(j, i)                                                                                             \
    _mm256_sub_ps(_mm256_mul_ps(vd[j][0], _mm256_cvtepi32_ps(_mm256_and_si256(                                   \
                      _mm256_srlv_epi32(_mm256_set1_epi32((int)words[j][i]), sh), m15))), vm[j])
#else  // Q6_K: chunk c = 4 h + k; low nibble from ql row 2 h + (k & 1) (>> 4 if k >= 2), high 2 bits from qh row h
#define EXACT_PREP(NB)                                                                                            \
    u32 hwords[NB][32];                                                                                           \
    for (int j = 0; j < NB; ++j) {                                                                                \
        const u8* ql = blk[j];                                                                                    \
        const u8* qh = blk[j] + 128;                                                                              \
        transpose_bytes_4x32(ql, ql + 32, ql + 64, ql + 96, words[j]);                                            \
        transpose_bytes_4x32(qh, qh + 32, qh, qh + 32, hwords[j]); /* bytes 2, 3 unused */                        \
        q6k_scales8(blk[j], &vd[j][0], &vd[j][1]);                                                                \
        vm[j] = _mm256_setzero_ps();                                                                              \
    }                                                                                                             \
    const __m256i shl = _mm256_setr_epi32(0, 8, 4, 12, 16, 24, 20, 28);                                           \
    const __m256i shh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);                                             \
    const __m256i m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), b32 = _mm256_set1_epi32(32);
// (d * scale of the half) * (float)(q - 32), q = low | high << 4
#define EXACT_W(j, i)                                                                                             \
    _mm256_mul_ps(vd[j][(i) >> 4], _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(                          \
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)words[j][i]), shl), m15),                      \
        _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)hwords[j][i]), shh), m3), 4)), b32)))
#endif
EXACT_BLOCKS(1)
EXACT_BLOCKS(2)

#endif
