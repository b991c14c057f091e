"""CuPy kernels over engine form: dequantization and matrix-vector products per ggml type.

Every kernel reads the layout defined once in :mod:`strata.engine.engine_form`:

- widened types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q1_0, Q2_0): ``const float* scales`` (plane
  at byte 0, ``n_fields`` per block) and the payload plane at byte ``4 * n_fields * n_blocks``;
- K-quants and IQ grid types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ4_XS):
  native blocks, fp16 super-scales converted in the kernel (exact);
- F32, F16, BF16 (BF16 = the pool's F32-from-BF16 re-rounded; ``u16 << 16`` is exact).

**Bit-exactness.** Each type's ``deq_chunk`` produces 32 consecutive values of a block with the
same IEEE f32 operations, in the same order, as ``gguf.quants.dequantize`` (gguf 0.19.0, which
mirrors ``dequantize_row_*`` in ggml-quants.c; FORMATS.md section 5), e.g. Q4_K
``(d*sc)*q - (dmin*m)``, IQ2_XXS ``((d*(0.5+s))*0.25)*grid`` then the sign. The modules are
compiled with ``--fmad=false`` (NVRTC would otherwise contract ``a*b - c`` into an FMA; NumPy
never fuses) and ``--ftz=false`` (IEEE subnormals; CuPy's own compile path forces FTZ, hence
:func:`_load_module`); with that the GPU output equals gguf-py's bit for bit
(tests/test_gpu_kernels.py, proven on an H200 for every type here).
The grids and sign table come from gguf-py (``IQ2_XXS.grid``, ``IQ2_XXS.ksigns``,
``IQ4_NL.kvalues``, ``IQ2_S.grid``), byte-identical to ggml's ``ggml-common.h`` tables (FORMATS.md
section 1). Q1_0 and Q2_0, which gguf-py 0.19.0 lacks, equal :mod:`strata.engine.dequant`'s NumPy
definitions (ggml-quants.c ``dequantize_row_q1_0`` / ``_q2_0``) bit for bit instead.

**Matrix-vector product** ``y = W x`` for a row-major weight ``[rows, ne0]`` (ggml ``ne =
(ne0, rows)``) and f32 ``x``: one warp per ``RPW`` rows; lane ``k`` takes the row's 32-value
chunks ``k, k+32, ...`` in ascending order, dequantizes each chunk exactly as above, computes
``s = s + w[i] * x[i]`` for ``i = 0..31`` (a rounded product, then a rounded sum: no FMA), adds
``s`` to its partial sum, and the warp combines the 32 partials with a fixed xor butterfly
(16, 8, 4, 2, 1); plain types do the same per element (lane ``k`` takes elements ``k, k+32, ...``).
Every operation is a single IEEE f32 operation in a fixed order, so
:func:`strata.engine.gpu.reference.matvec` replays it in NumPy BIT FOR BIT: that is how the
CPU side of the hybrid path (expert misses) agrees exactly with the GPU side (hits). Error bound
per output (Higham, gamma_k): ``|y - y_exact| <= k * u * sum|w x|``, ``u = 2**-24``, depth
``k = 33 + ceil(n_chunks / 32) + 5`` (:func:`matvec_error_depth`).

``matvec_batched`` runs the same product for several weights at once (an array of device
pointers: e.g. the routed experts found in cache slots), one ``x`` row per item or one ``x`` for
all (``x_stride = 0``).

CuPy is imported lazily: importing this module without CuPy works; :func:`gpu_available` says
why kernels cannot run.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from strata.packer import quants

__all__ = [
    "SUPPORTED_TYPES", "gpu_available", "kernels_for", "dequantize", "matvec", "matvec_batched", "silu_mul",
    "matvec_error_depth", "source_for", "NVRTC_OPTIONS",
]

#: NVRTC options for every module: no FMA contraction, IEEE subnormals, IEEE division (bit-exact
#: with NumPy). ``cupy.RawModule(code=...)`` appends ``-ftz=true`` after the caller's options
#: (measured on the H200: a subnormal ``silu_mul`` result flushed to 0), so :func:`_load_module`
#: compiles with NVRTC itself (cuda-python) and hands CuPy the PTX.
NVRTC_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "-std=c++17")

#: How the kernels were compiled in this process: "nvrtc" (IEEE, the options above) or
#: "cupy-ftz" (fallback without cuda-python: subnormal results flush to zero, so the NumPy
#: replicas can differ from the device for results below 2**-126).
COMPILE_MODE: str | None = None

#: Warps per CTA and rows per warp of the matvec kernels (``WARPS`` / ``RPW`` in the source).
WARPS_PER_CTA = 4
ROWS_PER_WARP = 2
ROWS_PER_CTA = WARPS_PER_CTA * ROWS_PER_WARP

_COMMON = r"""
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// Little-endian loads at any byte alignment (native blocks of 66/98/110/210 bytes are only
// 2-byte aligned).
__device__ __forceinline__ u32 ld16(const u8* p) { return (u32)p[0] | ((u32)p[1] << 8); }
__device__ __forceinline__ u32 ld32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
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
// Q4_K / Q5_K 6-bit scale and min of sub-block g (ggml-quants.c get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(const u8* s, int g, int* scv, int* mv) {
    if (g < 4) { *scv = s[g] & 63; *mv = s[g + 4] & 63; }
    else { *scv = (s[g + 4] & 15) | ((s[g - 4] >> 2) & 0x30); *mv = (s[g + 4] >> 4) | ((s[g] >> 2) & 0x30); }
}
"""

# ---------------------------------------------------------------- per-type device code
# Each defines QK (block elems), NF (f32 scales per block in the scale plane; 0 = native),
# PB (payload bytes per block, or native block bytes) and
#   deq_chunk(const float* sc, const u8* q, int sub, float* y)
# writing values [32*sub, 32*sub+32) of the block (sc = this block's scales, q = its payload).

_DEQ: dict[str, str] = {}

_DEQ["Q4_0"] = r"""
#define QK 32
#define NF 1
#define PB 16
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = d * (float)((int)(q[j] & 15) - 8);
        y[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
    }
}
"""

_DEQ["Q4_1"] = r"""
#define QK 32
#define NF 2
#define PB 16
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0], m = sc[1];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = d * (float)(q[j] & 15) + m;
        y[j + 16] = d * (float)(q[j] >> 4) + m;
    }
}
"""

_DEQ["Q5_0"] = r"""
#define QK 32
#define NF 1
#define PB 20
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
    const u32 qh = ld32(q);
    const u8* qs = q + 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int lo = (int)((qs[j] & 15) | (((qh >> j) & 1u) << 4));
        const int hi = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
        y[j] = d * (float)(lo - 16);
        y[j + 16] = d * (float)(hi - 16);
    }
}
"""

_DEQ["Q5_1"] = r"""
#define QK 32
#define NF 2
#define PB 20
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0], m = sc[1];
    const u32 qh = ld32(q);
    const u8* qs = q + 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const u32 lo = (qs[j] & 15) | (((qh >> j) & 1u) << 4);
        const u32 hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * (float)lo + m;
        y[j + 16] = d * (float)hi + m;
    }
}
"""

_DEQ["Q8_0"] = r"""
#define QK 32
#define NF 1
#define PB 32
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
#pragma unroll
    for (int j = 0; j < 32; ++j) y[j] = (float)(int)(i8)q[j] * d;
}
"""

_DEQ["IQ4_NL"] = r"""
#define QK 32
#define NF 1
#define PB 16
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = d * (float)kvalues_iq4nl[q[j] & 15];
        y[j + 16] = d * (float)kvalues_iq4nl[q[j] >> 4];
    }
}
"""

_DEQ["Q2_K"] = r"""
#define QK 256
#define NF 0
#define PB 84
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const u8* scales = q;
    const u8* qs = q + 16;
    const float d = h2f(ld16(q + 80)), dmin = h2f(ld16(q + 82));
    const int h = sub >> 2, sh = 2 * (sub & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s = 2 * sub + half;
        const float dl = d * (float)(scales[s] & 15);
        const float ml = dmin * (float)(scales[s] >> 4);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int ll = 16 * half + l;
            y[ll] = dl * (float)((qs[32 * h + ll] >> sh) & 3) - ml;
        }
    }
}
"""

_DEQ["Q3_K"] = r"""
#define QK 256
#define NF 0
#define PB 110
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const u8* hm = q;
    const u8* qs = q + 32;
    const u8* scales = q + 96;
    const float d = h2f(ld16(q + 108));
    const int h = sub >> 2, sh = 2 * (sub & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s = 2 * sub + half;
        const int low = s < 8 ? (scales[s] & 15) : (scales[s - 8] >> 4);
        const int high = (scales[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
        const float dl = d * (float)((low | (high << 4)) - 32);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int ll = 16 * half + l;
            const int ql = (qs[32 * h + ll] >> sh) & 3;
            const int hb = (hm[ll] >> sub) & 1;
            y[ll] = dl * (float)(ql - ((hb ^ 1) << 2));
        }
    }
}
"""

_DEQ["Q4_K"] = r"""
#define QK 256
#define NF 0
#define PB 144
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q)), dmin = h2f(ld16(q + 2));
    const u8* s = q + 4;
    const u8* qs = q + 16;
    const int g = sub;
    int scv, mv;
    scale_min_k4(s, g, &scv, &mv);
    const float D = d * (float)scv;
    const float DM = dmin * (float)mv;
    const u8* qq = qs + 32 * (g >> 1);
    const int sh = 4 * (g & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = D * (float)((qq[l] >> sh) & 15) - DM;
}
"""

_DEQ["Q5_K"] = r"""
#define QK 256
#define NF 0
#define PB 176
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q)), dmin = h2f(ld16(q + 2));
    const u8* s = q + 4;
    const u8* qh = q + 16;
    const u8* qs = q + 48;
    const int g = sub;
    int scv, mv;
    scale_min_k4(s, g, &scv, &mv);
    const float D = d * (float)scv;
    const float DM = dmin * (float)mv;
    const u8* qq = qs + 32 * (g >> 1);
    const int sh = 4 * (g & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int v = ((qq[l] >> sh) & 15) | (((qh[l] >> g) & 1) << 4);
        y[l] = D * (float)v - DM;
    }
}
"""

_DEQ["Q6_K"] = r"""
#define QK 256
#define NF 0
#define PB 210
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const u8* ql = q;
    const u8* qh = q + 128;
    const i8* scs = (const i8*)(q + 192);
    const float d = h2f(ld16(q + 208));
    const int h = sub >> 2, k = sub & 3;
    const u8* lq = ql + 64 * h + 32 * (k & 1);
    const int lsh = 4 * (k >> 1);
    const u8* hq = qh + 32 * h;
    const int hsh = 2 * k;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float D = d * (float)(int)scs[2 * sub + half];
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int ll = 16 * half + l;
            const int v = ((lq[ll] >> lsh) & 15) | (((hq[ll] >> hsh) & 3) << 4);
            y[ll] = D * (float)(v - 32);
        }
    }
}
"""

_DEQ["IQ2_XXS"] = r"""
#define QK 256
#define NF 0
#define PB 66
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u8* p = q + 2 + 8 * sub;
    const u32 a0 = ld32(p), a1 = ld32(p + 4);
    float db = d * (0.5f + (float)(a1 >> 28));
    db = db * 0.25f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u8* g = iq2xxs_grid + 8 * ((a0 >> (8 * l)) & 255u);
        const u32 sg = ksigns_iq2xs[(a1 >> (7 * l)) & 127u];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float v = db * (float)g[j];
            y[8 * l + j] = ((sg >> j) & 1u) ? -v : v;
        }
    }
}
"""

_DEQ["IQ2_XS"] = r"""
#define QK 256
#define NF 0
#define PB 74
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u8* qs = q + 2;
    const u8* scales = q + 66;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s = 2 * sub + half;
        const int scv = (scales[s >> 1] >> (4 * (s & 1))) & 15;
        float db = d * (0.5f + (float)scv);
        db = db * 0.25f;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const u32 v = ld16(qs + 2 * (2 * s + m));
            const u8* g = iq2xs_grid + 8 * (v & 511u);
            const u32 sg = ksigns_iq2xs[v >> 9];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float w = db * (float)g[j];
                y[16 * half + 8 * m + j] = ((sg >> j) & 1u) ? -w : w;
            }
        }
    }
}
"""

_DEQ["IQ3_XXS"] = r"""
#define QK 256
#define NF 0
#define PB 98
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u8* qs = q + 2 + 8 * sub;
    const u32 a = ld32(q + 66 + 4 * sub);
    float db = d * (0.5f + (float)(a >> 28));
    db = db * 0.5f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 sg = ksigns_iq2xs[(a >> (7 * l)) & 127u];
        const u8* g1 = iq3xxs_grid + 4 * qs[2 * l];
        const u8* g2 = iq3xxs_grid + 4 * qs[2 * l + 1];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float v1 = db * (float)g1[j];
            const float v2 = db * (float)g2[j];
            y[8 * l + j] = ((sg >> j) & 1u) ? -v1 : v1;
            y[8 * l + 4 + j] = ((sg >> (j + 4)) & 1u) ? -v2 : v2;
        }
    }
}
"""

_DEQ["IQ4_XS"] = r"""
#define QK 256
#define NF 0
#define PB 136
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u32 sh = ld16(q + 2);
    const u8* sl = q + 4;
    const u8* qs = q + 8 + 16 * sub;
    const int ls = ((sl[sub >> 1] >> (4 * (sub & 1))) & 15) | (((sh >> (2 * sub)) & 3u) << 4);
    const float dl = d * (float)(ls - 32);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = dl * (float)kvalues_iq4nl[qs[j] & 15];
        y[j + 16] = dl * (float)kvalues_iq4nl[qs[j] >> 4];
    }
}
"""

# Q1_0 / Q2_0: ggml-quants.c dequantize_row_q1_0 / _q2_0 (gguf-py 0.19.0 lacks both; the NumPy
# definitions are strata.engine.dequant's). Q1_0: bit j of the 128 -> d or -d; Q2_0: 2-bit q of
# the 64 -> (float)(q - 1) * d.
_DEQ["Q1_0"] = r"""
#define QK 128
#define NF 1
#define PB 16
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
    const float nd = -d;
    const u8* qb = q + 4 * sub;
