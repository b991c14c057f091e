// Quantized-activation matvec of strata's CPU path: llama.cpp's CPU numerics (strata.engine.cpu.kernels,
// kernel "q8"). Compiled into each type's library after cpu_driver.c; the type is known by the
// STRATA_T_<NAME> define strata.engine.cpu.kernels.source() puts first.
//
// What llama.cpp's CPU backend does for y = W @ x with a quantized W (ggml-cpu.c ggml_compute_forward_mul_mat:
// the activation row is converted ONCE per matvec to type_traits_cpu[W.type].vec_dot_type, then every row is
// ggml_vec_dot_<W>_<act>), and so this file:
//
// 1. Activation quantization (exact, bit for bit; strata.engine.numerics quantize_q8_0 / quantize_q8_K are the
//    NumPy definitions and the tests compare every value):
//    - Q8_0 (weights Q4_0, Q5_0, Q8_0, IQ4_NL), blocks of 32 (ggml-cpu/arch/x86/quants.c quantize_row_q8_0, the
//      AVX2 branch): amax = max |x|; d = fp16(amax / 127) (round to nearest even, F16C's _cvtss_sh);
//      id = amax != 0 ? 127 / amax : 0 (f32, from amax, not from the rounded d); q = round_half_even(x * id)
//      (_mm256_round_ps _MM_ROUND_NEAREST). The dot uses fp32(d).
//    - Q8_K (K-quant weights), blocks of 256 (ggml-quants.c quantize_row_q8_K_ref, which the x86
//      quantize_row_q8_K calls): max = the x of largest |x|, first on ties; iscale = -127 / max;
//      q = min(127, nearest_int(iscale * x)) (nearest_int adds 1.5 * 2^23: half to even); d = 1 / iscale (f32);
//      bsums[j] = sum of q over values 16j..16j+15. An all-zero block has d = 0, q = 0.
//    Here both formats also keep the per-16 sums (Q8_0 needs them for the offset trick below).
//
// 2. Integer dot products per block, EXACT (int32; every product and sum is an integer well inside range, so the
//    order of integer additions cannot change a bit). Weight formats (ggml-common.h block structs; the value
//    layout as in engine/kernel_src/types/<T>.cuh, which the tests check against gguf-py):
//    - Q4_0: fp16 d, qs[16]: value j = (qs[j] & 15) - 8, value j+16 = (qs[j] >> 4) - 8.
//    - Q5_0: fp16 d, qh (u32 LE), qs[16]: value j = ((qs[j] & 15) | bit j of qh << 4) - 16, j+16 likewise with
//      qs[j] >> 4 and bit j+16.
//    - Q8_0: fp16 d, int8 qs[32]. IQ4_NL: fp16 d, qs[16]: kvalues_iq4nl[nibble] in the Q4_0 order.
//    - Q2_K: scales[16] (lo nibble scale, hi nibble min per 16 values), qs[64], fp16 d @80, dmin @82; value
//      32c + l (chunk c = 0..7, l < 32) = (qs[32 (c >> 2) + l] >> 2 (c & 3)) & 3; w = d*sc*q - dmin*m.
//    - Q3_K: hmask[32], qs[64], scales[12] (16 6-bit, -32), fp16 d @108; value 32c + l = q2 - (hmask bit c of
//      byte l ? 0 : 4), q2 as in Q2_K; w = d * (sc - 32) * q.
//    - Q4_K: fp16 d, dmin, scales[12] (8 6-bit scales + 8 6-bit mins, get_scale_min_k4), qs[128]; value
//      64j + l = qs[32j + l] & 15, 64j + 32 + l = qs[32j + l] >> 4; w = d*sc*q - dmin*m per 32 values.
//    - Q5_K: as Q4_K plus qh[32] (bit g of qh[l] = bit 4 of value 32g + l), qs at 48.
//    - Q6_K: ql[128], qh[64], int8 scales[16], fp16 d @208; value 128h + 32k + l = (low nibble of
//      ql[64h + 32 (k & 1) + l] (>> 4 if k >= 2)) | ((qh[32h + l] >> 2k) & 3) << 4, minus 32; scale per 16.
//    Offsets are taken out with the activation's per-16 sums (exact): e.g. Q4_0 sum((n - 8) q) =
//    sum(n q) - 8 sum(q), Q6_K sum(sc (v - 32) q) = sum(sc v q) - 32 sum(sc bsum).
//
// 3. The float part - the only place an order matters - is ours, FIXED, and the same in the SIMD and the
//    scalar code (so every host gives the same bits; tests/test_engine_cpu_q8.py replays it in NumPy exactly):
//    - 32-value types: t_b = (fp32(d_w,b) * d_x,b) * (float)S_b for block b; acc[b % 8] += t_b in ascending b;
//      result = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) (ggml's hsum_float_8 order).
//    - K types, per super-block b: sa += (d_x,b * fp32(d_w,b)) * (float)S_b; sm += (d_x,b * fp32(dmin_w,b)) *
//      (float)M_b (M_b = sum of mins x bsums); result = sa - sm (Q3_K/Q6_K: sa).
//    Every operation is one rounded f32 multiply or add (no FMA: -ffp-contract=off). ggml's AVX2 code sums the
//    same terms split over 8 SIMD lanes with FMA (e.g. ggml_vec_dot_q4_K_q8_K: acc = fmadd(d, float(8 int32
//    lanes), acc)), so a row differs from llama.cpp's by float rounding only (a few ulp of sum |w x|).
//
// SIMD: AVX2 intrinsics when the compiler targets AVX2 (-march=native), with the AVX-512 VNNI / AVX-VNNI
// vpdpbusd for the u8 x s8 dots where present; -DSTRATA_SCALAR (or a host without AVX2) compiles the portable
// scalar code. Rows are split over OpenMP threads.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && !defined(STRATA_SCALAR)
#include <immintrin.h>
#define Q8_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#elif defined(__AVXVNNI__)
#define Q8_VNNI 2
#endif
#endif

