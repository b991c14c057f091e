// Row-wise operations of a prompt chunk in one launch each (gpu/rows_ops.py; layers.rms_norm and layers.Rope.rows are
// the same computations in array operations, a handful of launches and temporaries each). ROW_THREADS, ROUTE_MAX_E and
// ROUTE_SUM_MIN are defined by gpu/rows_ops.py (its constants; layers.ROUTE_WEIGHT_SUM_MIN).

// out[r, :] = (x[r, :] * (1 / sqrt(sum(x[r, :]^2) / n + eps))) * w[:]   (ggml_rms_norm then ggml_mul; x, out [R, n],
// w [n], f32; one CTA a row, the squares summed in a fixed tree)
extern "C" __global__ void __launch_bounds__(ROW_THREADS) rms_norm_rows(const float* __restrict__ x,
                                                                        const float* __restrict__ w,
                                                                        float* __restrict__ out, const int n,
                                                                        const float eps) {
    __shared__ float part[ROW_THREADS / 32];
    const float* xr = x + (i64)blockIdx.x * n;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) s += xr[i] * xr[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < ROW_THREADS / 32 ? part[threadIdx.x] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) part[0] = v;
    }
    __syncthreads();
    const float scale = 1.0f / sqrtf(part[0] / (float)n + eps);
    float* o = out + (i64)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) o[i] = (xr[i] * scale) * w[i];
}

// Rotary embedding of x [T, nh, hd] (numpy order), row t at position pos0 + t, into out (same shape): pair i < n_rot/2
// of each head is (i, i + n_rot/2) (neox) or (2i, 2i + 1) (norm), rotated by the table's cos / sin [n_ctx, n_rot/2];
// dims past n_rot copied. One thread a pair (or a copied dim).
extern "C" __global__ void rope_rows(const float* __restrict__ x, const float* __restrict__ cos_t,
                                     const float* __restrict__ sin_t, float* __restrict__ out, const int T,
                                     const int nh, const int hd, const int n_rot, const i64 pos0, const int neox) {
    const int h2 = n_rot / 2, per_head = h2 + (hd - n_rot);
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * nh * per_head) return;
    const int j = (int)(idx % per_head);
    const i64 row = idx / per_head;  // t * nh + head
    const int t = (int)(row / nh);
    const float* xr = x + row * hd;
    float* o = out + row * hd;
    if (j >= h2) {  // a dim past n_rot
        const int d = n_rot + (j - h2);
        o[d] = xr[d];
        return;
    }
    const float c = cos_t[(pos0 + t) * h2 + j], s = sin_t[(pos0 + t) * h2 + j];
    const int a = neox ? j : 2 * j, b = neox ? j + h2 : 2 * j + 1;
    const float x0 = xr[a], x1 = xr[b];
    o[a] = x0 * c - x1 * s;
    o[b] = x0 * s + x1 * c;
}

// out[t, j] = sum_k E[t, k, j] * w[t, k], summed in k order (y = E[t, 0, j] * w[t, 0], then y = y + E[t, k, j] * w[t, k]:
// the array form's order); E [T, K, n], w [T, K], out [T, n] f32. grid (ceil(n / 256), T).
extern "C" __global__ void weighted_rows(const float* __restrict__ E, const float* __restrict__ w,
                                         float* __restrict__ out, const int K, const int n) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const i64 t = blockIdx.y;
    const float* e = E + t * K * n + j;
    float y = e[0] * w[t * K];
    for (int k = 1; k < K; ++k) y = y + e[(i64)k * n] * w[t * K + k];
    out[t * n + j] = y;
}

// A chunk's routing (layers.route_topk_rows): per row t of logits [T, E], p = softmax (exp(l - max), divided by the
// sum), the K experts of highest p (ties: lower id first - an expert's rank is the count of experts better than it
// or as good with a lower id) into ids [T, K] (int32) by rank, their p into w [T, K], divided by max(sum,
// ROUTE_SUM_MIN) when norm. One CTA (ROW_THREADS) a row; E at most ROUTE_MAX_E. A row with a NaN probability ranks no
// NaN expert: the caller fills ids with 0..K-1 and w with 0 first, so every id stays a valid expert (fused.cu moe_route
// starts its choice the same way).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) route_rows(const float* __restrict__ logits,
                                                                     int* __restrict__ ids, float* __restrict__ w,
                                                                     const int E, const int K, const int norm) {
    __shared__ float p[ROUTE_MAX_E];
    __shared__ float red[ROW_THREADS / 32];
    const float* l = logits + (i64)blockIdx.x * E;
    float m = __int_as_float(0xff800000);
    for (int e = threadIdx.x; e < E; e += ROW_THREADS) m = fmaxf(m, l[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
    for (int i = 1; i < ROW_THREADS / 32; ++i) m = fmaxf(m, red[i]);
    __syncthreads();
    float s = 0.f;
    for (int e = threadIdx.x; e < E; e += ROW_THREADS) {
        p[e] = expf(l[e] - m);
        s += p[e];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    s = 0.f;
    for (int i = 0; i < ROW_THREADS / 32; ++i) s += red[i];
    for (int e = threadIdx.x; e < E; e += ROW_THREADS) p[e] = p[e] / s;
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += ROW_THREADS) {
        const float pe = p[e];
        if (pe != pe) continue;  // NaN: ranks nowhere (its slot keeps the caller's fill)
        int rank = 0;
        for (int f = 0; f < E && rank < K; ++f) rank += (p[f] > pe) || (p[f] == pe && f < e);
        if (rank < K) {
            ids[(i64)blockIdx.x * K + rank] = e;
            w[(i64)blockIdx.x * K + rank] = pe;
        }
    }
    __syncthreads();
    if (norm && threadIdx.x == 0) {
        float t = 0.f;
        for (int k = 0; k < K; ++k) t += w[(i64)blockIdx.x * K + k];
        t = fmaxf(t, ROUTE_SUM_MIN);
        for (int k = 0; k < K; ++k) w[(i64)blockIdx.x * K + k] = w[(i64)blockIdx.x * K + k] / t;
    }
}