#pragma unroll
    for (int j = 0; j < 32; ++j) y[j] = ((qb[j >> 3] >> (j & 7)) & 1) ? d : nd;
}
"""

_DEQ["Q2_0"] = r"""
#define QK 64
#define NF 1
#define PB 16
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = sc[0];
    const u8* qb = q + 8 * sub;
#pragma unroll
    for (int j = 0; j < 32; ++j) y[j] = (float)((int)((qb[j >> 2] >> (2 * (j & 3))) & 3) - 1) * d;
}
"""

# IQ2_S (block_iq2_s: d, qs[32] grid index low bytes, signs[32], qh[8] index high bits, scales[8]);
# gguf-py IQ2_S.dequantize_blocks: db = (d * (0.5 + scale)) * 0.25, value = (db * grid) * sign.
_DEQ["IQ2_S"] = r"""
#define QK 256
#define NF 0
#define PB 82
__device__ __forceinline__ void deq_chunk(const float* __restrict__ sc, const u8* __restrict__ q, int sub, float* y) {
    const float d = h2f(ld16(q));
    const u8* qs = q + 2;
    const u8* signs = q + 34;
    const u8* qh = q + 66;
    const u8* scales = q + 74;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int scv = (scales[sub] >> (4 * half)) & 15;
        float db = d * (0.5f + (float)scv);
        db = db * 0.25f;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const int l = 4 * sub + 2 * half + m;
            const u32 idx = (u32)qs[l] | ((((u32)qh[l >> 2] >> (2 * (l & 3))) & 3u) << 8);
            const u8* g = iq2s_grid + 8 * idx;
            const u32 sg = signs[l];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float w = db * (float)g[j];
                y[16 * half + 8 * m + j] = ((sg >> j) & 1u) ? -w : w;
            }
        }
    }
}
"""

_BLOCK_KERNELS = r"""
#define WARPS 4   // warps per CTA (blockDim.x == 32 * WARPS)
#define RPW 2     // rows per warp in the matvec kernels (they share one staged slice of x)

