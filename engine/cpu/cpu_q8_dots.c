// Per-type integer dots and the entry points of the quantized-activation matvec (appended to cpu_q8.c; the
// formats, the exactness argument and the float order are in cpu_q8.c's header).

#if Q8_ACT == 1
// ------------------------------------------------------------------ 32-value blocks, Q8_0 activations

#if defined(STRATA_T_Q4_0)
#define WB 18
#define WOFF 8  // the dot runs on nibble (0..15); sum((n - 8) y) = sum(n y) - 8 sum(y)
#elif defined(STRATA_T_Q5_0)
#define WB 22
#define WOFF 16  // on n | hbit << 4 (0..31)
#elif defined(STRATA_T_Q8_0)
#define WB 34
#elif defined(STRATA_T_IQ4_NL)
#define WB 18
#endif

// Block b's signed weight values (scalar reference of the layouts in cpu_q8.c's header).
static inline void blk_values(const u8* blk, int* w) {
#if defined(STRATA_T_Q4_0)
    for (int j = 0; j < 16; ++j) { w[j] = (blk[2 + j] & 15) - 8; w[j + 16] = (blk[2 + j] >> 4) - 8; }
#elif defined(STRATA_T_Q5_0)
    const u32 qh = ld32(blk + 2);
    for (int j = 0; j < 16; ++j) {
        w[j] = (int)((blk[6 + j] & 15) | (((qh >> j) & 1u) << 4)) - 16;
        w[j + 16] = (int)((blk[6 + j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
    }
#elif defined(STRATA_T_Q8_0)
    for (int j = 0; j < 32; ++j) w[j] = (i8)blk[2 + j];
#elif defined(STRATA_T_IQ4_NL)
    for (int j = 0; j < 16; ++j) { w[j] = kvalues_iq4nl[blk[2 + j] & 15]; w[j + 16] = kvalues_iq4nl[blk[2 + j] >> 4]; }
#endif
}

#ifdef Q8_AVX2
#if defined(STRATA_T_Q8_0) || defined(STRATA_T_IQ4_NL)
#ifdef Q8_VNNI
#define WOFF 128  // vpdpbusd on w + 128 (u8, w ^ 0x80): sum((w + 128) y) - 128 sum(y)
#else
#define WOFF 0    // the sign trick
#endif
#endif

// WOFF * x as a shift (WOFF is 8, 16 or 128: exact, and cheaper than a 32-bit multiply).
#if WOFF == 8
#define WOFF_SHIFT 3
#elif WOFF == 16
#define WOFF_SHIFT 4
#elif WOFF == 128
#define WOFF_SHIFT 7
#endif

// The block's weights as the dot's first operand (decoded once; a prompt chunk reuses them for several activations):
// u8 w' = w + WOFF for Q4_0 / Q5_0, the signed w for Q8_0 / IQ4_NL (w ^ 0x80 as u8 with VNNI).
static inline __m256i blk_w(const u8* blk) {
#if defined(STRATA_T_Q4_0)
    return nibbles32(blk + 2);
#elif defined(STRATA_T_Q5_0)
    const __m256i hb = _mm256_and_si256(bits32(blk + 2), _mm256_set1_epi8(16));
    return _mm256_or_si256(nibbles32(blk + 6), hb);
#else
#if defined(STRATA_T_Q8_0)
    const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 2));
#else
    const __m128i tab = _mm_loadu_si128((const __m128i*)kvalues_iq4nl);
    const __m256i w = _mm256_shuffle_epi8(_mm256_set_m128i(tab, tab), nibbles32(blk + 2));
#endif
#ifdef Q8_VNNI
    return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
#else
    return w;
#endif
#endif
}

// int32 lanes whose total is sum(w' y) over the block for the operand w of blk_w (the dot = total - WOFF sum(y)).
static inline __m256i blk_dp(__m256i w, const i8* y) {
    const __m256i vy = _mm256_loadu_si256((const __m256i*)y);
#if defined(STRATA_T_Q4_0) || defined(STRATA_T_Q5_0) || defined(Q8_VNNI)
    return dp_u8s8(_mm256_setzero_si256(), w, vy);
#else
    return dp_s8s8(_mm256_setzero_si256(), w, vy);
#endif
}

static inline __m256i blk_dot_v(const u8* blk, const i8* y) { return blk_dp(blk_w(blk), y); }
#endif

// The block's exact dot sum(w * q).
static inline int blk_dot(const u8* blk, const i8* y, const i16* s) {
#ifdef Q8_AVX2
    return hsum_i32x8(blk_dot_v(blk, y)) - WOFF * (s[0] + s[1]);
#else
    int w[32], t = 0;
    blk_values(blk, w);
    for (int j = 0; j < 32; ++j) t += w[j] * y[j];
    (void)s;
    return t;
#endif
}

#ifdef Q8_AVX2
static inline u32 q8_u16(const u8* p) { unsigned short v; memcpy(&v, p, 2); return v; }  // x86: little-endian

// Blocks b..b+7 of a row: their exact sums S (int32 x 8) and (d_w * d_x) (f32 x 8), lane k = block b + k.
#define Q8_BLK(k)                                                                              \
    v[k] = blk_dot_v(row + (i64)(b + k) * WB, A->q + (i64)(b + k) * 32);                       \
    dh = _mm_insert_epi16(dh, (int)q8_u16(row + (i64)(b + k) * WB), k);
#endif

// One row against the activation: acc[b % 8] += (d_w * d_x) * S_b, then hsum8 (cpu_q8.c, item 3).
static float dot_row(const u8* row, const Act* A, int ne0) {
    const int nb = ne0 / 32;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int b = 0;
#ifdef Q8_AVX2
    if (nb >= 8) {
        __m256 vacc = _mm256_setzero_ps();
        for (; b + 8 <= nb; b += 8) {
            __m256i v[8];
            __m128i dh = _mm_setzero_si128();
            Q8_BLK(0) Q8_BLK(1) Q8_BLK(2) Q8_BLK(3) Q8_BLK(4) Q8_BLK(5) Q8_BLK(6) Q8_BLK(7)
            __m256i S = hsum_i32x8x8(v);
#if WOFF
            S = _mm256_sub_epi32(S, _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(A->t + b))),
                                                       WOFF_SHIFT));
#endif
            const __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(dh), _mm256_loadu_ps(A->d + b));
            vacc = _mm256_add_ps(vacc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(S)));
        }
        _mm256_storeu_ps(acc, vacc);
    }
