// The logits' summary on the device (strata.engine.gpu.fused: "logit summary"): the count of non-finite
// logits and the TOPK best (id, logit) pairs by logit descending, then id ascending - the definition of
// strata.engine.sampling.top_k_pairs, and its first pair is numpy's argmax (the first of the largest).
// The host reads 16 words instead of the whole row and sorting nothing (the greedy decode of a 262144-token
// vocabulary spent ~0.3 ms per token in NumPy). Non-finite logits are counted and never ranked: with a
// count above 0 the host reads the row and refuses it (strata.engine.generate NonFiniteLogits).
//
// Two launches: logit_top_part (P CTAs of TOP_THREADS threads: each thread keeps its own sorted TOPK of a
// strided slice, then the CTA merges its lists pairwise in shared memory) and logit_top_final (one CTA
// merges the P lists). Every comparison is exact (floats compared, never summed), so any split gives the
// same answer.
// TOPK and TOP_THREADS are defined before this file (strata.engine.gpu.fused_ops.fused_source).

__device__ __forceinline__ bool tk_better(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

// (v, id)[0..TOPK) sorted best first: insert (x, ix) if it beats the last.
__device__ __forceinline__ void tk_insert(float* v, int* id, float x, int ix) {
    if (!tk_better(x, ix, v[TOPK - 1], id[TOPK - 1])) return;
    int k = TOPK - 1;
    while (k > 0 && tk_better(x, ix, v[k - 1], id[k - 1])) {
        v[k] = v[k - 1];
        id[k] = id[k - 1];
        --k;
    }
    v[k] = x;
    id[k] = ix;
}

// Lists a and b (sorted, TOPK each, in shared memory) -> the best TOPK of both into a.
__device__ __forceinline__ void tk_merge(float* av, int* ai, const float* bv, const int* bi) {
    float rv[TOPK];
    int ri[TOPK];
    int i = 0, j = 0;
    for (int k = 0; k < TOPK; ++k) {
        if (tk_better(av[i], ai[i], bv[j], bi[j])) { rv[k] = av[i]; ri[k] = ai[i]; ++i; }
        else { rv[k] = bv[j]; ri[k] = bi[j]; ++j; }
    }
    for (int k = 0; k < TOPK; ++k) { av[k] = rv[k]; ai[k] = ri[k]; }
}

// Pairwise tree over the nt lists sv/si[t * TOPK ..] (nt a power of two); the result in list 0.
__device__ __forceinline__ void tk_tree(float* sv, int* si, int nt) {
    for (int s = nt >> 1; s > 0; s >>= 1) {
        __syncthreads();
        if ((int)threadIdx.x < s)
            tk_merge(sv + threadIdx.x * TOPK, si + threadIdx.x * TOPK, sv + (threadIdx.x + s) * TOPK,
                     si + (threadIdx.x + s) * TOPK);
    }
    __syncthreads();
}

// part: P lists of TOPK floats then P lists of TOPK ints, then P ints (non-finite counts).
extern "C" __global__ void logit_top_part(const float* __restrict__ y, const int n, float* __restrict__ part) {
    __shared__ float sv[TOP_THREADS * TOPK];
    __shared__ int si[TOP_THREADS * TOPK];
    __shared__ int bad_s;
    const int P = gridDim.x, t = threadIdx.x;
    float v[TOPK];
    int id[TOPK];
    for (int k = 0; k < TOPK; ++k) { v[k] = __int_as_float(0xff800000); id[k] = 0x7fffffff; }
    if (t == 0) bad_s = 0;
    __syncthreads();
    int bad = 0;
    for (int i = blockIdx.x * TOP_THREADS + t; i < n; i += P * TOP_THREADS) {
        const float x = y[i];
        if (!(fabsf(x) <= 3.402823466e38f)) { ++bad; continue; }  // NaN or infinite
        tk_insert(v, id, x, i);
    }
    if (bad) atomicAdd(&bad_s, bad);
    for (int k = 0; k < TOPK; ++k) { sv[t * TOPK + k] = v[k]; si[t * TOPK + k] = id[k]; }
    tk_tree(sv, si, TOP_THREADS);
    if (t < TOPK) {
        part[blockIdx.x * TOPK + t] = sv[t];
        ((int*)part)[P * TOPK + blockIdx.x * TOPK + t] = si[t];
    }
    if (t == 0) ((int*)part)[2 * P * TOPK + blockIdx.x] = bad_s;
}

// out (16 words): [0] the non-finite count, [1..TOPK] the ids, [8..8+TOPK) the logits (f32 bits).
// One CTA of P threads (P a power of two <= TOP_THREADS).
extern "C" __global__ void logit_top_final(const float* __restrict__ part, int* __restrict__ out) {
    __shared__ float sv[TOP_THREADS * TOPK];
    __shared__ int si[TOP_THREADS * TOPK];
    __shared__ int bad_s;
    const int P = blockDim.x, t = threadIdx.x;
    if (t == 0) bad_s = 0;
    __syncthreads();
    for (int k = 0; k < TOPK; ++k) {
        sv[t * TOPK + k] = part[t * TOPK + k];
        si[t * TOPK + k] = ((const int*)part)[P * TOPK + t * TOPK + k];
    }
    const int b = ((const int*)part)[2 * P * TOPK + t];
    if (b) atomicAdd(&bad_s, b);
    tk_tree(sv, si, P);
    if (t == 0) {
        out[0] = bad_s;
        for (int k = 0; k < TOPK; ++k) {
            out[1 + k] = si[k];
            out[8 + k] = __float_as_int(sv[k]);
        }
    }
}
