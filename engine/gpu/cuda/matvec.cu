// matvec / matvec_batched over the warp_dot of matvec_block.cu or matvec_plain.cu (WARPS, RPW and
// STAGE_BYTES come from there).
// y[row] = dot(W[row, :], x); warp w of CTA b takes rows (b*WARPS + w)*RPW .. +RPW.
extern "C" __global__ void matvec(const u8* __restrict__ base, const i64 rows, const int ne0,
                                  const float* __restrict__ x, float* __restrict__ y) {
    __shared__ float xs_all[WARPS][32 * 33];
    __shared__ __align__(16) u8 wb_all[WARPS][STAGE_BYTES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row0 = ((i64)blockIdx.x * WARPS + warp) * RPW;
    if (row0 >= rows) return;  // whole warp leaves together
    float acc[RPW];
    warp_dot(base, rows, ne0, row0, x, xs_all[warp], wb_all[warp], lane, acc);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) if (row0 + r < rows) y[row0 + r] = acc[r];
    }
}

// Y[item, row] = dot(W_item[row, :], X[item * x_stride + :]); W_item at bases[item] (engine form);
// an item whose base is 0 is skipped (its rows of Y are left as they are: an expert-cache miss,
// filled by the host).
extern "C" __global__ void matvec_batched(const unsigned long long* __restrict__ bases, const i64 rows, const int ne0,
                                          const float* __restrict__ X, const i64 x_stride, float* __restrict__ Y) {
    __shared__ float xs_all[WARPS][32 * 33];
    __shared__ __align__(16) u8 wb_all[WARPS][STAGE_BYTES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row0 = ((i64)blockIdx.x * WARPS + warp) * RPW;
    const int item = blockIdx.y;
    if (row0 >= rows || bases[item] == 0ull) return;
    float acc[RPW];
    warp_dot((const u8*)bases[item], rows, ne0, row0, X + (i64)item * x_stride, xs_all[warp], wb_all[warp], lane, acc);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) if (row0 + r < rows) Y[(i64)item * rows + row0 + r] = acc[r];
    }
}