#endif
    for (; b < nb; ++b) {
        const u8* blk = row + (i64)b * WB;
        const int S = blk_dot(blk, A->q + (i64)b * 32, A->s + 2 * b);
        acc[b & 7] = acc[b & 7] + (q8_h2f(q8_ld16(blk)) * A->d[b]) * (float)S;
    }
    return hsum8_f32(acc);
}

#define MM_MULTI 8  // activations dot_rows takes per pass over a row

#ifdef Q8_AVX2
#define Q8_W(k)                                                 \
    w[k] = blk_w(row + (i64)(b + k) * WB);                      \
    dh = _mm_insert_epi16(dh, (int)q8_u16(row + (i64)(b + k) * WB), k);
#endif

// out[a] = dot_row(row, &A[a], ne0) for a < na (<= MM_MULTI), bit for bit: each weight block is decoded once for all
// na activations (a prompt chunk), then every activation takes dot_row's own integer sums and float order.
static void dot_rows(const u8* row, const Act* A, int na, int ne0, float* out) {
    const int nb = ne0 / 32;
    float acc[MM_MULTI][8];
    for (int a = 0; a < na; ++a)
        for (int j = 0; j < 8; ++j) acc[a][j] = 0.0f;
    int b = 0;
#ifdef Q8_AVX2
    if (nb >= 8) {
        __m256 vacc[MM_MULTI];
        for (int a = 0; a < na; ++a) vacc[a] = _mm256_setzero_ps();
        for (; b + 8 <= nb; b += 8) {
            __m256i w[8];
            __m128i dh = _mm_setzero_si128();
            Q8_W(0) Q8_W(1) Q8_W(2) Q8_W(3) Q8_W(4) Q8_W(5) Q8_W(6) Q8_W(7)
            const __m256 dw = _mm256_cvtph_ps(dh);
            for (int a = 0; a < na; ++a) {
                __m256i v[8];
                for (int k = 0; k < 8; ++k) v[k] = blk_dp(w[k], A[a].q + (i64)(b + k) * 32);
                __m256i S = hsum_i32x8x8(v);
#if WOFF
                S = _mm256_sub_epi32(S, _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(A[a].t + b))),
                                                           WOFF_SHIFT));
#endif
                const __m256 dd = _mm256_mul_ps(dw, _mm256_loadu_ps(A[a].d + b));
                vacc[a] = _mm256_add_ps(vacc[a], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(S)));
            }
        }
        for (int a = 0; a < na; ++a) _mm256_storeu_ps(acc[a], vacc[a]);
    }
