// The products of a prompt chunk on AVX-512 VNNI hosts (16-row panels) and the entry points of the quantized-activation
// kernels (appended to cpu_q8_dots.c: the per-type dots, dot_row / dot_rows, WB, WOFF, KDec / sb_decode, D_AT, HAS_MIN;
// the formats, the exactness argument and the float order are in cpu_q8.c's header).

// Prompt chunks on AVX-512 VNNI hosts: weight rows in 16-row panels (panel_pack / panel_dot below, per format).
#if defined(Q8_AVX2) && Q8_VNNI == 1 && defined(__AVX512F__)
#define Q8_PANEL 16
// Fewest activations a matrix must meet for its units to be packed: below, the packing costs more than it saves
// (strata alone on this project's 2-core Zen 4 VM, 2 threads: at 4 activations Q4_K [768 x 2048] 32 vs 39 GMAC/s
// for dot_rows, at 8 even, from 16 the panel ahead: 82 vs 66) - a routed expert in a chunk often meets only a few.
#define PANEL_MIN_ACTS 8
#endif

// Rows of this library's prompt-chunk panels (16), or 0 where it was built without them (no AVX-512 VNNI, the scalar
// build, a type without a q8 kernel): the tests check a VNNI host really takes the panel path.
int q8_panel_rows(void) {
#if defined(Q8_PANEL) && Q8_ACT
    return Q8_PANEL;
#else
    return 0;
#endif
}

#if Q8_ACT == 1 && defined(Q8_PANEL)
// ------------------------------------------------------------------ 16-row panels (a prompt chunk, AVX-512 VNNI)
//
// A prompt chunk multiplies each weight row by hundreds of activations. dot_rows reduces each block's 8 int32
// lanes to one sum per activation (a horizontal add tree: more instructions than the dots). A panel instead lays 16
// rows side by side, one zmm lane per row: block b's PANEL_BLOCK_BYTES at b * PANEL_BLOCK_BYTES hold, for value group
// g (values 4g..4g+3), 64 bytes at g * 64 with row r's blk_w bytes 4g..4g+3 at byte 4r, then the rows' scales (16 f32
// at 512: fp32 of row r's fp16 d). Eight vpdpbusd against the activation's groups (broadcast) leave lane r = row r's
// block sum: no horizontal add. The float part is then dot_row's, lane by lane: S_b less WOFF x the activation's
// block sum, acc[b % 8] += (d_w * d_x) * S_b in ascending b, ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) +
// (acc3 + acc7)) - the same bits as dot_row for every row (tests/test_engine_cpu_q8.py).
#define PANEL_BLOCK_BYTES 576

// Pack rows row0 .. row0 + nr - 1 (nr <= 16, row_bytes apart, nb blocks each) into panel P (nb * PANEL_BLOCK_BYTES,
// 64-byte aligned); rows past nr are 0 (their outputs are not used).
static void panel_pack(const u8* row0, i64 row_bytes, int nr, int nb, u8* P) {
    for (int b = 0; b < nb; ++b) {
        u32* V = (u32*)(P + (i64)b * PANEL_BLOCK_BYTES);
        float* dw = (float*)(P + (i64)b * PANEL_BLOCK_BYTES + 512);
        for (int r = 0; r < Q8_PANEL; ++r) {
            u32 w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            float d = 0.0f;
            if (r < nr) {
                const u8* blk = row0 + (i64)r * row_bytes + (i64)b * WB;
                _mm256_storeu_si256((__m256i*)w, blk_w(blk));
                d = q8_h2f(q8_ld16(blk));
            }
            for (int g = 0; g < 8; ++g) V[g * Q8_PANEL + r] = w[g];
            dw[r] = d;
        }
    }
}