typedef int i32;

#if defined(STRATA_T_Q4_0) || defined(STRATA_T_Q5_0) || defined(STRATA_T_Q8_0) || defined(STRATA_T_IQ4_NL)
#define Q8_ACT 1  // the weight meets Q8_0 activations
#elif defined(STRATA_T_Q2_K) || defined(STRATA_T_Q3_K) || defined(STRATA_T_Q4_K) || defined(STRATA_T_Q5_K) || \
    defined(STRATA_T_Q6_K)
#define Q8_ACT 2  // Q8_K
#else
#define Q8_ACT 0  // no integer kernel (the f32 paths of cpu_driver.c only)
#endif

// 0: no integer kernel for this type; 1: Q8_0 activations; 2: Q8_K activations.
int q8_act_format(void) { return Q8_ACT; }
// 1 when this library was compiled with the AVX2 code, 0 for the scalar code.
int q8_simd(void) {
#ifdef Q8_AVX2
    return 1;
#else
    return 0;
#endif
}

// q8_ld32 / q8_ld16 (unaligned little-endian loads): cpu_exact_simd.c, concatenated first.

// ------------------------------------------------------------------ fp16 <-> f32 (exact / round to nearest even)

// q8_h2f (fp16 -> f32, exact): cpu_exact_simd.c, concatenated first.

// f32 -> fp16 bits, round to nearest even (IEEE; what F16C's _cvtss_sh(x, 0) and numpy's astype(float16) do):
// overflow to inf, subnormal halves rounded at 2^-24, NaN -> 0x7e00.
static inline u32 q8_f2h(float f) {
#if defined(Q8_AVX2) && defined(__F16C__)
    return (u32)_cvtss_sh(f, 0);
#else
    u32 x = __float_as_uint(f);
    const u32 sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x >= 0x47800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);  // >= 65536, inf, NaN
    if (x < 0x38800000u) {  // below 2^-14: a subnormal half (or 0); adding 0.5 aligns the mantissa at 2^-24
        const float t = __uint_as_float(x) + 0.5f;
        return sign | (__float_as_uint(t) - 0x3f000000u);
    }
    const u32 odd = (x >> 13) & 1u;  // normal: rebias, then round the 13 dropped bits to even
    x += 0xc8000fffu + odd;          // (15 - 127) << 23 (mod 2^32) + 0xfff
    return sign | (x >> 13);
#endif
}

// out[i] = fp32(fp16(x[i])): the rounding of the Q8_0 scale, exported for the tests (numpy's float16 is the reference).
void f16_round(const float* x, i64 n, float* out) {
    for (i64 i = 0; i < n; ++i) out[i] = q8_h2f(q8_f2h(x[i]));
}

// ------------------------------------------------------------------ the quantized activation