#endif
    for (; b < nb; ++b) {
        const u8* blk = row + (i64)b * WB;
        const float dw = q8_h2f(q8_ld16(blk));
#ifdef Q8_AVX2
        const __m256i wv = blk_w(blk);  // the tail's block decoded once too
#endif
        for (int a = 0; a < na; ++a) {
#ifdef Q8_AVX2
            const i16* s = A[a].s + 2 * b;
            const int S = hsum_i32x8(blk_dp(wv, A[a].q + (i64)b * 32)) - WOFF * (s[0] + s[1]);
#else
            const int S = blk_dot(blk, A[a].q + (i64)b * 32, A[a].s + 2 * b);
#endif
            acc[a][b & 7] = acc[a][b & 7] + (dw * A[a].d[b]) * (float)S;
        }
    }
    for (int a = 0; a < na; ++a) out[a] = hsum8_f32(acc[a]);
}

#elif Q8_ACT == 2
// ------------------------------------------------------------------ K-quants, Q8_K activations

#if defined(STRATA_T_Q2_K)
#define WB 84
#define HAS_MIN 1
#elif defined(STRATA_T_Q3_K)
#define WB 110
#define HAS_MIN 0
#elif defined(STRATA_T_Q4_K)
#define WB 144
#define HAS_MIN 1
#elif defined(STRATA_T_Q5_K)
#define WB 176
#define HAS_MIN 1
#elif defined(STRATA_T_Q6_K)
#define WB 210
#define HAS_MIN 0
#endif

// k4_scales / k4_byte (Q4_K, Q5_K scale unpacking): cpu_exact_simd.c, concatenated first.

#if defined(STRATA_T_Q3_K)
// The 16 scales of scales[12] (6 bits, before the -32) as bytes 0..15 of u[4]: dequantize_row_q3_K's
// unpacking (ggml-quants.c; kmask1 0x03030303, kmask2 0x0f0f0f0f): scale j = low nibble of s[j] (j < 8) or high
// nibble of s[j - 8], with bits 4-5 = bits 2 (j >> 2) of s[8 + (j & 3)].
static inline void q3k_scales(const u8* s, u32* u) {
    const u32 a = q8_ld32(s), b = q8_ld32(s + 4), c = q8_ld32(s + 8);
    u[0] = (a & 0x0f0f0f0fu) | (((c >> 0) & 0x03030303u) << 4);
    u[1] = (b & 0x0f0f0f0fu) | (((c >> 2) & 0x03030303u) << 4);
    u[2] = ((a >> 4) & 0x0f0f0f0fu) | (((c >> 4) & 0x03030303u) << 4);
    u[3] = ((b >> 4) & 0x0f0f0f0fu) | (((c >> 6) & 0x03030303u) << 4);
}
static inline int q3k_byte(const u32* u, int i) { return (int)((u[i >> 2] >> (8 * (i & 3))) & 0xffu) - 32; }
#endif

