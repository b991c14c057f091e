// silu_mul1(g, u) = (g / (1 + exp_portable(-g))) * u, the exact op sequence of strata.engine.gpu.reference.silu_mul.
// assembly.silu_defines() prepends the constants LO, HI, LOG2E, HALF, LN2_HI, LN2_LO, C2..C7, ONE as #defines of
// their f32 bits, generated from strata.engine.kernel_src.assembly.EXP_CONSTANTS (one definition for the GPU, the CPU
// and the NumPy replica). Used by engine/gpu/cuda/silu.cu's silu_mul, q8_act.cu's quantize_q8 (the experts' down
// input made and quantized in one launch) and the CPU kernels' silu_mul_row (engine/cpu/cpu_q8.c).
__device__ __forceinline__ float silu_mul1(const float gi, const float ui) {
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
    return (gi / (ONE + e)) * ui;
}
