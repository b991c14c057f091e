"""CuPy kernels over engine form: dequantization and matrix-vector products per ggml type.

Every kernel reads the layout defined once in :mod:`strata.engine.engine_form`:

- widened types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q1_0, Q2_0): ``const float* scales`` (plane
  at byte 0, ``n_fields`` per block) and the payload plane at byte ``4 * n_fields * n_blocks``;
- K-quants and IQ grid types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ4_XS):
  native blocks, fp16 super-scales converted in the kernel (exact);
- F32, F16, BF16 (BF16 = the pool's F32-from-BF16 re-rounded; ``u16 << 16`` is exact).

**Where the CUDA lives.** Nothing is written in Python strings: the source of a module is the
concatenation of files installed with the package, in this order:

- the type's device code, shared with the CPU kernels: :func:`strata.engine.kernel_src.assembly.type_source`
  (``engine/kernel_src/``: ``prelude.cuh``, the ggml lookup tables, the ``QK`` / ``NF`` / ``PB`` defines
  generated from the type's registry row, ``types/<TYPE>.cuh``);
- ``cuda/matvec_block.cu`` or ``cuda/matvec_plain.cu`` (``dequant`` and ``warp_dot``), then
  ``cuda/matvec.cu`` (``matvec``, ``matvec_batched``).

:data:`strata.engine.kernel_src.assembly.SUPPORTED_TYPES` is the registry rows with ``gpu_kernel=True``.
``cuda/silu.cu`` holds ``silu_mul`` (its constants generated from
:data:`strata.engine.kernel_src.assembly.EXP_CONSTANTS`), ``cuda/fused.cu`` the fused decode-step kernels
of :mod:`strata.engine.gpu.fused`.

**Bit-exactness.** Each type's ``deq_chunk`` produces 32 consecutive values of a block with the
same IEEE f32 operations, in the same order, as ``gguf.quants.dequantize`` (gguf 0.19.0's
``gguf/quants.py``, which mirrors ``dequantize_row_*`` in llama.cpp's ``ggml/src/ggml-quants.c``),
e.g. Q4_K ``(d*sc)*q - (dmin*m)``, IQ2_XXS ``((d*(0.5+s))*0.25)*grid`` then the sign. The modules
are compiled with ``--fmad=false`` (NVRTC would otherwise contract ``a*b - c`` into an FMA; NumPy
never fuses) and ``--ftz=false`` (IEEE subnormals; CuPy's own compile path forces FTZ, hence
:func:`load_module`); with that the GPU output equals gguf-py's bit for bit
(tests/test_gpu_kernels.py, proven on an H200 for every type here).
The grids and sign table come from gguf-py (``IQ2_XXS.grid``, ``IQ2_XXS.ksigns``,
``IQ4_NL.kvalues``, ``IQ2_S.grid``), byte-identical to the tables of llama.cpp's
``ggml/src/ggml-common.h``. Q1_0 and Q2_0, which gguf-py 0.19.0 lacks, equal strata's NumPy
definitions (:mod:`strata.packer.dequant_own`, after ggml-quants.c ``dequantize_row_q1_0`` /
``_q2_0``) bit for bit instead.

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

**q8 numerics** (:func:`q8_kernels_for`, :func:`quantize_kernel`): llama.cpp's CPU numerics on the GPU,
bit-identical to the CPU's ``"q8"`` kernel (engine/cpu/cpu_q8.c, cpu_q8_dots.c) - the activation quantized to
Q8_0 / Q8_K by ``cuda/q8_act.cu`` exactly as the CPU quantizes it (one layout for both: engine/kernel_src/q8_layout.h),
integer block dots by DP4A (exact), and the CPU's fixed f32 order for the block scales (``cuda/matvec_q8.cu``
over the type's ``kernel_src/q8/<TYPE>.cuh``). For the types in :data:`Q8_GPU_TYPES` (the CPU's
:data:`strata.engine.cpu.kernels.Q8_TYPES`); about one instruction per weight instead of the exact kernel's 7-8.

CuPy is imported lazily: importing this module without CuPy works; :func:`gpu_available` says
why kernels cannot run.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.packer import quants

from ..kernel_src import assembly as A
from .launch_shape import (
    Q8_GPU_TYPES,
    Q8_WARPS,
    Q8Kernels,
    q8_act_format,
    q8_launch,
    q8_shape,
)

__all__ = [
    "gpu_available",
    "kernels_for",
    "dequantize",
    "matvec",
    "matvec_batched",
    "silu_mul",
    "matvec_error_depth",
    "source_for",
    "cuda_file",
    "load_module",
    "check_matvec",
    "silu_kernel",
    "NVRTC_OPTIONS",
    "Q8_GPU_TYPES",
    "q8_act_format",
    "q8_source_for",
    "q8_kernels_for",
    "q8_launch",
    "q8_shape",
    "module_sources",
    "quantize_source",
    "silu_source",
    "quantize_kernel",
    "quantize_q8",
    "matvec_q8",
]

#: NVRTC options for every module: no FMA contraction, IEEE subnormals, IEEE division (bit-exact
#: with NumPy). ``cupy.RawModule(code=...)`` appends ``-ftz=true`` after the caller's options
#: (measured on the H200: a subnormal ``silu_mul`` result flushed to 0), so :func:`load_module`
#: compiles with NVRTC itself (cuda-python) and hands CuPy the PTX.
#: A null device pointer argument (a kernel's optional input left out).
_NULL = np.uint64(0)

NVRTC_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "-std=c++17")

#: How the kernels were compiled in this process: "nvrtc" (IEEE, the options above) or
#: "cupy-ftz" (fallback without cuda-python: subnormal results flush to zero, so the NumPy
#: replicas can differ from the device for results below 2**-126).
COMPILE_MODE: str | None = None

#: Warps per CTA and rows per warp of the matvec kernels (``WARPS`` / ``RPW`` in the source): ``ROWS_PER_WARP``
#: for the block types, ``PLAIN_ROWS_PER_WARP`` for F32 / F16 / BF16 (a warp per row: the routers' 128 rows of f32
#: were 16 CTAs at 2 rows a warp; 1 row a warp took the 30B-A3B step's replay from 4.03 to 3.92 ms on the H200,
#: bench/results/h200-2026-12-02e-profile.log). ``STRATA_MATVEC_RPW`` / ``STRATA_MATVEC_RPW_PLAIN`` /
#: ``STRATA_MATVEC_MIN_BLOCKS`` (CTAs per SM the compiler must fit: caps registers; 0 = no bound) override the
#: defaults for benchmarks (bench/bench_moe.py ``--variants``); none changes the arithmetic. Defaults: the fastest
#: of bench/matvec_variants.py on the H200 (the measurements: docs/DESIGN.md "Kernel launch shapes").
WARPS_PER_CTA = 4
ROWS_PER_WARP = int(os.environ.get("STRATA_MATVEC_RPW", "2"))
PLAIN_ROWS_PER_WARP = int(os.environ.get("STRATA_MATVEC_RPW_PLAIN", "1"))
MATVEC_MIN_BLOCKS = int(os.environ.get("STRATA_MATVEC_MIN_BLOCKS", "5"))


def rows_per_warp(type_id: int) -> int:
    """Rows a warp of ``type_id``'s matvec kernels takes (``RPW`` in its module: :data:`PLAIN_ROWS_PER_WARP` for
    the plain types, else :data:`ROWS_PER_WARP`)."""
    return PLAIN_ROWS_PER_WARP if quants.qtype(type_id).block_elems == 1 else ROWS_PER_WARP


def matvec_grid_x(type_id: int, rows: int) -> int:
    """CTAs (grid x) of a ``matvec`` / ``matvec_batched`` / ``matvec_group`` launch of ``type_id`` over ``rows``
    rows: ``WARPS_PER_CTA x rows_per_warp(type_id)`` rows a CTA."""
    per = WARPS_PER_CTA * rows_per_warp(type_id)
    return (int(rows) + per - 1) // per


#: The GPU's own CUDA source files (the kernels; the per-type device code is :mod:`strata.engine.kernel_src`'s),
#: installed with the package (pyproject.toml package-data).
CUDA_DIR = Path(__file__).resolve().parent / "cuda"


@functools.cache
def cuda_file(relpath: str) -> str:
    """The text of ``cuda/<relpath>`` (e.g. ``"matvec.cu"``, ``"q8_quant.cuh"``)."""
    return (CUDA_DIR / relpath).read_text(encoding="utf-8")


def q8_source_for(type_id: int, *, with_kernels: bool = True) -> str:
    """The CUDA source of ``type_id``'s q8 module: the type's q8 lane code
    (:func:`strata.engine.kernel_src.assembly.q8_type_source`: prelude, the activation layout, tables, generated
    defines, ``q8_lane.cuh``, ``q8/<TYPE>.cuh``) and (``with_kernels``) ``matvec_q8.cu``.
    Raises ValueError for a type without one."""
    q8_act_format(type_id)
    code = A.q8_type_source(type_id)
    shape = f"#define Q8_WARPS {Q8_WARPS}\n"
    return code + shape + cuda_file("matvec_q8.cu") if with_kernels else code


#: The kernels of a type's module (:func:`source_for`) and of its q8 module (:func:`q8_source_for`).
TYPE_KERNEL_NAMES = ("dequant", "matvec", "matvec_batched", "matvec_group", "dequant_many")
Q8_KERNEL_NAMES = ("matvec_q8", "matvec_q8_batched", "matvec_q8_group")


def module_sources() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every CUDA module this file compiles, as ``label -> (source, kernel names)``: one per GPU type
    (:func:`source_for`), one per q8 type (:func:`q8_source_for`), the quantizer and ``silu_mul`` (the fused step's is
    :func:`strata.engine.gpu.fused_ops.fused_source`). For checks that compile them without a GPU
    (tests/test_gpu_cuda_compile.py)."""
    out = {f"{quants.qtype(t).name}": (source_for(t), TYPE_KERNEL_NAMES) for t in sorted(A.SUPPORTED_TYPES)}
    out |= {f"{quants.qtype(t).name} q8": (q8_source_for(t), Q8_KERNEL_NAMES) for t in sorted(Q8_GPU_TYPES)}
    out["quantize_q8"] = (quantize_source(), ("quantize_q8",))
    out["silu_mul"] = (silu_source(), ("silu_mul",))
    return out


