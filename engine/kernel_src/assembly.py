"""The source assembly of the per-type device code both devices compile (files of this folder, concatenated;
nothing is ``#include``d).

- :func:`type_source` - one type's dequantization code, in this order: ``prelude.cuh`` (typedefs, unaligned
  loads, ``h2f`` with its host twin, ``scale_min_k4``); the ggml lookup tables the type's code names, built
  from gguf-py's copies; for block types :func:`type_defines` - ``QK`` / ``NF`` / ``PB`` GENERATED from the
  type's registry row (:class:`strata.packer.quants.QuantType`: ``block_elems``, ``engine_scale_fields``,
  ``engine_payload_bytes``; plain types' code indexes elements and needs no block geometry); then
  ``types/<TYPE>.cuh``, the type's only hand-written code: ``deq_chunk`` (block types) or ``load_w`` (F32,
  F16, BF16). The GPU appends its matvec kernels (:func:`strata.engine.gpu.kernels.source_for`), the CPU its
  driver (:func:`strata.engine.cpu.kernels.source`).
- :func:`q8_type_source` - one type's q8 lane code: prelude, the activation layout, tables, defines,
  ``q8_lane.cuh`` and ``q8/<TYPE>.cuh`` (the GPU appends ``matvec_q8.cu``:
  :func:`strata.engine.gpu.kernels.q8_source_for`).
- :func:`q8_layout_source` - ``q8_layout.h``, the quantized activation's one layout, with the function
  qualifier of the device that compiles it (``Q8_FN``).

:data:`SUPPORTED_TYPES` is the registry rows with ``gpu_kernel=True``; giving a new type device code is its
row plus its ``types/<TYPE>.cuh`` (tests check that the files and the rows agree). The grids and sign table
come from gguf-py (``IQ2_XXS.grid``, ``IQ2_XXS.ksigns``, ``IQ4_NL.kvalues``, ``IQ2_S.grid``), byte-identical
to the tables of llama.cpp's ``ggml/src/ggml-common.h``.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import numpy as np

from strata.packer import quants

#: The source files, installed with the package (pyproject.toml package-data).
SRC_DIR = Path(__file__).resolve().parent

#: ``STRATA_PLAIN_I2F=1``: the per-value int -> f32 conversions by I2F instead of prelude.cuh ``i2f``'s
#: exact add-and-subtract (the same floats; for bench/matvec_variants.py and bench_gpu.py A/B runs only).
PLAIN_I2F = os.environ.get("STRATA_PLAIN_I2F") == "1"

#: ggml type ids with device code: the registry rows with ``gpu_kernel`` (each has ``types/<NAME>.cuh``).
SUPPORTED_TYPES: frozenset[int] = frozenset(t.id for t in quants.QTYPES.values() if t.gpu_kernel)

#: ``Q8_FN`` of :func:`q8_layout_source` for the GPU's device code.
DEVICE_FN = "__device__ __forceinline__"


#: Constants of the experts' activation's exp (:func:`strata.engine.gpu.reference.exp_portable`) as float32: one
#: definition for the NumPy replica, the CUDA kernels and the CPU kernels (:func:`silu_defines` embeds their bits).
EXP_CONSTANTS: dict[str, np.float32] = {
    "LO": np.float32(-80.0),
    "HI": np.float32(88.0),
    "LOG2E": np.float32(1.4426950408889634),
    "HALF": np.float32(0.5),
    "LN2_HI": np.float32(0.693145751953125),
    "LN2_LO": np.float32(1.4286068203094172e-06),
    "C7": np.float32(1.0 / 5040.0),
    "C6": np.float32(1.0 / 720.0),
    "C5": np.float32(1.0 / 120.0),
    "C4": np.float32(1.0 / 24.0),
    "C3": np.float32(1.0 / 6.0),
    "C2": np.float32(0.5),
    "ONE": np.float32(1.0),
}


def silu_defines() -> str:
    """``silu.cuh`` (``silu_mul1(g, u)`` = (g / (1 + exp_portable(-g))) * u, the exact op sequence of
    :func:`strata.engine.gpu.reference.silu_mul`) with :data:`EXP_CONSTANTS` prepended as defines of their f32 bits:
    the GPU's ``silu_mul`` / ``quantize_q8`` modules and the CPU kernels (engine/cpu/cpu_q8.c) compile this text."""
    consts = "".join(
        f"#define {k} __uint_as_float(0x{int(np.float32(v).view(np.uint32)):08x}u)\n" for k, v in EXP_CONSTANTS.items()
    )
    return consts + source_file("silu.cuh")


@functools.cache
def source_file(relpath: str) -> str:
    """The text of ``<this folder>/<relpath>`` (e.g. ``"prelude.cuh"``, ``"types/Q4_K.cuh"``)."""
    return (SRC_DIR / relpath).read_text(encoding="utf-8")


def type_defines(type_id: int) -> str:
    """The ``#define`` lines a type's kernels need, generated from its registry row:
    ``QK`` = values per block (``block_elems``), ``NF`` = f32 scales per block in the engine
    form's scale plane (``engine_scale_fields``; 0 for native blocks), ``PB`` = bytes per block in
    the payload plane (``engine_payload_bytes``; the native block bytes for native types)."""
    t = quants.qtype(type_id)
    return f"#define QK {t.block_elems}\n#define NF {t.engine_scale_fields}\n#define PB {t.engine_payload_bytes}\n"


def q8_layout_source(fn: str = DEVICE_FN) -> str:
    """``q8_layout.h`` (the quantized activation's layout: ``act_d_off``, ``act_s_off``, ``act_t_off``,
    ``act_nbytes_of``) after ``#define Q8_FN <fn>``: the GPU's :data:`DEVICE_FN`, the CPU's ``static inline``."""
    return f"#define Q8_FN {fn}\n" + source_file("q8_layout.h") + "\n"


