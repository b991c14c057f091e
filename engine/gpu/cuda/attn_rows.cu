// Causal attention of a prompt chunk in one launch (gpu/attn_rows.py; layers.attend_rows is the same computation in
// array operations): query row t (position pos0 + t), head h = g * R + i (R = n_head / n_kv query heads per KV head g)
// over the keys k of positions lo + k it may see (lo + k <= pos0 + t, and pos0 + t - (lo + k) < window when window
// > 0: llama.cpp is_masked_swa):
//   s_k = dot(q[t, h], K[k, g]) * scale;  p_k = exp(s_k - max_k s) / sum_k exp(s_k - max_k s);  out[t, h] = sum_k p_k V[k, g]
// (q and p rounded to f16 first when F16OPS: llama.cpp's non-flash attention with an F16 cache). Two passes over the
// keys: the first finds each row's max and sum (a running max, the sum rescaled when it grows), the second the
// probabilities and the weighted values. f32 throughout; the sums' order differs from the array form's (rounding).
//
// HD / HDV (head dims, multiples of 64, at most 256), KT (keys a tile), BQ (queries a CTA) are defined by the module
// (gpu/attn_rows.py), RPW (rows a warp takes at most) too. A CTA: KV head g = blockIdx.y, queries [BQ * blockIdx.x, + BQ), its BQ * R rows shared by
// ATT_WARPS warps (a warp up to RPW rows). Per tile the KT keys' K (and V) rows are staged in shared memory; lane l
// holds dims [l * DPL, + DPL) of a row's q and out, and its partial dots of the KT keys are summed across the warp by a
// halving exchange that leaves key (l % KT)'s score in lane l.
#define ATT_WARPS 4
#define DPL (HD / 32)
#define DPLV (HDV / 32)
static_assert(HD % 64 == 0 && HDV % 64 == 0 && HD <= 256 && HDV <= 256, "head dims: multiples of 64 up to 256");
static_assert(KT == 16 || KT == 32, "key tiles of 16 or 32 (key_sums)");
#define NEG_INF __int_as_float(0xff800000)  // (NVRTC has no math.h: no INFINITY)

// n (DPL or DPLV) consecutive f32 of shared memory at p (16-byte aligned when n % 4 == 0) into x: vector loads.
template <int n>
__device__ __forceinline__ void lds(const float* p, float* x) {
    if (n % 4 == 0) {
#pragma unroll
        for (int i = 0; i < n / 4; ++i) {
            const float4 v = ((const float4*)p)[i];
            x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < n / 2; ++i) {
            const float2 v = ((const float2*)p)[i];
            x[2 * i] = v.x, x[2 * i + 1] = v.y;
        }
    }
}

__device__ __forceinline__ float f16_round(const float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    float y;
    asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(h));
    return y;
}

