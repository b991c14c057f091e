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
// One warp per Q8_RPW rows: lane l works on block b0 + l / LPB of each step of 32 / LPB blocks. The integer partial sums
// of a block's LPB lanes are added by xor shuffles (integers: exact in any order); then the float part in
// cpu_q8.c's FIXED order (item 3 of its header):
//   Q8_FMT 1: acc[b % 8] += (d_w * d_x) * (float)S_b in ascending b (lane group g holds acc[g]: a step covers
//             8 blocks from a multiple of 8), result ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7));
//   Q8_FMT 2: sa += (d_x * d_w) * (float)S_b, sm += (d_x * dmin_w) * (float)M_b in ascending b (every lane adds
//             the step's terms in block order, read by shuffle), result sa - sm (sa without a min).
// Every float operation is one IEEE f32 operation (--fmad=false), as cpu_q8.c's -ffp-contract=off.
#define Q8_BPI (32 / LPB)  // blocks per step
// Q8_RPW (rows per warp, defined by kernels.q8_source_for): the warp walks Q8_RPW rows side by side (their loads
// in flight together); each row's arithmetic is the one-row order above, so the bits do not depend on it.

// res[r] = row row0 + r of W . act, for r < min(Q8_RPW, rows - row0) (every lane returns the same values).
__device__ __forceinline__ void q8_rows(const u8* __restrict__ base, const i64 rows, const int ne0, const i64 row0,
                                        const u8* __restrict__ act, const int lane, float* res) {
    const int nb = ne0 / QK;
    const float* scales = (const float*)base;
    const u8* payload = base + rows * nb * NF * 4;
    const i8* aq = (const i8*)act;
    const float* ad = (const float*)(act + act_d_off(ne0));
    const i16* as = (const i16*)(act + act_s_off(ne0));
    const i16* at = (const i16*)(act + act_t_off(ne0));
    const int g = lane / LPB, p = lane % LPB;
    const int nr = (int)min((i64)Q8_RPW, rows - row0);
#if Q8_FMT == 1
    float acc[Q8_RPW];
#else
    float sa[Q8_RPW], sm[Q8_RPW];
#endif
#pragma unroll
    for (int r = 0; r < Q8_RPW; ++r) {
#if Q8_FMT == 1
        acc[r] = 0.0f;
#else
        sa[r] = 0.0f;
        sm[r] = 0.0f;
#endif
    }
    for (int b0 = 0; b0 < nb; b0 += Q8_BPI) {
        const int b = b0 + g;
        const bool on = b < nb;
        const float dx = on ? ad[b] : 0.0f;
        int S[Q8_RPW], M[Q8_RPW];
#pragma unroll
        for (int r = 0; r < Q8_RPW; ++r) {
            S[r] = 0;
            M[r] = 0;
            if (on && r < nr) {
                const i64 blk = (row0 + r) * nb + b;
                lane_sums(scales + blk * NF, payload + blk * PB, aq + (i64)b * QK, as + (i64)b * (QK / 16),
                          at + (i64)b * (QK / 32), p, &S[r], &M[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < Q8_RPW; ++r) {
#pragma unroll
            for (int o = LPB / 2; o > 0; o >>= 1) {
                S[r] += __shfl_xor_sync(0xffffffffu, S[r], o);
#if HAS_MIN
                M[r] += __shfl_xor_sync(0xffffffffu, M[r], o);
#endif
            }
            float dw = 0.0f, dm = 0.0f;
            if (on && r < nr) {
                const i64 blk = (row0 + r) * nb + b;
                blk_scales(scales + blk * NF, payload + blk * PB, &dw, &dm);
            }
#if Q8_FMT == 1
            if (on) acc[r] = acc[r] + (dw * dx) * (float)S[r];
#else
            const float ta = (dx * dw) * (float)S[r];
#if HAS_MIN
            const float tm = (dx * dm) * (float)M[r];
#endif
#pragma unroll
            for (int k = 0; k < Q8_BPI; ++k) {
                const float va = __shfl_sync(0xffffffffu, ta, k * LPB);
#if HAS_MIN
                const float vm = __shfl_sync(0xffffffffu, tm, k * LPB);
#endif
                if (b0 + k < nb) {
                    sa[r] = sa[r] + va;
#if HAS_MIN
                    sm[r] = sm[r] + vm;
#endif
                }
            }
#endif
        }
    }
#pragma unroll
    for (int r = 0; r < Q8_RPW; ++r) {
#if Q8_FMT == 1
        float a[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] = __shfl_sync(0xffffffffu, acc[r], k * LPB);
        res[r] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
#elif HAS_MIN
        res[r] = sa[r] - sm[r];
#else
        res[r] = sa[r];
#endif
    }
}

// Q8_WARPS (warps per CTA) comes with Q8_RPW from kernels.q8_source_for; a CTA takes Q8_WARPS * Q8_RPW rows.
#define Q8_ROWS (Q8_WARPS * Q8_RPW)

__device__ __forceinline__ void q8_store(float* __restrict__ y, const i64 row0, const i64 rows, const float* res,
                                         const int lane) {
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < Q8_RPW; ++r) if (row0 + r < rows) y[row0 + r] = res[r];
    }
}

// y[row] = W[row, :] . act (act: the q8 activation of ne0 values); warp w of CTA b takes rows
// (b * Q8_WARPS + w) * Q8_RPW .. + Q8_RPW.
extern "C" __global__ void __launch_bounds__(32 * Q8_WARPS) matvec_q8(const u8* __restrict__ base, const i64 rows,
                                                                       const int ne0, const u8* __restrict__ act,
                                                                       float* __restrict__ y) {
    const int lane = threadIdx.x & 31;
    const i64 row0 = ((i64)blockIdx.x * Q8_WARPS + (threadIdx.x >> 5)) * Q8_RPW;
    if (row0 >= rows) return;  // whole warp (no CTA barrier here)
    float res[Q8_RPW];
    q8_rows(base, rows, ne0, row0, act, lane, res);
    q8_store(y, row0, rows, res, lane);
}

// Y[item, row] = W_item[row, :] . act_item, act_item = act + item * act_stride bytes (0: one activation for
// all); W_item at bases[item] (engine form); base 0 = skipped (an expert-cache miss the host fills).
extern "C" __global__ void __launch_bounds__(32 * Q8_WARPS) matvec_q8_batched(
    const unsigned long long* __restrict__ bases, const i64 rows, const int ne0, const u8* __restrict__ act,
    const i64 act_stride, float* __restrict__ Y) {
    const int lane = threadIdx.x & 31, item = blockIdx.y;
    const i64 row0 = ((i64)blockIdx.x * Q8_WARPS + (threadIdx.x >> 5)) * Q8_RPW;
    if (bases[item] == 0ull || row0 >= rows) return;
    float res[Q8_RPW];
    q8_rows((const u8*)bases[item], rows, ne0, row0, act + (i64)item * act_stride, lane, res);
    q8_store(Y + (i64)item * rows, row0, rows, res, lane);
}

// Y_item = W_item . act for up to 4 weights of one type and row length on one activation (q, k, v; gate, up):
// addresses, rows and outputs by value, blockIdx.y = item (matvec.cu's matvec_group).
extern "C" __global__ void __launch_bounds__(32 * Q8_WARPS) matvec_q8_group(
    const unsigned long long b0, const unsigned long long b1, const unsigned long long b2,
    const unsigned long long b3, const i64 r0, const i64 r1, const i64 r2, const i64 r3, const int ne0,
    const u8* __restrict__ act, const unsigned long long o0, const unsigned long long o1,
    const unsigned long long o2, const unsigned long long o3) {
    const int lane = threadIdx.x & 31, item = blockIdx.y;
    const unsigned long long base = item == 0 ? b0 : item == 1 ? b1 : item == 2 ? b2 : b3;
    const unsigned long long outp = item == 0 ? o0 : item == 1 ? o1 : item == 2 ? o2 : o3;
    const i64 n = item == 0 ? r0 : item == 1 ? r1 : item == 2 ? r2 : r3;
    const i64 row0 = ((i64)blockIdx.x * Q8_WARPS + (threadIdx.x >> 5)) * Q8_RPW;
    if (row0 >= n) return;
    float res[Q8_RPW];
    q8_rows((const u8*)base, n, ne0, row0, act, lane, res);
    q8_store((float*)outp, row0, n, res, lane);
}
