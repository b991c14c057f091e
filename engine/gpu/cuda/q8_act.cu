// Activation quantization of the GPU q8 kernels (strata.engine.gpu.kernels, q8 numerics): bit for bit
// engine/cpu_q8.c quantize_q8_0 / quantize_q8_K / act_quantize, into the layout of engine/q8_layout.h
// (concatenated before this file, after prelude.cuh). The rules (cpu_q8.c's header, after ggml-quants.c):
//   Q8_0 (fmt 1, blocks of 32): amax = max |x|; d = fp32(fp16(amax / 127)) (round to nearest even);
//        id = amax != 0 ? 127 / amax : 0 (from amax, not from the rounded d); q = round_half_even(x * id).
//   Q8_K (fmt 2, blocks of 256): mx = the x of largest |x|, the first on ties; iscale = -127 / mx;
//        q = min(127, nearest_int(iscale * x)) (1.5 * 2^23 added: half to even); d = 1 / iscale; an all-zero
//        block has d = 0, q = 0.
//   Either: a block holding a NaN or an infinity gets d = NaN and q = 0 (its products become NaN: a
//   non-finite activation stays visible). s = sums of q per 16 values, t = per 32 (integers: exact).
// Every f32 operation is one IEEE operation (the module is compiled with --fmad=false, --prec-div=true).
//
// Grid (ceil(n / 256), rows), 256 threads: thread i of CTA (bx, r) quantizes value bx * 256 + i of row r
// (x + r * x_stride floats) into out + r * out_stride bytes. fmt 1 takes one warp per block; fmt 2 one CTA
// per block (n % 256 == 0). n % 32 == 0: a warp past n leaves whole (fmt 1 never synchronises the CTA).
extern "C" __global__ void __launch_bounds__(256) quantize_q8(const float* __restrict__ x, const int n,
                                                              const i64 x_stride, const int fmt,
                                                              u8* __restrict__ out, const i64 out_stride) {
    __shared__ unsigned long long red[8];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int i = blockIdx.x * 256 + tid;
    const float* xr = x + (i64)blockIdx.y * x_stride;
    u8* o = out + (i64)blockIdx.y * out_stride;
    if (fmt == 1 && i - lane >= n) return;  // a whole warp past the end
    const float xv = xr[i];
    const float a = fabsf(xv);
    const int bad = !(a <= 3.40282347e38f);  // NaN or infinite
    float* d = (float*)(o + act_d_off(n));
    int v;
    if (fmt == 1) {
        float amax = a;
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
        if (__any_sync(0xffffffffu, bad)) {
            v = 0;
            if (lane == 0) d[i >> 5] = __int_as_float(0x7fc00000);
        } else {
            if (lane == 0) d[i >> 5] = h2f(f2h(amax / 127.0f));
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            v = __float2int_rn(xv * id);
        }
    } else {
        // the largest |x| and its first position: max of (bits of |x|) << 32 | (255 - position)
        unsigned long long key = bad ? 0ull : ((unsigned long long)__float_as_uint(a) << 32) | (u32)(255 - tid);
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            const unsigned long long k2 = __shfl_xor_sync(0xffffffffu, key, s);
            key = k2 > key ? k2 : key;
        }
        if (lane == 0) red[warp] = key;
        const int any_bad = __syncthreads_or(bad);
        key = red[0];
#pragma unroll
        for (int w = 1; w < 8; ++w) key = red[w] > key ? red[w] : key;
        const float amax = __uint_as_float((u32)(key >> 32));
        const i64 b = i >> 8;
        if (any_bad || amax == 0.0f) {
            v = 0;
            if (tid == 0) d[b] = any_bad ? __int_as_float(0x7fc00000) : 0.0f;
        } else {
            const float mx = xr[(i64)b * 256 + 255 - (int)(key & 0xffu)];
            const float iscale = -127.0f / mx;
            const float r = iscale * xv + 12582912.0f;  // two rounded operations (no FMA: --fmad=false)
            v = (int)(__float_as_uint(r) & 0x007fffffu) - 0x00400000;
            v = v < 127 ? v : 127;
            if (tid == 0) d[b] = 1.0f / iscale;
        }
    }
    ((i8*)o)[i] = (i8)v;
    int s16 = v;
#pragma unroll
    for (int s = 8; s > 0; s >>= 1) s16 += __shfl_xor_sync(0xffffffffu, s16, s);
    if ((lane & 15) == 0) ((i16*)(o + act_s_off(n)))[i >> 4] = (i16)s16;
    const int s32 = s16 + __shfl_xor_sync(0xffffffffu, s16, 16);
    if (lane == 0) ((i16*)(o + act_t_off(n)))[i >> 5] = (i16)s32;
}
