// Activation quantization of the GPU q8 kernels (strata.engine.gpu.kernels, q8 numerics): bit for bit
// engine/cpu/cpu_q8.c quantize_q8_0 / quantize_q8_K / act_quantize, into the layout of engine/kernel_src/q8_layout.h
// (concatenated before this file, after prelude.cuh, with q8_quant.cuh's warp functions). The rules (cpu_q8.c's
// header, after ggml-quants.c):
//   Q8_0 (fmt 1, blocks of 32): amax = max |x|; d = fp32(fp16(amax / 127)) (round to nearest even);
//        id = amax != 0 ? 127 / amax : 0 (from amax, not from the rounded d); q = round_half_even(x * id).
//   Q8_K (fmt 2, blocks of 256): mx = the x of largest |x|, the first on ties; iscale = -127 / mx;
//        q = min(127, nearest_int(iscale * x)) (1.5 * 2^23 added: half to even); d = 1 / iscale; an all-zero
//        block has d = 0, q = 0.
//   Either: a block holding a NaN or an infinity gets d = NaN and q = 0 (its products become NaN: a
//   non-finite activation stays visible). s = sums of q per 16 values, t = per 32 (integers: exact).
// Every f32 operation is one IEEE operation (the module is compiled with --fmad=false, --prec-div=true).
//
// Grid (ceil(blocks / 8), rows), 256 threads: warp w of CTA (bx, r) quantizes block bx * 8 + w of row r
// (x + r * x_stride floats) into out + r * out_stride bytes; blocks = n / 32 (fmt 1) or n / 256 (fmt 2).
// With g (and u): the row is made first, x[i] = silu_mul1(g[i], u[i]) (silu.cuh; g, u rows x_stride floats apart
// too), each lane making the values it quantizes - silu_mul and quantize_q8 in one launch, the same bits.
extern "C" __global__ void __launch_bounds__(256) quantize_q8(float* __restrict__ x, const int n,
                                                              const i64 x_stride, const int fmt,
                                                              u8* __restrict__ out, const i64 out_stride,
                                                              const float* __restrict__ g,
                                                              const float* __restrict__ u) {
    const int lane = threadIdx.x & 31;
    const int b = blockIdx.x * 8 + (threadIdx.x >> 5);
    float* xr = x + (i64)blockIdx.y * x_stride;
    u8* o = out + (i64)blockIdx.y * out_stride;
    const bool on = fmt == 1 ? b < n / 32 : b < n / 256;
    if (!on) return;  // whole warp
    if (g) {
        const float* gr = g + (i64)blockIdx.y * x_stride;
        const float* ur = u + (i64)blockIdx.y * x_stride;
        if (fmt == 1) {
            const int i = 32 * b + lane;
            xr[i] = silu_mul1(gr[i], ur[i]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const i64 i = 256 * (i64)b + 8 * lane + j;
                xr[i] = silu_mul1(gr[i], ur[i]);
            }
        }
        __syncwarp();  // the block's values, written by every lane, visible to the warp (the Q8_K maximum reads any)
    }
    if (fmt == 1) q8_quant_block32(xr, o, n, b, lane);
    else q8_quant_block256(xr, o, n, b, lane);
}
