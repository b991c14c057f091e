// The fused decode-step kernels of strata.engine.gpu.fused (resid_norm, qk_prep, attn, act_mul,
// logit_post). Concatenated after prelude.cuh (typedefs, h2f, f2h); the f32 reductions below run in a
// fixed order so that every thread of a CTA gets the same bits.
__device__ __forceinline__ float load_kv(const void* p, const i64 i, const int f16) {
    return f16 ? h2f(((const u16*)p)[i]) : ((const float*)p)[i];
}
__device__ __forceinline__ void store_kv(void* p, const i64 i, const float v, const int f16) {
    if (f16) ((u16*)p)[i] = f2h(v); else ((float*)p)[i] = v;
}

// xor butterfly: every lane ends with the same bits (each step adds the same two values)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide sum in a fixed order (per-warp butterfly, then warp totals 0..nw-1 by butterfly);
// every thread returns the same bits. blockDim.x must be a multiple of 32. Uniform control flow.
__device__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // red[] may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_sum(lane < nw ? red[lane] : 0.0f);
}
__device__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_max(lane < nw ? red[lane] : __int_as_float(0xff800000));
}

#define RN_K 8   // routed experts whose values branch_in loads together (registers: 1,024 threads leave 64 a thread)
#define RN_E 4   // values of x a resid_norm thread keeps in registers (n <= RN_E * blockDim.x; else it reads x back)
// The residual branch's value i: a[i] (+ ab[i]), or with D (routed experts) moe_combine's sum: D[0, i] * w[0] +
// D[1, i] * w[1] + ... in selection order (as strata.engine.experts.ExpertPath combines the selected experts), plus,
// with a shared expert, S[i] * sg (sg = 1 / (1 + exp(-gdot[0])), the caller's).
__device__ __forceinline__ float branch_in(const float* __restrict__ a, const float* __restrict__ ab,
                                           const float* __restrict__ D, const float* __restrict__ cw, const int K,
                                           const int n, const float* __restrict__ S, const float sg, const int i) {
    if (D) {  // the first RN_K experts' values loaded before the first add (all in flight at once), then added in order
        float dv[RN_K];
#pragma unroll
        for (int k = 0; k < RN_K; ++k)
            if (k < K) dv[k] = D[(long long)k * n + i];
        float acc = dv[0] * cw[0];
#pragma unroll
        for (int k = 1; k < RN_K; ++k)
            if (k < K) acc = acc + dv[k] * cw[k];
        for (int k = RN_K; k < K; ++k) acc = acc + D[(long long)k * n + i] * cw[k];
        if (S) acc = acc + S[i] * sg;
        return acc;
    }
    float v = a[i];
    if (ab) v = v + ab[i];
    return v;
}

// x[i] from the branch's value v (resid_norm's mode, below), stored; returns it.
__device__ __forceinline__ float resid_x(float* __restrict__ x, const float v, const float* __restrict__ wa,
                                        const float scale, const int mode, const float inv_a, const int i) {
    float xi;
    if (mode == 0) xi = v * scale;
    else if (mode == 1) xi = x[i] + v;
    else xi = x[i] + (v * inv_a) * wa[i];
    x[i] = xi;
    return xi;
}

