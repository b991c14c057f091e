// Grouped products of a prompt chunk's routed experts (gpu/moe_mm.py), one launch per expert part: for the G experts
// of a call, expert g's pairs are rows starts[g] .. starts[g] + counts[g] - 1 of the output Y [P, N] (numpy order),
// and pair p's input is row src[p] of X (src == null: row p):
//   Y[p, n] = inv_s[p] * sum_k f16(X[src[p], k] * s[p]) * f16(W_g[n, k])      (s[p] = xscale[src[p]], or 1)
// with W_g the engine-form weight [N, K] at bases[g] (scale plane, then payload plane), its values from deq_chunk
// (the type's arithmetic; this module is compiled with FMA contraction, so a value may differ from the other kernels'
// by one f32 rounding before its own rounding to f16, round to nearest even), and the products
// summed in f32 by the tensor cores (mma.sync m16n8k16, f16 operands, f32 accumulators: PTX ISA "Matrix multiply-
// accumulate operation using mma instruction", the m16n8k16 fragment layouts). xscale holds a power of two per X row
// that puts the row's largest magnitude in [2^13, 2^14): f16's range without overflow, and its 11-bit significand
// relative to the row's own scale (multiplying by a power of two and dividing again is exact).
//
// Concatenated after the type's device code (kernel_src/assembly.type_source: QK, NF, PB, deq_chunk). A CTA
// (MM_WARPS warps) computes a tile of BM pairs of one expert x BN weight rows, stepping K by BK values: each thread
// dequantizes whole 32-value chunks of one weight row into shared memory as f16, the X rows are gathered and
// converted likewise, then each warp multiplies its 32 x 32 (pairs x rows) part. The tile list (blockIdx.y) is
// tiles[2 * i] = g, tiles[2 * i + 1] = the tile's first pair of that expert (g = -1: no tile, the CTA returns);
// blockIdx.x = the BN-row block.
// BM, BN, BK and MM_WARPS are defined by gpu/moe_mm.py (TILE_PAIRS, TILE_ROWS, TILE_K, THREADS / 32).
#define MT (BM / 16)  // m16 tiles a warp takes (every warp all BM pairs, its 32 of the BN rows)
#define XT (32 * MM_WARPS / BM)  // threads loading one pair's BK inputs
static_assert(BN == 32 * MM_WARPS, "a thread dequantizes one weight row of the tile; a warp multiplies 32 of them");
static_assert(BM % 16 == 0 && (32 * MM_WARPS) % BM == 0, "m16 tiles; whole threads per pair row");
static_assert(BK % 32 == 0 && (BK / XT) % 4 == 0, "whole 32-value chunks; float4 input loads");
#define LDH (BK + 8)  // f16 per shared row (+8: the fragment loads of a warp fall on 32 different banks)