// Block b + K of the panel against activation A into accumulator ACC (block b + K's index mod 8 is K: b % 8 == 0).
#define PANEL_BLK(K, ACC)                                                                                          \
    {                                                                                                              \
        const int bb = b + (K);                                                                                    \
        const u8* yq = (const u8*)A->q + (i64)bb * 32;                                                            \
        const u8* pb = P + (i64)bb * PANEL_BLOCK_BYTES;                                                            \
        const __m512i* w = (const __m512i*)pb;                                                                     \
        const __m512i z = _mm512_setzero_si512();                                                                  \
        __m512i s0 = _mm512_dpbusd_epi32(z, _mm512_load_si512(w), _mm512_set1_epi32((int)q8_ld32(yq)));          \
        __m512i s1 = _mm512_dpbusd_epi32(z, _mm512_load_si512(w + 1), _mm512_set1_epi32((int)q8_ld32(yq + 4)));  \
        s0 = _mm512_dpbusd_epi32(s0, _mm512_load_si512(w + 2), _mm512_set1_epi32((int)q8_ld32(yq + 8)));         \
        s1 = _mm512_dpbusd_epi32(s1, _mm512_load_si512(w + 3), _mm512_set1_epi32((int)q8_ld32(yq + 12)));        \
        s0 = _mm512_dpbusd_epi32(s0, _mm512_load_si512(w + 4), _mm512_set1_epi32((int)q8_ld32(yq + 16)));        \
        s1 = _mm512_dpbusd_epi32(s1, _mm512_load_si512(w + 5), _mm512_set1_epi32((int)q8_ld32(yq + 20)));        \
        s0 = _mm512_dpbusd_epi32(s0, _mm512_load_si512(w + 6), _mm512_set1_epi32((int)q8_ld32(yq + 24)));        \
        s1 = _mm512_dpbusd_epi32(s1, _mm512_load_si512(w + 7), _mm512_set1_epi32((int)q8_ld32(yq + 28)));        \
        const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(WOFF * (int)A->t[bb]));   \
        const __m512 dd = _mm512_mul_ps(_mm512_load_ps((const float*)(pb + 512)), _mm512_set1_ps(A->d[bb]));     \
        ACC = _mm512_add_ps(ACC, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(s)));                                        \
    }

// out[r] = dot_row(row r of the panel, A, ne0) for r < 16, bit for bit (the panel's header).
static void panel_dot(const u8* P, int nb, const Act* A, float* out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
        PANEL_BLK(0, a0) PANEL_BLK(1, a1) PANEL_BLK(2, a2) PANEL_BLK(3, a3)
        PANEL_BLK(4, a4) PANEL_BLK(5, a5) PANEL_BLK(6, a6) PANEL_BLK(7, a7)
    }
    if (b + 0 < nb) PANEL_BLK(0, a0)
    if (b + 1 < nb) PANEL_BLK(1, a1)
    if (b + 2 < nb) PANEL_BLK(2, a2)
    if (b + 3 < nb) PANEL_BLK(3, a3)
    if (b + 4 < nb) PANEL_BLK(4, a4)
    if (b + 5 < nb) PANEL_BLK(5, a5)
    if (b + 6 < nb) PANEL_BLK(6, a6)
    const __m512 r = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a4), _mm512_add_ps(a2, a6)),
                                   _mm512_add_ps(_mm512_add_ps(a1, a5), _mm512_add_ps(a3, a7)));
    _mm512_storeu_ps(out, r);
}
#undef PANEL_BLK
#endif

#if Q8_ACT == 2 && defined(Q8_PANEL)
// 16-row panels of super-blocks (the 32-value types' panel header above): block b's PANEL_BLOCK_BYTES hold the values
// (64 groups of 4: 64 x 64 bytes, row r's u8 bytes 4g..4g+3 of sb_decode's w at byte 4r of group g), the 16 scales
// per 16 values (16 x 16 int32 at 4096: scale g of row r at 4096 + 64 g + 4 r), the correction pairs (8 x 16 int32 at
// 5120: int16 pair i of row r - Q4_K / Q5_K: mins 2i, 2i + 1 (i < 4); Q6_K, Q3_K: the scales 2i, 2i + 1 whose offset
// the activation's per-16 sums take out; Q2_K: its mins 2i, 2i + 1) and d, dmin (16 f32 each at 5632, 5696). Per
// activation: S = sum over g of scale_g x (4 vpdpbusd over the group's 16 values), the corrections by vpdpwssd against
// the activation's sums (the integers of sb_dot, exact in any order), then dot_row's float part lane by lane: sa +=
// (d_x * d_w) * S, sm += (d_x * dmin_w) * M in ascending b, sa - sm - the same bits as dot_row.
#define PANEL_BLOCK_BYTES 5760

