// silu_mul: out = (g / (1 + exp_portable(-g))) * u, the exact op sequence of
// strata.engine.gpu.reference.silu_mul. kernels.py prepends the constants LO, HI, LOG2E, HALF,
// LN2_HI, LN2_LO, C2..C7, ONE as #defines of their f32 bits, generated from
// strata.engine.gpu.reference.EXP_CONSTANTS (one definition for the device and the NumPy replica).
extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ out, const long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gi = g[i];
    float t = fminf(fmaxf(-gi, LO), HI);
    const float nf = floorf(t * LOG2E + HALF);
    const float r = (t - nf * LN2_HI) - nf * LN2_LO;
    float p = r * C7;
    p = p + C6; p = p * r;
    p = p + C5; p = p * r;
    p = p + C4; p = p * r;
    p = p + C3; p = p * r;
    p = p + C2; p = p * r;
    p = p + ONE; p = p * r;
    p = p + ONE;
    const float e = p * __uint_as_float((unsigned)((int)nf + 127) << 23);
    out[i] = (gi / (ONE + e)) * u[i];
}
