"""Quantized matrix-vector products on the CPU, straight from the memory-mapped GGUF bytes.

The CPU path keeps no dequantized copy of a quantized weight: every product reads the weight's
native blocks (``pool.bin`` for dense tensors, the GGUF shard for a routed expert) and dequantizes
them on the fly. The per-type code is the GPU's own (:mod:`strata.engine.gpu.kernels`:
``cuda/prelude.cuh``, the generated ``QK``/``NF``/``PB`` defines, the lookup tables and
``cuda/types/<TYPE>.cuh``), compiled for the host by the C compiler with ``engine/cpu_driver.c``:
one definition of each ggml type for both devices.

Why compiled C (gcc/cc with OpenMP) and not a Python JIT: the same source as the GPU kernels means
the CPU dequantizes exactly what the GPU dequantizes, and :func:`matvec` with ``exact=True`` sums in
the GPU kernel's order (``matvec_exact`` in the driver), so an expert computed on the CPU (a cache
miss) is bit-identical to the same expert computed on the GPU (a hit) - the design's "the hit path
is all or nothing". ``exact=False`` dequantizes a row into a scratch row and takes a vectorised dot
(faster; a different summation order, ~1e-7 relative). Both use ``-ffp-contract=off`` (no FMA, as
NumPy and the GPU modules' ``--fmad=false``) and split rows over OpenMP threads.

Each type's library is built once and cached under ``$STRATA_CACHE/kernels`` (default
``~/.cache/strata/kernels``), keyed by the sha256 of its source, compiler and flags.

Raises :class:`CpuKernelError` (with the compiler's message) when no C compiler can build them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from strata.packer import quants

from .errors import GenerateError

DRIVER = Path(__file__).resolve().parent / "cpu_driver.c"
#: Compiler flags: IEEE f32 (no contraction into FMA, no fast-math), the host's vector units, OpenMP.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared",
          "-Wno-unknown-pragmas")

# The CUDA keywords and intrinsics the per-type device code uses, for a host compiler.
_STUBS = r"""
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
"""


class CpuKernelError(GenerateError):
    """The CPU kernels cannot be built (no C compiler, or it failed: its message is included)."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CpuKernelError("strata's CPU kernels are C compiled on first use and no C compiler was found "
                             "(install gcc, or set CC)")
    return cc


def cache_dir() -> Path:
    """Where built kernel libraries are kept: ``$STRATA_CACHE/kernels`` (default ``~/.cache/strata/kernels``)."""
    root = os.environ.get("STRATA_CACHE") or str(Path.home() / ".cache" / "strata")
    return Path(root) / "kernels"


def source(type_id: int) -> str:
    """The host C source of ``type_id``'s library: stubs, the type's device code (as the GPU compiles
    it, without the GPU kernels) and the CPU driver."""
    from .gpu import kernels as K

    return _STUBS + K.source_for(type_id, with_kernels=False) + "\n" + DRIVER.read_text()


@functools.lru_cache(maxsize=None)
def library(type_id: int) -> ctypes.CDLL:
    """The compiled library of ``type_id`` (built and cached on first use).

    Raises:
        CpuKernelError: no compiler, or the build failed (compiler output in the message).
        GGMLTypeError: an unknown type id.
    """
    t = quants.qtype(type_id)
    cc = _compiler()
    src = source(type_id)
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([src, cc, *ver, *CFLAGS]).encode()).hexdigest()[:24]
    d = cache_dir()
    so = d / f"strata_cpu_{t.name}_{key}.so"
    if not so.is_file():
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            c, out = Path(tmp) / f"{t.name}.c", Path(tmp) / f"{t.name}.so"
            c.write_text(src)
            r = subprocess.run([cc, *CFLAGS, "-o", str(out), str(c)], capture_output=True, text=True)
            if r.returncode != 0:
                raise CpuKernelError(f"building the CPU kernels of {t.name} with {cc} failed:\n{r.stderr[:3000]}")
            os.replace(out, so)  # atomic: a concurrent build of the same key writes the same bytes
    lib = ctypes.CDLL(str(so))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.matvec_exact.argtypes = [vp, i64, ctypes.c_int, i64, vp, vp, ctypes.c_int]
    lib.matvec_fast.argtypes = [vp, i64, ctypes.c_int, i64, vp, vp, ctypes.c_int, vp]
    lib.dequant_rows.argtypes = [vp, vp, i64, ctypes.c_int, i64, vp]
    for f in (lib.matvec_exact, lib.matvec_fast, lib.dequant_rows):
        f.restype = None
    return lib