static void panel_pack(const u8* row0, i64 row_bytes, int nr, int nb, u8* P) {
    for (int b = 0; b < nb; ++b) {
        u8* pb = P + (i64)b * PANEL_BLOCK_BYTES;
        u32* V = (u32*)pb;
        i32* SC = (i32*)(pb + 4096);
        u32* C = (u32*)(pb + 5120);
        float* dw = (float*)(pb + 5632);
        float* dm = (float*)(pb + 5696);
        for (int r = 0; r < Q8_PANEL; ++r) {
            u32 w[64];
            i16 sc[8][16], c[16];
            float d = 0.0f, m = 0.0f;
            if (r < nr) {
                const u8* blk = row0 + (i64)r * row_bytes + (i64)b * WB;
                KDec D;
                sb_decode(blk, &D);
                for (int k = 0; k < 8; ++k) {
                    _mm256_storeu_si256((__m256i*)(w + 8 * k), D.w[k]);
                    _mm256_storeu_si256((__m256i*)sc[k], D.sc[k]);
                }
                _mm256_storeu_si256((__m256i*)c, D.c16);
                d = q8_h2f(q8_ld16(blk + D_AT));
#if HAS_MIN
                m = q8_h2f(q8_ld16(blk + D_AT + 2));
#endif
            } else {
                memset(w, 0, sizeof w);
                memset(sc, 0, sizeof sc);
                memset(c, 0, sizeof c);
            }
            for (int g = 0; g < 64; ++g) V[g * Q8_PANEL + r] = w[g];
            for (int k = 0; k < 8; ++k) {  // words 0..7 of sc[k]: values 32k..32k+15; 8..15: values 32k+16..32k+31
                SC[(2 * k) * Q8_PANEL + r] = sc[k][0];
                SC[(2 * k + 1) * Q8_PANEL + r] = sc[k][8];
            }
#if defined(STRATA_T_Q4_K) || defined(STRATA_T_Q5_K)
            for (int i = 0; i < 8; ++i) C[i * Q8_PANEL + r] = i < 4 ? ((u32)(u16)c[8 + 2 * i] | ((u32)(u16)c[9 + 2 * i] << 16)) : 0u;
#else
            for (int i = 0; i < 8; ++i) C[i * Q8_PANEL + r] = (u32)(u16)c[2 * i] | ((u32)(u16)c[2 * i + 1] << 16);
#endif
            dw[r] = d;
            dm[r] = m;
        }
    }
}