@functools.cache
def q8_kernels_for(type_id: int) -> Q8Kernels:
    """Compile (once per process) the q8 module of ``type_id`` (:func:`load_module`)."""
    f = load_module(q8_source_for(type_id), Q8_KERNEL_NAMES)
    qk, bpi, terms = q8_shape(type_id)
    return Q8Kernels(
        type_id,
        q8_act_format(type_id),
        f["matvec_q8"],
        f["matvec_q8_batched"],
        f["matvec_q8_group"],
        qk=qk,
        bpi=bpi,
        terms=terms,
    )


def quantize_source() -> str:
    """The CUDA source of the ``quantize_q8`` module (prelude, the q8 quantizer,
    :func:`~strata.engine.kernel_src.assembly.silu_defines` for its silu
    pre-op, ``cuda/q8_act.cu``)."""
    return A.source_file("prelude.cuh") + q8_quant_source() + A.silu_defines() + cuda_file("q8_act.cu")


@functools.lru_cache(maxsize=1)
def quantize_kernel():
    """The compiled ``quantize_q8`` kernel (``cuda/q8_act.cu``; grid ``(ceil(n / 256), rows)``, 256 threads)."""
    return load_module(quantize_source(), ("quantize_q8",))["quantize_q8"]


def q8_quant_source() -> str:
    """The activation layout and the warp-level quantizers (``q8_quant.cuh``) - after the prelude, in the
    quantizer's module and the fused step's (whose ``resid_norm`` quantizes the row it normalizes)."""
    return A.q8_layout_source() + cuda_file("q8_quant.cuh")