// Super-block integer sums: S = sum over values of scale * q * y, M = sum over groups of min * bsum (exact).
// Scalar reference: unpack each value as in cpu_q8.c's header.
static inline void sb_sums_scalar(const u8* blk, const i8* y, const i16* s, const i16* t32, int* S, int* M) {
    (void)t32;
    int tot = 0, mt = 0;
#if defined(STRATA_T_Q4_K) || defined(STRATA_T_Q5_K)
    u32 u[4];
    k4_scales(blk + 4, u);
    for (int g = 0; g < 8; ++g) {
        int t = 0;
        for (int l = 0; l < 32; ++l) {
#if defined(STRATA_T_Q4_K)
            const int q = (blk[16 + 32 * (g >> 1) + l] >> (4 * (g & 1))) & 15;
#else
            const int q = ((blk[48 + 32 * (g >> 1) + l] >> (4 * (g & 1))) & 15) | (((blk[16 + l] >> g) & 1) << 4);
#endif
            t += q * y[32 * g + l];
        }
        tot += k4_byte(u, g) * t;
        mt += k4_byte(u, 8 + g) * (s[2 * g] + s[2 * g + 1]);
    }
#elif defined(STRATA_T_Q6_K)
    const i8* sc = (const i8*)(blk + 192);
    for (int c = 0; c < 8; ++c) {
        const int h = c >> 2, k = c & 3;
        for (int half = 0; half < 2; ++half) {
            int t = 0;
            for (int l = 16 * half; l < 16 * half + 16; ++l) {
                const int lo = (blk[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15;
                const int hi = (blk[128 + 32 * h + l] >> (2 * k)) & 3;
                t += ((lo | (hi << 4)) - 32) * y[32 * c + l];
            }
            tot += sc[2 * c + half] * t;
        }
    }
#elif defined(STRATA_T_Q3_K)
    u32 u[4];
    q3k_scales(blk + 96, u);
    for (int c = 0; c < 8; ++c) {
        const int h = c >> 2, sh = 2 * (c & 3);
        for (int half = 0; half < 2; ++half) {
            int t = 0;
            for (int l = 16 * half; l < 16 * half + 16; ++l) {
                const int q2 = (blk[32 + 32 * h + l] >> sh) & 3;
                const int hb = (blk[l] >> c) & 1;
                t += (q2 - (hb ? 0 : 4)) * y[32 * c + l];
            }
            tot += q3k_byte(u, 2 * c + half) * t;
        }
    }
#elif defined(STRATA_T_Q2_K)
    for (int c = 0; c < 8; ++c) {
        const int h = c >> 2, sh = 2 * (c & 3);
        for (int half = 0; half < 2; ++half) {
            const int g = 2 * c + half;
            int t = 0;
            for (int l = 16 * half; l < 16 * half + 16; ++l) t += ((blk[16 + 32 * h + l] >> sh) & 3) * y[32 * c + l];
            tot += (blk[g] & 15) * t;
            mt += (blk[g] >> 4) * s[g];
        }
    }
#endif
    *S = tot;
    *M = mt;
}

#ifdef Q8_AVX2
// Shuffle masks that spread int16 scales 2k (low 128-bit lane) and 2k+1 (high lane) of a lane-broadcast
// vector of 8 scales over their 8 words each: the scale of values 0..15 and 16..31 of a 32-value chunk.
static const u8 SC_PAIR[4][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15,
     14, 15, 14, 15}};

// Shuffle masks that spread int16 word g of a lane-broadcast vector of 8 scales over all 16 words.
static const u8 SC_ONE[8][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1},
    {2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5},
    {6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9},
    {10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11,
     10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
     12, 13, 12, 13},
    {14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15,
     14, 15, 14, 15}};

static inline __m256i sc_pair(__m256i sch, int k) {
    return _mm256_shuffle_epi8(sch, _mm256_loadu_si256((const __m256i*)SC_PAIR[k]));
}

// sum over the 16 groups of sc[g] * s[g] (int16 x int16 -> int32, exact).
static inline int dot16_i16(__m256i sc16, const i16* s) {
    return hsum_i32x8(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)s)));
}

// A super-block decoded for the integer dots (once per block; a prompt chunk reuses it for several activations):
// eight u8 value vectors w[k] that meet activation bytes 32k..32k+31, each with its int16 scale per 16 values sc[k],
// and c16 - the mins (Q4_K, Q5_K: 8 scales then 8 mins as 16 x int16), or the 16 scales whose offset the activation
// sums take out (Q6_K, Q3_K), or the mins of Q2_K.
typedef struct {
    __m256i w[8], sc[8], c16;
} KDec;

static inline void sb_decode(const u8* blk, KDec* D) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
#if defined(STRATA_T_Q4_K) || defined(STRATA_T_Q5_K)
    u32 u[4];
    k4_scales(blk + 4, u);
    const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
    const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(ms));  // 8 scales, both lanes
    D->c16 = ms;
