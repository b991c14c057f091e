// ---------------------------------------------------------------- the next layer's misses, copied ahead
// (strata.engine.gpu.prefetch: the fused step's side stream, full graph only; issue 19 "a miss costs one miss")
//
// After layer il-1's residual add, its resid_norm also writes the row normed with layer il's ffn_norm (xn2); on a
// side stream layer il's router reads it (the predicted logits), moe_stage picks the predicted experts that live in
// the host tier and moe_stage_copy copies them over PCIe into staging slots while the main stream runs layer il's
// attention. moe_route of layer il (after the side stream is joined) reads a selected host-tier expert from its
// staging slot when it was staged. The staged bytes are the tier's bytes of the same (layer, expert): tokens and
// logits do not depend on the prediction, only the time does.

// The plan for layer `layer`: the K best experts of the predicted logits, ranked as moe_route ranks (higher first,
// lower id on ties; softmax is monotone, so logits rank as probabilities up to rounding; a NaN ranks last), and of
// those whose slot is in the host tier (slot_of <= -2) the first P in rank order: staged[p] = layer * n_expert + id
// (the tag moe_route matches), src[p] = host + (-2 - slot) * slot_bytes; the other entries -1 and 0. This step's
// counts of the layer: counts[2 layer] = the entries staged, counts[2 layer + 1] = 0 (moe_route adds those it reads).
// One CTA; dynamic shared memory: n_expert floats.
extern "C" __global__ void moe_stage(const float* __restrict__ logits, const int n_expert, const int K,
                                     const int* __restrict__ slot_of, const int layer, const int P,
                                     const unsigned long long* __restrict__ host_ptr, const long long slot_bytes,
                                     int* __restrict__ staged, unsigned long long* __restrict__ src,
                                     int* __restrict__ counts) {
    extern __shared__ float sl[];
    __shared__ int best[64];
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int e = tid; e < n_expert; e += nt) {
        const float v = logits[e];
        sl[e] = isnan(v) ? __int_as_float(0xff800000) : v;
    }
    if (tid < K) best[tid] = -1;
    __syncthreads();
    for (int e = tid; e < n_expert; e += nt) {
        const float v = sl[e];
        int r = 0;
        for (int f = 0; f < n_expert && r < K; ++f) {
            const float u = sl[f];
            r += (u > v) || (u == v && f < e);
        }
        if (r < K) best[r] = e;
    }
    __syncthreads();
    if (tid == 0) {
        const unsigned long long host = *host_ptr;
        const int* row = slot_of + (long long)layer * n_expert;
        int p = 0;
        for (int r = 0; r < K && p < P && host; ++r) {
            const int e = best[r];
            if (e < 0) continue;
            const int s = row[e];
            if (s > -2) continue;
            staged[p] = layer * n_expert + e;
            src[p] = host + (unsigned long long)(-2 - s) * (unsigned long long)slot_bytes;
            ++p;
        }
        counts[2 * layer] = p;
        counts[2 * layer + 1] = 0;
        for (; p < P; ++p) {
            staged[p] = -1;
            src[p] = 0ull;
        }
    }
}

// The staged experts' bytes: CTA (x, p) copies a share of entry p's n16 16-byte words from src[p] (mapped, pinned
// host memory: read over PCIe, four loads in flight a thread, as cuda/probe.cu reads it) to dst + p * slot_bytes
// (device memory); an entry with src 0 is skipped.
extern "C" __global__ void moe_stage_copy(const unsigned long long* __restrict__ src, const unsigned long long dst,
                                          const long long slot_bytes, const long long n16) {
    const int p = blockIdx.y;
    const unsigned long long s = src[p];
    if (!s) return;
    const uint4* __restrict__ a = (const uint4*)s;
    uint4* __restrict__ b = (uint4*)(dst + (unsigned long long)p * (unsigned long long)slot_bytes);
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 w0 = a[i], w1 = a[i + stride], w2 = a[i + 2 * stride], w3 = a[i + 3 * stride];
        b[i] = w0;
        b[i + stride] = w1;
        b[i + 2 * stride] = w2;
        b[i + 3 * stride] = w3;
    }
    for (; i < n16; i += stride) b[i] = a[i];
}
