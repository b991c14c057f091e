"""Quantized matrix-vector products on the CPU, straight from the memory-mapped GGUF bytes.

The CPU path keeps no dequantized copy of a quantized weight: every product reads the weight's
native blocks (``pool.bin`` for dense tensors, the GGUF shard for a routed expert) and dequantizes
them on the fly. The per-type code is the GPU's own (:func:`strata.engine.kernel_src.assembly.type_source`:
``kernel_src/prelude.cuh``, the generated ``QK``/``NF``/``PB`` defines, the lookup tables and
``kernel_src/types/<TYPE>.cuh``), compiled for the host by the C compiler with ``engine/cpu/cpu_driver.c``:
one definition of each ggml type for both devices.

Three kernels (:data:`KERNELS`; ``kernel=`` of :func:`matvec`, :func:`matvec_many`):

- ``"exact"`` sums in the GPU kernel's order (``matvec_exact`` in the driver: per 32-value chunk a
  sequential f32 sum, 32 lanes, the xor butterfly), so an expert computed on the CPU (a cache miss) is
  bit-identical to the same expert computed on the GPU (a hit) - docs/DESIGN.md "The hit path is all
  or nothing". Why compiled C and not a Python JIT: the same source as the GPU kernels means the CPU
  dequantizes exactly what the GPU dequantizes. ``x`` is laid out for the lanes once per call.
- ``"q8"`` is llama.cpp's CPU numerics (``engine/cpu/cpu_q8.c``, ``cpu_q8_dots.c``): the activation quantized
  once per product to Q8_0 / Q8_K exactly as ggml's ``quantize_row_q8_0`` / ``quantize_row_q8_K`` do (the
  values of :func:`strata.engine.numerics.quantize_activation`), integer block dots (exact), and a fixed
  f32 order for the block scales; AVX2 (+VNNI) intrinsics or portable C with the same bits. For the types
  in :data:`Q8_TYPES`; any other type runs ``"f32"``. The CPU engine's default (the fast path).
- ``"f32"`` dequantizes a row into a scratch row and takes a 16-way f32 dot (~1e-7 relative from exact).

All use ``-ffp-contract=off`` (no FMA, as NumPy and the GPU modules' ``--fmad=false``), split rows - or,
for :func:`matvec_many`, (matrix, row) pairs - over OpenMP threads, and read the mapped bytes in place.

A prompt chunk multiplies many activation rows at once (:func:`call_matmat`; docs/DESIGN.md "Prompts in chunks"):
``"q8"`` runs ``matmat_q8_many`` - units of 16 weight rows per thread: on an AVX-512 VNNI host the 16 rows packed once
into a panel (a zmm lane per row, engine/cpu/cpu_q8_chunk.c ``panel_pack`` / ``panel_dot``) that every activation of the
chunk meets with no horizontal adds; elsewhere tiles of 32 activations, each weight block (a K-quant's super-block)
decoded once for 8 of them (``dot_rows``); every value the matvec's bits either way - and the other kernels run the
matvec per row.

Each type's library is built once and cached under ``$STRATA_CACHE/kernels`` (default
``~/.cache/strata/kernels``), keyed by the sha256 of its source, compiler and flags.

Raises :class:`CpuKernelError` (with the compiler's message) when no C compiler can build them.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from strata.packer import quants

from ..errors import GenerateError
from ..kernel_src import assembly as A

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "cpu_driver.c"
#: The exact kernel's AVX2 block dots (Q4_K, Q6_K), concatenated before the driver.
EXACT_SIMD = HERE / "cpu_exact_simd.c"
#: The quantized-activation (llama.cpp) kernels: the common part, then the per-type dots and entry points.
Q8_SOURCES = (HERE / "cpu_q8.c", HERE / "cpu_q8_dots.c", HERE / "cpu_q8_chunk.c")
#: Compiler flags: IEEE f32 (no contraction into FMA, no fast-math), the host's vector units, OpenMP.
CFLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-Wno-unknown-pragmas",
)

#: Kernels of :func:`matvec`: ``"exact"`` the GPU's summation order (f32), ``"f32"`` a dequantized row and a
#: 16-way dot, ``"q8"`` llama.cpp's CPU numerics (activation quantized to Q8_0 / Q8_K, integer block dots),
#: ``"q8-exact"`` the GPU path's q8 numerics: ``"q8"`` for :data:`Q8_TYPES`, ``"exact"`` for the rest (what the
#: GPU's q8 step runs, so a miss computed here equals a hit bit for bit).
KERNELS = ("exact", "f32", "q8", "q8-exact")
#: Types with a ``"q8"`` kernel (engine/cpu/cpu_q8_dots.c); any other type runs ``"f32"`` when ``"q8"`` is asked.
#: IQ2/IQ3 types, IQ4_XS, Q4_1/Q5_1 (Q8_1 activations), Q1_0/Q2_0 and the plain types have none yet.
Q8_TYPES: frozenset[int] = frozenset(t.id for t in quants.QTYPES.values() if t.q8_kernel)

# The CUDA keywords and intrinsics the per-type device code uses, for a host compiler (the x86 intrinsics
# header first, before the keyword stubs can touch it).
_STUBS = r"""
#if defined(__AVX2__) && !defined(STRATA_SCALAR)
#include <immintrin.h>
#endif
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#define __device__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
"""


class CpuKernelError(GenerateError):
    """The CPU kernels cannot be built (no C compiler, or it failed: its message is included)."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CpuKernelError(
            "strata's CPU kernels are C compiled on first use and no C compiler was found (install gcc, or set CC)"
        )
    return cc