#if defined(STRATA_T_Q5_K)
    __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
    const u8* qs = blk + 48;
#else
    const u8* qs = blk + 16;
#endif
    (void)m3;
    for (int j = 0; j < 4; ++j) {
        const __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(bits, m15);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m15);
#if defined(STRATA_T_Q5_K)
        const __m256i one = _mm256_set1_epi8(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
        qh = _mm256_srli_epi16(qh, 2);
#endif
        D->w[2 * j] = lo;
        D->w[2 * j + 1] = hi;
        D->sc[2 * j] = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i*)SC_ONE[2 * j]));
        D->sc[2 * j + 1] = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i*)SC_ONE[2 * j + 1]));
    }
#else
    // 16 scales of 16 values: Q6_K int8, Q3_K 6-bit - 32, Q2_K low nibbles
#if defined(STRATA_T_Q6_K)
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));
    D->c16 = sc16;
#elif defined(STRATA_T_Q3_K)
    u32 u[4];
    q3k_scales(blk + 96, u);
    const __m256i sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0])),
                                          _mm256_set1_epi16(32));
    const __m256i hm = _mm256_loadu_si256((const __m256i*)blk);
    D->c16 = sc16;
#else  // Q2_K
    const __m256i raw16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)blk));
    const __m256i sc16 = _mm256_and_si256(raw16, _mm256_set1_epi16(15));
    D->c16 = _mm256_srli_epi16(raw16, 4);
#endif
    for (int h = 0; h < 2; ++h) {
        const __m256i sch = _mm256_permute2x128_si256(sc16, sc16, h ? 0x11 : 0x00);
        __m256i* v = D->w + 4 * h;
#if defined(STRATA_T_Q6_K)
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
        v[0] = _mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
        v[1] = _mm256_or_si256(_mm256_and_si256(l1, m15),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
        v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
        v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
#else
        (void)m15;
        const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + (WB == 84 ? 16 : 32) + 32 * h));
        v[0] = _mm256_and_si256(q, m3);
        v[1] = _mm256_and_si256(_mm256_srli_epi16(q, 2), m3);
        v[2] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m3);
        v[3] = _mm256_and_si256(_mm256_srli_epi16(q, 6), m3);
#if defined(STRATA_T_Q3_K)
        // q2 - (hbit ? 0 : 4) = (q2 | hbit << 2) - 4: hmask bit c = 4h + k of byte l
        const __m256i one = _mm256_set1_epi8(1);
        const __m256i hh = _mm256_srli_epi16(hm, 4 * h);
        v[0] = _mm256_or_si256(v[0], _mm256_slli_epi16(_mm256_and_si256(hh, one), 2));
        v[1] = _mm256_or_si256(v[1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 1), one), 2));
        v[2] = _mm256_or_si256(v[2], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), one), 2));
        v[3] = _mm256_or_si256(v[3], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 3), one), 2));
#endif
#endif
        for (int k = 0; k < 4; ++k) D->sc[4 * h + k] = sc_pair(sch, k);
    }
#endif
}

// The exact sums of one decoded super-block against activation bytes y (256), its per-16 sums s and per-32 sums t32.
static inline void sb_dot(const KDec* D, const i8* y, const i16* s, const i16* t32, int* S, int* M) {
    __m256i acc = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
        const __m256i p = _mm256_maddubs_epi16(D->w[k], _mm256_loadu_si256((const __m256i*)(y + 32 * k)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, D->sc[k]));
    }
#if defined(STRATA_T_Q4_K) || defined(STRATA_T_Q5_K)
    // mins x the activation's sums per 32 (int16), exact
    const __m128i mp = _mm_madd_epi16(_mm256_extracti128_si256(D->c16, 1), _mm_loadu_si128((const __m128i*)t32));
    (void)s;
    *S = hsum_i32x8(acc);
    *M = hsum_i32x4(mp);
#else
    (void)t32;
    int tot = hsum_i32x8(acc), mt = 0;
#if defined(STRATA_T_Q6_K)
    tot -= 32 * dot16_i16(D->c16, s);
#elif defined(STRATA_T_Q3_K)
    tot -= 4 * dot16_i16(D->c16, s);
