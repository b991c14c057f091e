"""The GPU kernels' per-type CUDA code, checked WITHOUT a GPU: each type's device code
(``deq_chunk`` / ``load_w``, the tables, ``h2f``'s host twin) is compiled as C++ with g++
(``-ffp-contract=off``, the host twin of NVRTC's ``--fmad=false``) behind a few stubs for the CUDA
keywords and run over every chunk of a tensor on the CPU. The output must equal
``gguf.quants.dequantize`` bit for bit, like on the device (tests/test_gpu_kernels.py).

This catches indexing, layout and operation-order mistakes in CI, where there is no GPU. It does
not prove the device's arithmetic (that is what the gpu-marked tests are for). Skips when g++
is missing.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from test_gpu_kernels import IDS, TYPES, _pool_and_ref, _random_blocks, _wild_blocks

from strata.engine import engine_form as EF
from strata.engine.gpu import kernels as K
from strata.packer import quants

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="needs g++ to compile the kernel source on the host"
)

_PRELUDE = r"""
#include <cstring>
#include <cmath>
#define __device__
#define __global__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__
struct dim3_ { unsigned x, y, z; };
static dim3_ blockIdx, threadIdx, blockDim;
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
"""

# Same addressing as the device kernels: chunk t of block t / (QK/32); scales at
# base + 4*NF*blk, payload plane after the scale plane.
_DRIVER_BLOCK = r"""
extern "C" void run_dequant(const u8* base, i64 n_blocks, float* out) {
    for (i64 t = 0; t < n_blocks * (QK / 32); ++t) {
        const i64 blk = t / (QK / 32);
        deq_chunk((const float*)base + blk * NF, base + n_blocks * NF * 4 + blk * PB, (int)(t % (QK / 32)),
                  out + t * 32);
    }
}
"""
_DRIVER_PLAIN = r"""
extern "C" void run_dequant(const u8* base, i64 n, float* out) {
    for (i64 i = 0; i < n; ++i) out[i] = load_w(base, i);
}
"""


def compile_host(d, name: str, code: str) -> ctypes.CDLL:
    """``_PRELUDE + code`` compiled by g++ as the host twin of NVRTC's options (``-ffp-contract=off``) into
    ``d/<name>.so`` and loaded; a compile error fails the test with g++'s message."""
    cpp, so = d / f"{name}.cpp", d / f"{name}.so"
    cpp.write_text(_PRELUDE + code)
    r = subprocess.run(
        ["g++", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-o", str(so), str(cpp)], capture_output=True, text=True
    )
    assert r.returncode == 0, f"{name}: kernel source does not compile as C++:\n{r.stderr[:4000]}"
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def host_build(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernel_src")
    libs = {}

    def build(type_id: int):
        if type_id not in libs:
            driver = _DRIVER_PLAIN if quants.qtype(type_id).block_elems == 1 else _DRIVER_BLOCK
            libs[type_id] = compile_host(
                d, quants.qtype(type_id).name, K.source_for(type_id, with_kernels=False) + driver
            )
        return libs[type_id]

    return build


@pytest.mark.parametrize("type_id", TYPES, ids=IDS)
@pytest.mark.parametrize("kind", ["synth", "wild"])
def test_kernel_source_dequant_bit_exact_on_host(host_build, type_id, kind):
    t = quants.qtype(type_id)
    rng = np.random.default_rng([type_id, 17 if kind == "synth" else 18])
    n = 256 * 128
    raw = (_random_blocks if kind == "synth" else _wild_blocks)(type_id, n, rng)
    pool_t, src_t, pool, ref = _pool_and_ref(type_id, raw, (n,))
    ef = EF.to_engine_form(pool, pool_t, src_t, (n,))
    lay = EF.engine_layout(pool_t, src_t, (n,))
    out = np.full(n, np.nan, dtype=np.float32)
    host_build(type_id).run_dequant(
        ef.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(lay.n_blocks), out.ctypes.data_as(ctypes.c_void_p)
    )
    ref = ref.reshape(-1)
    diff = np.flatnonzero(out.view(np.uint32) != ref.view(np.uint32))
    assert diff.size == 0, f"{t.name}/{kind}: {diff.size} values differ; first {diff[:4].tolist()}"


def test_tables_come_from_gguf():
    import gguf.quants as gq

    src = K.source_for(quants.by_name("IQ2_XXS").id)
    assert "ksigns_iq2xs[128]" in src and "iq2xxs_grid[2048]" in src
    src = K.source_for(quants.by_name("IQ3_XXS").id)
    assert "iq3xxs_grid[1024]" in src
    assert ",".join(str(v) for v in gq.IQ4_NL.kvalues) in K.source_for(quants.by_name("IQ4_NL").id)


# The fused step's kernels (cuda/fused.cu + its prelude and quantizers) parsed as C++ behind stubs of the CUDA
# intrinsics they call: a typo, an undeclared name or a wrong argument count in device code fails in CI, where
# NVRTC is not installed (tests/test_gpu_cuda_compile.py compiles the real thing where it is).
_FUSED_STUBS = (
    _PRELUDE
    + r"""
#include <algorithm>
#include <cmath>
using std::min; using std::max; using std::isnan;
struct uint4 { unsigned x, y, z, w; };
#define __shared__
#define __launch_bounds__(...)
static dim3_ gridDim;
static inline void __syncthreads() {}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int, int = 32) { return v; }
template <class T> static inline T __shfl_sync(unsigned, T v, int, int = 32) { return v; }
static inline int __any_sync(unsigned, int p) { return p; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
static inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
static inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
static inline unsigned short f2h(float) { return 0; }
template <class T> static inline T atomicAdd(T* p, T v) { T o = *p; *p += v; return o; }
"""
)


def test_fused_source_parses_as_cpp_on_the_host(tmp_path):
    """g++ -fsyntax-only over the stubs + :func:`strata.engine.gpu.fused_ops.fused_source`; the same with one
    undeclared name put into ``gdn_step`` fails (so the check can fail)."""
    from strata.engine.gpu.fused_ops import fused_source

    src = fused_source()

    def parse(code: str) -> subprocess.CompletedProcess:
        f = tmp_path / "fused.cpp"
        f.write_text(_FUSED_STUBS + code)
        return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-w", str(f)], capture_output=True, text=True)

    r = parse(src)
    assert r.returncode == 0, f"cuda/fused.cu does not parse as C++:\n{r.stderr[:4000]}"
    broken = src.replace("const bool reset = params[0] == 0;", "const bool reset = params[0] == no_such_name;", 1)
    assert broken != src
    bad = parse(broken)
    assert bad.returncode != 0 and "no_such_name" in bad.stderr