def default_threads() -> int:
    """CPU threads the kernels use: the cores this process may run on (``os.sched_getaffinity``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class _Scratch:
    """One scratch row per thread for ``matvec_fast``, grown as needed (never shrunk: the token
    path allocates nothing once the largest row has been seen)."""

    buf = np.zeros(0, dtype=np.float32)

    @classmethod
    def get(cls, n: int) -> np.ndarray:
        if cls.buf.size < n:
            cls.buf = np.zeros(n, dtype=np.float32)
        return cls.buf


def matvec(type_id: int, raw: np.ndarray, rows: int, ne0: int, x: np.ndarray, out: np.ndarray | None = None, *,
           exact: bool = True, threads: int | None = None) -> np.ndarray:
    """``y = W @ x`` for a weight of ggml type ``type_id`` held as native GGUF blocks in ``raw``
    (``uint8``, C-contiguous, ``rows`` rows of ``ne0`` values each: ggml ``ne = (ne0, rows)``, numpy
    ``[rows, ne0]``) and ``x`` f32 ``[ne0]``. Returns f32 ``[rows]`` (``out`` if given).

    ``exact``: the GPU kernel's summation order (bit-identical to the GPU's matvec); else the faster
    scratch-row dot. The memory-mapped bytes are read in place (no copy).

    Raises:
        ValueError: ``raw`` not ``rows`` whole rows of the type, ``x`` not ``ne0`` f32 values.
        CpuKernelError: the kernels cannot be built.
    """
    t = quants.qtype(type_id)
    row_bytes = quants.row_nbytes(type_id, ne0)
    if raw.dtype != np.uint8 or raw.size != rows * row_bytes or not raw.flags.c_contiguous:
        raise ValueError(f"{t.name}: {raw.size} contiguous bytes given, {rows} rows x {ne0} need {rows * row_bytes}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != (ne0,):
        raise ValueError(f"{t.name}: x has shape {x.shape}, the weight's rows have {ne0} values")
    if out is None:
        out = np.empty(rows, dtype=np.float32)
    n = threads or default_threads()
    lib = library(type_id)
    if exact:
        lib.matvec_exact(_ptr(raw), rows, ne0, row_bytes, _ptr(x), _ptr(out), n)
    else:
        lib.matvec_fast(_ptr(raw), rows, ne0, row_bytes, _ptr(x), _ptr(out), n, _ptr(_Scratch.get(n * ne0)))
    return out


def dequant_rows(type_id: int, raw: np.ndarray, ne0: int, ids) -> np.ndarray:
    """Rows ``ids`` of a weight (native blocks ``raw`` as in :func:`matvec`) as f32 ``[len(ids), ne0]``."""
    row_bytes = quants.row_nbytes(type_id, ne0)
    idx = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
    rows = raw.size // row_bytes
    if idx.size and (idx.min() < 0 or idx.max() >= rows):
        raise ValueError(f"row ids {idx.min()}..{idx.max()} outside 0..{rows - 1}")
    out = np.empty((idx.size, ne0), dtype=np.float32)
    library(type_id).dequant_rows(_ptr(raw), _ptr(idx), idx.size, ne0, row_bytes, _ptr(out))
    return out


__all__ = ["CFLAGS", "CpuKernelError", "cache_dir", "default_threads", "dequant_rows", "library", "matvec", "source"]
