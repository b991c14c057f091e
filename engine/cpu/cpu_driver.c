// CPU driver of strata's quantized matrix-vector products (strata.engine.cpu.kernels).
//
// Compiled for the host by the C compiler, once per ggml type, AFTER the type's device code:
// engine/kernel_src/prelude.cuh + the generated QK/NF/PB defines + the lookup tables + types/<T>.cuh
// (the very code NVRTC compiles for the GPU; the CUDA keywords are stubbed before it). So a value
// dequantized here is the value the GPU dequantizes: one definition of each type.
//
// Weights are read in their NATIVE GGUF blocks (the memory-mapped pool.bin or expert shard), not in
// engine form: for a widened type (NF > 0) the block's fp16 scale field(s) at byte 0 (and 2) are
// widened to f32 here (exact) and the payload follows them; native types pass the block itself.
//
// Two orders of summation:
// - exact (matvec_exact): the GPU kernel's order (engine/gpu/cuda/matvec_block.cu warp_dot): per
//   32-value chunk c, s = s + w[i] * x[i] for i = 0..31; lane c % 32 accumulates s over its chunks
//   in ascending order; then the xor butterfly 16, 8, 4, 2, 1. Bit-identical to the GPU and to
//   strata.engine.gpu.reference.matvec (plain types: lane i % 32 accumulates the elements).
// - fast (matvec_fast): the row dequantized into a buffer, then a 16-way dot (vectorised).
// Both: no FMA contraction (-ffp-contract=off), rows split over OpenMP threads.

#ifndef QK
#define PLAIN_TYPE 1
#endif

// acc[0] after the xor butterfly 16, 8, 4, 2, 1 of the GPU's warp (acc[l] + acc[l ^ o] at every level): only the
// lanes lane 0 depends on are formed (l < o, where l ^ o = l + o), each by the same addition.
static inline void butterfly32(float* acc) {
    for (int o = 16; o > 0; o >>= 1)
        for (int l = 0; l < o; ++l) acc[l] = acc[l] + acc[l + o];
}

#ifndef PLAIN_TYPE
#define CPB (QK / 32)
#define BB (PB + 2 * NF)  // native block bytes: the fp16 scale fields, then the payload

static inline void deq_native(const u8* blk, int sub, float* y) {
#if NF > 0
    float sc[NF];
    for (int f = 0; f < NF; ++f) sc[f] = h2f(ld16(blk + 2 * f));
    deq_chunk(sc, blk + 2 * NF, sub, y);
#else
    deq_chunk((const float*)0, blk, sub, y);
#endif
}

// x laid out for row_exact (once per matvec, shared by all rows): for each whole group of 8 chunks, value i of
// chunk k of the group at xt[256 g + 8 i + k]; the chunks after the last whole group as they are.
static void exact_prep(const float* x, int ne0, float* xt) {
    const int n_chunk = (ne0 / QK) * CPB, ng = n_chunk / 8;
    for (int g = 0; g < ng; ++g)
        for (int k = 0; k < 8; ++k)
            for (int i = 0; i < 32; ++i) xt[256 * g + 8 * i + k] = x[(i64)(8 * g + k) * 32 + i];
    for (i64 j = (i64)ng * 256; j < (i64)n_chunk * 32; ++j) xt[j] = x[j];
}