#else
    mt = dot16_i16(D->c16, s);
#endif
    *S = tot;
    *M = mt;
#endif
}

static inline void sb_sums(const u8* blk, const i8* y, const i16* s, const i16* t32, int* S, int* M) {
    KDec D;
    sb_decode(blk, &D);
    sb_dot(&D, y, s, t32, S, M);
}
#else
#define sb_sums sb_sums_scalar
#endif

// The super-block's fp16 scale(s): d at byte 0 (Q4_K, Q5_K), 80 (Q2_K), 108 (Q3_K), 208 (Q6_K); dmin after d.
#if defined(STRATA_T_Q2_K)
#define D_AT 80
#elif defined(STRATA_T_Q3_K)
#define D_AT 108
#elif defined(STRATA_T_Q6_K)
#define D_AT 208
#else
#define D_AT 0
#endif

// One row: sa += (d_x * d_w) * S_b, sm += (d_x * dmin_w) * M_b per super-block, result sa - sm (cpu_q8.c, item 3).
static float dot_row(const u8* row, const Act* A, int ne0) {
    const int nb = ne0 / 256;
    float sa = 0.0f, sm = 0.0f;
    for (int b = 0; b < nb; ++b) {
        const u8* blk = row + (i64)b * WB;
        int S, M;
        sb_sums(blk, A->q + (i64)b * 256, A->s + 16 * b, A->t + 8 * b, &S, &M);
        const float dx = A->d[b];
        sa = sa + (dx * q8_h2f(q8_ld16(blk + D_AT))) * (float)S;
#if HAS_MIN
        sm = sm + (dx * q8_h2f(q8_ld16(blk + D_AT + 2))) * (float)M;
#else
        (void)M;
#endif
    }
    return sa - sm;
}

#define MM_MULTI 8

// out[a] = dot_row(row, &A[a], ne0) for a < na (<= MM_MULTI), bit for bit: each super-block decoded once for all na
// activations (sb_decode), then each activation takes dot_row's integer sums and float order.
static void dot_rows(const u8* row, const Act* A, int na, int ne0, float* out) {
#ifdef Q8_AVX2
    const int nb = ne0 / 256;
    float sa[MM_MULTI], sm[MM_MULTI];
    for (int a = 0; a < na; ++a) sa[a] = sm[a] = 0.0f;
    for (int b = 0; b < nb; ++b) {
        const u8* blk = row + (i64)b * WB;
        KDec D;
        sb_decode(blk, &D);
        const float dw = q8_h2f(q8_ld16(blk + D_AT));
#if HAS_MIN
        const float dm = q8_h2f(q8_ld16(blk + D_AT + 2));
#endif
        for (int a = 0; a < na; ++a) {
            int S, M;
            sb_dot(&D, A[a].q + (i64)b * 256, A[a].s + 16 * b, A[a].t + 8 * b, &S, &M);
            const float dx = A[a].d[b];
            sa[a] = sa[a] + (dx * dw) * (float)S;
#if HAS_MIN
            sm[a] = sm[a] + (dx * dm) * (float)M;
#else
            (void)M;
#endif
        }
    }
    for (int a = 0; a < na; ++a) out[a] = sa[a] - sm[a];
#else
    for (int a = 0; a < na; ++a) out[a] = dot_row(row, &A[a], ne0);
#endif
}