def quantize_grid(n: int, fmt: int, rows: int = 1) -> tuple[int, int]:
    """``quantize_q8``'s grid for ``rows`` vectors of ``n`` values in format ``fmt``: a warp per block, 8 per CTA."""
    blocks = n // (32 if fmt == 1 else 256)
    return (blocks + 7) // 8, rows


def quantize_q8(
    x,
    fmt: int,
    out=None,
    *,
    n: int | None = None,
    rows: int = 1,
    x_stride: int | None = None,
    out_stride: int | None = None,
):
    """Quantize ``rows`` activation rows of ``n`` f32 values each (``x``: cupy f32, row r at ``r * x_stride``
    floats, default ``n``; ``n`` default ``x.size // rows``) to ``fmt`` (1 = Q8_0, 2 = Q8_K) in
    engine/kernel_src/q8_layout.h's layout; returns ``cupy.uint8[rows * out_stride]`` (``out`` if given;
    ``out_stride`` default :func:`strata.layout.step.q8_act_bytes` of ``n``). Bit for bit the CPU kernels'
    quantization (:func:`strata.engine.cpu.kernels.quantize_activation`). Launches on the current CuPy stream.

    Raises:
        ValueError: ``n`` not a positive multiple of the format's block (32 or 256), or an unknown format.
    """
    import cupy as cp

    from strata.layout.step import q8_act_bytes

    n = int(x.size) // rows if n is None else int(n)
    blk = {1: 32, 2: 256}.get(fmt)
    if blk is None or n <= 0 or n % blk:
        raise ValueError(f"q8 activation format {fmt}: {n} values is not a positive multiple of {blk}")
    ob = q8_act_bytes(n) if out_stride is None else int(out_stride)
    if out is None:
        out = cp.zeros(rows * ob, dtype=cp.uint8)
    quantize_kernel()(
        quantize_grid(n, fmt, rows),
        (256,),
        (x, np.int32(n), np.int64(n if x_stride is None else x_stride), np.int32(fmt), out, np.int64(ob), _NULL, _NULL),
    )
    return out