// w[8 i + k] = t[32 k + i] (i < 32, k < 8): 8 dequantized chunks to the lane-per-chunk layout (data movement
// only: the AVX shuffles and the scalar loop give the same floats).
static inline void transpose_8x32(const float* t, float* w) {
#if defined(__AVX__) && !defined(STRATA_SCALAR)
    for (int i0 = 0; i0 < 32; i0 += 8) {
        __m256 r0 = _mm256_loadu_ps(t + 0 * 32 + i0), r1 = _mm256_loadu_ps(t + 1 * 32 + i0);
        __m256 r2 = _mm256_loadu_ps(t + 2 * 32 + i0), r3 = _mm256_loadu_ps(t + 3 * 32 + i0);
        __m256 r4 = _mm256_loadu_ps(t + 4 * 32 + i0), r5 = _mm256_loadu_ps(t + 5 * 32 + i0);
        __m256 r6 = _mm256_loadu_ps(t + 6 * 32 + i0), r7 = _mm256_loadu_ps(t + 7 * 32 + i0);
        const __m256 a0 = _mm256_unpacklo_ps(r0, r1), a1 = _mm256_unpackhi_ps(r0, r1);
        const __m256 a2 = _mm256_unpacklo_ps(r2, r3), a3 = _mm256_unpackhi_ps(r2, r3);
        const __m256 a4 = _mm256_unpacklo_ps(r4, r5), a5 = _mm256_unpackhi_ps(r4, r5);
        const __m256 a6 = _mm256_unpacklo_ps(r6, r7), a7 = _mm256_unpackhi_ps(r6, r7);
        const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
        const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
        const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
        const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
        float* o = w + 8 * i0;
        _mm256_storeu_ps(o + 0, _mm256_permute2f128_ps(b0, b4, 0x20));
        _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(b1, b5, 0x20));
        _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(b2, b6, 0x20));
        _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(b3, b7, 0x20));
        _mm256_storeu_ps(o + 32, _mm256_permute2f128_ps(b0, b4, 0x31));
        _mm256_storeu_ps(o + 40, _mm256_permute2f128_ps(b1, b5, 0x31));
        _mm256_storeu_ps(o + 48, _mm256_permute2f128_ps(b2, b6, 0x31));
        _mm256_storeu_ps(o + 56, _mm256_permute2f128_ps(b3, b7, 0x31));
    }
#else
    for (int k = 0; k < 8; ++k)
        for (int i = 0; i < 32; ++i) w[8 * i + k] = t[32 * k + i];
#endif
}

static float row_exact(const u8* row, int ne0, const float* x, const float* xt) {
    const int n_chunk = (ne0 / QK) * CPB;
    float acc[32];
    float t[8 * 32];   // 8 chunks dequantized, chunk-major
    float w[8 * 32];   // the same, transposed: w[i * 8 + k] = value i of chunk k
    for (int l = 0; l < 32; ++l) acc[l] = 0.0f;
    int c = 0;
#ifdef EXACT_BLOCK8
    // one block (8 chunks) at a time, its 8 sums in the lanes of one vector (cpu_exact_simd.c); chunk c + k
    // accumulates into acc[(c + k) & 31] = lane k of av[(c / 8) & 3], in ascending c as below
    __m256 av[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; c + 16 <= n_chunk; c += 16) {  // two blocks side by side
        const u8* b2[2] = {row + (i64)(c / CPB) * BB, row + (i64)(c / CPB + 1) * BB};
        const float* x2[2] = {xt + (i64)c * 32, xt + (i64)(c + 8) * 32};
        __m256 s[2];
        exact_block8_2(b2, x2, s);
        const int v = (c >> 3) & 3;  // even: the pair's lane groups v, v + 1
        av[v] = _mm256_add_ps(av[v], s[0]);
        av[v + 1] = _mm256_add_ps(av[v + 1], s[1]);
    }
    for (; c + 8 <= n_chunk; c += 8) {
        const u8* b1[1] = {row + (i64)(c / CPB) * BB};
        const float* x1[1] = {xt + (i64)c * 32};
        __m256 s[1];
        exact_block8_1(b1, x1, s);
        const int v = (c >> 3) & 3;
        av[v] = _mm256_add_ps(av[v], s[0]);
    }
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + 8 * v, av[v]);
#endif
    // 8 chunks at a time: their 32-term sums are independent, so they run side by side in vector
    // lanes; each one is still s = s + w[i] * x[i] for i = 0..31 in order (the GPU's order)
    for (; c + 8 <= n_chunk; c += 8) {
        for (int k = 0; k < 8; ++k) deq_native(row + (i64)((c + k) / CPB) * BB, (c + k) % CPB, t + 32 * k);
        transpose_8x32(t, w);
        const float* xx = xt + (i64)c * 32;
        float s[8];
        for (int k = 0; k < 8; ++k) s[k] = 0.0f;
        for (int i = 0; i < 32; ++i)
            for (int k = 0; k < 8; ++k) s[k] = s[k] + w[i * 8 + k] * xx[i * 8 + k];
        for (int k = 0; k < 8; ++k) acc[(c + k) & 31] = acc[(c + k) & 31] + s[k];
    }
    for (; c < n_chunk; ++c) {
        deq_native(row + (i64)(c / CPB) * BB, c % CPB, t);
        const float* xx = x + (i64)c * 32;
        float s = 0.0f;
        for (int i = 0; i < 32; ++i) s = s + t[i] * xx[i];
        acc[c & 31] = acc[c & 31] + s;
    }
    butterfly32(acc);
    return acc[0];
}