// One halving step of key_sums: lanes with bit OFF set keep the upper OFF values, the others the lower, each adding
// its partner's (lane ^ OFF) copy of the same keys.
template <int OFF>
__device__ __forceinline__ void halve(float* v, const int lane) {
    const bool up = (lane & OFF) != 0;
#pragma unroll
    for (int i = 0; i < OFF; ++i) {
        const float send = up ? v[i] : v[i + OFF];
        const float keep = up ? v[i + OFF] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
}

// v[0..KT) partial sums of the lanes -> the full sum of key (lane % KT) in every lane's return value.
__device__ __forceinline__ float key_sums(float* v, const int lane) {
    if (KT == 16) {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], 16);
    } else {
        halve<16>(v, lane);
    }
    halve<8>(v, lane);
    halve<4>(v, lane);
    halve<2>(v, lane);
    halve<1>(v, lane);
    return v[0];
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attn_rows(
    const float* __restrict__ q, const float* __restrict__ K, const float* __restrict__ V, float* __restrict__ out,
    const int T, const int S, const int n_head, const int n_kv, const i64 pos0, const i64 lo, const i64 window,
    const float scale) {
    __shared__ __align__(16) float Ks[KT * HD];
    __shared__ __align__(16) float Vs[KT * HDV];
    const int R = n_head / n_kv, g = blockIdx.y;
    const int t0 = blockIdx.x * BQ, t1 = min(T, t0 + BQ);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nrows = (t1 - t0) * R;
    const i64 kend = min((i64)S, pos0 + t1 - lo);
    const i64 kbeg = window > 0 ? max((i64)0, pos0 + t0 + 1 - window - lo) : 0;
    float qr[RPW][DPL], o[RPW][DPLV], m[RPW], l[RPW];
    i64 qpos[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = warp + ATT_WARPS * r;
        m[r] = NEG_INF;
        l[r] = 0.f;
        qpos[r] = pos0 + t0 + (row < nrows ? row / R : 0);
#pragma unroll
        for (int d = 0; d < DPLV; ++d) o[r][d] = 0.f;
#pragma unroll
        for (int d = 0; d < DPL; ++d) {
            float v = 0.f;
            if (row < nrows) {
                const int t = t0 + row / R, h = g * R + row % R;
                v = q[((i64)t * n_head + h) * HD + lane * DPL + d];
                if (F16OPS) v = f16_round(v);
            }
            qr[r][d] = v;
        }
    }
    const i64 ks_row = (i64)n_kv * HD, vs_row = (i64)n_kv * HDV;
    for (int pass = 0; pass < 2; ++pass) {
        for (i64 k0 = kbeg; k0 < kend; k0 += KT) {
            const int nk = (int)min((i64)KT, kend - k0);
            __syncthreads();
            for (int i = threadIdx.x; i < KT * HD / 4; i += 32 * ATT_WARPS) {
                const int j = i / (HD / 4), c = i % (HD / 4);
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (j < nk) v = ((const float4*)(K + (k0 + j) * ks_row + (i64)g * HD))[c];
                ((float4*)Ks)[i] = v;
            }
            if (pass == 1)
                for (int i = threadIdx.x; i < KT * HDV / 4; i += 32 * ATT_WARPS) {
                    const int j = i / (HDV / 4), c = i % (HDV / 4);
                    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (j < nk) v = ((const float4*)(V + (k0 + j) * vs_row + (i64)g * HDV))[c];
                    ((float4*)Vs)[i] = v;
                }
            __syncthreads();
            const int kl = lane % KT;  // the key whose score this lane ends with
            const i64 kp = lo + k0 + kl;
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                if (warp + ATT_WARPS * r >= nrows) continue;  // (a whole warp's decision: its rows are warp, warp + 4, ...)
                float v[KT];
#pragma unroll
                for (int j = 0; j < KT; ++j) {
                    float kv[DPL];
                    lds<DPL>(Ks + j * HD + lane * DPL, kv);
                    float acc = 0.f;
#pragma unroll
                    for (int d = 0; d < DPL; ++d) acc = fmaf(qr[r][d], kv[d], acc);
                    v[j] = acc;
                }
                const float s0 = key_sums(v, lane) * scale;
                const bool seen = kl < nk && kp <= qpos[r] && (window <= 0 || qpos[r] - kp < window);
                const float s = seen ? s0 : NEG_INF;
                if (pass == 0) {
                    const float mt = warp_max(s);
                    const float mn = fmaxf(m[r], mt);
                    // (KT == 16: lanes l and l + 16 hold the same key: count it once)
                    const float e = (seen && (KT == 32 || lane < 16)) ? expf(s - mn) : 0.f;
                    const float add = warp_sum(e);
                    l[r] = (m[r] == NEG_INF ? 0.f : l[r] * expf(m[r] - mn)) + add;
                    m[r] = mn;
                } else {
                    float p = seen ? expf(s - m[r]) / l[r] : 0.f;
                    if (F16OPS) p = f16_round(p);
#pragma unroll
                    for (int j = 0; j < KT; ++j) {
                        const float pj = __shfl_sync(0xffffffffu, p, j);
                        float vv[DPLV];
                        lds<DPLV>(Vs + j * HDV + lane * DPLV, vv);
#pragma unroll
                        for (int d = 0; d < DPLV; ++d) o[r][d] = fmaf(pj, vv[d], o[r][d]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = warp + ATT_WARPS * r;
        if (row >= nrows) continue;
        const int t = t0 + row / R, h = g * R + row % R;
#pragma unroll
        for (int d = 0; d < DPLV; ++d) out[((i64)t * n_head + h) * HDV + lane * DPLV + d] = o[r][d];
    }
}