// Chunk t = block * (QK/32) + sub holds values [32t, 32t+32) of the tensor. Each warp
// dequantizes 32 consecutive chunks (one per lane) into a padded shared tile, then writes them
// out coalesced: lane l stores value l of each chunk (stride 33: no bank conflicts either way).
extern "C" __global__ void dequant(const u8* __restrict__ base, const i64 n_blocks, float* __restrict__ out) {
    __shared__ float tile[WARPS][32 * 33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 n_chunks = n_blocks * (QK / 32);
    const i64 c0 = ((i64)blockIdx.x * WARPS + warp) * 32;
    if (c0 >= n_chunks) return;  // whole warp
    float* tl = tile[warp];
    const i64 t = c0 + lane;
    if (t < n_chunks) {
        const i64 blk = t / (QK / 32);
        float y[32];
        deq_chunk((const float*)base + blk * NF, base + n_blocks * NF * 4 + blk * PB, (int)(t % (QK / 32)), y);
#pragma unroll
        for (int i = 0; i < 32; ++i) tl[lane * 33 + i] = y[i];
    }
    __syncwarp();
    const int nk = (int)min((i64)32, n_chunks - c0);
    for (int k = 0; k < nk; ++k) out[(c0 + k) * 32 + lane] = tl[k * 33 + lane];
}

// acc[r] = dot(W[row0 + r, :], x) for r < RPW, on one warp. Lane l takes chunks l, l+32, ... of
// the row in ascending order: s = s + w[i] * x[i] over the chunk's 32 values, acc += s; then
// a fixed xor butterfly. Per 32 chunks, x is staged into a padded shared tile (coalesced global
// loads, conflict-free reads) and reused for the warp's RPW rows; each row's block bytes for
// those chunks (contiguous) are staged into shared memory with coalesced 4- or 2-byte loads, so
// deq_chunk's byte reads hit shared memory instead of strided global loads. Staging changes
// where bytes are read from, not the arithmetic.
#define CPB (QK / 32)                       // chunks per block
#define BLK_PER_IT (32 / CPB)               // blocks covered by 32 chunks
#define STAGE_BYTES (((BLK_PER_IT * PB) + 15) / 16 * 16)

__device__ __forceinline__ void stage_bytes(u8* __restrict__ dst, const u8* __restrict__ src, const int nbytes,
                                            const int lane) {
    if ((((unsigned long long)src) & 3ull) == 0) {
        const int n4 = nbytes >> 2;
        for (int i = lane; i < n4; i += 32) ((u32*)dst)[i] = ((const u32*)src)[i];
        if ((nbytes & 2) && lane == 0) ((u16*)dst)[2 * n4] = ((const u16*)src)[2 * n4];
    } else {  // native blocks of 66/74/98/110/210 bytes: only 2-byte aligned
        const int n2 = nbytes >> 1;
        for (int i = lane; i < n2; i += 32) ((u16*)dst)[i] = ((const u16*)src)[i];
    }
}

__device__ __forceinline__ void warp_dot(const u8* __restrict__ base, const i64 rows, const int ne0, const i64 row0,
                                         const float* __restrict__ x, float* __restrict__ xs, u8* __restrict__ wb,
                                         const int lane, float* acc) {
    const int nb = ne0 / QK;
    const int n_chunk = nb * CPB;
    const i64 n_blocks = rows * nb;
    const float* scales = (const float*)base;
    const u8* payload = base + n_blocks * NF * 4;
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.0f;
    for (int c0 = 0; c0 < n_chunk; c0 += 32) {
        const int nk = min(32, n_chunk - c0);
        const int jb0 = c0 / CPB;
        const int nblk = (nk + CPB - 1) / CPB;
        __syncwarp();
        for (int k = 0; k < nk; ++k) xs[k * 33 + lane] = x[(i64)(c0 + k) * 32 + lane];
        const int c = c0 + lane;
        const float* xx = xs + lane * 33;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const i64 row = row0 + r;
            if (row >= rows) break;  // uniform across the warp
            __syncwarp();
            stage_bytes(wb, payload + (row * nb + jb0) * PB, nblk * PB, lane);
            __syncwarp();
            if (c < n_chunk) {
                const int jl = c / CPB - jb0;
                const i64 blk = row * nb + jb0 + jl;
                float w[32];
                deq_chunk(scales + blk * NF, wb + jl * PB, c % CPB, w);
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 32; ++i) s = s + w[i] * xx[i];  // mul then add: --fmad=false keeps them apart
                acc[r] += s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}
"""

_PLAIN_LOAD = {
    "F32": "__device__ __forceinline__ float load_w(const u8* b, i64 i) { return ((const float*)b)[i]; }",
    "F16": "__device__ __forceinline__ float load_w(const u8* b, i64 i) { return h2f(((const u16*)b)[i]); }",
    "BF16": "__device__ __forceinline__ float load_w(const u8* b, i64 i) "
            "{ return __uint_as_float(((u32)((const u16*)b)[i]) << 16); }",
}

_PLAIN_KERNELS = r"""
#define WARPS 4
#define RPW 2
extern "C" __global__ void dequant(const u8* __restrict__ base, const i64 n, float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = load_w(base, i);
}

// acc[r] = dot(W[row0 + r, :], x): lane l takes elements l, l+32, ... (acc = acc + w * x), then
// the same xor butterfly as the block types.
#define STAGE_BYTES 16
__device__ __forceinline__ void warp_dot(const u8* __restrict__ base, const i64 rows, const int ne0, const i64 row0,
                                         const float* __restrict__ x, float* __restrict__ xs, u8* __restrict__ wb,
                                         const int lane, float* acc) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        float a = 0.0f;
        const i64 row = row0 + r;
        if (row < rows) {
            const i64 r0 = row * ne0;
            for (int i = lane; i < ne0; i += 32) a = a + load_w(base, r0 + i) * x[i];
        }
        acc[r] = a;
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}
"""

_MATVEC_KERNELS = r"""
// y[row] = dot(W[row, :], x); warp w of CTA b takes rows (b*WARPS + w)*RPW .. +RPW.
extern "C" __global__ void matvec(const u8* __restrict__ base, const i64 rows, const int ne0,
                                  const float* __restrict__ x, float* __restrict__ y) {
    __shared__ float xs_all[WARPS][32 * 33];
    __shared__ __align__(16) u8 wb_all[WARPS][STAGE_BYTES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row0 = ((i64)blockIdx.x * WARPS + warp) * RPW;
    if (row0 >= rows) return;  // whole warp leaves together
    float acc[RPW];
    warp_dot(base, rows, ne0, row0, x, xs_all[warp], wb_all[warp], lane, acc);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) if (row0 + r < rows) y[row0 + r] = acc[r];
    }
}