// One CTA. The branch v = branch_in(i) (a + ab, or the routed experts' weighted sum: moe_combine fused here, one
// launch less per MoE layer). mode 0: x = v * scale (the embedding row); 1: x = x + v; 2: x = x + rms_norm(v) * wa
// (gemma's post-norms). Then, if w: xn = rms_norm(x) * w (and, if w2, xn2 = rms_norm(x) * w2: the next layer's
// router input as its ffn_norm would make it, for the prefetch's prediction, cuda/prefetch.cu), and if qfmt (1 = Q8_0, 2 = Q8_K): xn quantized into xq for
// the q8 matvecs that read it (q8_quant.cuh; the bits of quantize_q8's, one launch less per normed row).
// rms_norm(v) = v * (1 / sqrt(sum(v*v) / n + eps)), as strata.engine.layers.rms_norm.
extern "C" __global__ void resid_norm(float* __restrict__ x, const float* __restrict__ a, const float* __restrict__ ab,
                                      const float* __restrict__ wa, const float* __restrict__ w, float* __restrict__ xn,
                                      const int n, const float eps, const float scale, const int mode,
                                      u8* __restrict__ xq, const int qfmt, const float* __restrict__ D,
                                      const float* __restrict__ cw, const int K, const float* __restrict__ S,
                                      const float* __restrict__ gdot, const float* __restrict__ w2,
                                      float* __restrict__ xn2) {
    __shared__ float red[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    const float sg = (D && S) ? 1.0f / (1.0f + expf(-gdot[0])) : 0.0f;
    float inv_a = 0.0f;
    if (mode == 2) {
        float s = 0.0f;
        for (int i = tid; i < n; i += nt) {
            const float v = branch_in(a, ab, D, cw, K, n, S, sg, i);
            s = s + v * v;
        }
        const float ms = block_sum(s, red) / (float)n;
        inv_a = 1.0f / sqrtf(ms + eps);
    }
    float s2 = 0.0f, xr[RN_E];  // thread tid's values i = tid, tid + nt, ... in order (the same order either way)
    const bool in_regs = n <= RN_E * nt;
    if (in_regs) {
#pragma unroll
        for (int t = 0; t < RN_E; ++t) {
            const int i = tid + t * nt;
            if (i < n) {
                xr[t] = resid_x(x, branch_in(a, ab, D, cw, K, n, S, sg, i), wa, scale, mode, inv_a, i);
                s2 = s2 + xr[t] * xr[t];
            }
        }
    } else {
        for (int i = tid; i < n; i += nt) {
            const float xi = resid_x(x, branch_in(a, ab, D, cw, K, n, S, sg, i), wa, scale, mode, inv_a, i);
            s2 = s2 + xi * xi;
        }
    }
    if (w) {
        const float ms = block_sum(s2, red) / (float)n;
        const float r = 1.0f / sqrtf(ms + eps);
        if (in_regs) {
#pragma unroll
            for (int t = 0; t < RN_E; ++t)
                if (tid + t * nt < n) {
                    xn[tid + t * nt] = (xr[t] * r) * w[tid + t * nt];
                    if (w2) xn2[tid + t * nt] = (xr[t] * r) * w2[tid + t * nt];
                }
        } else {
            for (int i = tid; i < n; i += nt) {
                xn[i] = (x[i] * r) * w[i];
                if (w2) xn2[i] = (x[i] * r) * w2[i];
            }
        }
        if (qfmt) {
            __syncthreads();  // every thread's xn values are visible to the CTA
            const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
            if (qfmt == 1) for (int b = warp; b < n / 32; b += nw) q8_quant_block32(xn, xq, n, b, lane);
            else for (int b = warp; b < n / 256; b += nw) q8_quant_block256(xn, xq, n, b, lane);
        }
    }
}

// CTA b < n_head: query head b; else KV head b - n_head. Per head: + bias, RMS norm (if nw),
// rope at pos = params[0] (cos/sin rows of the rope table; rope_norm: adjacent pairs (2i, 2i+1),
// llama; else NEOX pairs (i, i + n_rot/2)), then q: * qscale (if scale_q) -> qo;
// k -> K cache and (KV CTAs) v + bias -> V cache, both at ring slot pos % size.
extern "C" __global__ void qk_prep(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                                   const float* __restrict__ qb, const float* __restrict__ kb, const float* __restrict__ vb,
                                   const float* __restrict__ qnw, const float* __restrict__ knw,
                                   const float* __restrict__ cosb, const float* __restrict__ sinb,
                                   const int* __restrict__ params, float* __restrict__ qo, void* __restrict__ kc,
                                   void* __restrict__ vc, const int n_head, const int n_kv, const int hd, const int hd_v,
                                   const int n_rot, const int size, const float eps, const float qscale,
                                   const int scale_q, const int kv_f16, const int rope_norm, const int q_stride) {
    extern __shared__ float sh[];  // hd floats
    __shared__ float red[32];
    const int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const int pos = params[0];
    const bool isq = b < n_head;
    const int h = isq ? b : b - n_head;
    const float* src = isq ? q + (i64)h * q_stride : k + (i64)h * hd;  // q_stride 2 hd: [q | gate] per head
    const float* bias = isq ? qb : kb;
    const float* nw = isq ? qnw : knw;
    float ss = 0.0f;
    for (int d = tid; d < hd; d += nt) {
        float val = src[d];
        if (bias) val = val + bias[(i64)h * hd + d];
        sh[d] = val;
        ss = ss + val * val;
    }
    if (nw) {
        const float ms = block_sum(ss, red) / (float)hd;
        const float r = 1.0f / sqrtf(ms + eps);
        for (int d = tid; d < hd; d += nt) sh[d] = (sh[d] * r) * nw[d];
    }
    __syncthreads();
    const int half = n_rot / 2;
    const float* c = cosb + (i64)pos * half;
    const float* s = sinb + (i64)pos * half;
    const i64 slot = pos % size;
    for (int d = tid; d < hd; d += nt) {
        float o;
        if (d >= n_rot) o = sh[d];
        else if (rope_norm) o = (d & 1) ? sh[d - 1] * s[d >> 1] + sh[d] * c[d >> 1] : sh[d] * c[d >> 1] - sh[d + 1] * s[d >> 1];
        else if (d < half) o = sh[d] * c[d] - sh[d + half] * s[d];
        else o = sh[d - half] * s[d - half] + sh[d] * c[d - half];
        if (isq) {
            if (scale_q) o = o * qscale;
            qo[(i64)h * hd + d] = o;
        } else {
            store_kv(kc, (slot * n_kv + h) * hd + d, o, kv_f16);
        }
    }
    if (!isq) {
        for (int d = tid; d < hd_v; d += nt) {
            float val = v[(i64)h * hd_v + d];
            if (vb) val = val + vb[(i64)h * hd_v + d];
            store_kv(vc, (slot * n_kv + h) * hd_v + d, val, kv_f16);
        }
    }
}

// One CTA per query head h (KV head g = h / (n_head / n_kv)). Positions lo..pos, lo = pos + 1 - window
// (clamped at 0) for a sliding layer, else 0; position p lives in slot p % size. Scores
// (q . K[p]) * kq_scale (warp per position, lanes over dims, butterfly), softmax (max, exp, sum,
// divide: probabilities normalised first), then out[d] = sum_p prob[p] * V[p, d]: G = nt / hd_v
// thread groups take positions j, j + G, ... and the G partials are added in group order.
// sc: scratch of sc_stride floats per head.
extern "C" __global__ void attn(const float* __restrict__ qo, const void* __restrict__ kc, const void* __restrict__ vc,
                                const int* __restrict__ params, float* __restrict__ sc, float* __restrict__ out,
                                const int n_head, const int n_kv, const int hd, const int hd_v, const int size,
                                const int window, const float kq_scale, const int kv_f16, const int sc_stride) {
    extern __shared__ float part[];  // blockDim.x floats
    __shared__ float red[32];
    const int h = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
    const int g = h / (n_head / n_kv);
    const int pos = params[0];
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int T = pos - lo + 1;
    float* s = sc + (i64)h * sc_stride;
    const float* qh = qo + (i64)h * hd;
    float m = __int_as_float(0xff800000);  // -inf
    for (int t = warp; t < T; t += nwarps) {
        const i64 base = ((i64)((lo + t) % size) * n_kv + g) * hd;
        float a = 0.0f;
        for (int d = lane; d < hd; d += 32) a = a + qh[d] * load_kv(kc, base + d, kv_f16);
        a = warp_sum(a);
        const float val = a * kq_scale;
        if (lane == 0) s[t] = val;
        m = fmaxf(m, val);
    }
    m = block_max(m, red);  // its barriers also publish s[]
    float z = 0.0f;
    for (int t = tid; t < T; t += nt) {
        const float p = expf(s[t] - m);
        s[t] = p;
        z = z + p;
    }
    z = block_sum(z, red);
    for (int t = tid; t < T; t += nt) s[t] = s[t] / z;
    __syncthreads();
    const int G = nt >= hd_v ? nt / hd_v : 1;
    if (G == 1) {
        for (int d = tid; d < hd_v; d += nt) {
            float acc = 0.0f;
            for (int t = 0; t < T; ++t)
                acc = acc + s[t] * load_kv(vc, ((i64)((lo + t) % size) * n_kv + g) * hd_v + d, kv_f16);
            out[(i64)h * hd_v + d] = acc;
        }
        return;
    }
    const int j = tid / hd_v, d0 = tid - j * hd_v;
    if (j < G) {
        float acc = 0.0f;
        for (int t = j; t < T; t += G)
            acc = acc + s[t] * load_kv(vc, ((i64)((lo + t) % size) * n_kv + g) * hd_v + d0, kv_f16);
        part[j * hd_v + d0] = acc;
    }
    __syncthreads();
    if (tid < hd_v) {
        float o = 0.0f;
        for (int jj = 0; jj < G; ++jj) o = o + part[jj * hd_v + tid];
        out[(i64)h * hd_v + tid] = o;
    }
}

// out = act(g) * u; kind 0: silu(x) = x / (1 + exp(-x)); 1: gelu_tanh(x) =
// (0.5 * x) * (1 + tanh((c * x) * (1 + (k * x) * x))), the operation order of strata.engine.layers.
extern "C" __global__ void act_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out,
                                   const int n, const int kind, const float c, const float k) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float x = g[i];
    float a;
    if (kind == 0) a = x / (1.0f + expf(-x));
    else a = (0.5f * x) * (1.0f + tanhf((c * x) * (1.0f + (k * x) * x)));
    out[i] = a * u[i];
}

