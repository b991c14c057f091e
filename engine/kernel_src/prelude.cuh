// Shared prelude of every CUDA module of strata.engine.gpu and of the CPU kernels (kernel_src/assembly.py,
// gpu/kernels.py and gpu/fused_ops.py concatenate the files; nothing is #included): integer typedefs,
// unaligned little-endian loads, fp16 -> f32 with its host twin (tests/test_gpu_kernel_source.py
// compiles the per-type code with g++), and the K-quant 6-bit scale helper.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef long long i64;

// Little-endian loads at any byte alignment (native blocks of 66/98/110/210 bytes are only
// 2-byte aligned).
__device__ __forceinline__ u32 ld16(const u8* p) { return (u32)p[0] | ((u32)p[1] << 8); }
__device__ __forceinline__ u32 ld32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
// n (16 or 32) consecutive bytes p[0..n) as little-endian words w[0..n/4): byte i is
// byte_of(w, i). Word loads when p is 4-aligned, half-word loads when 2-aligned, byte loads
// otherwise - the same bytes either way, fewer load instructions (the matvec kernels read staged
// blocks from shared memory, where a byte load costs as much as a word load); w stays in
// registers once the caller's loops are unrolled.
__device__ __forceinline__ u32 ld32_aligned(const u8* p) {
#ifdef __CUDA_ARCH__
    return *(const u32*)p;
#else
    u32 v;
    __builtin_memcpy(&v, p, 4);
    return v;
#endif
}
__device__ __forceinline__ u32 ld16_aligned(const u8* p) {
#ifdef __CUDA_ARCH__
    return (u32)*(const u16*)p;
#else
    u16 v;
    __builtin_memcpy(&v, p, 2);
    return (u32)v;
#endif
}
#ifdef __CUDA_ARCH__
// On the device without a branch on the alignment (lanes whose chunks differ in alignment - 210-byte Q6_K
// blocks - would run every branch): the aligned words around p, funnel-shifted by p's byte offset. The word past
// the last is read only when p is not aligned (its bytes are then inside the buffer: the blocks are contiguous).
__device__ __forceinline__ void load_words(const u8* __restrict__ p, u32* w, const int n) {
    const u32* a = (const u32*)(((unsigned long long)p) & ~3ull);
    const u32 sh = 8u * (u32)(((unsigned long long)p) & 3ull);
    u32 prev = a[0];
#pragma unroll
    for (int i = 0; i < n / 4; ++i) {
        const u32 nxt = (i + 1 < n / 4 || sh) ? a[i + 1] : 0u;
        w[i] = __funnelshift_r(prev, nxt, sh);
        prev = nxt;
    }
}
#else
__device__ __forceinline__ void load_words(const u8* __restrict__ p, u32* w, const int n) {
    if ((((unsigned long long)p) & 3ull) == 0) {
#pragma unroll
        for (int i = 0; i < n / 4; ++i) w[i] = ld32_aligned(p + 4 * i);
    } else if ((((unsigned long long)p) & 1ull) == 0) {
#pragma unroll
        for (int i = 0; i < n / 4; ++i) w[i] = ld16_aligned(p + 4 * i) | (ld16_aligned(p + 4 * i + 2) << 16);
    } else {
#pragma unroll
        for (int i = 0; i < n / 4; ++i) w[i] = ld32(p + 4 * i);
    }
}
#endif
// load_words for an address whose alignment (mod 16 when n is a multiple of 16, mod 8 otherwise) is THE SAME ON EVERY
// LANE of the warp - blocks whose size is a multiple of 16 bytes (Q4_K's 144, Q5_K's 176) or of 8 in a plane that is,
// and the q8 activation's 64-byte aligned planes: 128-bit loads when n is a multiple of 16 and p 16-aligned, 64-bit
// when p is 8-aligned, else load_words - the same words either way (n: 8 or a multiple of 8). Why: a lane reading 16
// contiguous bytes as 4 word loads makes 4 requests in which the warp's lanes, 16 bytes apart, each touch their own
// sector, so the decode step's expert products were bound by L1 wavefronts, not DRAM (ncu,
// bench/results/h200-2026-12-02e-ncu-sections.txt: L1/TEX 86%, DRAM 15%); one 128-bit load reads them in one request.
__device__ __forceinline__ void load_words_v(const u8* __restrict__ p, u32* w, const int n) {
#ifdef __CUDA_ARCH__
    const unsigned long long a = (unsigned long long)p;
    if (n % 16 == 0 && (a & 15ull) == 0) {
#pragma unroll
        for (int i = 0; i < n / 4; i += 4) {
            const uint4 v = *(const uint4*)(p + 4 * i);
            w[i] = v.x;
            w[i + 1] = v.y;
            w[i + 2] = v.z;
            w[i + 3] = v.w;
        }
    } else if ((a & 7ull) == 0) {
#pragma unroll
        for (int i = 0; i < n / 4; i += 2) {
            const uint2 v = *(const uint2*)(p + 4 * i);
            w[i] = v.x;
            w[i + 1] = v.y;
        }
    } else {
        load_words(p, w, n);
    }
#else
    load_words(p, w, n);
#endif
}
#define byte_of(w, i) ((int)(((w)[(i) >> 2] >> (8 * ((i) & 3))) & 255u))
// IEEE fp16 -> f32, exact for every finite pattern (subnormals included). On the device the
// hardware conversion (cvt.f32.f16); the software version is its host twin for the CPU check.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float h2f(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
#else
__device__ __forceinline__ float h2f(u32 h) {
    const u32 sign = (h & 0x8000u) << 16;
    const u32 ex = (h >> 10) & 0x1fu;
    const u32 man = h & 0x3ffu;
    if (ex == 0) {
        const float f = (float)man * 5.9604644775390625e-08f;  // man * 2^-24, exact
        return sign ? -f : f;
    }
    if (ex == 31) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    return __uint_as_float(sign | ((ex + 112u) << 23) | (man << 13));
}
#endif
#ifdef __CUDA_ARCH__
// f32 -> fp16 bits, round to nearest even (IEEE, overflow to inf): numpy's astype(float16), F16C's _cvtss_sh(x, 0).
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif
// c + the sum of the four products of the signed bytes of a and b (exact int32): the DP4A instruction on the
// device; its host twin for the CPU check of the q8 kernels' source.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ int dp4a(int a, int b, int c) { return __dp4a(a, b, c); }
#else
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(i8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    return c;
}
#endif
// An int v with |v| < 2^22 as f32: exactly (float)v. On the device through 1.5 * 2^23 (0x4B400000): adding v to
// that float's bit pattern gives the float 12582912 + v (the mantissa stays in range, ulp 1), and subtracting
// 12582912.0f leaves v, both steps exact - an integer add and an f32 subtract instead of the I2F conversion,
// which Hopper issues at 16 per clock per SM (CUDA C++ Programming Guide, arithmetic instruction throughput)
// against 64-128 for the integer and f32 ops. On the host (and with STRATA_PLAIN_I2F, for benchmarks) the plain
// conversion: the same value.
// u2f: the same for an unsigned v < 2^23 through 2^23 (0x4B000000): an OR the compiler merges with the mask
// that extracted v (one LOP3), then the exact subtract.
#if defined(__CUDA_ARCH__) && !defined(STRATA_PLAIN_I2F)
__device__ __forceinline__ float i2f(int v) { return __int_as_float(0x4B400000 + v) - 12582912.0f; }
__device__ __forceinline__ float u2f(u32 v) { return __uint_as_float(0x4B000000u | v) - 8388608.0f; }
#else
__device__ __forceinline__ float i2f(int v) { return (float)v; }
__device__ __forceinline__ float u2f(u32 v) { return (float)v; }
#endif
// Byte i (0..11) of the 12 bytes in s[0..3) for a run-time i, in registers (indexing a register array by a
// run-time index would put it in local memory).
__device__ __forceinline__ int byte12(const u32* s, const int i) {
    const unsigned long long lo = (unsigned long long)s[0] | ((unsigned long long)s[1] << 32);
    return (int)(i < 8 ? (lo >> (8 * (i & 7))) & 255u : (s[2] >> (8 * (i & 3))) & 255u);
}
// scale_min_k4 of the scales[12] bytes held as 3 little-endian words (the q8 kernels' run-time g).
__device__ __forceinline__ void scale_min_k4_words(const u32* s, int g, int* scv, int* mv) {
    if (g < 4) { *scv = byte12(s, g) & 63; *mv = byte12(s, g + 4) & 63; }
    else {
        *scv = (byte12(s, g + 4) & 15) | ((byte12(s, g - 4) >> 2) & 0x30);
        *mv = (byte12(s, g + 4) >> 4) | ((byte12(s, g) >> 2) & 0x30);
    }
}
// Q4_K / Q5_K 6-bit scale and min of sub-block g (ggml-quants.c get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(const u8* s, int g, int* scv, int* mv) {
    if (g < 4) { *scv = s[g] & 63; *mv = s[g + 4] & 63; }
    else { *scv = (s[g + 4] & 15) | ((s[g - 4] >> 2) & 0x30); *mv = (s[g + 4] >> 4) | ((s[g] >> 2) & 0x30); }
}
