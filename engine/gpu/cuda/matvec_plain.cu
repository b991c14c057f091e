// Kernels of the plain types (F32, F16, BF16): dequant, and warp_dot for matvec.cu. Concatenated
// after prelude.cuh and types/<TYPE>.cuh, which defines
//   load_w(const u8* b, i64 i) -> float: value i of the tensor.
#define WARPS 4
extern "C" __global__ void dequant(const u8* __restrict__ base, const i64 n, float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = load_w(base, i);
}

// Values [i0, i0 + cnt) of n tensors of one plain type and shape as f32 (gpu/chunk.py): tensor
// blockIdx.y at bases[blockIdx.y], its values to out + blockIdx.y * out_stride; each equals dequant's.
extern "C" __global__ void dequant_many(const unsigned long long* __restrict__ bases, const i64 n, const i64 i0,
                                        const i64 cnt, float* __restrict__ out, const i64 out_stride) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < cnt) out[(i64)blockIdx.y * out_stride + i] = load_w((const u8*)bases[blockIdx.y], i0 + i);
}

// acc[r] = dot(W[row0 + r, :], x): lane l takes elements l, l+32, ... (acc = acc + w * x), then
// the same xor butterfly as the block types.
#define STAGE_BYTES 16
#define ROW_STAGE 16
__device__ __forceinline__ void warp_dot(const u8* __restrict__ base, const i64 rows, const int ne0, const i64 row0,
                                         const float* __restrict__ x, float* __restrict__ xs, u8* __restrict__ wb,
                                         const int lane, float* acc, const bool active) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        float a = 0.0f;
        const i64 row = row0 + r;
        if (active && row < rows) {
            const i64 r0 = row * ne0;
            for (int i = lane; i < ne0; i += 32) a = a + load_w(base, r0 + i) * x[i];
        }
        acc[r] = a;
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}
