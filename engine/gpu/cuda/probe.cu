// The start-up probe of the host tier's link as the decode kernels use it (strata.engine.gpu.miss_split): threads
// reading pinned, mapped host memory through its device address, 16 bytes a load, four loads in flight a thread - the
// reads the batched expert matvecs make of a miss in the host tier (zero-copy over PCIe), without their arithmetic.
// The words are folded into one value (atomicXor), so no load can be dropped.

extern "C" __global__ void read_mapped(const uint4* __restrict__ p, long long n, unsigned int* __restrict__ out) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = p[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    atomicXor(out, acc);
}