#ifdef Q8_AVX2
#define Q8_ROWS_W 8  // weight rows dot_rows_w takes against one activation
// out[i] = dot_row(row0 + i * row_bytes, A, ne0) for i < nr (<= Q8_ROWS_W), bit for bit: a token's matvec. Each row
// reads up to 8 super-blocks in order and takes sb_decode and sb_dot's integer products for each, but the lanes are
// not summed one row at a time: per super-block the 8 rows' int32 vectors are reduced together (hsum_i32x8x8:
// integers, exact in any order; the Q6_K / Q3_K offsets folded in before it, as exact), then dot_row's float part
// runs lane by lane - lane i = row i: sa += (d_x * d_w) * S, sm += (d_x * dmin_w) * M in ascending b, sa - sm.
// llama.cpp gets the same saving from its repacked 8-row Q4_K (ggml-cpu/repack.cpp), here without a repacked copy.
// Measured on this project's 2-core Zen 4 VM, one thread, 16 Q4_K [768 x 2048] / 8 Q6_K [2048 x 768] matrices: 1.2-1.7x
// / 1.3-1.4x dot_row's row at a time (bench/cpu_moe_layers.py times a whole token on a pack).
static void dot_rows_w(const u8* row0, i64 row_bytes, int nr, const Act* A, int ne0, float* out) {
    const int nb = ne0 / 256;
    const __m256i z = _mm256_setzero_si256();
    __m256 sa = _mm256_setzero_ps(), sm = sa;
    for (int b0 = 0; b0 < nb; b0 += 8) {  // 8 super-blocks of each row (its bytes in order), then their float part
        const int nbb = nb - b0 < 8 ? nb - b0 : 8;
        __m256i vs[8][Q8_ROWS_W], vm[8][Q8_ROWS_W];
        unsigned short dh[8][Q8_ROWS_W], mh[8][Q8_ROWS_W];
        for (int i = 0; i < Q8_ROWS_W; ++i)
        for (int bb = 0; bb < nbb; ++bb) {
            vs[bb][i] = vm[bb][i] = z;
            dh[bb][i] = mh[bb][i] = 0;
            if (i >= nr) continue;
            const int b = b0 + bb;
            const i8* y = A->q + (i64)b * 256;
            const u8* blk = row0 + (i64)i * row_bytes + (i64)b * WB;
            KDec D;
            sb_decode(blk, &D);
            __m256i acc = z;
            for (int k = 0; k < 8; ++k) {
                const __m256i p = _mm256_maddubs_epi16(D.w[k], _mm256_loadu_si256((const __m256i*)(y + 32 * k)));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, D.sc[k]));
            }
#if defined(STRATA_T_Q4_K) || defined(STRATA_T_Q5_K)
            vm[bb][i] = _mm256_zextsi128_si256(_mm_madd_epi16(_mm256_extracti128_si256(D.c16, 1),
                                                              _mm_loadu_si128((const __m128i*)(A->t + 8 * b))));
#else
            const __m256i cs = _mm256_madd_epi16(D.c16, _mm256_loadu_si256((const __m256i*)(A->s + 16 * b)));
#if defined(STRATA_T_Q6_K)
            acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(cs, 5));  // 32 x
#elif defined(STRATA_T_Q3_K)
            acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(cs, 2));  // 4 x
#else
            vm[bb][i] = cs;  // Q2_K: the mins
#endif
#endif
            vs[bb][i] = acc;
            dh[bb][i] = (unsigned short)q8_ld16(blk + D_AT);
#if HAS_MIN
            mh[bb][i] = (unsigned short)q8_ld16(blk + D_AT + 2);
#endif
        }
        for (int bb = 0; bb < nbb; ++bb) {
            const __m256 dx = _mm256_set1_ps(A->d[b0 + bb]);
            sa = _mm256_add_ps(sa, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)dh[bb]))),
                                                 _mm256_cvtepi32_ps(hsum_i32x8x8(vs[bb]))));
#if HAS_MIN
            sm = _mm256_add_ps(sm, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)mh[bb]))),
                                                 _mm256_cvtepi32_ps(hsum_i32x8x8(vm[bb]))));
#else
            (void)mh;
#endif
        }
    }
    float r[Q8_ROWS_W];
    _mm256_storeu_ps(r, _mm256_sub_ps(sa, sm));
    for (int i = 0; i < nr; ++i) out[i] = r[i];
}
#endif
#endif

// out[i] = dot_row(row0 + i * row_bytes, A, ne0) for i < nr: one row at a time where this build has no dot_rows_w
// (the 32-value types, the scalar build).
#ifndef Q8_ROWS_W
#define Q8_ROWS_W 8
static void dot_rows_w(const u8* row0, i64 row_bytes, int nr, const Act* A, int ne0, float* out) {
    for (int i = 0; i < nr; ++i) out[i] = dot_row(row0 + (i64)i * row_bytes, A, ne0);
}
#endif

// The prompt chunks' panels and the entry points follow (cpu_q8_chunk.c, appended by strata.engine.cpu.kernels.source).
