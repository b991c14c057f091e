// silu_mul1(g, u) = (g / (1 + exp_portable(-g))) * u, the exact op sequence of strata.engine.gpu.reference.silu_mul.
// kernels.silu_defines() prepends the constants LO, HI, LOG2E, HALF, LN2_HI, LN2_LO, C2..C7, ONE as #defines of their
// f32 bits, generated from strata.engine.gpu.reference.EXP_CONSTANTS (one definition for the device and the NumPy
// replica). Used by silu.cu's silu_mul and by q8_act.cu's quantize_q8 (the experts' down input made and quantized in
// one launch).
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
