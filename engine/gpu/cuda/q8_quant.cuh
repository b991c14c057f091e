// The q8 kernels' activation quantization as warp-level device functions: bit for bit engine/cpu/cpu_q8.c
// quantize_q8_0 / quantize_q8_K / act_quantize (the rules are in q8_act.cu's header), into engine/kernel_src/q8_layout.h's
// layout at o (a vector of n values). Used by q8_act.cu's quantize_q8 and by fused.cu's resid_norm (the normed row
// quantized where it is made). Every lane of the warp calls them (shuffles); the warp owns block b.

// Q8_0 block b (values 32b .. 32b + 31 of x): one value per lane.
__device__ __forceinline__ void q8_quant_block32(const float* __restrict__ x, u8* __restrict__ o, const int n,
                                                 const int b, const int lane) {
    const float xv = x[32 * b + lane];
    const float a = fabsf(xv);
    const int bad = !(a <= 3.40282347e38f);  // NaN or infinite
    float amax = a;
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
    float* d = (float*)(o + act_d_off(n));
    int v;
    if (__any_sync(0xffffffffu, bad)) {
        v = 0;
        if (lane == 0) d[b] = __int_as_float(0x7fc00000);
    } else {
        if (lane == 0) d[b] = h2f(f2h(amax / 127.0f));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        v = __float2int_rn(xv * id);
    }
    ((i8*)o)[32 * b + lane] = (i8)v;
    int s16 = v;
#pragma unroll
    for (int s = 8; s > 0; s >>= 1) s16 += __shfl_xor_sync(0xffffffffu, s16, s);
    if ((lane & 15) == 0) ((i16*)(o + act_s_off(n)))[2 * b + (lane >> 4)] = (i16)s16;
    const int s32 = s16 + __shfl_xor_sync(0xffffffffu, s16, 16);
    if (lane == 0) ((i16*)(o + act_t_off(n)))[b] = (i16)s32;
}

// Q8_K block b (values 256b .. 256b + 255 of x): lane l takes values 8l .. 8l + 7. The largest |x| and its FIRST
// position: each lane's first maximum (strict >), then the warp's maximum of (bits of |x|) << 32 | (255 - position).
__device__ __forceinline__ void q8_quant_block256(const float* __restrict__ x, u8* __restrict__ o, const int n,
                                                  const int b, const int lane) {
    const float* xb = x + 256 * (i64)b + 8 * lane;
    float xv[8];
    float best = 0.0f;
    int idx = 8 * lane, bad = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        xv[j] = xb[j];
        const float a = fabsf(xv[j]);
        if (a > best) { best = a; idx = 8 * lane + j; }
        bad |= !(a <= 3.40282347e38f);
    }
    unsigned long long key = ((unsigned long long)__float_as_uint(best) << 32) | (u32)(255 - idx);
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        const unsigned long long k2 = __shfl_xor_sync(0xffffffffu, key, s);
        key = k2 > key ? k2 : key;
    }
    const int any_bad = __any_sync(0xffffffffu, bad);
    const float amax = __uint_as_float((u32)(key >> 32));
    float* d = (float*)(o + act_d_off(n));
    int q[8];
    if (any_bad || amax == 0.0f) {
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = 0;
        if (lane == 0) d[b] = any_bad ? __int_as_float(0x7fc00000) : 0.0f;
    } else {
        const float mx = x[256 * (i64)b + 255 - (int)(key & 0xffu)];
        const float iscale = -127.0f / mx;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float r = iscale * xv[j] + 12582912.0f;  // two rounded operations (no FMA: --fmad=false)
            const int v = (int)(__float_as_uint(r) & 0x007fffffu) - 0x00400000;
            q[j] = v < 127 ? v : 127;
        }
        if (lane == 0) d[b] = 1.0f / iscale;
    }
    u32 w0 = 0, w1 = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        w0 |= (u32)(u8)(i8)q[j] << (8 * j);
        w1 |= (u32)(u8)(i8)q[4 + j] << (8 * j);
    }
    u32* qo = (u32*)(o + 256 * (i64)b + 8 * lane);  // 8-byte aligned: the layout's planes are 64-byte aligned
    qo[0] = w0;
    qo[1] = w1;
    const int s8 = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
    const int s16 = s8 + __shfl_xor_sync(0xffffffffu, s8, 1);
    if ((lane & 1) == 0) ((i16*)(o + act_s_off(n)))[16 * b + (lane >> 1)] = (i16)s16;
    const int s32 = s16 + __shfl_xor_sync(0xffffffffu, s16, 2);
    if ((lane & 3) == 0) ((i16*)(o + act_t_off(n)))[8 * b + (lane >> 2)] = (i16)s32;
}
