// Kernels of the block types (QK > 1): dequant, and warp_dot for matvec.cu. Concatenated after
// prelude.cuh, the ggml lookup tables the type uses, the type's generated defines
// (kernel_src/assembly.type_defines, from its registry row: QK = values per block, NF = f32 scales per block
// in the engine form's scale plane (0 = native block), PB = payload bytes per block in the payload
// plane (the native block bytes when NF == 0)) and types/<TYPE>.cuh, which defines
//   deq_chunk(const float* sc, const u8* q, int sub, float* y)
// writing values [32*sub, 32*sub+32) of one block (sc = its NF scales, q = its PB payload bytes)
// with exactly the f32 operations, in the order, of the CPU dequantizer.
#define WARPS 4   // warps per CTA (blockDim.x == 32 * WARPS)
// RPW (rows per warp) and MV_BOUNDS (the kernels' launch bounds) are defined by kernels.source_for

// Chunk t = block * (QK/32) + sub holds values [32t, 32t+32) of the tensor. Each warp dequantizes 32 consecutive
// chunks (one per lane) into a padded shared tile, then writes them out coalesced: lane l stores value l of each
// chunk (stride 33: no bank conflicts either way). dequant_chunks: this warp's 32 chunks from chunk c0 of the n_chunks
// that start at block blk0 of a tensor of n_blocks (engine form at base: scale plane, then payload plane); chunk t
// goes to out + t * 32. Called by one whole warp.
__device__ __forceinline__ void dequant_chunks(const u8* __restrict__ base, const i64 n_blocks, const i64 blk0,
                                               const i64 n_chunks, const i64 c0, float* __restrict__ out,
                                               float* tl) {
    const int lane = threadIdx.x & 31;
    const i64 t = c0 + lane;
    if (t < n_chunks) {
        const i64 blk = blk0 + t / (QK / 32);
        float y[32];
        deq_chunk((const float*)base + blk * NF, base + n_blocks * NF * 4 + blk * PB, (int)(t % (QK / 32)), y);
#pragma unroll
        for (int i = 0; i < 32; ++i) tl[lane * 33 + i] = y[i];
    }
    __syncwarp();
    const int nk = (int)min((i64)32, n_chunks - c0);
    for (int k = 0; k < nk; ++k) out[(c0 + k) * 32 + lane] = tl[k * 33 + lane];
}

extern "C" __global__ void dequant(const u8* __restrict__ base, const i64 n_blocks, float* __restrict__ out) {
    __shared__ float tile[WARPS][32 * 33];
    const int warp = threadIdx.x >> 5;
    const i64 n_chunks = n_blocks * (QK / 32);
    const i64 c0 = ((i64)blockIdx.x * WARPS + warp) * 32;
    if (c0 >= n_chunks) return;  // whole warp
    dequant_chunks(base, n_blocks, 0, n_chunks, c0, out, tile[warp]);
}

// Blocks [blk0, blk0 + nblk) of n tensors of one type and shape as f32, for a prompt chunk's matrix products
// (gpu/chunk.py): tensor i (blockIdx.y) is the engine-form buffer at bases[i] (n_blocks blocks: its scale plane
// at byte 0, its payload plane after it), its values go to out + i * out_stride. The same chunk arithmetic
// (deq_chunk) and tiling as dequant (dequant_chunks): each value equals dequant's bit for bit.
extern "C" __global__ void dequant_many(const unsigned long long* __restrict__ bases, const i64 n_blocks,
                                        const i64 blk0, const i64 nblk, float* __restrict__ out_all,
                                        const i64 out_stride) {
    __shared__ float tile[WARPS][32 * 33];
    const int warp = threadIdx.x >> 5;
    const i64 n_chunks = nblk * (QK / 32);
    const i64 c0 = ((i64)blockIdx.x * WARPS + warp) * 32;
    if (c0 >= n_chunks) return;  // whole warp
    dequant_chunks((const u8*)bases[blockIdx.y], n_blocks, blk0, n_chunks, c0, out_all + (i64)blockIdx.y * out_stride,
                   tile[warp]);
}

// acc[r] = dot(W[row0 + r, :], x) for r < RPW, on one warp. Lane l takes chunks l, l+32, ... of
// the row in ascending order: s = s + w[i] * x[i] over the chunk's 32 values, acc += s; then
// a fixed xor butterfly. That is the whole arithmetic, and it is the same as one row at a time
// (strata.engine.gpu.reference.matvec, engine/cpu/cpu_driver.c row_exact): bit-identical results.
//
// Where the bytes come from (not the arithmetic): the kernel walks the row in steps of 32 chunks.
// Each step's x slice (32 x 32 floats) is staged ONCE PER CTA into a shared tile (every warp of
// the CTA walks the same chunks in lockstep, so one tile serves WARPS * RPW rows), laid out as
// float4 [8][32]: value 4j..4j+3 of chunk k at float4 j * 32 + k, so lane l reads its chunk with
// 8 conflict-free 16-byte loads; and
// each warp's RPW rows' block bytes for those chunks (contiguous per row) into its shared region;
// deq_chunk then reads shared memory. Both go through cp.async (global -> shared without
// registers) into two buffers: while a step is computed, the next step's bytes are in flight
// (double buffering), so a warp keeps 2 * RPW rows' bytes outstanding.
//
// Alignment: cp.async moves 4-byte words. A row's bytes start 2 bytes past a word when its block
// size is 2 mod 4 (66, 74, 82, 98, 110, 210) and the row's offset is odd in blocks; the word
// copy then starts 2 bytes early (bytes of the previous row: in bounds) and deq_chunk reads
// from 2 bytes into the staged row; a trailing half word is copied by a plain 2-byte load, so
// nothing past the row's own bytes is read at the end of the tensor.
//
// Called by EVERY warp of the CTA (it has __syncthreads): a warp whose rows are all past ``rows``
// (active == false) stages x and waits at the barriers but loads and computes nothing else.
#define CPB (QK / 32)                       // chunks per block
#define BLK_PER_IT (32 / CPB)               // blocks covered by 32 chunks
#define STAGE_BYTES (((BLK_PER_IT * PB) + 15) / 16 * 16)
#define ROW_STAGE (STAGE_BYTES + 16)        // one row's staged bytes, with room for the 2-byte shift

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