// One activation vector of n values: engine/kernel_src/q8_layout.h (act_d_off, act_s_off, act_t_off, act_nbytes_of), concatenated
// first, the layout the GPU kernels read too.
i64 act_nbytes(int n) { return act_nbytes_of(n); }

typedef struct {
    const i8* q;
    const float* d;
    const i16* s;
    const i16* t;
} Act;

static inline Act act_view(const u8* buf, int n) {
    Act a = {(const i8*)buf, (const float*)(buf + act_d_off(n)), (const i16*)(buf + act_s_off(n)),
             (const i16*)(buf + act_t_off(n))};
    return a;
}

// x (n f32, n % 32 == 0) -> Q8_0: q, d (fp32 of the fp16 scale), per-16 sums s.
void quantize_q8_0(const float* x, int n, i8* q, float* d, i16* s) {
    for (int b = 0; b < n / 32; ++b) {
        const float* xb = x + (i64)b * 32;
        float amax = 0.0f;
        int bad = 0;
        for (int j = 0; j < 32; ++j) {
            const float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
            bad |= !(a <= 3.40282347e38f);  // NaN or infinite (a max would drop a NaN silently)
        }
        if (bad) {  // a non-finite activation stays visible: the block's products become NaN
            d[b] = NAN;
            for (int j = 0; j < 32; ++j) q[(i64)b * 32 + j] = 0;
            s[2 * b] = s[2 * b + 1] = 0;
            continue;
        }
        d[b] = q8_h2f(q8_f2h(amax / 127.0f));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int s0 = 0, s1 = 0;
        for (int j = 0; j < 32; ++j) {
            const int v = (int)rintf(xb[j] * id);  // default rounding mode: to nearest, ties to even
            q[(i64)b * 32 + j] = (i8)v;
            if (j < 16) s0 += v; else s1 += v;
        }
        s[2 * b] = (i16)s0;
        s[2 * b + 1] = (i16)s1;
    }
}

// ggml-quants.c nearest_int: exact round-half-even for |f| <= 2^22.
static inline int q8_nearest_int(float f) {
    const float v = f + 12582912.0f;
    return (int)(__float_as_uint(v) & 0x007fffffu) - 0x00400000;
}

// x (n f32, n % 256 == 0) -> Q8_K: q, d (one per 256), per-16 sums s (ggml's bsums).
void quantize_q8_K(const float* x, int n, i8* q, float* d, i16* s) {
    for (int b = 0; b < n / 256; ++b) {
        const float* xb = x + (i64)b * 256;
        i8* qb = q + (i64)b * 256;
        float mx = 0.0f, amax = 0.0f;
        int bad = 0;
        for (int j = 0; j < 256; ++j) {
            const float a = fabsf(xb[j]);
            if (a > amax) { amax = a; mx = xb[j]; }
            bad |= !(a <= 3.40282347e38f);  // NaN or infinite
        }
        if (bad) {  // a non-finite activation stays visible: the block's products become NaN
            d[b] = NAN;
            for (int j = 0; j < 256; ++j) qb[j] = 0;
            for (int j = 0; j < 16; ++j) s[16 * b + j] = 0;
            continue;
        }
        if (amax == 0.0f) {
            d[b] = 0.0f;
            for (int j = 0; j < 256; ++j) qb[j] = 0;
            for (int j = 0; j < 16; ++j) s[16 * b + j] = 0;
            continue;
        }
        const float iscale = -127.0f / mx;
        for (int j = 0; j < 256; ++j) {
            const int v = q8_nearest_int(iscale * xb[j]);
            qb[j] = (i8)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; ++j) {
            int t = 0;
            for (int i = 0; i < 16; ++i) t += qb[16 * j + i];
            s[16 * b + j] = (i16)t;
        }
        d[b] = 1.0f / iscale;
    }
}

static void act_quantize(const float* x, int n, u8* buf) {
    i8* q = (i8*)buf;
    float* d = (float*)(buf + act_d_off(n));
    i16* s = (i16*)(buf + act_s_off(n));
    i16* t = (i16*)(buf + act_t_off(n));
#if Q8_ACT == 2
    quantize_q8_K(x, n, q, d, s);
#else
    quantize_q8_0(x, n, q, d, s);
#endif
    for (int b = 0; b < n / 32; ++b) t[b] = (i16)(s[2 * b] + s[2 * b + 1]);
}

// ------------------------------------------------------------------ SIMD helpers