// y = y + bias (if bias); then, if softcap: y = tanh(y * inv_cap) * cap.
extern "C" __global__ void logit_post(float* __restrict__ y, const float* __restrict__ bias, const int n,
                                      const float inv_cap, const float cap, const int softcap) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = y[i];
    if (bias) v = v + bias[i];
    if (softcap) v = tanhf(v * inv_cap) * cap;
    y[i] = v;
}

// ---------------------------------------------------------------- routed experts (one token)

// One CTA (blockDim.x a multiple of 32, <= 1024; dynamic shared memory: n_expert floats, then 32 * ceil(n_expert / 32)
// ints and as many floats: ROUTE_SHARED_BYTES in fused_ops.py). The routing of
// strata.engine.layers.route_topk (llama.cpp build_moe_ffn, softmax gating): p = softmax(logits) (block max, exp,
// block sum, divide), kept in shared memory (and written to probs); the K most probable experts: expert e's rank is
// the count of experts f with p[f] > p[e] or p[f] == p[e] and f < e (most probable first, lowest id on ties: the
// order of a stable argsort of -p), and the expert of rank k < K is chosen k - in two steps, with no K rounds of block
// argmax (those were ~10 us a layer, a latency chain of barriers) and no rank over all n_expert per expert (16.7 us a
// layer at n_expert 512: the 80B-A3B step, 2026-12-03): (1) each warp ranks the 32 experts of a chunk among themselves
// (shuffles) and keeps those of chunk rank < Kc = min(K, 32) as candidates; (2) each candidate is ranked among the
// candidates alone. Exact: an expert f that beats a chosen e (rank < K) is a candidate (else the Kc experts of f's
// chunk that beat f beat e too); and a candidate of rank >= K has >= K candidates beating it (a chunk's experts that
// beat it are that chunk's best ones: min(that count, Kc) of them are candidates). So rank among candidates < K
// exactly when the rank is, and then they are equal. Their weights p[id],
// divided by their sum (k order, clamped below at 6.103515625e-5) when norm, by thread k. Then the cache lookup:
// slot = slot_of[layer * n_expert + id]; the part addresses of expert k are bases[k] (gate), bases[K + k] (up),
// bases[2K + k] (down) = storage + slot * slot_bytes + offset for a slot >= 0 (device memory), host + (-2 - slot) *
// slot_bytes + offset for a slot <= -2 (the host tier: mapped pinned host memory the same kernels read over PCIe), 0
// for -1 (a miss the host fills: matvec_batched skips a 0 base); a host-tier address has bit 0 set (the parts are
// EXPERT_PART_ALIGN-aligned: the bit is free), which the batched kernels clear - matvec_q8_batched reads such a weight
// with word loads (q8_lane.cuh load_weight_words). The split of a layer's misses (miss_split.py keep_table): of the
// c selected experts whose slot is <= -2, the first keep[c] in k order stay in the host tier, the others become -1
// (the CPU computes them in the hybrid step); keep[c] = c: no split. info[k] = id, info[K + k] = slot. storage / host:
// device u64s at *storage_ptr / *host_ptr (written after capture, read at replay). A host-tier expert whose tag
// layer * n_expert + id is among the P entries of staged (the prefetch's staging set of this layer: cuda/prefetch.cu)
// is read from stage_base + p * slot_bytes instead (device memory, the same bytes; counts[2 layer + 1] += 1); info keeps its
// host-tier slot (it was a miss: counted as one, its bytes crossed PCIe). P = 0: no prefetch. A NaN probability ranks nowhere:
// chosen[] starts as 0..K-1, so ids stay in range (the step's logit summary reports the non-finite logits).
extern "C" __global__ void moe_route(const float* __restrict__ logits, const int n_expert, const int K,
                                     const int norm, const int* __restrict__ slot_of, const int layer,
                                     const unsigned long long* __restrict__ storage_ptr,
                                     const unsigned long long* __restrict__ host_ptr, const int* __restrict__ keep,
                                     const long long slot_bytes, const long long off_g, const long long off_u,
                                     const long long off_d, float* __restrict__ probs, float* __restrict__ weights,
                                     unsigned long long* __restrict__ bases, int* __restrict__ info,
                                     const int* __restrict__ staged, const unsigned long long stage_base,
                                     const int P, int* __restrict__ counts) {
    extern __shared__ float sp[];  // n_expert probabilities, then the candidates' ids and probabilities
    __shared__ float red[32];
    __shared__ int chosen[64];
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    const int W = (n_expert + 31) >> 5, Kc = K < 32 ? K : 32, nc = W * Kc;
    int* cid = (int*)(sp + n_expert);
    float* cp = (float*)(cid + 32 * W);
    if (tid < K) chosen[tid] = tid;
    for (int i = tid; i < nc; i += nt) cid[i] = -1;  // a short last chunk leaves some empty
    float m = __int_as_float(0xff800000);
    for (int e = tid; e < n_expert; e += nt) m = fmaxf(m, logits[e]);
    m = block_max(m, red);
    float z = 0.0f;
    for (int e = tid; e < n_expert; e += nt) {
        const float p = expf(logits[e] - m);
        sp[e] = p;
        z = z + p;
    }
    z = block_sum(z, red);
    for (int e = tid; e < n_expert; e += nt) {
        const float p = sp[e] / z;
        sp[e] = p;
        probs[e] = p;
    }
    __syncthreads();
    for (int c = warp; c < W; c += nw) {  // (1) chunk c: experts 32c..32c+31, ranked among themselves
        const int e = 32 * c + lane;
        const bool on = e < n_expert;
        const float v = on ? sp[e] : 0.0f;
        int r = 0;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const float u = __shfl_sync(0xffffffffu, v, j);
            r += (32 * c + j < n_expert) && ((u > v) || (u == v && j < lane));
        }
        if (on && r < Kc) {
            cid[c * Kc + r] = e;
            cp[c * Kc + r] = v;
        }
    }
    __syncthreads();
    for (int i = tid; i < nc; i += nt) {  // (2) a candidate ranked among the candidates
        const int e = cid[i];
        if (e < 0) continue;
        const float v = cp[i];
        int r = 0;
        for (int j = 0; j < nc; ++j) {
            const int f = cid[j];
            const float u = cp[j];
            r += (f >= 0) && ((u > v) || (u == v && f < e));
        }
        if (r < K) chosen[r] = e;
    }
    __syncthreads();
    if (tid < K) {
        float s = 0.0f;
        for (int k = 0; k < K; ++k) s = s + sp[chosen[k]];
        s = fmaxf(s, 6.103515625e-5f);
        const int e = chosen[tid];
        const float p = sp[e];
        weights[tid] = norm ? p / s : p;
        const int* row = slot_of + (long long)layer * n_expert;
        int slot = row[e];
        if (slot <= -2) {  // the split: this expert's rank among the selected in the tier, and their count
            int c = 0, r = 0;
            for (int j = 0; j < K; ++j) {
                const int t = row[chosen[j]] <= -2;
                c += t;
                r += t & (j < tid);
            }
            if (r >= keep[c]) slot = -1;
        }
        const bool any = slot != -1;
        const unsigned long long storage = *storage_ptr, host = *host_ptr;
        unsigned long long b = slot >= 0    ? storage + (unsigned long long)slot * slot_bytes
                               : slot <= -2 ? host + (unsigned long long)(-2 - slot) * slot_bytes
                                            : 0ull;
        unsigned long long tag = slot <= -2 ? 1ull : 0ull;  // the host tier's: read with word loads
        for (int p = 0; p < P && slot <= -2; ++p)  // copied ahead into staging slot p (cuda/prefetch.cu)
            if (staged[p] == layer * n_expert + e) {
                b = stage_base + (unsigned long long)p * slot_bytes;
                tag = 0ull;
                atomicAdd(counts + 2 * layer + 1, 1);
                break;
            }
        bases[tid] = any ? (b + off_g) | tag : 0ull;
        bases[K + tid] = any ? (b + off_u) | tag : 0ull;
        bases[2 * K + tid] = any ? (b + off_d) | tag : 0ull;
        info[tid] = e;
        info[K + tid] = slot;
    }
}