__device__ __forceinline__ u32 pack_f16x2(const float lo, const float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void mma_f16(float* c, const u32* a, const u32 b0, const u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(32 * MM_WARPS) mm_grouped(
    const unsigned long long* __restrict__ bases, const int* __restrict__ tiles, const int* __restrict__ starts,
    const int* __restrict__ counts, const int* __restrict__ src, const float* __restrict__ X, const i64 ldx,
    const float* __restrict__ xscale, const int N, const int K, float* __restrict__ Y) {
    __shared__ __align__(16) unsigned short Ws[BN * LDH];
    __shared__ __align__(16) unsigned short Xs[BM * LDH];
    const int g = tiles[2 * blockIdx.y], m0 = tiles[2 * blockIdx.y + 1];
    if (g < 0) return;  // a tile past the last of a list made on the device (rows_ops.cu group_pairs)
    const int cnt = counts[g] - m0 < BM ? counts[g] - m0 : BM;  // this tile's pairs
    const i64 p0 = (i64)starts[g] + m0;
    const int n0 = blockIdx.x * BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u8* base = (const u8*)bases[g];
    const i64 nb_row = K / QK;
    const i64 n_blocks = (i64)N * nb_row;
    const float* scp = (const float*)base;
    const u8* pay = base + n_blocks * NF * 4;
    // X: thread tid loads pair tm's values [BK / XT * tq, + BK / XT) of each K step
    const int tm = tid / XT, tq = tid % XT;
    const bool xrow = tm < cnt;
    const i64 xr = xrow ? (src ? (i64)src[p0 + tm] : p0 + tm) : 0;
    const float s = (xrow && xscale) ? xscale[xr] : 1.0f;
    const float* xp = X + xr * ldx;
    float acc[MT][4][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
    const int gid = lane >> 2, tig = lane & 3;
    for (int k0 = 0; k0 < K; k0 += BK) {
        // the weight: BN rows x BK values = 2 chunks a row, one row a thread (BN == 32 * MM_WARPS)
        {
            const int n = n0 + tid;
            u32* dst = (u32*)(Ws + tid * LDH);
#pragma unroll
            for (int j = 0; j < BK / 32; ++j) {
                const int kc = k0 + 32 * j;
                if (n < N && kc < K) {
                    const i64 t = (i64)n * (K / 32) + kc / 32;  // chunk index in the tensor
                    const i64 blk = t / (QK / 32);
                    float y[32];
                    deq_chunk(scp + blk * NF, pay + blk * PB, (int)(t % (QK / 32)), y);
#pragma unroll
                    for (int i = 0; i < 16; ++i) dst[16 * j + i] = pack_f16x2(y[2 * i], y[2 * i + 1]);
                } else {
#pragma unroll
                    for (int i = 0; i < 16; ++i) dst[16 * j + i] = 0u;
                }
            }
        }
        // the inputs: BM pairs x BK values
        {
            u32* dst = (u32*)(Xs + tm * LDH + (BK / XT) * tq);
            const int kk = k0 + (BK / XT) * tq;
            if (xrow && kk < K) {
                const float4* x4 = (const float4*)(xp + kk);
#pragma unroll
                for (int i = 0; i < BK / XT / 4; ++i) {
                    const float4 v = x4[i];
                    dst[2 * i] = pack_f16x2(v.x * s, v.y * s);
                    dst[2 * i + 1] = pack_f16x2(v.z * s, v.w * s);
                }
            } else {
#pragma unroll
                for (int i = 0; i < BK / XT / 2; ++i) dst[i] = 0u;
            }
        }
        __syncthreads();
        const u32* W32 = (const u32*)Ws;
        const u32* X32 = (const u32*)Xs;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = 16 * mt + gid;
                a[mt][0] = X32[r * (LDH / 2) + 8 * ks + tig];
                a[mt][1] = X32[(r + 8) * (LDH / 2) + 8 * ks + tig];
                a[mt][2] = X32[r * (LDH / 2) + 8 * ks + 4 + tig];
                a[mt][3] = X32[(r + 8) * (LDH / 2) + 8 * ks + 4 + tig];
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const int n = 32 * warp + 8 * nt + gid;
                const u32 b0 = W32[n * (LDH / 2) + 8 * ks + tig];
                const u32 b1 = W32[n * (LDH / 2) + 8 * ks + 4 + tig];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_f16(acc[mt][nt], a[mt], b0, b1);
            }
        }
        __syncthreads();
    }
    // out: acc[mt][nt] = rows (16 mt + gid, + 8), columns 32 warp + 8 nt + 2 tig (+1)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = 16 * mt + gid + 8 * h;
            if (m >= cnt) continue;
            const i64 p = p0 + m;
            const float inv = xscale ? 1.0f / xscale[src ? (i64)src[p] : p] : 1.0f;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const int n = n0 + 32 * warp + 8 * nt + 2 * tig;
                if (n < N) Y[p * N + n] = acc[mt][nt][2 * h] * inv;
                if (n + 1 < N) Y[p * N + n + 1] = acc[mt][nt][2 * h + 1] * inv;
            }
        }
}

// xscale[r] for the rows of X [R, K] (one CTA of MM_WARPS warps a row): the power of two that puts the row's largest
// magnitude in [2^13, 2^14) (1 for a row of zeros or with a NaN or an infinity: its products stay what f16 makes of
// them; at most 2^100).
extern "C" __global__ void __launch_bounds__(32 * MM_WARPS) row_f16_scale(const float* __restrict__ X, const i64 ldx,
                                                                         const int K, float* __restrict__ xscale) {
    __shared__ float part[MM_WARPS];
    __shared__ int bad_any;
    if (threadIdx.x == 0) bad_any = 0;
    __syncthreads();
    const float* x = X + (i64)blockIdx.x * ldx;
    float m = 0.f;
    int bad = 0;
    for (int k = threadIdx.x; k < K; k += 32 * MM_WARPS) {
        const float a = fabsf(x[k]);
        bad |= !(a <= 3.0e38f);  // NaN or infinite (or near it)
        m = fmaxf(m, a);
    }
    if (bad) bad_any = 1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float mx = part[0];
        for (int w = 1; w < MM_WARPS; ++w) mx = fmaxf(mx, part[w]);
        float s = 1.0f;
        if (!bad_any && mx > 0.f) {
            int e;
            frexpf(mx, &e);  // mx = f * 2^e, f in [0.5, 1): mx in [2^(e-1), 2^e)
            s = ldexpf(1.0f, min(14 - e, 100));  // (a subnormal row's scale stays finite)
        }
        xscale[blockIdx.x] = s;
    }
}