// out[r] = dot_row(row r of the panel, A, ne0) for r < 16, bit for bit (the panel's header).
static void panel_dot(const u8* P, int nb, const Act* A, float* out) {
    __m512 sa = _mm512_setzero_ps(), sm = sa;
    for (int b = 0; b < nb; ++b) {
        const u8* pb = P + (i64)b * PANEL_BLOCK_BYTES;
        const __m512i* V = (const __m512i*)pb;
        const __m512i* SC = (const __m512i*)(pb + 4096);
        const __m512i* C = (const __m512i*)(pb + 5120);
        const u8* y = (const u8*)A->q + (i64)b * 256;
        const __m512i z = _mm512_setzero_si512();
        __m512i S0 = z, S1 = z;
        for (int g = 0; g < 16; g += 2) {
            __m512i a = _mm512_dpbusd_epi32(z, _mm512_load_si512(V + 4 * g), _mm512_set1_epi32((int)q8_ld32(y + 16 * g)));
            __m512i e = _mm512_dpbusd_epi32(z, _mm512_load_si512(V + 4 * g + 4), _mm512_set1_epi32((int)q8_ld32(y + 16 * g + 16)));
            a = _mm512_dpbusd_epi32(a, _mm512_load_si512(V + 4 * g + 1), _mm512_set1_epi32((int)q8_ld32(y + 16 * g + 4)));
            e = _mm512_dpbusd_epi32(e, _mm512_load_si512(V + 4 * g + 5), _mm512_set1_epi32((int)q8_ld32(y + 16 * g + 20)));
            a = _mm512_dpbusd_epi32(a, _mm512_load_si512(V + 4 * g + 2), _mm512_set1_epi32((int)q8_ld32(y + 16 * g + 8)));
            e = _mm512_dpbusd_epi32(e, _mm512_load_si512(V + 4 * g + 6), _mm512_set1_epi32((int)q8_ld32(y + 16 * g + 24)));
            a = _mm512_dpbusd_epi32(a, _mm512_load_si512(V + 4 * g + 3), _mm512_set1_epi32((int)q8_ld32(y + 16 * g + 12)));
            e = _mm512_dpbusd_epi32(e, _mm512_load_si512(V + 4 * g + 7), _mm512_set1_epi32((int)q8_ld32(y + 16 * g + 28)));
            S0 = _mm512_add_epi32(S0, _mm512_mullo_epi32(a, _mm512_load_si512(SC + g)));
            S1 = _mm512_add_epi32(S1, _mm512_mullo_epi32(e, _mm512_load_si512(SC + g + 1)));
        }
        __m512i S = _mm512_add_epi32(S0, S1);
        __m512i corr = z;
#if defined(STRATA_T_Q4_K) || defined(STRATA_T_Q5_K)
        const u8* t32 = (const u8*)(A->t + 8 * b);
        for (int i = 0; i < 4; ++i)
            corr = _mm512_dpwssd_epi32(corr, _mm512_load_si512(C + i), _mm512_set1_epi32((int)q8_ld32(t32 + 4 * i)));
#else
        const u8* s16 = (const u8*)(A->s + 16 * b);
        for (int i = 0; i < 8; ++i)
            corr = _mm512_dpwssd_epi32(corr, _mm512_load_si512(C + i), _mm512_set1_epi32((int)q8_ld32(s16 + 4 * i)));
#endif
#if defined(STRATA_T_Q6_K)
        S = _mm512_sub_epi32(S, _mm512_slli_epi32(corr, 5));  // 32 x
#elif defined(STRATA_T_Q3_K)
        S = _mm512_sub_epi32(S, _mm512_slli_epi32(corr, 2));  // 4 x
#endif
        const __m512 dx = _mm512_set1_ps(A->d[b]);
        sa = _mm512_add_ps(sa, _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_load_ps((const float*)(pb + 5632))),
                                             _mm512_cvtepi32_ps(S)));
#if HAS_MIN
        sm = _mm512_add_ps(sm, _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_load_ps((const float*)(pb + 5696))),
                                             _mm512_cvtepi32_ps(corr)));
#endif
    }
#if HAS_MIN
    _mm512_storeu_ps(out, _mm512_sub_ps(sa, sm));
#else
    (void)sm;
    _mm512_storeu_ps(out, _mm512_sub_ps(sa, _mm512_setzero_ps()));
#endif
}
#endif

#if Q8_ACT
// ------------------------------------------------------------------ entry points

// Units of Q8_ROWS_W rows of one matrix split over the threads of the caller's OpenMP region (dot_rows_w: the same
// bits as dot_row per row): y[m * rows + r] = row r of matrix m . the activation at scratch + slot[m] * ab.
static inline void rows_units(const u8* const* bases, int nmat, i64 rows, int ne0, i64 row_bytes, const int* slot,
                              float* y, const u8* scratch, i64 ab) {
    const i64 groups = (rows + Q8_ROWS_W - 1) / Q8_ROWS_W;
    #pragma omp for collapse(2) schedule(static)
    for (int m = 0; m < nmat; ++m)
    for (i64 g = 0; g < groups; ++g) {
        const i64 r0 = g * Q8_ROWS_W;
        const Act A = act_view(scratch + (i64)slot[m] * ab, ne0);
        dot_rows_w(bases[m] + r0 * row_bytes, row_bytes, rows - r0 < Q8_ROWS_W ? (int)(rows - r0) : Q8_ROWS_W, &A,
                   ne0, y + (i64)m * rows + r0);
    }
}