// The hybrid step's CPU rows into the experts' outputs, inside the segment after the host's fill (no copy per miss
// queued by the host): D[k] = host[m] (f32 rows of n) for each selected k whose slot info[K + k] is -1, m being the
// number of -1 slots before k (the host writes its misses' rows in selection order, packed: HybridHost.on_fill). host:
// pinned, mapped host memory read over PCIe. Grid (x, K), any block: rows whose slot is not -1 are left alone.
extern "C" __global__ void moe_take_rows(float* __restrict__ D, const float* __restrict__ host,
                                         const int* __restrict__ info, const int K, const int n) {
    const int k = blockIdx.y;
    if (info[K + k] != -1) return;
    int m = 0;
    for (int j = 0; j < k; ++j) m += info[K + j] == -1;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        D[(long long)k * n + i] = host[(long long)m * n + i];
}

// ---------------------------------------------------------------- qwen3next (src/models/qwen3next.cpp)

// ao[h * hd + d] *= sigmoid(qg[h * 2 hd + hd + d]): the attention output gate carried by the query
// projection (per head [q | gate]); sigmoid(x) = 1 / (1 + exp(-x)) as strata.engine.layers.sigmoid.
extern "C" __global__ void gate_mul(float* __restrict__ ao, const float* __restrict__ qg, const int n_head,
                                    const int hd) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_head * hd) return;
    const int h = i / hd, d = i - h * hd;
    const float g = qg[(i64)h * 2 * hd + hd + d];
    ao[i] = ao[i] * (1.0f / (1.0f + expf(-g)));
}

