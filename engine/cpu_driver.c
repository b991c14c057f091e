// CPU driver of strata's quantized matrix-vector products (strata.engine.cpukernels).
//
// Compiled for the host by the C compiler, once per ggml type, AFTER the type's device code:
// engine/gpu/cuda/prelude.cuh + the generated QK/NF/PB defines + the lookup tables + types/<T>.cuh
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

static float row_exact(const u8* row, int ne0, const float* x) {
    const int n_chunk = (ne0 / QK) * CPB;
    float acc[32];
    float w[8 * 32];   // 8 chunks, transposed: w[i * 8 + k] = value i of chunk k
    float tmp[32];
    for (int l = 0; l < 32; ++l) acc[l] = 0.0f;
    int c = 0;
    // 8 chunks at a time: their 32-term sums are independent, so they run side by side in vector
    // lanes; each one is still s = s + w[i] * x[i] for i = 0..31 in order (the GPU's order)
    for (; c + 8 <= n_chunk; c += 8) {
        float xt[8 * 32];
        for (int k = 0; k < 8; ++k) {
            deq_native(row + (i64)((c + k) / CPB) * BB, (c + k) % CPB, tmp);
            const float* xx = x + (i64)(c + k) * 32;
            for (int i = 0; i < 32; ++i) { w[i * 8 + k] = tmp[i]; xt[i * 8 + k] = xx[i]; }
        }
        float s[8];
        for (int k = 0; k < 8; ++k) s[k] = 0.0f;
        for (int i = 0; i < 32; ++i)
            for (int k = 0; k < 8; ++k) s[k] = s[k] + w[i * 8 + k] * xt[i * 8 + k];
        for (int k = 0; k < 8; ++k) acc[(c + k) & 31] = acc[(c + k) & 31] + s[k];
    }
    for (; c < n_chunk; ++c) {
        deq_native(row + (i64)(c / CPB) * BB, c % CPB, tmp);
        const float* xx = x + (i64)c * 32;
        float s = 0.0f;
        for (int i = 0; i < 32; ++i) s = s + tmp[i] * xx[i];
        acc[c & 31] = acc[c & 31] + s;
    }
    for (int o = 16; o > 0; o >>= 1) {
        float t[32];
        for (int l = 0; l < 32; ++l) t[l] = acc[l] + acc[l ^ o];
        for (int l = 0; l < 32; ++l) acc[l] = t[l];
    }
    return acc[0];
}

static void row_dequant(const u8* row, int ne0, float* out) {
    const int n_chunk = (ne0 / QK) * CPB;
    for (int c = 0; c < n_chunk; ++c) deq_native(row + (i64)(c / CPB) * BB, c % CPB, out + (i64)c * 32);
}
#else
static float row_exact(const u8* row, int ne0, const float* x) {
    float acc[32];
    for (int l = 0; l < 32; ++l) acc[l] = 0.0f;
    for (int i = 0; i < ne0; ++i) acc[i & 31] = acc[i & 31] + load_w(row, i) * x[i];
    for (int o = 16; o > 0; o >>= 1) {
        float t[32];
        for (int l = 0; l < 32; ++l) t[l] = acc[l] + acc[l ^ o];
        for (int l = 0; l < 32; ++l) acc[l] = t[l];
    }
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

// y[r] = dot(W[r, :], x) for r < rows; W row r at base + r * row_bytes (native blocks).
void matvec_exact(const u8* base, i64 rows, int ne0, i64 row_bytes, const float* x, float* y, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (i64 r = 0; r < rows; ++r) y[r] = row_exact(base + r * row_bytes, ne0, x);
}

// The same product, dequantizing each row into a scratch row of ne0 floats (scratch: nthreads * ne0).
void matvec_fast(const u8* base, i64 rows, int ne0, i64 row_bytes, const float* x, float* y, int nthreads,
                 float* scratch) {
    #pragma omp parallel num_threads(nthreads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float* buf = scratch + (i64)t * ne0;
        #pragma omp for schedule(static)
        for (i64 r = 0; r < rows; ++r) {
            row_dequant(base + r * row_bytes, ne0, buf);
            y[r] = dot16(buf, x, ne0);
        }
    }
}

// Rows ids[k] of W dequantized to out[k, :] (embedding lookup, tests).
void dequant_rows(const u8* base, const i64* ids, i64 n, int ne0, i64 row_bytes, float* out) {
    for (i64 k = 0; k < n; ++k) row_dequant(base + ids[k] * row_bytes, ne0, out + k * ne0);
}