// y[m * rows + r] = row r of matrix m (native blocks at bases[m], row_bytes apart) . x_m quantized as llama.cpp
// does for this type (xs[m]: ne0 f32 each; consecutive equal pointers are quantized once). scratch: nmat *
// act_nbytes(ne0) bytes. One OpenMP region: the quantizations, then units of Q8_ROWS_W rows of one matrix
// (rows_units) split over the threads.
void matvec_q8_many(const u8* const* bases, int nmat, i64 rows, int ne0, i64 row_bytes, const float* const* xs,
                    float* y, int nthreads, u8* scratch) {
    const i64 ab = act_nbytes(ne0);
    int slot[nmat > 0 ? nmat : 1];
    for (int m = 0; m < nmat; ++m) slot[m] = (m > 0 && xs[m] == xs[m - 1]) ? slot[m - 1] : m;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int m = 0; m < nmat; ++m)
            if (slot[m] == m) act_quantize(xs[m], ne0, scratch + (i64)m * ab);
        rows_units(bases, nmat, rows, ne0, row_bytes, slot, y, scratch, ab);
    }
}

// The experts' down products with their inputs made in the same region: h[m * ne0 + i] = silu_mul1(g[m * ne0 + i],
// u[m * ne0 + i]) (cpu_q8.c silu_mul_row: silu.cuh's op sequence, the GPU's bits), quantized as matvec_q8_many
// quantizes x_m, then y as matvec_q8_many(bases, nmat, rows, ne0, row_bytes, {h_m}, ...) - the same bits as the
// activation made apart (strata.engine.gpu.reference.silu_mul) and passed in. g, u, h: nmat x ne0 f32 each (h is
// written). scratch: nmat * act_nbytes(ne0) bytes. Saves a token's MoE layer the activation's round trip through
// NumPy and one OpenMP region.
void matvec_q8_many_silu(const u8* const* bases, int nmat, i64 rows, int ne0, i64 row_bytes, const float* g,
                         const float* u, float* h, float* y, int nthreads, u8* scratch) {
    const i64 ab = act_nbytes(ne0);
    int slot[nmat > 0 ? nmat : 1];
    for (int m = 0; m < nmat; ++m) slot[m] = m;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int m = 0; m < nmat; ++m) {
            const i64 o = (i64)m * ne0;
            silu_mul_row(g + o, u + o, h + o, ne0);
            act_quantize(h + o, ne0, scratch + (i64)m * ab);
        }
        rows_units(bases, nmat, rows, ne0, row_bytes, slot, y, scratch, ab);
    }
}

void matvec_q8(const u8* base, i64 rows, int ne0, i64 row_bytes, const float* x, float* y, int nthreads,
               u8* scratch) {
    matvec_q8_many(&base, 1, rows, ne0, row_bytes, &x, y, nthreads, scratch);
}

// Rows of weight per work unit and activations per inner tile of matmat_q8_many: a unit's 16 weight rows (16 x 1.1
// KiB for 4096 Q4_K values) stay in L1 while 32 activations at a time (~140 KiB) stream from L2, so a weight byte
// is read from memory once per chunk, not once per token.
#define MM_ROWS 16
#define MM_ACTS 32