def cache_dir() -> Path:
    """Where built kernel libraries are kept: ``$STRATA_CACHE/kernels`` (default ``~/.cache/strata/kernels``)."""
    root = os.environ.get("STRATA_CACHE") or str(Path.home() / ".cache" / "strata")
    return Path(root) / "kernels"


@functools.cache
def _private_dir(why: str) -> Path:
    """A directory of this process's own (``mkdtemp``: mode 0700, under ``$TMPDIR``) for the kernels when the
    cache cannot be written (a read-only ``$STRATA_CACHE`` or ``$HOME``: containers, HPC); said once on stderr."""
    d = Path(tempfile.mkdtemp(prefix="strata-kernels-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)  # "for this run": removed when the process ends
    print(f"warning: {why}; the CPU kernels are built in {d} for this run instead", file=sys.stderr)
    return d


def _writable_cache() -> Path:
    """:func:`cache_dir`, created if missing, or - when it cannot be created or written - :func:`_private_dir`."""
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
        return d
    except OSError as e:
        return _private_dir(f"the kernel cache {d} cannot be written ({e.strerror or e})")


def source(type_id: int, scalar: bool = False) -> str:
    """The host C source of ``type_id``'s library: the type's define (``STRATA_T_<NAME>``), stubs, the
    type's device code (as the GPU compiles it, without the GPU kernels), the CPU driver, the experts'
    activation (``silu_mul1``, ``kernel_src/silu.cuh`` as the GPU compiles it) and the quantized-activation
    kernels. ``scalar``: ``STRATA_SCALAR`` - the portable code without SIMD
    intrinsics (the same results; tests compare the two)."""
    t = quants.qtype(type_id)
    head = f"#define STRATA_T_{t.name} 1\n" + ("#define STRATA_SCALAR 1\n" if scalar else "")
    return (
        head
        + _STUBS
        + A.type_source(type_id)
        + "\n"
        + EXACT_SIMD.read_text()
        + "\n"
        + DRIVER.read_text()
        + "\n"
        + A.q8_layout_source("static inline")
        + A.silu_defines()
        + "\n".join(p.read_text() for p in Q8_SOURCES)
    )


@functools.cache
def library(type_id: int, scalar: bool = False) -> ctypes.CDLL:
    """The compiled library of ``type_id`` (built and cached on first use; ``scalar``: see :func:`source`).

    Raises:
        CpuKernelError: no compiler, or the build failed (compiler output in the message).
        GGMLTypeError: an unknown type id.
    """
    t = quants.qtype(type_id)
    cc = _compiler()
    src = source(type_id, scalar)
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([src, cc, *ver, *CFLAGS]).encode()).hexdigest()[:24]
    name = f"strata_cpu_{t.name}{'_scalar' if scalar else ''}_{key}.so"
    so = cache_dir() / name
    if not so.is_file():
        d = _writable_cache()
        so = d / name
    if not so.is_file():
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            c, out = Path(tmp) / f"{t.name}.c", Path(tmp) / f"{t.name}.so"
            c.write_text(src)
            r = subprocess.run([cc, *CFLAGS, "-o", str(out), str(c)], capture_output=True, text=True)
            if r.returncode != 0:
                raise CpuKernelError(f"building the CPU kernels of {t.name} with {cc} failed:\n{r.stderr[:3000]}")
            os.replace(out, so)  # atomic: a concurrent build of the same key writes the same bytes
    lib = ctypes.CDLL(str(so))
    i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    many = [vp, ci, i64, ci, i64, vp, vp, ci, vp]  # bases, nmat, rows, ne0, row_bytes, xs, y, threads, scratch
    sigs = {
        "matvec_exact": [vp, i64, ci, i64, vp, vp, ci, vp],
        "matvec_exact_many": many,
        "matvec_fast": [vp, i64, ci, i64, vp, vp, ci, vp],
        "matvec_fast_many": many,
        "dequant_rows": [vp, vp, i64, ci, i64, vp],
        "quantize_q8_0": [vp, ci, vp, vp, vp],
        "quantize_q8_K": [vp, ci, vp, vp, vp],
        "q8_act_format": [],
        "q8_simd": [],
        "q8_panel_rows": [],
        "act_nbytes": [ci],
        "f16_round": [vp, i64, vp],
        "silu_mul_f32": [vp, vp, vp, i64],
    }
    if type_id in Q8_TYPES:
        sigs.update(
            matvec_q8=[vp, i64, ci, i64, vp, vp, ci, vp],
            matvec_q8_many=many,
            matvec_q8_many_silu=[vp, ci, i64, ci, i64, vp, vp, vp, vp, ci, vp],  # ... g, u, h, y, threads, scratch
            matmat_q8_many=[vp, ci, i64, ci, i64, vp, vp, vp, ci, vp],  # ... xs, ts (int32), ys, threads, scratch
        )
    for name, args in sigs.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = {"q8_act_format": ci, "q8_simd": ci, "q8_panel_rows": ci, "act_nbytes": i64}.get(name)
    return lib


@contextlib.contextmanager
def blas_single_thread():
    """NumPy's BLAS on one thread for the duration (threadpoolctl): a prompt chunk's attention takes matrix products
    between the C kernels' OpenMP regions, and OpenBLAS's worker threads spin-wait after each call, taking the cores
    from the kernels' threads (docs/DESIGN.md "Prompts in chunks")."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


def default_threads() -> int:
    """CPU threads the kernels use: the cores this process may run on (``os.sched_getaffinity``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


_local = threading.local()


def _scratch(nbytes: int) -> int:
    """The address of this thread's scratch buffer of at least ``nbytes`` (64-byte aligned; grown as needed and
    never shrunk, so the token path allocates nothing once the largest product has been seen)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < nbytes + 64:
        buf = _local.buf = np.zeros(nbytes + 64, dtype=np.uint8)
    p = _ptr(buf)
    return p + (-p % 64)


def kernel_for(type_id: int, kernel: str) -> str:
    """The kernel that runs ``kernel`` for ``type_id``: ``"q8"`` falls back to ``"f32"`` for a type without
    an integer kernel (:data:`Q8_TYPES`), ``"q8-exact"`` to ``"exact"``. Raises ValueError for a name not in
    :data:`KERNELS`."""
    if kernel not in KERNELS:
        raise ValueError(f"CPU kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if kernel == "q8-exact":
        return "q8" if type_id in Q8_TYPES else "exact"
    return "f32" if kernel == "q8" and type_id not in Q8_TYPES else kernel


def scratch_bytes(type_id: int, kernel: str, ne0: int, nmat: int, threads: int) -> int:
    """Scratch bytes one call of :func:`call_many` needs: ``"q8"`` one quantized activation per matrix
    (``act_nbytes``), ``"exact"`` one laid-out f32 input per matrix, ``"f32"`` one f32 row per thread."""
    kernel = kernel_for(type_id, kernel)
    if kernel == "q8":
        return nmat * _act_nbytes(type_id, ne0)
    return 4 * ne0 * (nmat if kernel == "exact" else threads)


@functools.cache
def _act_nbytes(type_id: int, ne0: int) -> int:
    """Bytes of one quantized activation of ``ne0`` values (engine/kernel_src/q8_layout.h), asked of the C library
    once."""
    return int(library(type_id).act_nbytes(ne0))


def entry_point(type_id: int, kernel: str):
    """The C function of ``kernel`` (after :func:`kernel_for`) for ``type_id``: ``(bases, nmat, rows, ne0,
    row_bytes, xs, out, threads, scratch)`` as in :func:`call_many` (addresses as ints)."""
    kernel = kernel_for(type_id, kernel)
    return getattr(
        library(type_id), {"q8": "matvec_q8_many", "exact": "matvec_exact_many", "f32": "matvec_fast_many"}[kernel]
    )


def call_many(
    type_id: int,
    kernel: str,
    bases: np.ndarray,
    rows: int,
    ne0: int,
    row_bytes: int,
    xs: np.ndarray,
    out: np.ndarray,
    threads: int,
) -> None:
    """The C entry point without checks (the engine's token path; :func:`matvec_many` checks its arguments):
    ``out[m * rows + r] = W_m[r] . x_m``. ``bases``/``xs``: uint64 arrays of ``nmat`` addresses (weights in
    native blocks, f32 inputs of ``ne0``), ``out`` f32 ``[nmat * rows]`` C-contiguous."""
    sc = _scratch(scratch_bytes(type_id, kernel, ne0, bases.size, threads))
    entry_point(type_id, kernel)(_ptr(bases), bases.size, rows, ne0, row_bytes, _ptr(xs), _ptr(out), threads, sc)


def call_many_silu(
    type_id: int,
    bases: np.ndarray,
    rows: int,
    ne0: int,
    row_bytes: int,
    g: np.ndarray,
    u: np.ndarray,
    h: np.ndarray,
    out: np.ndarray,
    threads: int,
) -> None:
    """The experts' down products with their input made in the same OpenMP region (the token path; no checks):
    ``h[m] = silu_mul(g[m], u[m])`` (:func:`strata.engine.gpu.reference.silu_mul`, bit for bit: the GPU's
    ``silu_mul1``), then ``out[m * rows + r] = W_m[r] . h[m]`` with the ``"q8"`` kernel - the same bits as
    :func:`call_many` on ``h``. ``g``, ``u``, ``h``: f32 numpy ``[nmat, ne0]`` C-contiguous (``h`` written);
    ``bases``: uint64 ``[nmat]``; ``out`` f32 ``[nmat * rows]``. Only for :data:`Q8_TYPES` (engine/cpu/cpu_q8_chunk.c
    ``matvec_q8_many_silu``)."""
    sc = _scratch(scratch_bytes(type_id, "q8", ne0, bases.size, threads))
    library(type_id).matvec_q8_many_silu(
        _ptr(bases), bases.size, rows, ne0, row_bytes, _ptr(g), _ptr(u), _ptr(h), _ptr(out), threads, sc
    )


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``silu_mul1(g, u)`` elementwise in C (engine/cpu/cpu_q8.c ``silu_mul_row``, AVX2 where built with it): f32
    numpy of ``g``'s shape, bit-identical to :func:`strata.engine.gpu.reference.silu_mul` (the tests check).
    Raises ValueError when ``g`` and ``u`` differ in shape."""
    g = np.ascontiguousarray(g, dtype=np.float32)
    u = np.ascontiguousarray(u, dtype=np.float32)
    if g.shape != u.shape:
        raise ValueError(f"silu_mul: g has shape {g.shape}, u {u.shape}")
    out = np.empty_like(g)
    library(next(iter(sorted(Q8_TYPES)))).silu_mul_f32(_ptr(g), _ptr(u), _ptr(out), g.size)
    return out


def call_matmat(
    type_id: int,
    kernel: str,
    bases: np.ndarray,
    rows: int,
    ne0: int,
    row_bytes: int,
    xs: list[np.ndarray],
    threads: int,
) -> list[np.ndarray]:
    """The matrix-matrix form of :func:`call_many` (a prompt chunk; no checks, the token path's): matrix ``m``
    (native blocks at address ``bases[m]``, ggml ``ne = (ne0, rows)``) times every row of ``xs[m]`` (f32 numpy
    ``[T_m, ne0]``, C-contiguous). Returns ``[xs[m] @ W_m.T]``: f32 numpy ``[T_m, rows]`` each, row ``t``
    bit-identical to :func:`call_many` on ``xs[m][t]`` (the same per-row code).

    ``"q8"`` runs ``matmat_q8_many`` (engine/cpu/cpu_q8_chunk.c: weight rows tiled so each is read from memory
    once per call, not once per token; consecutive equal ``xs`` quantized once); the other kernels run
    :func:`call_many` with the matrix repeated per input row (the same results, no weight reuse)."""
    kernel = kernel_for(type_id, kernel)
    ys = [np.empty((x.shape[0], rows), dtype=np.float32) for x in xs]
    if not xs:
        return ys
    if kernel == "q8":
        ts = np.array([x.shape[0] for x in xs], dtype=np.int32)
        distinct = sum(int(ts[m]) for m in range(len(xs)) if m == 0 or xs[m] is not xs[m - 1])
        sc = _scratch(distinct * _act_nbytes(type_id, ne0))
        # the address arrays are held in names until the call returns (a temporary's buffer would be freed)
        x_at = np.array([_ptr(x) for x in xs], dtype=np.uint64)
        y_at = np.array([_ptr(y) for y in ys], dtype=np.uint64)
        library(type_id).matmat_q8_many(
            _ptr(bases), len(xs), rows, ne0, row_bytes, _ptr(x_at), _ptr(ts), _ptr(y_at), threads, sc
        )
        return ys
    reps = np.array([x.shape[0] for x in xs])
    rows_at = np.concatenate([_ptr(x) + ne0 * 4 * np.arange(x.shape[0], dtype=np.uint64) for x in xs])
    out = np.empty(int(reps.sum()) * rows, dtype=np.float32)
    call_many(type_id, kernel, np.repeat(bases, reps), rows, ne0, row_bytes, rows_at.astype(np.uint64), out, threads)
    at = 0
    for y in ys:
        y[...] = out[at * rows : (at + y.shape[0]) * rows].reshape(y.shape)
        at += y.shape[0]
    return ys


def _check(type_id: int, raw: np.ndarray, rows: int, ne0: int, x: np.ndarray) -> tuple[int, np.ndarray]:
    t = quants.qtype(type_id)
    row_bytes = quants.row_nbytes(type_id, ne0)
    if raw.dtype != np.uint8 or raw.size != rows * row_bytes or not raw.flags.c_contiguous:
        raise ValueError(f"{t.name}: {raw.size} contiguous bytes given, {rows} rows x {ne0} need {rows * row_bytes}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != (ne0,):
        raise ValueError(f"{t.name}: x has shape {x.shape}, the weight's rows have {ne0} values")
    return row_bytes, x


def matvec(
    type_id: int,
    raw: np.ndarray,
    rows: int,
    ne0: int,
    x: np.ndarray,
    out: np.ndarray | None = None,
    *,
    exact: bool = True,
    threads: int | None = None,
    kernel: str | None = None,
) -> np.ndarray:
    """``y = W @ x`` for a weight of ggml type ``type_id`` held as native GGUF blocks in ``raw``
    (``uint8``, C-contiguous, ``rows`` rows of ``ne0`` values each: ggml ``ne = (ne0, rows)``, numpy
    ``[rows, ne0]``) and ``x`` f32 ``[ne0]``. Returns f32 ``[rows]`` (``out`` if given).

    ``kernel`` (:data:`KERNELS`; default ``"exact"`` if ``exact`` else ``"q8"``): ``"exact"`` sums in the
    GPU kernel's order (bit-identical to the GPU's matvec); ``"q8"`` quantizes ``x`` as llama.cpp's CPU
    backend does for this weight type and takes integer block dots (engine/cpu/cpu_q8.c: the formats, the
    rounding rules and the fixed float order; ``"f32"`` for a type outside :data:`Q8_TYPES`); ``"f32"``
    dequantizes a row and takes a 16-way f32 dot. The memory-mapped bytes are read in place (no copy).

    Raises:
        ValueError: ``raw`` not ``rows`` whole rows of the type, ``x`` not ``ne0`` f32 values, an unknown kernel.
        CpuKernelError: the kernels cannot be built.
    """
    row_bytes, x = _check(type_id, raw, rows, ne0, x)
    if out is None:
        out = np.empty(rows, dtype=np.float32)
    call_many(
        type_id,
        kernel or ("exact" if exact else "q8"),
        np.array([_ptr(raw)], dtype=np.uint64),
        rows,
        ne0,
        row_bytes,
        np.array([_ptr(x)], dtype=np.uint64),
        out,
        threads or default_threads(),
    )
    return out


def matvec_many(
    type_id: int,
    raws: list[np.ndarray],
    rows: int,
    ne0: int,
    xs: list[np.ndarray],
    *,
    exact: bool = True,
    threads: int | None = None,
    kernel: str | None = None,
) -> np.ndarray:
    """``y[m] = W_m @ xs[m]`` for ``len(raws)`` weights of one type and shape (each as in :func:`matvec`),
    in ONE C call: one OpenMP region over all ``(m, row)`` pairs; inputs that are the same array object
    in consecutive positions are quantized / laid out once. Returns f32 ``[len(raws), rows]`` (numpy
    order); ``y[m]`` is bit-identical to ``matvec(type_id, raws[m], rows, ne0, xs[m], ...)``.

    Raises:
        ValueError: as :func:`matvec`, or ``len(xs) != len(raws)``.
        CpuKernelError: the kernels cannot be built.
    """
    if len(xs) != len(raws):
        raise ValueError(f"{len(raws)} weights but {len(xs)} inputs")
    keep = []
    for raw, x in zip(raws, xs):
        row_bytes, xc = _check(type_id, raw, rows, ne0, x)
        keep.append(x if xc is x else xc)  # the same object stays the same object (shared input)
    out = np.empty((len(raws), rows), dtype=np.float32)
    if raws:
        call_many(
            type_id,
            kernel or ("exact" if exact else "q8"),
            np.array([_ptr(r) for r in raws], dtype=np.uint64),
            rows,
            ne0,
            quants.row_nbytes(type_id, ne0),
            np.array([_ptr(x) for x in keep], dtype=np.uint64),
            out,
            threads or default_threads(),
        )
    return out


def quantize_activation(
    type_id: int, x: np.ndarray, *, scalar: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` (f32, length a multiple of the block) quantized by the C kernels for a weight of ``type_id``
    (a :data:`Q8_TYPES` member): ``(q int8 [n], d f32 [n / 32 or n / 256], s int16 [n / 16])`` - the values,
    the block scales and the sums of ``q`` per 16 values. For tests: ``d * q`` must equal
    :func:`strata.engine.numerics.quantize_activation` bit for bit.

    Raises:
        ValueError: a type without a q8 kernel, or a length that is not a multiple of the block.
    """
    fmt = int(library(type_id, scalar).q8_act_format()) if type_id in Q8_TYPES else 0
    blk = {1: 32, 2: 256}.get(fmt)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if blk is None or x.ndim != 1 or x.size % blk:
        raise ValueError(f"{quants.qtype(type_id).name}: no q8 kernel, or {x.size} values not a multiple of {blk}")
    q = np.empty(x.size, np.int8)
    d = np.empty(x.size // blk, np.float32)
    s = np.empty(x.size // 16, np.int16)
    fn = library(type_id, scalar).quantize_q8_0 if fmt == 1 else library(type_id, scalar).quantize_q8_K
    fn(_ptr(x), x.size, _ptr(q), _ptr(d), _ptr(s))
    return q, d, s


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


__all__ = [
    "CFLAGS",
    "blas_single_thread",
    "KERNELS",
    "Q8_TYPES",
    "CpuKernelError",
    "cache_dir",
    "call_many",
    "call_matmat",
    "default_threads",
    "dequant_rows",
    "entry_point",
    "kernel_for",
    "library",
    "matvec",
    "matvec_many",
    "quantize_activation",
    "scratch_bytes",
    "source",
]