def matvec_q8(type_id: int, buf, rows: int, ne0: int, x, out=None, split: int | None = None):
    """``y = W @ x`` with the q8 numerics (module docstring) for an engine-form weight (ggml ``ne = (ne0,
    rows)``) and ``x = cupy.float32[ne0]``: quantizes ``x`` (:func:`quantize_q8`) then one ``matvec_q8``
    launch; returns ``cupy.float32[rows]``, bit-identical to ``strata.engine.cpu.kernels.matvec(...,
    kernel="q8")`` on the native blocks.

    Raises:
        ValueError: a type without a q8 kernel, ``ne0`` not a multiple of the block, a wrong-sized buffer.
    """
    import cupy as cp

    k = q8_kernels_for(type_id)
    if ne0 % quants.qtype(type_id).block_elems or ne0 % (32 if k.fmt == 1 else 256) or rows < 0:
        raise ValueError(f"{quants.qtype(type_id).name}: matvec_q8 shape rows={rows} ne0={ne0}")
    _check_buf(buf, type_id, (ne0, rows))
    xq = quantize_q8(x, k.fmt)
    if out is None:
        out = cp.empty(rows, dtype=cp.float32)
    if rows:
        gx, nt, shmem, split = q8_launch(k, rows, ne0, split)
        k.matvec((gx,), (nt,), (buf, np.int64(rows), np.int32(ne0), xq, out, np.int32(split)), shared_mem=shmem)
    return out