def _c_array(ctype: str, name: str, values, align: int = 0) -> str:
    vals = ",".join(str(int(v)) for v in values)
    al = f"__align__({align}) " if align else ""
    return f"__device__ {al}const {ctype} {name}[{len(values)}] = {{{vals}}};\n"


@functools.cache
def _tables_source(code: str) -> str:
    """The ggml lookup tables that ``code`` uses (comments aside), as CUDA arrays built from
    gguf-py's copies (byte-identical to ``ggml-common.h``: ksigns_iq2xs, kvalues_iq4nl,
    iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid)."""
    from gguf import quants as gq

    code = re.sub(r"//[^\n]*", "", code)

    src = []
    if "ksigns_iq2xs" in code:
        src.append(_c_array("u8", "ksigns_iq2xs", np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)))
    if "kvalues_iq4nl" in code:
        src.append(_c_array("i8", "kvalues_iq4nl", gq.IQ4_NL.kvalues))
    for cls, name in (
        (gq.IQ2_XXS, "iq2xxs_grid"),
        (gq.IQ2_XS, "iq2xs_grid"),
        (gq.IQ2_S, "iq2s_grid"),
        (gq.IQ3_XXS, "iq3xxs_grid"),
    ):
        if name not in code:
            continue
        cls.init_grid()
        g = np.asarray(cls.grid, dtype=np.float32).reshape(-1)
        gi = g.astype(np.uint8)
        assert np.array_equal(gi.astype(np.float32), g), name  # small non-negative integers
        # a grid entry is read as ONE word (8 bytes; iq3xxs_grid's 4): aligned to its entry size
        src.append(_c_array("u8", name, gi, align=4 if name == "iq3xxs_grid" else 8))
    if any(name in code for name in GRID_NAMES):
        src.append(_GRID_ENTRY)
    return "".join(src)


#: The grid tables :func:`_tables_source` emits (``u8``, 8 bytes an entry; ``iq3xxs_grid`` 4).
GRID_NAMES = ("iq2xxs_grid", "iq2xs_grid", "iq2s_grid", "iq3xxs_grid")

# A grid entry as one word: one load a lane on the device, where 8 byte loads of lanes gathering from different
# lines of the table were serialized; byte by byte on the host (any byte order). Byte j of the entry
# (the device is little-endian, as the table's bytes are laid out) is grid_byte(entry, j): table[8 i + j].
_GRID_ENTRY = """#if defined(__CUDA_ARCH__)
__device__ __forceinline__ unsigned long long grid_entry8(const u8* t, const u32 i) {
    return *(const unsigned long long*)(t + 8 * i);
}
__device__ __forceinline__ u32 grid_entry4(const u8* t, const u32 i) { return *(const u32*)(t + 4 * i); }
#else
static inline unsigned long long grid_entry8(const u8* t, const u32 i) {
    unsigned long long v = 0;
    for (int j = 7; j >= 0; --j) v = (v << 8) | t[8 * i + j];
    return v;
}
static inline u32 grid_entry4(const u8* t, const u32 i) {
    return (u32)t[4 * i] | ((u32)t[4 * i + 1] << 8) | ((u32)t[4 * i + 2] << 16) | ((u32)t[4 * i + 3] << 24);
}
#endif
__device__ __forceinline__ int grid_byte(const unsigned long long g, const int j) {
    return (int)((g >> (8 * j)) & 255ull);
}
"""


def type_source(type_id: int) -> str:
    """The per-type device code of ``type_id`` (module docstring): prelude, tables, generated defines
    (block types) and ``types/<TYPE>.cuh`` (``deq_chunk`` or ``load_w``) - what both devices compile and
    tests/test_gpu_kernel_source.py compiles and runs on the host.

    Raises:
        NotImplementedError: the type has no GPU kernel (names the ones that have).
    """
    t = quants.qtype(type_id)
    if not t.gpu_kernel:
        raise NotImplementedError(
            f"no GPU kernel for {t.name} (type {t.id}); have {sorted(quants.qtype(i).name for i in SUPPORTED_TYPES)}"
        )
    type_code = source_file(f"types/{t.name}.cuh")
    return (
        ("#define STRATA_PLAIN_I2F 1\n" if PLAIN_I2F else "")
        + source_file("prelude.cuh")
        + _tables_source(type_code)
        + ("" if t.block_elems == 1 else type_defines(t.id))
        + type_code
    )


def q8_type_source(type_id: int) -> str:
    """The q8 lane code of ``type_id`` (``lane_sums``, ``blk_scales``; module docstring): prelude, the activation
    layout (:data:`DEVICE_FN`), tables, generated defines, ``q8_lane.cuh`` (the lane code's shared helpers) and
    ``q8/<TYPE>.cuh``. Raises FileNotFoundError for a type without one (the GPU checks first:
    :func:`strata.engine.gpu.kernels.q8_act_format`)."""
    t = quants.qtype(type_id)
    type_code = source_file(f"q8/{t.name}.cuh")
    return (
        source_file("prelude.cuh")
        + q8_layout_source()
        + _tables_source(type_code)
        + type_defines(t.id)
        + source_file("q8_lane.cuh")
        + type_code
    )


__all__ = [
    "DEVICE_FN",
    "PLAIN_I2F",
    "SRC_DIR",
    "SUPPORTED_TYPES",
    "q8_layout_source",
    "q8_type_source",
    "source_file",
    "type_defines",
    "type_source",
]
