// Matrix-vector products with llama.cpp's CPU numerics on the GPU: BIT-IDENTICAL to engine/cpu/cpu_q8_dots.c
// (strata.engine.cpu.kernels kernel "q8"), so a q8 product gives the same bits on both devices - an expert
// computed on the CPU (a cache miss) equals the same expert on the GPU (a hit).
//
// Concatenated after prelude.cuh, engine/kernel_src/q8_layout.h, the tables, the type's generated defines (QK, NF, PB) and
// q8/<TYPE>.cuh, which defines Q8_FMT (1: Q8_0 activations, blocks of 32; 2: Q8_K, blocks of 256), LPB (lanes
// per block), HAS_MIN, and
//   lane_sums(sc, blk, y, ys, yt, p, &S, &M): lane p's share (p < LPB) of block blk's exact integer sums
//       S = sum of scale * w * y and M = sum of min * (sum of y) (cpu_q8_dots.c sb_sums / blk_dot);
//   blk_scales(sc, blk, &dw, &dm): the block's f32 scale (fp32 of the fp16 d) and min - for the widened types
//       (the engine form's f32 scale plane) q8_lane.cuh defines it, with the 8-value dots the lane code uses.
// The activation (q, d, s, t of q8_layout.h) is made by q8_act.cu's quantize_q8 for ne0 values.
//
// A row's blocks go in steps of Q8_BPI = 32 / LPB blocks (lane l works on block b0 + l / LPB of a step). The integer
// partial sums of a block's LPB lanes are added by xor shuffles (integers: exact in any order), and the block's float
// terms are made as cpu_q8.c makes them: Q8_FMT 1: t_b = (d_w * d_x) * (float)S_b; Q8_FMT 2: t_b = (d_x * d_w) *
// (float)S_b and m_b = (d_x * dmin_w) * (float)M_b. The terms go to shared memory; then the row's first warp adds them
// in cpu_q8.c's FIXED order (item 3 of its header):
//   Q8_FMT 1: acc[b % 8] += t_b in ascending b, result ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7));
//   Q8_FMT 2: sa += t_b, sm += m_b in ascending b, result sa - sm (sa without a min).
// Every float operation is one IEEE f32 operation (--fmad=false), as cpu_q8.c's -ffp-contract=off.
//
// Launch shape (strata.engine.gpu.kernels.q8_launch; neither changes the arithmetic): a CTA of Q8_WARPS warps takes
// Q8_WARPS / split rows. split 1: a warp per row adds the terms as it goes (q8_row_direct). split > 1 (a power of
// two dividing Q8_WARPS; auto takes Q8_WARPS): the row's warps take its steps round robin, so its loads are in flight on several warps at once
// (one warp per row left a 4096-long row latency-bound: docs/DESIGN.md "Kernel launch shapes"), the terms go to
// shared memory (Q8_TERMS * nb floats per row of the CTA) and the row's first warp adds them (q8_row_sum).
#define Q8_BPI (32 / LPB)  // blocks per step
#if Q8_FMT == 2 && HAS_MIN
#define Q8_TERMS 2
#else
#define Q8_TERMS 1
#endif
extern __shared__ float q8_terms[];

// Where a product's planes are: the weight's engine form at base (rows x nb blocks: the f32 scale plane, then the
// payload plane) and the q8 activation of ne0 values at act (q, d, s, t of q8_layout.h).
struct Q8Planes {
    int nb;
    const float* scales;
    const u8* payload;
    const i8* aq;
    const float* ad;
    const i16* as;
    const i16* at;
};
__device__ __forceinline__ Q8Planes q8_planes(const u8* __restrict__ base, const i64 rows, const int ne0,
                                              const u8* __restrict__ act) {
    const int nb = ne0 / QK;
    return Q8Planes{nb,
                    (const float*)base,
                    base + rows * nb * NF * 4,
                    (const i8*)act,
                    (const float*)(act + act_d_off(ne0)),
                    (const i16*)(act + act_s_off(ne0)),
                    (const i16*)(act + act_t_off(ne0))};
}

