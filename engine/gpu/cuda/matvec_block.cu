// Kernels of the block types (QK > 1): dequant, and warp_dot for matvec.cu. Concatenated after
// prelude.cuh, the ggml lookup tables the type uses, the type's generated defines
// (kernels.type_defines, from its registry row: QK = values per block, NF = f32 scales per block
// in the engine form's scale plane (0 = native block), PB = payload bytes per block in the payload
// plane (the native block bytes when NF == 0)) and types/<TYPE>.cuh, which defines
//   deq_chunk(const float* sc, const u8* q, int sub, float* y)
// writing values [32*sub, 32*sub+32) of one block (sc = its NF scales, q = its PB payload bytes)
// with exactly the f32 operations, in the order, of the CPU dequantizer.
#define WARPS 4   // warps per CTA (blockDim.x == 32 * WARPS)
#define RPW 2     // rows per warp in the matvec kernels (they share one staged slice of x)

// Chunk t = block * (QK/32) + sub holds values [32t, 32t+32) of the tensor. Each warp
// dequantizes 32 consecutive chunks (one per lane) into a padded shared tile, then writes them
// out coalesced: lane l stores value l of each chunk (stride 33: no bank conflicts either way).
extern "C" __global__ void dequant(const u8* __restrict__ base, const i64 n_blocks, float* __restrict__ out) {
    __shared__ float tile[WARPS][32 * 33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 n_chunks = n_blocks * (QK / 32);
    const i64 c0 = ((i64)blockIdx.x * WARPS + warp) * 32;
    if (c0 >= n_chunks) return;  // whole warp
    float* tl = tile[warp];
    const i64 t = c0 + lane;
    if (t < n_chunks) {
        const i64 blk = t / (QK / 32);
        float y[32];
        deq_chunk((const float*)base + blk * NF, base + n_blocks * NF * 4 + blk * PB, (int)(t % (QK / 32)), y);
#pragma unroll
        for (int i = 0; i < 32; ++i) tl[lane * 33 + i] = y[i];
    }
    __syncwarp();
    const int nk = (int)min((i64)32, n_chunks - c0);
    for (int k = 0; k < nk; ++k) out[(c0 + k) * 32 + lane] = tl[k * 33 + lane];
}

// acc[r] = dot(W[row0 + r, :], x) for r < RPW, on one warp. Lane l takes chunks l, l+32, ... of
// the row in ascending order: s = s + w[i] * x[i] over the chunk's 32 values, acc += s; then
// a fixed xor butterfly. Per 32 chunks, x is staged into a padded shared tile (coalesced global
// loads, conflict-free reads) and reused for the warp's RPW rows; each row's block bytes for
// those chunks (contiguous) are staged into shared memory with coalesced 4- or 2-byte loads, so
// deq_chunk's byte reads hit shared memory instead of strided global loads. Staging changes
// where bytes are read from, not the arithmetic.
#define CPB (QK / 32)                       // chunks per block
#define BLK_PER_IT (32 / CPB)               // blocks covered by 32 chunks
#define STAGE_BYTES (((BLK_PER_IT * PB) + 15) / 16 * 16)

__device__ __forceinline__ void stage_bytes(u8* __restrict__ dst, const u8* __restrict__ src, const int nbytes,
                                            const int lane) {
    if ((((unsigned long long)src) & 3ull) == 0) {
        const int n4 = nbytes >> 2;
        for (int i = lane; i < n4; i += 32) ((u32*)dst)[i] = ((const u32*)src)[i];
        if ((nbytes & 2) && lane == 0) ((u16*)dst)[2 * n4] = ((const u16*)src)[2 * n4];
    } else {  // native blocks of 66/74/98/110/210 bytes: only 2-byte aligned
        const int n2 = nbytes >> 1;
        for (int i = lane; i < n2; i += 32) ((u16*)dst)[i] = ((const u16*)src)[i];
    }
}

__device__ __forceinline__ void warp_dot(const u8* __restrict__ base, const i64 rows, const int ne0, const i64 row0,
                                         const float* __restrict__ x, float* __restrict__ xs, u8* __restrict__ wb,
                                         const int lane, float* acc) {
    const int nb = ne0 / QK;
    const int n_chunk = nb * CPB;
    const i64 n_blocks = rows * nb;
    const float* scales = (const float*)base;
    const u8* payload = base + n_blocks * NF * 4;
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.0f;
    for (int c0 = 0; c0 < n_chunk; c0 += 32) {
        const int nk = min(32, n_chunk - c0);
        const int jb0 = c0 / CPB;
        const int nblk = (nk + CPB - 1) / CPB;
        __syncwarp();
        for (int k = 0; k < nk; ++k) xs[k * 33 + lane] = x[(i64)(c0 + k) * 32 + lane];
        const int c = c0 + lane;
        const float* xx = xs + lane * 33;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const i64 row = row0 + r;
            if (row >= rows) break;  // uniform across the warp
            __syncwarp();
            stage_bytes(wb, payload + (row * nb + jb0) * PB, nblk * PB, lane);
            __syncwarp();
            if (c < n_chunk) {
                const int jl = c / CPB - jb0;
                const i64 blk = row * nb + jb0 + jl;
                float w[32];
                deq_chunk(scales + blk * NF, wb + jl * PB, c % CPB, w);
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 32; ++i) s = s + w[i] * xx[i];  // mul then add: --fmad=false keeps them apart
                acc[r] += s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}