// Issue the copies of step c0 into buffer xs / wb (one commit group per thread).
__device__ __forceinline__ void stage_step(const u8* __restrict__ payload, const int nb, const i64 row0, const int nr,
                                           const int c0, const int n_chunk, const float* __restrict__ x,
                                           float* __restrict__ xs, u8* __restrict__ wb, const int lane,
                                           const int warp) {
    const int nk = min(32, n_chunk - c0);
    const float* xc = x + (i64)c0 * 32;
    if ((((unsigned long long)xc) & 15ull) == 0) {
        for (int t = threadIdx.x; t < nk * 8; t += 32 * WARPS)  // t = chunk * 8 + j
            cp_async16(xs + ((t & 7) * 32 + (t >> 3)) * 4, xc + 4 * t);
    } else {
        for (int t = threadIdx.x; t < nk * 32; t += 32 * WARPS)  // t = chunk * 32 + value
            cp_async4(xs + (((t & 31) >> 2) * 32 + (t >> 5)) * 4 + (t & 3), xc + t);
    }
    const int jb0 = c0 / CPB;
    const int nbytes = ((nk + CPB - 1) / CPB) * PB;
    for (int r = 0; r < nr; ++r) {
        const u8* src = payload + ((row0 + r) * nb + jb0) * PB;
        const int mis = (int)(((unsigned long long)src) & 3ull);  // 0 or 2 (block sizes are even)
        const u8* sa = src - mis;
        u8* dst = wb + r * ROW_STAGE;
        const int nw = (mis + nbytes) >> 2;
        for (int i = lane; i < nw; i += 32) cp_async4(dst + 4 * i, sa + 4 * i);
        if (((mis + nbytes) & 3) && lane == 0)  // a trailing half word
            *(u16*)(dst + 4 * nw) = *(const u16*)(sa + 4 * nw);
    }
    cp_async_commit();
}

__device__ __forceinline__ void warp_dot(const u8* __restrict__ base, const i64 rows, const int ne0, const i64 row0,
                                         const float* __restrict__ x, float* __restrict__ xs2, u8* __restrict__ wb2,
                                         const int lane, float* acc, const bool active) {
    const int nb = ne0 / QK;
    const int n_chunk = nb * CPB;
    const i64 n_blocks = rows * nb;
    const float* scales = (const float*)base;
    const u8* payload = base + n_blocks * NF * 4;
    const int nr = active ? (int)min((i64)RPW, rows - row0) : 0;
    const int warp = threadIdx.x >> 5;
    int mis[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        acc[r] = 0.0f;
        mis[r] = r < nr ? (int)(((unsigned long long)(payload + (row0 + r) * nb * PB)) & 3ull) : 0;
    }
    // buffer b: xs2 + b * 1024 floats, wb2 + b * (RPW * ROW_STAGE) bytes
    stage_step(payload, nb, row0, nr, 0, n_chunk, x, xs2, wb2, lane, warp);
    int b = 0;
    for (int c0 = 0; c0 < n_chunk; c0 += 32) {
        if (c0 + 32 < n_chunk) {
            stage_step(payload, nb, row0, nr, c0 + 32, n_chunk, x, xs2 + (b ^ 1) * 1024,
                       wb2 + (b ^ 1) * (RPW * ROW_STAGE), lane, warp);
            cp_async_wait_one();  // this step's group has landed (the next one may still fly)
        } else {
            cp_async_wait_all();
        }
        __syncthreads();  // every thread's copies of this step are visible
        const int c = c0 + lane;
        if (nr > 0 && c < n_chunk) {
            const float4* x4 = (const float4*)(xs2 + b * 1024) + lane;  // float4 j of this lane's chunk: x4[32 * j]
            const u8* wb = wb2 + b * (RPW * ROW_STAGE);
            const int jb0 = c0 / CPB;
            const int jl = c / CPB - jb0;
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                if (r >= nr) break;  // uniform across the warp
                const i64 blk = (row0 + r) * nb + jb0 + jl;
                float w[32];
                deq_chunk(scales + blk * NF, wb + r * ROW_STAGE + mis[r] + jl * PB, c % CPB, w);
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {  // s = s + w[i] * x[i], i = 0..31 in order (--fmad=false: no fma)
                    const float4 xv = x4[32 * j];
                    s = s + w[4 * j] * xv.x;
                    s = s + w[4 * j + 1] * xv.y;
                    s = s + w[4 * j + 2] * xv.z;
                    s = s + w[4 * j + 3] * xv.w;
                }
                acc[r] += s;
            }
        }
        __syncthreads();  // buffer b is refilled by the step after next
        b ^= 1;
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}