// The matrix-matrix form of matvec_q8_many (a prompt chunk): for each matrix m, ts[m] input rows of ne0 f32 at xs[m]
// (row stride ne0) and ys[m][t * rows + r] = row r of matrix m . input row t quantized as llama.cpp does. Every
// (t, r) value is dot_row on the same bytes as the matvec's, so it is bit-identical to matvec_q8(..., xs[m] + t *
// ne0, ...). Consecutive matrices with the same xs and ts share one quantization. scratch: (sum of the distinct
// ts[m]) * act_nbytes(ne0) bytes. One OpenMP region: the quantizations, then units of MM_ROWS rows of one matrix.
void matmat_q8_many(const u8* const* bases, int nmat, i64 rows, int ne0, i64 row_bytes, const float* const* xs,
                    const int* ts, float* const* ys, int nthreads, u8* scratch) {
    const i64 ab = act_nbytes(ne0);
    i64* first = (i64*)malloc(sizeof(i64) * (nmat > 0 ? nmat : 1));  // index of matrix m's first activation
    i64 nact = 0;
    const float** src = NULL;  // activation i's input row
    for (int pass = 0; pass < 2; ++pass) {  // count, then fill (an input of 0 rows adds none)
        nact = 0;
        for (int m = 0; m < nmat; ++m) {
            const int shared = m > 0 && xs[m] == xs[m - 1] && ts[m] == ts[m - 1];
            if (shared) { first[m] = first[m - 1]; continue; }
            first[m] = nact;
            if (pass) for (int t = 0; t < ts[m]; ++t) src[nact + t] = xs[m] + (i64)t * ne0;
            nact += ts[m];
        }
        if (!pass) src = (const float**)malloc(sizeof(float*) * (nact > 0 ? nact : 1));
    }
    const i64 tiles = (rows + MM_ROWS - 1) / MM_ROWS;
    const i64 units = (i64)nmat * tiles;
    #pragma omp parallel num_threads(nthreads)
    {
#ifdef Q8_PANEL
        const int nb = ne0 / (Q8_ACT == 2 ? 256 : 32);  // a unit's rows packed once, for every activation
        u8* P = (u8*)aligned_alloc(64, (size_t)nb * PANEL_BLOCK_BYTES);
#endif
        #pragma omp for schedule(static)
        for (i64 i = 0; i < nact; ++i) act_quantize(src[i], ne0, scratch + i * ab);
        #pragma omp for schedule(dynamic, 1)
        for (i64 u = 0; u < units; ++u) {
            const int m = (int)(u / tiles);
            const i64 r0 = (u % tiles) * MM_ROWS, r1 = r0 + MM_ROWS < rows ? r0 + MM_ROWS : rows;
#ifdef Q8_PANEL
            if (P != NULL && ts[m] >= PANEL_MIN_ACTS) {
                panel_pack(bases[m] + r0 * row_bytes, row_bytes, (int)(r1 - r0), nb, P);
                for (int t = 0; t < ts[m]; ++t) {
                    const Act A = act_view(scratch + (first[m] + t) * ab, ne0);
                    float o[Q8_PANEL];
                    panel_dot(P, nb, &A, o);
                    memcpy(ys[m] + (i64)t * rows + r0, o, sizeof(float) * (size_t)(r1 - r0));
                }
                continue;
            }
#endif
            for (int t0 = 0; t0 < ts[m]; t0 += MM_ACTS) {
                const int t1 = t0 + MM_ACTS < ts[m] ? t0 + MM_ACTS : ts[m];
                for (i64 r = r0; r < r1; ++r) {
                    const u8* row = bases[m] + r * row_bytes;
                    for (int t = t0; t < t1; t += MM_MULTI) {
                        const int na = t1 - t < MM_MULTI ? t1 - t : MM_MULTI;
                        Act A[MM_MULTI];
                        float o[MM_MULTI];
                        for (int a = 0; a < na; ++a) A[a] = act_view(scratch + (first[m] + t + a) * ab, ne0);
                        dot_rows(row, A, na, ne0, o);
                        for (int a = 0; a < na; ++a) ys[m][(i64)(t + a) * rows + r] = o[a];
                    }
                }
            }
        }
#ifdef Q8_PANEL
        free(P);
#endif
    }
    free(src);
    free(first);
}
#endif
