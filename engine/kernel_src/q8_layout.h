// The quantized activation vector of strata's q8 kernels, ONE layout for the CPU (engine/cpu/cpu_q8.c) and the GPU
// (engine/gpu/cuda/q8_act.cu, matvec_q8.cu): concatenated first by strata.engine.kernel_src.assembly.q8_layout_source
// (Q8_FN = static inline for the CPU, __device__ __forceinline__ for the GPU). For n values (n % 32 == 0):
//   int8  q[n]         at 0                the quantized values
//   f32   d[n / 32]    at act_d_off(n)     block scales (Q8_0: one per 32 values; Q8_K: one per 256, the rest unused)
//   int16 s[n / 16]    at act_s_off(n)     sums of q per 16 values (ggml's Q8_K bsums)
//   int16 t[n / 32]    at act_t_off(n)     sums of q per 32 values (|t| <= 4064)
// each plane at a 64-byte aligned offset; act_nbytes(n) bytes in all (strata.layout.step.q8_act_bytes is the
// same number for the VRAM plan; tests/test_engine_cpu_q8.py checks that the two agree).
Q8_FN i64 act_d_off(int n) { return ((i64)n + 63) & ~(i64)63; }
Q8_FN i64 act_s_off(int n) { return act_d_off(n) + ((((i64)n / 32) * 4 + 63) & ~(i64)63); }
Q8_FN i64 act_t_off(int n) { return act_s_off(n) + ((((i64)n / 16) * 2 + 63) & ~(i64)63); }
Q8_FN i64 act_nbytes_of(int n) { return act_t_off(n) + ((((i64)n / 32) * 2 + 63) & ~(i64)63); }