// Block b of row `row` on lane p of its LPB lanes: the block's f32 scale and min (*dw, *dm) and the exact integer
// sums S, M of the block's LPB lanes (lane_sums, then an xor butterfly: integers, exact in any order), every lane of
// the group holding them; all 0 when !on (b past the row: the lanes still take part in the shuffles).
__device__ __forceinline__ void q8_block_sums(const Q8Planes& P, const i64 row, const int b, const int p,
                                              const bool on, float* dw, float* dm, int* S, int* M, const bool wide) {
    *dw = 0.0f;
    *dm = 0.0f;
    *S = 0;
    *M = 0;
    if (on) {  // the scales' loads first: in flight with the lane sums'
        const i64 blk = row * P.nb + b;
        blk_scales(P.scales + blk * NF, P.payload + blk * PB, dw, dm);
        lane_sums(P.scales + blk * NF, P.payload + blk * PB, P.aq + (i64)b * QK, P.as + (i64)b * (QK / 16),
                  P.at + (i64)b * (QK / 32), p, S, M, wide);
    }
#pragma unroll
    for (int o = LPB / 2; o > 0; o >>= 1) {
        *S += __shfl_xor_sync(0xffffffffu, *S, o);
#if HAS_MIN
        *M += __shfl_xor_sync(0xffffffffu, *M, o);
#endif
    }
}

// Part `part` of `split` of row `row`'s block terms into T[b] (and T[nb + b], the min terms).
__device__ __forceinline__ void q8_row_terms(const u8* __restrict__ base, const i64 rows, const int ne0, const i64 row,
                                             const u8* __restrict__ act, const int lane, const int part,
                                             const int split, float* T, const bool wide) {
    const Q8Planes P = q8_planes(base, rows, ne0, act);
    const int nb = P.nb;
    const int g = lane / LPB, p = lane % LPB;
    for (int b0 = part * Q8_BPI; b0 < nb; b0 += split * Q8_BPI) {  // uniform across the warp
        const int b = b0 + g;
        const bool on = b < nb;
        const float dx = on ? P.ad[b] : 0.0f;
        float dw, dm;
        int S, M;
        q8_block_sums(P, row, b, p, on, &dw, &dm, &S, &M, wide);
        if (on && p == 0) {
#if Q8_FMT == 1
            T[b] = (dw * dx) * (float)S;
#else
            T[b] = (dx * dw) * (float)S;
#if HAS_MIN
            T[nb + b] = (dx * dm) * (float)M;
#endif
#endif
        }
    }
}

// The row's result from its nb block terms in the fixed order above (every lane returns the same bits).
__device__ __forceinline__ float q8_row_sum(const float* T, const int nb, const int lane) {
#if Q8_FMT == 1
    float acc = 0.0f;
    if (lane < 8)
        for (int b = lane; b < nb; b += 8) acc = acc + T[b];
    float a[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] = __shfl_sync(0xffffffffu, acc, k);
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
#else
    float v = 0.0f;
    if (lane < Q8_TERMS) {
        const float* t = T + lane * nb;
        for (int b = 0; b < nb; ++b) v = v + t[b];
    }
    const float sa = __shfl_sync(0xffffffffu, v, 0);
#if HAS_MIN
    return sa - __shfl_sync(0xffffffffu, v, 1);
#else
    return sa;
#endif
#endif
}

// split 1: the row's warp adds each step's terms as it goes (cpu_q8.c's order, no shared memory, no barrier); every
// lane returns the same bits. (Two rows a warp sharing the activation loads was measured slower: docs/DESIGN.md
// "Kernel launch shapes".)
__device__ __forceinline__ float q8_row_direct(const u8* __restrict__ base, const i64 rows, const int ne0, const i64 row,
                                               const u8* __restrict__ act, const int lane, const bool wide) {
    const Q8Planes P = q8_planes(base, rows, ne0, act);
    const int nb = P.nb;
    const int g = lane / LPB, p = lane % LPB;
#if Q8_FMT == 1
    float acc = 0.0f;
#else
    float sa = 0.0f, sm = 0.0f;
#endif
    for (int b0 = 0; b0 < nb; b0 += Q8_BPI) {
        const int b = b0 + g;
        const bool on = b < nb;
        const float dx = on ? P.ad[b] : 0.0f;
        float dw, dm;
        int S, M;
        q8_block_sums(P, row, b, p, on, &dw, &dm, &S, &M, wide);
#if Q8_FMT == 1
        if (on) acc = acc + (dw * dx) * (float)S;  // lane group g holds acc[g]: a step covers 8 blocks from a multiple of 8
#else
        const float ta = (dx * dw) * (float)S;
#if HAS_MIN
        const float tm = (dx * dm) * (float)M;
#endif
#pragma unroll
        for (int k = 0; k < Q8_BPI; ++k) {  // the step's terms in block order, read by shuffle
            const float va = __shfl_sync(0xffffffffu, ta, k * LPB);
#if HAS_MIN
            const float vm = __shfl_sync(0xffffffffu, tm, k * LPB);
#endif
            if (b0 + k < nb) {
                sa = sa + va;
#if HAS_MIN
                sm = sm + vm;
#endif
            }
        }
#endif
    }
#if Q8_FMT == 1
    float a[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] = __shfl_sync(0xffffffffu, acc, k * LPB);
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
#elif HAS_MIN
    return sa - sm;
#else
    return sa;
#endif
}

