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

// out[t, j] = sum_k E[r(t, k), j] * w[t, k], summed in k order (y = E[r(t, 0), j] * w[t, 0], then y = y + E[r(t, k),
// j] * w[t, k]: the array form's order), r(t, k) = at[t * K + k] (at == null: t * K + k); E [rows, n] (numpy order: the
// pairs' outputs [T, K, n], or sorted by expert with at their places), w [T, K], out [T, n] f32. grid (ceil(n / 256), T).
extern "C" __global__ void weighted_rows(const float* __restrict__ E, const float* __restrict__ w,
                                         float* __restrict__ out, const int K, const int n, const int* __restrict__ at) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const i64 t = blockIdx.y;
    float y = E[(at ? (i64)at[t * K] : t * K) * n + j] * w[t * K];
    for (int k = 1; k < K; ++k) y = y + E[(at ? (i64)at[t * K + k] : t * K + k) * n + j] * w[t * K + k];
    out[t * n + j] = y;
}

// A chunk's (row, expert) pairs sorted by expert on the device (gpu/chunk.py ChunkPath.device_grouped; moe_mm.py
// group_layout and group_pairs_reference are the layout and the same computation in NumPy): ids [P] int32, pair
// q = t * K + kk (row t's kk-th expert), every id in [0, E) (route_rows leaves none outside). Writes index
// [2 P + 2 NT + 2 E] int32, moe_mm.PairIndex's layout for one round of all E experts: src [P] (sorted pair p's X row:
// the pairs by expert, q ascending within one - a stable sort), NT tiles (g, first pair): each expert's pairs in
// steps of TP, (-1, 0) past the last (the grouped product's CTAs for those return at once), starts [E], counts [E],
// then inv [P] (pair q's place p). One CTA of ROW_THREADS threads; E at most ROUTE_MAX_E; the counts by shared-memory
// atomics (integers: any order), the places by one warp in pair order (__match_any_sync ranks equal ids in a step).
#define GROUP_SEG (8 * ROW_THREADS)
extern "C" __global__ void __launch_bounds__(ROW_THREADS) group_pairs(const int* __restrict__ ids, const int P,
                                                                      const int K, const int E, const int TP,
                                                                      const int NT, int* __restrict__ index) {
    __shared__ int cnt[ROUTE_MAX_E];
    __shared__ int cur[ROUTE_MAX_E];
    __shared__ int seg[GROUP_SEG];
    __shared__ int n_tiles;
    int* src = index;
    int* tiles = index + P;
    int* starts = tiles + 2 * NT;
    int* counts = starts + E;
    int* inv = counts + E;
    const int tid = threadIdx.x, lane = tid & 31;
    for (int e = tid; e < E; e += ROW_THREADS) cnt[e] = 0;
    __syncthreads();
    for (int q = tid; q < P; q += ROW_THREADS) atomicAdd(&cnt[ids[q]], 1);
    __syncthreads();
    if (tid < 32) {  // exclusive scans of the counts and the tile counts; lane l takes experts [l per, (l + 1) per)
        const int per = (E + 31) / 32, e0 = min(lane * per, E), e1 = min(e0 + per, E);
        int s = 0, t = 0;
        for (int e = e0; e < e1; ++e) {
            s += cnt[e];
            t += (cnt[e] + TP - 1) / TP;
        }
        int si = s, ti = t;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, si, o), b = __shfl_up_sync(0xffffffffu, ti, o);
            if (lane >= o) {
                si += a;
                ti += b;
            }
        }
        s = si - s;
        t = ti - t;
        for (int e = e0; e < e1; ++e) {
            const int c = cnt[e], nt = (c + TP - 1) / TP;
            starts[e] = s;
            counts[e] = c;
            cur[e] = s;
            for (int j = 0; j < nt; ++j) {
                tiles[2 * (t + j)] = e;
                tiles[2 * (t + j) + 1] = j * TP;
            }
            s += c;
            t += nt;
        }
        if (lane == 31) n_tiles = t;
    }
    __syncthreads();
    for (int i = n_tiles + tid; i < NT; i += ROW_THREADS) {
        tiles[2 * i] = -1;
        tiles[2 * i + 1] = 0;
    }
    for (int b = 0; b < P; b += GROUP_SEG) {
        const int n = min(GROUP_SEG, P - b);
        for (int i = tid; i < n; i += ROW_THREADS) seg[i] = ids[b + i];
        __syncthreads();
        if (tid < 32) {
            for (int i0 = 0; i0 < n; i0 += 32) {
                const int i = i0 + lane;
                const int e = i < n ? seg[i] : -1;
                const unsigned same = __match_any_sync(0xffffffffu, e);
                if (i < n) {
                    const int p = cur[e] + __popc(same & ((1u << lane) - 1u));
                    src[p] = (b + i) / K;
                    inv[b + i] = p;
                }
                __syncwarp();
                if (i < n && lane == __ffs(same) - 1) cur[e] += __popc(same);
                __syncwarp();
            }
        }
        __syncthreads();
    }
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

// X = (I + A)^-1 for strictly lower-triangular A [batch, n, n] (row-major f32; the diagonal and the upper part are
// not read), n <= ULI_MAX_N: one CTA per matrix (blockIdx.x), thread c computes column c by forward substitution,
// X[i, c] = (i == c) - sum_{c <= j < i} A[i, j] X[j, c] with j ascending - deltanet.unit_lower_solve(A, I)'s
// arithmetic, one launch for every (head, sub-chunk) of a prompt chunk's delta rule instead of the array form's
// ~50 (deltanet.unit_lower_inverse). Shared memory: A and X, ULI_MAX_N^2 floats each; thread c reads row i of A at
// consecutive j and X at stride n + 1 (no bank conflicts for n = 64).
extern "C" __global__ void unit_lower_inverse(const float* __restrict__ A, float* __restrict__ X, const int n) {
    __shared__ float a[ULI_MAX_N * ULI_MAX_N];
    __shared__ float x[ULI_MAX_N * ULI_MAX_N];
    const i64 base = (i64)blockIdx.x * n * n;
    for (int i = threadIdx.x; i < n * n; i += blockDim.x) a[i] = A[base + i];
    __syncthreads();
    const int c = threadIdx.x;
    if (c < n) {
        for (int i = 0; i < n; ++i) {
            float v = i == c ? 1.0f : 0.0f;
            if (i > c) {
                float s = 0.0f;
                for (int j = c; j < i; ++j) s = s + a[i * n + j] * x[j * n + c];
                v = -s;
            }
            x[i * n + c] = v;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n * n; i += blockDim.x) X[base + i] = x[i];
}