static void row_dequant(const u8* row, int ne0, float* out) {
    const int n_chunk = (ne0 / QK) * CPB;
    for (int c = 0; c < n_chunk; ++c) deq_native(row + (i64)(c / CPB) * BB, c % CPB, out + (i64)c * 32);
}
#else
static void exact_prep(const float* x, int ne0, float* xt) {
    for (int i = 0; i < ne0; ++i) xt[i] = x[i];
}

static float row_exact(const u8* row, int ne0, const float* x, const float* xt) {
    (void)xt;
    float acc[32];
    for (int l = 0; l < 32; ++l) acc[l] = 0.0f;
    for (int i = 0; i < ne0; ++i) acc[i & 31] = acc[i & 31] + load_w(row, i) * x[i];
    butterfly32(acc);
    return acc[0];
}

static void row_dequant(const u8* row, int ne0, float* out) {
    for (int i = 0; i < ne0; ++i) out[i] = load_w(row, i);
}
#endif

static float dot16(const float* w, const float* x, int n) {
    float a[16];
    for (int j = 0; j < 16; ++j) a[j] = 0.0f;
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) a[j] = a[j] + w[i + j] * x[i + j];
    for (; i < n; ++i) a[0] = a[0] + w[i] * x[i];
    float s = 0.0f;
    for (int j = 0; j < 16; ++j) s = s + a[j];
    return s;
}

// y[m * rows + r] = dot(W_m[r, :], x_m) for nmat matrices of the same shape (native blocks at bases[m], rows
// row_bytes apart; xs[m] the f32 input of matrix m, consecutive equal pointers prepared once): one OpenMP region,
// the (m, r) pairs split over the threads. scratch: nmat * ne0 floats (x laid out for row_exact).
void matvec_exact_many(const u8* const* bases, int nmat, i64 rows, int ne0, i64 row_bytes, const float* const* xs,
                       float* y, int nthreads, float* scratch) {
    int slot[nmat > 0 ? nmat : 1];
    for (int m = 0; m < nmat; ++m) slot[m] = (m > 0 && xs[m] == xs[m - 1]) ? slot[m - 1] : m;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int m = 0; m < nmat; ++m)
            if (slot[m] == m) exact_prep(xs[m], ne0, scratch + (i64)m * ne0);
        #pragma omp for collapse(2) schedule(static)
        for (int m = 0; m < nmat; ++m)
        for (i64 r = 0; r < rows; ++r) {
            const i64 i = (i64)m * rows + r;
            y[i] = row_exact(bases[m] + r * row_bytes, ne0, xs[m], scratch + (i64)slot[m] * ne0);
        }
    }
}

void matvec_exact(const u8* base, i64 rows, int ne0, i64 row_bytes, const float* x, float* y, int nthreads,
                  float* scratch) {
    matvec_exact_many(&base, 1, rows, ne0, row_bytes, &x, y, nthreads, scratch);
}

// The same products, dequantizing each row into a scratch row of ne0 floats and a 16-way dot (scratch:
// nthreads * ne0 floats).
void matvec_fast_many(const u8* const* bases, int nmat, i64 rows, int ne0, i64 row_bytes, const float* const* xs,
                      float* y, int nthreads, float* scratch) {
    #pragma omp parallel num_threads(nthreads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float* buf = scratch + (i64)t * ne0;
        #pragma omp for collapse(2) schedule(static)
        for (int m = 0; m < nmat; ++m)
        for (i64 r = 0; r < rows; ++r) {
            const i64 i = (i64)m * rows + r;
            row_dequant(bases[m] + r * row_bytes, ne0, buf);
            y[i] = dot16(buf, xs[m], ne0);
        }
    }
}

void matvec_fast(const u8* base, i64 rows, int ne0, i64 row_bytes, const float* x, float* y, int nthreads,
                 float* scratch) {
    matvec_fast_many(&base, 1, rows, ne0, row_bytes, &x, y, nthreads, scratch);
}

// Rows ids[k] of W dequantized to out[k, :] (embedding lookup, tests).
void dequant_rows(const u8* base, const i64* ids, i64 n, int ne0, i64 row_bytes, float* out) {
    for (i64 k = 0; k < n; ++k) row_dequant(base + ids[k] * row_bytes, ne0, out + k * ne0);
}