// y[row] = W[row, :] . act for the row of this warp's group (rows past the end still reach the barrier); wide: the
// weight is in device memory (q8_lane.cuh load_weight_words: wide loads), else a host-tier expert read over PCIe.
__device__ __forceinline__ void q8_row(const u8* __restrict__ base, const i64 rows, const int ne0,
                                       const u8* __restrict__ act, float* __restrict__ y, const int split,
                                       const bool wide) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (split == 1) {  // uniform across the CTA
        const i64 row = (i64)blockIdx.x * Q8_WARPS + warp;
        if (row >= rows) return;  // whole warp
        const float r = q8_row_direct(base, rows, ne0, row, act, lane, wide);
        if (lane == 0) y[row] = r;
        return;
    }
    const int rl = warp / split, part = warp - rl * split;
    const i64 row = (i64)blockIdx.x * (Q8_WARPS / split) + rl;
    const int nb = ne0 / QK;
    float* T = q8_terms + (i64)rl * Q8_TERMS * nb;
    const bool live = row < rows;
    if (live) q8_row_terms(base, rows, ne0, row, act, lane, part, split, T, wide);
    __syncthreads();
    if (live && part == 0) {
        const float r = q8_row_sum(T, nb, lane);
        if (lane == 0) y[row] = r;
    }
}

// y[row] = W[row, :] . act (act: the q8 activation of ne0 values).
extern "C" __global__ void __launch_bounds__(32 * Q8_WARPS) matvec_q8(const u8* __restrict__ base, const i64 rows,
                                                                       const int ne0, const u8* __restrict__ act,
                                                                       float* __restrict__ y, const int split) {
    q8_row(base, rows, ne0, act, y, split, true);
}

// Y[item, row] = W_item[row, :] . act_item, act_item = act + item * act_stride bytes (0: one activation for
// all); W_item at bases[item] (engine form); base 0 = skipped (an expert-cache miss the host fills); bit 0 set = a
// host-tier expert read over PCIe (fused.cu moe_route tags it: the addresses are even), read with word loads.
extern "C" __global__ void __launch_bounds__(32 * Q8_WARPS) matvec_q8_batched(
    const unsigned long long* __restrict__ bases, const i64 rows, const int ne0, const u8* __restrict__ act,
    const i64 act_stride, float* __restrict__ Y, const int split) {
    const int item = blockIdx.y;
    const unsigned long long b = bases[item];
    if (b == 0ull) return;  // uniform across the CTA
    q8_row((const u8*)(b & ~1ull), rows, ne0, act + (i64)item * act_stride, Y + (i64)item * rows, split,
           (b & 1ull) == 0ull);
}

// Y_item = W_item . act for up to 4 weights of one type and row length on one activation (q, k, v; gate, up):
// addresses, rows and outputs by value, blockIdx.y = item (matvec.cu's matvec_group).
extern "C" __global__ void __launch_bounds__(32 * Q8_WARPS) matvec_q8_group(
    const unsigned long long b0, const unsigned long long b1, const unsigned long long b2,
    const unsigned long long b3, const i64 r0, const i64 r1, const i64 r2, const i64 r3, const int ne0,
    const u8* __restrict__ act, const unsigned long long o0, const unsigned long long o1,
    const unsigned long long o2, const unsigned long long o3, const int split) {
    const int item = blockIdx.y;
    const unsigned long long base = item == 0 ? b0 : item == 1 ? b1 : item == 2 ? b2 : b3;
    const unsigned long long outp = item == 0 ? o0 : item == 1 ? o1 : item == 2 ? o2 : o3;
    const i64 n = item == 0 ? r0 : item == 1 ? r1 : item == 2 ? r2 : r3;
    if ((i64)blockIdx.x * (Q8_WARPS / split) >= n) return;  // uniform across the CTA
    q8_row((const u8*)base, n, ne0, act, (float*)outp, split, true);
}