// The gated delta net's causal depthwise conv + SiLU for one token (strata.engine.deltanet.conv_silu):
// channel c: acc = sum over k of window[k] * cw[c * dc + k] in order, window = [cs[0..dc-2][c] | qkv[c]];
// the state shifts by one (cs[dc-2][c] = qkv[c]); h[c] = acc / (1 + exp(-acc)). At position 0
// (params[0] == 0) the state is a new sequence's: zeros.
extern "C" __global__ void gdn_conv(const float* __restrict__ qkv, float* __restrict__ cs, const float* __restrict__ cw,
                                    const int conv_dim, const int dc, const int* __restrict__ params,
                                    float* __restrict__ h) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= conv_dim) return;
    const bool reset = params[0] == 0;
    float acc = (reset ? 0.0f : cs[c]) * cw[(i64)c * dc];
    for (int k = 1; k < dc - 1; ++k) acc = acc + (reset ? 0.0f : cs[(i64)k * conv_dim + c]) * cw[(i64)c * dc + k];
    const float xin = qkv[c];
    acc = acc + xin * cw[(i64)c * dc + dc - 1];
    for (int k = 0; k < dc - 2; ++k) cs[(i64)k * conv_dim + c] = reset ? 0.0f : cs[(i64)(k + 1) * conv_dim + c];
    cs[(i64)(dc - 2) * conv_dim + c] = xin;
    h[c] = acc / (1.0f + expf(-acc));
}