// Y[item, row] = dot(W_item[row, :], X[item * x_stride + :]); W_item at bases[item] (engine form).
extern "C" __global__ void matvec_batched(const unsigned long long* __restrict__ bases, const i64 rows, const int ne0,
                                          const float* __restrict__ X, const i64 x_stride, float* __restrict__ Y) {
    __shared__ float xs_all[WARPS][32 * 33];
    __shared__ __align__(16) u8 wb_all[WARPS][STAGE_BYTES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row0 = ((i64)blockIdx.x * WARPS + warp) * RPW;
    const int item = blockIdx.y;
    if (row0 >= rows) return;
    float acc[RPW];
    warp_dot((const u8*)bases[item], rows, ne0, row0, X + (i64)item * x_stride, xs_all[warp], wb_all[warp], lane, acc);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) if (row0 + r < rows) Y[(i64)item * rows + row0 + r] = acc[r];
    }
}
"""

#: ggml type ids with GPU kernels.
SUPPORTED_TYPES: frozenset[int] = frozenset(
    quants.by_name(n).id for n in (*_DEQ.keys(), *_PLAIN_LOAD.keys())
)


def _c_array(ctype: str, name: str, values) -> str:
    vals = ",".join(str(int(v)) for v in values)
    return f"__device__ const {ctype} {name}[{len(values)}] = {{{vals}}};\n"


@functools.lru_cache(maxsize=None)
def _tables_source(code: str) -> str:
    """The ggml lookup tables that ``code`` names, as CUDA arrays built from gguf-py's copies
    (byte-identical to ``ggml-common.h``: ksigns_iq2xs, kvalues_iq4nl, iq2xxs_grid, iq2xs_grid,
    iq3xxs_grid)."""
    from gguf import quants as gq

    src = []
    if "ksigns_iq2xs" in code:
        src.append(_c_array("u8", "ksigns_iq2xs", np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)))
    if "kvalues_iq4nl" in code:
        src.append(_c_array("i8", "kvalues_iq4nl", gq.IQ4_NL.kvalues))
    for cls, name in ((gq.IQ2_XXS, "iq2xxs_grid"), (gq.IQ2_XS, "iq2xs_grid"), (gq.IQ2_S, "iq2s_grid"),
                      (gq.IQ3_XXS, "iq3xxs_grid")):
        if name not in code:
            continue
        cls.init_grid()
        g = np.asarray(cls.grid, dtype=np.float32).reshape(-1)
        gi = g.astype(np.uint8)
        assert np.array_equal(gi.astype(np.float32), g), name  # small non-negative integers
        src.append(_c_array("u8", name, gi))
    return "".join(src)


def source_for(type_id: int, *, with_kernels: bool = True) -> str:
    """The CUDA source of one type's module (dequant, matvec, matvec_batched). With
    ``with_kernels=False`` only the per-type device code (``deq_chunk`` or ``load_w`` and the
    tables): the part tests/test_gpu_kernel_source.py compiles and runs on the host."""
    t = quants.qtype(type_id)
    if t.name in _PLAIN_LOAD:
        code = _COMMON + _PLAIN_LOAD[t.name] + "\n"
        return code + _PLAIN_KERNELS + _MATVEC_KERNELS if with_kernels else code
    if t.name not in _DEQ:
        raise NotImplementedError(f"no GPU kernel for {t.name} (type {t.id}); have "
                                  f"{sorted(quants.qtype(i).name for i in SUPPORTED_TYPES)}")
    code = _COMMON + _tables_source(_DEQ[t.name]) + _DEQ[t.name]
    return code + _BLOCK_KERNELS + _MATVEC_KERNELS if with_kernels else code


def _silu_source() -> str:
    """``silu_mul``: out = (g / (1 + exp_portable(-g))) * u, the exact op sequence of
    :func:`strata.engine.gpu.reference.silu_mul` (constants embedded by their f32 bits)."""
    from strata.engine.gpu.reference import EXP_CONSTANTS

    consts = "".join(f"#define {k} __uint_as_float(0x{int(np.float32(v).view(np.uint32)):08x}u)\n"
                     for k, v in EXP_CONSTANTS.items())
    return consts + r"""
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
"""


@functools.lru_cache(maxsize=1)
def _silu_kernel():
    return _load_module(_silu_source(), ("silu_mul",))["silu_mul"]


def silu_mul(g, u, out=None):
    """``silu(g) * u`` on the GPU (float32 cupy arrays of one length), bit-identical to
    :func:`strata.engine.gpu.reference.silu_mul`."""
    import cupy as cp

    n = int(g.size)
    if out is None:
        out = cp.empty(n, dtype=cp.float32)
    if n:
        _silu_kernel()(((n + 255) // 256,), (256,), (g, u, out, np.int64(n)))
    return out


def gpu_available() -> tuple[bool, str]:
    """``(True, device description)`` when CuPy imports and a CUDA device answers, else
    ``(False, reason)`` - the reason tests print when they skip."""
    try:
        import cupy as cp
    except Exception as e:  # ImportError, or a CuPy built for another CUDA
        return False, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cp.cuda.runtime.getDeviceCount()
        if n < 1:
            return False, "CuPy sees no CUDA device"
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return True, f"{name} (cc {props['major']}.{props['minor']}), CuPy {cp.__version__}"
    except Exception as e:
        return False, f"no usable CUDA device ({type(e).__name__}: {e})"


@dataclass(frozen=True)
class TypeKernels:
    """The compiled kernels of one ggml type."""

    type_id: int
    block_elems: int
    plain: bool
    dequant: object
    matvec: object
    matvec_batched: object


def _load_module(source: str, names: tuple[str, ...]) -> dict:
    """Compile ``source`` with NVRTC and :data:`NVRTC_OPTIONS` for the current device, load it into
    CuPy and return its kernels ``names``; falls back to ``cupy.RawModule(code=...)`` (FTZ) when
    cuda-python is missing or cannot compile."""
    global COMPILE_MODE
    import cupy as cp

    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # older cuda-python
        except ImportError:
            nvrtc = None
    if nvrtc is not None:
        try:
            mod = _nvrtc_module(nvrtc, source)
            funcs = {n: mod.get_function(n) for n in names}
            COMPILE_MODE = "nvrtc"
            return funcs
        except Exception as e:  # an NVRTC/cuda-python we cannot drive: CuPy's compiler, with FTZ
            COMPILE_MODE = f"cupy-ftz (own NVRTC failed: {type(e).__name__}: {e})"
    else:
        COMPILE_MODE = "cupy-ftz (cuda-python not installed)"
    mod = cp.RawModule(code=source, options=NVRTC_OPTIONS)
    return {n: mod.get_function(n) for n in names}


def _nvrtc_module(nvrtc, source: str):
    import os
    import tempfile

    import cupy as cp

    def check(res, what):
        err = res[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC {what}: {err}")
        return res[1:]

    (prog,) = check(nvrtc.nvrtcCreateProgram(source.encode(), b"strata_kernels.cu", 0, [], []), "create")
    cc = cp.cuda.Device().compute_capability
    opts = [o.encode() for o in NVRTC_OPTIONS] + [f"--gpu-architecture=compute_{cc}".encode()]
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        (n,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC compile failed: {log.decode(errors='replace')[:4000]}")
    (n,) = check(nvrtc.nvrtcGetPTXSize(prog), "ptx size")
    ptx = b" " * n
    check(nvrtc.nvrtcGetPTX(prog, ptx), "ptx")
    nvrtc.nvrtcDestroyProgram(prog)
    # CuPy loads a module from a file; the PTX file stays in the temp folder (a few hundred KB)
    fd, path = tempfile.mkstemp(suffix=".ptx", prefix="strata_")
    with os.fdopen(fd, "wb") as f:
        f.write(ptx.rstrip(b"\x00 ") + b"\n")
    return cp.RawModule(path=path)


@functools.lru_cache(maxsize=None)
def kernels_for(type_id: int) -> TypeKernels:
    """Compile (once per process) the module of ``type_id`` (see :func:`_load_module`)."""
    t = quants.qtype(type_id)
    f = _load_module(source_for(type_id), ("dequant", "matvec", "matvec_batched"))
    return TypeKernels(t.id, t.block_elems, t.name in _PLAIN_LOAD, f["dequant"], f["matvec"], f["matvec_batched"])


def _check_buf(buf, type_id: int, ne: tuple[int, ...]):
    from strata.engine.engine_form import engine_layout

    src = quants.BF16.id if type_id == quants.BF16.id else type_id
    pool = quants.F32.id if type_id == quants.BF16.id else type_id
    lay = engine_layout(pool, src, ne)
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != lay.nbytes:
        raise ValueError(f"{quants.qtype(type_id).name} {list(ne)}: engine-form buffer must be 1-D uint8 of "
                         f"{lay.nbytes} bytes, got {buf.dtype} {buf.shape}")
    return lay


def dequantize(type_id: int, buf, n_elements: int, out=None):
    """Dequantize an engine-form buffer (1-D ``cupy.uint8``) of ``n_elements`` values to
    ``cupy.float32[n_elements]`` (``out`` if given). Equals
    :func:`strata.engine.engine_form.dequantize_engine_form` bit for bit."""
    import cupy as cp

    k = kernels_for(type_id)
    lay = _check_buf(buf, type_id, (int(n_elements),))
    if out is None:
        out = cp.empty(int(n_elements), dtype=cp.float32)
    if k.plain:
        n_work, per_cta = lay.n_elements, 256
    else:  # one warp per 32 chunks of 32 values
        n_work, per_cta = lay.n_blocks * (k.block_elems // 32), 32 * WARPS_PER_CTA
    if n_work:
        k.dequant(((n_work + per_cta - 1) // per_cta,), (256 if k.plain else 32 * WARPS_PER_CTA,),
                  (buf, np.int64(lay.n_blocks), out))
    return out


def _check_matvec(k: TypeKernels, rows: int, ne0: int):
    if ne0 % k.block_elems or (not k.plain and ne0 % 32):
        raise ValueError(f"{quants.qtype(k.type_id).name}: ne0={ne0} is not a multiple of the block size {k.block_elems}")
    if ne0 >= 2**31 or rows < 0:
        raise ValueError(f"matvec shape rows={rows} ne0={ne0} out of range")


def matvec(type_id: int, buf, rows: int, ne0: int, x, out=None):
    """``y = W @ x`` for an engine-form weight ``W`` (ggml ``ne = (ne0, rows)``, numpy
    ``[rows, ne0]``) and ``x = cupy.float32[ne0]``; returns ``cupy.float32[rows]`` (``out`` if
    given). Launches on the current CuPy stream; allocates only when ``out`` is None."""
    import cupy as cp

    k = kernels_for(type_id)
    _check_matvec(k, rows, ne0)
    if out is None:
        _check_buf(buf, type_id, (ne0, rows))
        out = cp.empty(rows, dtype=cp.float32)
    if rows:
        k.matvec(((rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA,), (32 * WARPS_PER_CTA,),
                 (buf, np.int64(rows), np.int32(ne0), x, out))
    return out


def matvec_batched(type_id: int, bases, rows: int, ne0: int, X, out=None, *, x_stride: int | None = None):
    """``Y[i] = W_i @ X[i]`` for ``n`` engine-form weights of one type and shape.

    Args:
        bases: ``cupy.uint64[n]`` device addresses of the weights' engine-form buffers
            (``buf.data.ptr``), e.g. the cache slots of the routed experts.
        X: ``cupy.float32`` with rows of ``ne0`` values; ``x_stride`` (elements) between items'
            inputs, default ``ne0``; 0 = one ``x`` for all items.
        out: ``cupy.float32[n, rows]`` or None.
    """
    import cupy as cp

    k = kernels_for(type_id)
    _check_matvec(k, rows, ne0)
    n = int(bases.size)
    if x_stride is None:
        x_stride = ne0
    if out is None:
        out = cp.empty((n, rows), dtype=cp.float32)
    if n and rows:
        k.matvec_batched(((rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, n), (32 * WARPS_PER_CTA,),
                         (bases, np.int64(rows), np.int32(ne0), X, np.int64(x_stride), out))
    return out


def matvec_error_depth(type_id: int, ne0: int) -> int:
    """Longest chain of f32 roundings behind one matvec output (see module doc): the error bound
    is ``depth * 2**-24 * sum_j |W[r, j] * x[j]|`` (plus the tiny gamma_k second-order term)."""
    t = quants.qtype(type_id)
    if t.name in _PLAIN_LOAD:
        return 1 + math.ceil(ne0 / 32) + 5
    return 33 + math.ceil((ne0 // 32) / 32) + 5