#ifdef Q8_AVX2
// acc + sum over each 4 adjacent bytes of u8 a times s8 b, in int32 lanes. Exact: with maddubs the pair sums stay
// within int16 because every caller has a <= 128 and |b| <= 127 (2 * 128 * 127 < 32767).
static inline __m256i dp_u8s8(__m256i acc, __m256i a, __m256i b) {
#if Q8_VNNI == 1
    return _mm256_dpbusd_epi32(acc, a, b);
#elif Q8_VNNI == 2
    return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

static inline int hsum_i32x4(__m128i s) {
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

static inline int hsum_i32x8(__m256i v) {
    return hsum_i32x4(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// [sum(v[0]), ..., sum(v[7])]: the lane totals of 8 vectors (integer: exact in any order).
static inline __m256i hsum_i32x8x8(const __m256i* v) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// 32 nibbles of 16 bytes: low nibbles in bytes 0..15, high nibbles in bytes 16..31.
static inline __m256i nibbles32(const u8* p) {
    const __m128i t = _mm_loadu_si128((const __m128i*)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
}

// byte j = 0xff where bit j of the u32 at p is set (j = 0..31).
static inline __m256i bits32(const u8* p) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)q8_ld32(p)), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, sel), sel);
}

// s8 w times s8 y (|y| <= 127), summed per 4 bytes: the sign trick (|w| as u8, y with w's sign), exact.
static inline __m256i dp_s8s8(__m256i acc, __m256i w, __m256i y) {
    return dp_u8s8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
}
#endif

// ------------------------------------------------------------------ the experts' activation

// out[i] = silu_mul1(g[i], u[i]) (silu.cuh, its constants defined before this file: the op sequence of
// strata.engine.gpu.reference.silu_mul, every step one rounded f32 op), 8 lanes at a time with AVX2: the same ops
// (min / max against the finite clamps, floor, separate multiplies and adds, 2^n from bits, IEEE division), so the
// same bits as the scalar form and the GPU's (tests/test_engine_cpu_q8.py).
static void silu_mul_row(const float* g, const float* u, float* out, i64 n) {
    i64 i = 0;
#ifdef Q8_AVX2
    const __m256 lo = _mm256_set1_ps(LO), hi = _mm256_set1_ps(HI), log2e = _mm256_set1_ps(LOG2E);
    const __m256 half = _mm256_set1_ps(HALF), l2h = _mm256_set1_ps(LN2_HI), l2l = _mm256_set1_ps(LN2_LO);
    const __m256 one = _mm256_set1_ps(ONE), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gi = _mm256_loadu_ps(g + i);
        // fminf(fmaxf(-g, LO), HI): max_ps / min_ps return their second operand for a NaN first, as fmaxf / fminf do
        const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_xor_ps(gi, sign), lo), hi);
        const __m256 nf = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(t, log2e), half));
        const __m256 r = _mm256_sub_ps(_mm256_sub_ps(t, _mm256_mul_ps(nf, l2h)), _mm256_mul_ps(nf, l2l));
        __m256 p = _mm256_mul_ps(r, _mm256_set1_ps(C7));
        p = _mm256_mul_ps(_mm256_add_ps(p, _mm256_set1_ps(C6)), r);
        p = _mm256_mul_ps(_mm256_add_ps(p, _mm256_set1_ps(C5)), r);
        p = _mm256_mul_ps(_mm256_add_ps(p, _mm256_set1_ps(C4)), r);
        p = _mm256_mul_ps(_mm256_add_ps(p, _mm256_set1_ps(C3)), r);
        p = _mm256_mul_ps(_mm256_add_ps(p, _mm256_set1_ps(C2)), r);
        p = _mm256_mul_ps(_mm256_add_ps(p, one), r);
        p = _mm256_add_ps(p, one);
        const __m256i e2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(nf), _mm256_set1_epi32(127)), 23);
        const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(e2));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gi, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; ++i) out[i] = silu_mul1(g[i], u[i]);
}

// out[i] = silu_mul1(g[i], u[i]) for i < n (silu_mul_row), exported for the tests.
void silu_mul_f32(const float* g, const float* u, float* out, i64 n) { silu_mul_row(g, u, out, n); }

static inline float hsum8_f32(const float* a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// The per-type dots (cpu_q8_dots.c), then the prompt chunks' panels and the entry points (cpu_q8_chunk.c) follow,
// appended by strata.engine.cpu.kernels.source.