def source_for(type_id: int, *, with_kernels: bool = True) -> str:
    """The CUDA source of one type's module (dequant, matvec, matvec_batched): the type's device code
    (:func:`strata.engine.kernel_src.assembly.type_source`: prelude, tables, generated defines (block types),
    ``types/<TYPE>.cuh``) and the kernel bodies (module docstring). With ``with_kernels=False`` only the
    per-type device code (``deq_chunk`` or ``load_w``): the part tests/test_gpu_kernel_source.py compiles
    and runs on the host.

    Raises:
        NotImplementedError: the type has no GPU kernel (names the ones that have).
    """
    code = A.type_source(type_id)
    if not with_kernels:
        return code
    shape = (
        f"#define RPW {rows_per_warp(type_id)}\n#define MV_BOUNDS "
        + (f"__launch_bounds__(32 * WARPS, {MATVEC_MIN_BLOCKS})" if MATVEC_MIN_BLOCKS > 0 else "")
        + "\n"
    )
    plain = quants.qtype(type_id).block_elems == 1
    return code + shape + cuda_file("matvec_plain.cu" if plain else "matvec_block.cu") + cuda_file("matvec.cu")


def silu_source() -> str:
    """``silu_mul``: out = silu_mul1(g, u) elementwise
    (:func:`strata.engine.kernel_src.assembly.silu_defines`, ``cuda/silu.cu``)."""
    return A.silu_defines() + cuda_file("silu.cu")


@functools.lru_cache(maxsize=1)
def silu_kernel():
    """The compiled ``silu_mul`` kernel (once per process)."""
    return load_module(silu_source(), ("silu_mul",))["silu_mul"]


