// matvec / matvec_batched over the warp_dot of matvec_block.cu or matvec_plain.cu (WARPS, RPW and
// STAGE_BYTES come from there). Every warp calls warp_dot (the block types' version synchronises
// the CTA); a warp whose rows are past the end passes active = false.
// y[row] = dot(W[row, :], x); warp w of CTA b takes rows (b*WARPS + w)*RPW .. +RPW.
extern "C" __global__ void MV_BOUNDS matvec(const u8* __restrict__ base, const i64 rows, const int ne0,
                                  const float* __restrict__ x, float* __restrict__ y) {
    __shared__ __align__(16) float xs[2 * 1024];
    __shared__ __align__(16) u8 wb_all[WARPS][2 * RPW * ROW_STAGE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row0 = ((i64)blockIdx.x * WARPS + warp) * RPW;
    const bool active = row0 < rows;
    float acc[RPW];
    warp_dot(base, rows, ne0, row0, x, xs, wb_all[warp], lane, acc, active);
    if (active && lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) if (row0 + r < rows) y[row0 + r] = acc[r];
    }
}

// Y[item, row] = dot(W_item[row, :], X[item * x_stride + :]); W_item at bases[item] (engine form);
// an item whose base is 0 is skipped (its rows of Y are left as they are: an expert-cache miss,
// filled by the host). The whole CTA belongs to one item, so it leaves together.
extern "C" __global__ void MV_BOUNDS matvec_batched(const unsigned long long* __restrict__ bases, const i64 rows, const int ne0,
                                          const float* __restrict__ X, const i64 x_stride, float* __restrict__ Y) {
    __shared__ __align__(16) float xs[2 * 1024];
    __shared__ __align__(16) u8 wb_all[WARPS][2 * RPW * ROW_STAGE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row0 = ((i64)blockIdx.x * WARPS + warp) * RPW;
    const int item = blockIdx.y;
    if (bases[item] == 0ull) return;  // uniform across the CTA
    const bool active = row0 < rows;
    float acc[RPW];
    warp_dot((const u8*)(bases[item] & ~1ull), rows, ne0, row0, X + (i64)item * x_stride, xs, wb_all[warp], lane, acc, active);
    if (active && lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) if (row0 + r < rows) Y[(i64)item * rows + row0 + r] = acc[r];
    }
}

// Y_item = W_item @ x for up to 4 weights of ONE type and row length read by the same x (q, k and v
// of a layer; gate and up): one launch instead of one per weight. The weights' engine-form
// addresses b*, rows r* and output addresses o* are kernel parameters (by value: no device table);
// blockIdx.y = item. CTAs past an item's rows leave together.
extern "C" __global__ void MV_BOUNDS matvec_group(const unsigned long long b0, const unsigned long long b1,
                                                  const unsigned long long b2, const unsigned long long b3,
                                                  const i64 r0, const i64 r1, const i64 r2, const i64 r3,
                                                  const int ne0, const float* __restrict__ x,
                                                  const unsigned long long o0, const unsigned long long o1,
                                                  const unsigned long long o2, const unsigned long long o3) {
    __shared__ __align__(16) float xs[2 * 1024];
    __shared__ __align__(16) u8 wb_all[WARPS][2 * RPW * ROW_STAGE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int item = blockIdx.y;
    const unsigned long long base = item == 0 ? b0 : item == 1 ? b1 : item == 2 ? b2 : b3;
    const unsigned long long outp = item == 0 ? o0 : item == 1 ? o1 : item == 2 ? o2 : o3;
    const i64 n = item == 0 ? r0 : item == 1 ? r1 : item == 2 ? r2 : r3;
    if ((i64)blockIdx.x * WARPS * RPW >= n) return;  // uniform across the CTA
    const i64 row0 = ((i64)blockIdx.x * WARPS + warp) * RPW;
    const bool active = row0 < n;
    float acc[RPW];
    warp_dot((const u8*)base, n, ne0, row0, x, xs, wb_all[warp], lane, acc, active);
    float* y = (float*)outp;
    if (active && lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) if (row0 + r < n) y[row0 + r] = acc[r];
    }
}
