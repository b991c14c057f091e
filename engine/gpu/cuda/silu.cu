// silu_mul: out[i] = silu_mul1(g[i], u[i]) (silu.cuh, concatenated before this file with its constants).
extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ out, const long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = silu_mul1(g[i], u[i]);
}