def silu_mul(g, u, out=None):
    """``silu(g) * u`` on the GPU (float32 cupy arrays of one length), bit-identical to
    :func:`strata.engine.gpu.reference.silu_mul`."""
    import cupy as cp

    n = int(g.size)
    if out is None:
        out = cp.empty(n, dtype=cp.float32)
    if n:
        silu_kernel()(((n + 255) // 256,), (256,), (g, u, out, np.int64(n)))
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
        hint = ""
        if "InsufficientDriver" in str(e) or "NoDevice" in str(e):  # what CuPy reports on a machine without a GPU too
            hint = " - no NVIDIA GPU or driver here, or a driver older than CuPy's CUDA runtime (nvidia-smi says)"
        return False, f"no usable CUDA device ({type(e).__name__}: {e}){hint}"


@dataclass(frozen=True)
class TypeKernels:
    """The compiled kernels of one ggml type."""

    type_id: int
    block_elems: int
    plain: bool
    dequant: object
    matvec: object
    matvec_batched: object
    matvec_group: object
    dequant_many: object  # gpu/gemm.py: row ranges of many weights as f32 (a prompt chunk's tile)


def load_module(source: str, names: tuple[str, ...], *, fmad: bool = False) -> dict:
    """Compile ``source`` with NVRTC and :data:`NVRTC_OPTIONS` for the current device, load it into
    CuPy and return its kernels ``names``; falls back to ``cupy.RawModule(code=...)`` (FTZ) when
    cuda-python is missing or cannot compile. ``fmad``: let the compiler contract ``a * b + c`` into FMAs
    (``--fmad=true``: for modules whose results are not compared bit for bit with NumPy - the prompt chunk's f16
    products)."""
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
            mod = _nvrtc_module(nvrtc, source, fmad)
            funcs = {n: mod.get_function(n) for n in names}
            COMPILE_MODE = "nvrtc"
            return funcs
        except Exception as e:  # an NVRTC/cuda-python we cannot drive: CuPy's compiler, with FTZ
            COMPILE_MODE = f"cupy-ftz (own NVRTC failed: {type(e).__name__}: {e})"
    else:
        COMPILE_MODE = "cupy-ftz (cuda-python not installed)"
    mod = cp.RawModule(code=source, options=nvrtc_options(fmad))
    return {n: mod.get_function(n) for n in names}


def nvrtc_options(fmad: bool = False) -> tuple[str, ...]:
    """:data:`NVRTC_OPTIONS`, with ``--fmad=true`` in place of ``--fmad=false`` when ``fmad``."""
    return tuple("--fmad=true" if (fmad and o == "--fmad=false") else o for o in NVRTC_OPTIONS)


def _nvrtc_module(nvrtc, source: str, fmad: bool = False):
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
    opts = [o.encode() for o in nvrtc_options(fmad)] + [f"--gpu-architecture=compute_{cc}".encode()]
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


@functools.cache
def kernels_for(type_id: int) -> TypeKernels:
    """Compile (once per process) the module of ``type_id`` (see :func:`load_module`)."""
    t = quants.qtype(type_id)
    f = load_module(source_for(type_id), TYPE_KERNEL_NAMES)
    return TypeKernels(
        t.id,
        t.block_elems,
        t.block_elems == 1,
        f["dequant"],
        f["matvec"],
        f["matvec_batched"],
        f["matvec_group"],
        f["dequant_many"],
    )


def _check_buf(buf, type_id: int, ne: tuple[int, ...]):
    from strata.engine.engine_form import engine_layout

    src = quants.BF16.id if type_id == quants.BF16.id else type_id
    pool = quants.F32.id if type_id == quants.BF16.id else type_id
    lay = engine_layout(pool, src, ne)
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != lay.nbytes:
        raise ValueError(
            f"{quants.qtype(type_id).name} {list(ne)}: engine-form buffer must be 1-D uint8 of "
            f"{lay.nbytes} bytes, got {buf.dtype} {buf.shape}"
        )
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
        k.dequant(
            ((n_work + per_cta - 1) // per_cta,),
            (256 if k.plain else 32 * WARPS_PER_CTA,),
            (buf, np.int64(lay.n_blocks), out),
        )
    return out


def check_matvec(k: TypeKernels, rows: int, ne0: int):
    """Refuse a matvec shape the kernels of ``k`` cannot run (ValueError naming the type): ``ne0``
    not a multiple of the block size (or of 32 for block types), ``ne0 >= 2**31``, ``rows < 0``."""
    if ne0 % k.block_elems or (not k.plain and ne0 % 32):
        raise ValueError(
            f"{quants.qtype(k.type_id).name}: ne0={ne0} is not a multiple of the block size {k.block_elems}"
        )
    if ne0 >= 2**31 or rows < 0:
        raise ValueError(f"matvec shape rows={rows} ne0={ne0} out of range")


def matvec(type_id: int, buf, rows: int, ne0: int, x, out=None):
    """``y = W @ x`` for an engine-form weight ``W`` (ggml ``ne = (ne0, rows)``, numpy
    ``[rows, ne0]``) and ``x = cupy.float32[ne0]``; returns ``cupy.float32[rows]`` (``out`` if
    given). Launches on the current CuPy stream; allocates only when ``out`` is None."""
    import cupy as cp

    k = kernels_for(type_id)
    check_matvec(k, rows, ne0)
    if out is None:
        _check_buf(buf, type_id, (ne0, rows))
        out = cp.empty(rows, dtype=cp.float32)
    if rows:
        k.matvec(
            (matvec_grid_x(type_id, rows),),
            (32 * WARPS_PER_CTA,),
            (buf, np.int64(rows), np.int32(ne0), x, out),
        )
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
    check_matvec(k, rows, ne0)
    n = int(bases.size)
    if x_stride is None:
        x_stride = ne0
    if out is None:
        out = cp.empty((n, rows), dtype=cp.float32)
    if n and rows:
        k.matvec_batched(
            (matvec_grid_x(type_id, rows), n),
            (32 * WARPS_PER_CTA,),
            (bases, np.int64(rows), np.int32(ne0), X, np.int64(x_stride), out),
        )
    return out


def matvec_error_depth(type_id: int, ne0: int) -> int:
    """Longest chain of f32 roundings behind one matvec output (see module doc): the error bound
    is ``depth * 2**-24 * sum_j |W[r, j] * x[j]|`` (plus the tiny gamma_k second-order term)."""
    t = quants.qtype(type_id)
    if t.block_elems == 1:
        return 1 + math.ceil(ne0 / 32) + 5
    return 33 + math.ceil((ne0 // 32) / 32) + 5