// One token of the delta rule for v head blockIdx.x (strata.engine.deltanet.delta_rule), GDN_THREADS threads (16 warps).
// q, k: l2-normalised (x * (1 / sqrt(sum(x^2) / ds + eps / ds)) * (1 / sqrt(ds))), k head vh / r, q also scaled by
// 1 / sqrt(ds); beta = sigmoid(b), g = softplus(a + dt_bias) * ssm_a (ggml's softplus: x above 20);
// S = S * exp(g); d = (v - S k) * beta; S = S + d k^T; o = S q; then o * (1 / sqrt(sum(o^2) / ds + eps)) * norm_w *
// silu(z). At position 0 S starts at zero. The head's state S [ds (v rows), ds (k columns)] is row-major: warp w takes
// rows w * ds / 16 .. (w + 1) * ds / 16, GDN_RB rows at a time, and lane l columns l, l + 32, ... of each (every load
// and store a warp makes covers 128 consecutive bytes; all GDN_RB x GDN_C of a lane's values are in flight at once).
// A row's dot products S k and S q: each lane's columns in ascending order, then a warp butterfly (the NumPy oracle
// sums in its own order: the two agree within float rounding, tests/test_gpu_fused.py). Rows past ds/32 * 32 columns
// per lane (ds > 32 * GDN_C) go in chunks of GDN_C columns, the second pass reading back what the first wrote.
#define GDN_THREADS 512
#define GDN_RB 8
#define GDN_C 4
extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_step(
    const float* __restrict__ h, const float* __restrict__ z, const float* __restrict__ ba, float* __restrict__ S,
    const float* __restrict__ dt_bias, const float* __restrict__ ssm_a, const float* __restrict__ norm_w,
    const int* __restrict__ params, const int nk, const int nv, const int ds, const float eps, const float inv_sqrt_ds,
    float* __restrict__ out) {
    extern __shared__ float qk[];  // q[ds], k[ds], o[ds]
    __shared__ float red[32];
    const int vh = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int r = nv / nk, kh = vh / r, kd = nk * ds;
    float qs = 0.0f, ks = 0.0f;
    for (int i = tid; i < ds; i += blockDim.x) {
        const float qv = h[(i64)kh * ds + i], kv = h[(i64)kd + kh * ds + i];
        qs = qs + qv * qv;
        ks = ks + kv * kv;
    }
    qs = block_sum(qs, red) / (float)ds;
    ks = block_sum(ks, red) / (float)ds;
    for (int i = tid; i < ds; i += blockDim.x) {
        const float qv = h[(i64)kh * ds + i], kv = h[(i64)kd + kh * ds + i];
        qk[i] = ((qv * (1.0f / sqrtf(qs + eps / (float)ds))) * inv_sqrt_ds) * inv_sqrt_ds;
        qk[ds + i] = (kv * (1.0f / sqrtf(ks + eps / (float)ds))) * inv_sqrt_ds;
    }
    const float b = ba[(i64)kh * 2 * r + (vh % r)], a = ba[(i64)kh * 2 * r + r + (vh % r)];
    const float beta = 1.0f / (1.0f + expf(-b));
    const float x = a + dt_bias[vh];
    const float sp = x > 20.0f ? x : logf(1.0f + expf(fminf(x, 20.0f)));
    const float eg = expf(sp * ssm_a[vh]);
    __syncthreads();
    const bool reset = params[0] == 0;
    const int C = ds >> 5, R = ds / nw;  // columns a lane holds in a row; rows a warp owns
    float* Sh = S + (i64)vh * ds * ds;
    for (int j0 = warp * R; j0 < (warp + 1) * R; j0 += GDN_RB) {
        const int nr = min(GDN_RB, (warp + 1) * R - j0);
        float sk[GDN_RB], o[GDN_RB], s[GDN_RB][GDN_C];
#pragma unroll
        for (int rr = 0; rr < GDN_RB; ++rr) sk[rr] = o[rr] = 0.0f;
        for (int c0 = 0; c0 < C; c0 += GDN_C) {  // pass 1: S *= exp(g), S k
#pragma unroll
            for (int rr = 0; rr < GDN_RB; ++rr)
#pragma unroll
                for (int cc = 0; cc < GDN_C; ++cc)
                    if (rr < nr && c0 + cc < C)
                        s[rr][cc] = reset ? 0.0f : Sh[(i64)(j0 + rr) * ds + (c0 + cc) * 32 + lane];
#pragma unroll
            for (int rr = 0; rr < GDN_RB; ++rr)
#pragma unroll
                for (int cc = 0; cc < GDN_C; ++cc)
                    if (rr < nr && c0 + cc < C) {
                        s[rr][cc] = s[rr][cc] * eg;
                        sk[rr] = sk[rr] + s[rr][cc] * qk[ds + (c0 + cc) * 32 + lane];
                        if (C > GDN_C) Sh[(i64)(j0 + rr) * ds + (c0 + cc) * 32 + lane] = s[rr][cc];
                    }
        }
        float d[GDN_RB];
#pragma unroll
        for (int rr = 0; rr < GDN_RB; ++rr) {
            const float t = warp_sum(sk[rr]);
            d[rr] = rr < nr ? (h[(i64)2 * kd + vh * ds + j0 + rr] - t) * beta : 0.0f;
        }
        for (int c0 = 0; c0 < C; c0 += GDN_C) {  // pass 2: S += d k^T, S q
            if (C > GDN_C) {
#pragma unroll
                for (int rr = 0; rr < GDN_RB; ++rr)
#pragma unroll
                    for (int cc = 0; cc < GDN_C; ++cc)
                        if (rr < nr && c0 + cc < C) s[rr][cc] = Sh[(i64)(j0 + rr) * ds + (c0 + cc) * 32 + lane];
            }
#pragma unroll
            for (int rr = 0; rr < GDN_RB; ++rr)
#pragma unroll
                for (int cc = 0; cc < GDN_C; ++cc)
                    if (rr < nr && c0 + cc < C) {
                        const int col = (c0 + cc) * 32 + lane;
                        const float v = s[rr][cc] + d[rr] * qk[ds + col];
                        Sh[(i64)(j0 + rr) * ds + col] = v;
                        o[rr] = o[rr] + v * qk[col];
                    }
        }
#pragma unroll
        for (int rr = 0; rr < GDN_RB; ++rr) {
            const float t = warp_sum(o[rr]);
            if (rr < nr && lane == 0) qk[2 * ds + j0 + rr] = t;
        }
    }
    __syncthreads();
    float os = 0.0f;
    for (int i = tid; i < ds; i += blockDim.x) os = os + qk[2 * ds + i] * qk[2 * ds + i];
    os = block_sum(os, red) / (float)ds;
    for (int i = tid; i < ds; i += blockDim.x) {
        const float zz = z[(i64)vh * ds + i];
        out[(i64)vh * ds + i] = ((qk[2 * ds + i] * (1.0f / sqrtf(os + eps))) * norm_w[i]) * (zz / (1.0f + expf(-zz)));
    }
}
