"""The one registry of ggml tensor types: every per-type fact strata uses, in one row per type.

Every ggml type id that exists in ggml master (0..42, minus the removed ids) is a row of
:data:`QTYPES` (a :class:`QuantType`) carrying everything the three tools and the engine need
to know about that type:

- **file layout**: block size in elements and in bytes, the fp16 super-scale fields inside a block
  (:class:`Fp16Field`: name and byte offset, the offset written as the sum of the struct members
  before it; block structs in llama.cpp ``ggml/src/ggml-common.h``, lines 180-459
  of the tree vendored in llama-cpp-python 0.3.36; type ids in ``ggml/include/ggml.h``:
  NVFP4=40, Q1_0=41, Q2_0=42; sizes agree with ``gguf.constants.GGML_QUANT_SIZES`` of gguf
  0.19.0 except Q8_1, see its row);
- **engine form**: whether the engine widens the fp16 scales to an f32 scale plane plus a
  payload plane (types whose block is fp16 scale(s) at byte 0 followed by a payload) or keeps
  the native block (K-quants, IQ grid types), and the resulting per-block geometry
  (:attr:`QuantType.engine_scale_fields`, :attr:`QuantType.engine_payload_bytes`; the byte
  layout itself is :mod:`strata.engine.engine_form`);
- **llama.cpp CPU numerics**: the activation format llama.cpp's CPU backend quantizes the
  activation to before a dot product with a weight of this type (``type_traits_cpu[].vec_dot_type``
  in ``ggml/src/ggml-cpu/ggml-cpu.c``; :mod:`strata.engine.numerics` emulates it);
- **CPU dequantization**: a NumPy view (F32, F16), gguf-py 0.19.0's class
  ``gguf.quants.<NAME>``, or strata's own NumPy function (:mod:`strata.packer.dequant_own`, for
  Q1_0 / Q2_0, which gguf-py lacks); :mod:`strata.engine.dequant` dispatches through the row;
- **GPU kernel**: whether ``engine/kernel_src/types/<NAME>.cuh`` exists;
  :mod:`strata.engine.kernel_src.assembly` generates the kernel's ``QK`` / ``NF`` / ``PB`` defines from
  the row (:func:`strata.engine.kernel_src.assembly.type_defines`).

A type is **engine-supported** when it has both a CPU dequantizer and a GPU kernel.

**Adding a quant type** is one row here, plus

- if gguf-py cannot dequantize it: a NumPy dequantizer in :mod:`strata.packer.dequant_own`
  (``uint8[n_blocks, block_bytes] -> float32[n_blocks, block_elems]``) named by the row's
  ``own_dequantize``;
- if the engine gets a kernel (``gpu_kernel=True``): one CUDA device-code file
  ``engine/kernel_src/types/<NAME>.cuh`` defining ``deq_chunk`` (block types) or ``load_w``
  (plain types), bit-exact with the CPU dequantizer (tests/test_gpu_kernel_source.py checks it
  on the host, tests/test_gpu_kernels.py on a GPU).

The engine, the budget audit and the packer read the type only through its row. The one other
per-type table is test data: :func:`strata.testing.blocks.make_random_blocks` keeps each type's
largest decoded ``|value| / d`` to draw valid random blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from strata.packer import dequant_own


class GGMLTypeError(ValueError):
    """A ggml type id that strata does not know (never existed or removed from ggml).

    The message names the tensor, the file and the id when the caller gives them.
    """


class ShapeError(ValueError):
    """A tensor shape that its type cannot hold (ne[0] not a multiple of the block, negative or
    overflowing element counts)."""


#: Elements per super-block of the K-quant, IQ (but IQ4_NL) and TQ types (ggml-common.h ``QK_K``).
QK_K = 256
#: Bytes of one ``ggml_half``: an fp16 scale field.
HALF = 2


class Fp16Field(NamedTuple):
    """One fp16 super-scale field inside a block: its member name in the ggml block struct (``d``, ``dmin``,
    ``m``, ``s``) and its byte offset, written in the rows as the sum of the sizes of the members before it
    (ggml-common.h; gguf-py's ``gguf/quants.py`` splits a block the same way, candle's ``k_quants.rs`` names
    them as struct fields). The field is :data:`HALF` bytes long."""

    name: str
    offset: int


#: ``d`` first (``ggml_half d`` at byte 0, then the quants): Q4_0, Q5_0, Q8_0, the IQ types, Q1_0, Q2_0.
D_FIRST = (Fp16Field("d", 0),)
#: ``d`` then ``m`` (the block minimum): Q4_1, Q5_1.
D_M_FIRST = (Fp16Field("d", 0), Fp16Field("m", HALF))
#: ``d`` then ``s`` (``d`` times the sum of the quants): Q8_1.
D_S_FIRST = (Fp16Field("d", 0), Fp16Field("s", HALF))
#: ``d`` then ``dmin`` (super-block scale of the mins): Q4_K, Q5_K.
D_DMIN_FIRST = (Fp16Field("d", 0), Fp16Field("dmin", HALF))
#: block_q2_K: ``scales[QK_K/16]``, ``qs[QK_K/4]``, then ``d`` and ``dmin``.
Q2_K_SCALES = (Fp16Field("d", QK_K // 16 + QK_K // 4), Fp16Field("dmin", QK_K // 16 + QK_K // 4 + HALF))
#: block_q3_K: ``hmask[QK_K/8]``, ``qs[QK_K/4]``, ``scales[12]``, then ``d``.
Q3_K_SCALES = (Fp16Field("d", QK_K // 8 + QK_K // 4 + 12),)
#: block_q6_K: ``ql[QK_K/2]``, ``qh[QK_K/4]``, ``scales[QK_K/16]``, then ``d``.
Q6_K_SCALES = (Fp16Field("d", QK_K // 2 + QK_K // 4 + QK_K // 16),)
#: block_tq1_0: ``qs[(QK_K - 4 * QK_K / 64) / 5]``, ``qh[QK_K/64]``, then ``d``.
TQ1_0_SCALES = (Fp16Field("d", (QK_K - 4 * QK_K // 64) // 5 + QK_K // 64),)
#: block_tq2_0: ``qs[QK_K/4]``, then ``d``.
TQ2_0_SCALES = (Fp16Field("d", QK_K // 4),)

#: Activation formats of llama.cpp's CPU backend (see :attr:`QuantType.act_format`).
ActFormat = Literal["q8_0", "q8_K", "f16", "bf16", "f32"]
#: How the CPU reference path dequantizes a type (see :attr:`QuantType.cpu_dequant`).
CpuDequant = Literal["view", "gguf", "strata"]


@dataclass(frozen=True)
class QuantType:
    """One ggml tensor type: every per-type fact strata uses (module docstring).

    Attributes:
        id: ggml type id (``enum ggml_type``), e.g. 12 for Q4_K.
        name: ggml name, e.g. ``"Q4_K"``.
        block_elems: elements per block (1 for plain types, 32 / 64 / 128 / 256 for quants).
        block_bytes: bytes per block in the GGUF file (ggml ``type_size``).
        fp16_scales: every fp16 super-scale field inside one block (:class:`Fp16Field`: ``d``,
            ``dmin``, ``m``, ``s`` and its byte offset; :attr:`fp16_scale_offsets` the offsets). Empty for
            types with no fp16 super-scale (plain types, Q8_K's f32 ``d``, MXFP4/NVFP4's 8-bit scales,
            IQ1_M's packed scale).
        widened: True when the engine holds this type as an f32 scale plane plus a
            payload plane (each fp16 scale widened exactly to f32).
        act_format: what llama.cpp's CPU backend quantizes the activation to before a dot
            product with a weight of this type (``vec_dot_type`` in ``ggml-cpu.c``): ``"q8_0"``
            (Q4_1/Q5_1 meet Q8_1 there, whose values are Q8_0's: reported as ``"q8_0"``),
            ``"q8_K"``, ``"f16"``, ``"bf16"`` or ``"f32"`` (unchanged; also the activation-only
            types Q8_1 and Q8_K, which are never weights).
        cpu_dequant: how strata's CPU path dequantizes it: ``"view"`` (IEEE floats of
            ``block_bytes`` bytes, read through a NumPy dtype view: F32, F16), ``"gguf"``
            (gguf-py 0.19.0's ``gguf.quants.<name>``), ``"strata"`` (:attr:`own_dequantize`), or
            None (no dequantizer in strata's stack).
        own_dequantize: strata's NumPy dequantizer (``uint8[n_blocks, block_bytes]`` ->
            ``float32[n_blocks, block_elems]``) when ``cpu_dequant == "strata"``, else None.
        gpu_kernel: True when ``engine/kernel_src/types/<name>.cuh`` holds the type's CUDA device
            code (:mod:`strata.engine.gpu.kernels`).
        q8_kernel: True when strata has the type's integer product with llama.cpp's CPU numerics (activation
            quantized to ``act_format``), on the CPU (engine/cpu/cpu_q8_dots.c) and the GPU
            (``engine/kernel_src/q8/<name>.cuh``), bit-identical to each other (the ``q8`` kernels).
    """

    id: int
    name: str
    block_elems: int
    block_bytes: int
    fp16_scales: tuple[Fp16Field, ...] = ()
    widened: bool = False
    act_format: ActFormat = "f32"
    cpu_dequant: CpuDequant | None = None
    own_dequantize: Callable | None = None
    gpu_kernel: bool = False
    q8_kernel: bool = False

    def __post_init__(self):
        if (self.cpu_dequant == "strata") != (self.own_dequantize is not None):
            raise ValueError(f"{self.name}: own_dequantize is given exactly when cpu_dequant is 'strata'")
        if self.widened and not self.fp16_scale_offsets:
            raise ValueError(f"{self.name}: a widened type needs fp16 scale fields")

    @property
    def fp16_scale_offsets(self) -> tuple[int, ...]:
        """Byte offsets, inside one block, of the fp16 super-scale fields (:attr:`fp16_scales`), in order."""
        return tuple(f.offset for f in self.fp16_scales)

    @property
    def is_quantized(self) -> bool:
        """True for block types (block_elems > 1)."""
        return self.block_elems > 1

    @property
    def engine_supported(self) -> bool:
        """True when strata's engine runs the type: a CPU dequantizer and a GPU kernel."""
        return self.gpu_kernel and self.cpu_dequant is not None

    @property
    def widen_extra_bytes(self) -> int:
        """Bytes added per block when the engine widens the fp16 scales to f32 (2 per field), 0 if not widened."""
        return 2 * len(self.fp16_scale_offsets) if self.widened else 0

    @property
    def engine_block_bytes(self) -> int:
        """Bytes per block in engine form: ``block_bytes + widen_extra_bytes``
        (= ``4 * engine_scale_fields + engine_payload_bytes``)."""
        return self.block_bytes + self.widen_extra_bytes

    @property
    def payload_block_bytes(self) -> int:
        """Bytes per block left after removing the fp16 scale fields (widened types only)."""
        return self.block_bytes - 2 * len(self.fp16_scale_offsets)

    @property
    def engine_scale_fields(self) -> int:
        """f32 scales per block in the engine form's scale plane: the number of fp16 fields for
        widened types, 0 for native blocks (the kernels' ``NF``)."""
        return len(self.fp16_scale_offsets) if self.widened else 0

    @property
    def engine_payload_bytes(self) -> int:
        """Bytes per block in the engine form's payload plane: :attr:`payload_block_bytes` for
        widened types, the native ``block_bytes`` otherwise (the kernels' ``PB``)."""
        return self.payload_block_bytes if self.widened else self.block_bytes


def _t(id_, name, be, bb, scales=(), *, widened=False, act="f32", cpu=None, own=None, gpu=False, q8=False):
    return QuantType(id_, name, be, bb, tuple(scales), widened, act, cpu, own, gpu, q8)


#: Every ggml tensor type id that exists, keyed by id. Columns: id, name, block elems, block
#: bytes, fp16 scale fields; engine form; llama.cpp CPU activation; CPU dequantizer; GPU kernel; q8 kernels.
QTYPES: dict[int, QuantType] = {
    t.id: t
    for t in (
        _t(0, "F32", 1, 4, act="f32", cpu="view", gpu=True),
        _t(1, "F16", 1, 2, act="f16", cpu="view", gpu=True),
        _t(2, "Q4_0", 32, 18, D_FIRST, widened=True, act="q8_0", cpu="gguf", gpu=True, q8=True),
        _t(3, "Q4_1", 32, 20, D_M_FIRST, widened=True, act="q8_0", cpu="gguf", gpu=True),  # meets Q8_1
        _t(6, "Q5_0", 32, 22, D_FIRST, widened=True, act="q8_0", cpu="gguf", gpu=True, q8=True),
        _t(7, "Q5_1", 32, 24, D_M_FIRST, widened=True, act="q8_0", cpu="gguf", gpu=True),  # meets Q8_1
        _t(8, "Q8_0", 32, 34, D_FIRST, widened=True, act="q8_0", cpu="gguf", gpu=True, q8=True),
        # Q8_1 is an activation-only type: 36 B in ggml master (d, s fp16 + 32 int8);
        # the gguf 0.19.0 wheel still says 40. It never appears in a model file.
        _t(9, "Q8_1", 32, 36, D_S_FIRST),
        _t(10, "Q2_K", QK_K, 84, Q2_K_SCALES, act="q8_K", cpu="gguf", gpu=True, q8=True),
        _t(11, "Q3_K", QK_K, 110, Q3_K_SCALES, act="q8_K", cpu="gguf", gpu=True, q8=True),
        _t(12, "Q4_K", QK_K, 144, D_DMIN_FIRST, act="q8_K", cpu="gguf", gpu=True, q8=True),
        _t(13, "Q5_K", QK_K, 176, D_DMIN_FIRST, act="q8_K", cpu="gguf", gpu=True, q8=True),
        _t(14, "Q6_K", QK_K, 210, Q6_K_SCALES, act="q8_K", cpu="gguf", gpu=True, q8=True),
        _t(15, "Q8_K", QK_K, 292),  # activation-only; d is f32: nothing to widen
        _t(16, "IQ2_XXS", QK_K, 66, D_FIRST, act="q8_K", cpu="gguf", gpu=True),
        _t(17, "IQ2_XS", QK_K, 74, D_FIRST, act="q8_K", cpu="gguf", gpu=True),
        _t(18, "IQ3_XXS", QK_K, 98, D_FIRST, act="q8_K", cpu="gguf", gpu=True),
        _t(19, "IQ1_S", QK_K, 50, D_FIRST, act="q8_K", cpu="gguf"),
        _t(20, "IQ4_NL", 32, 18, D_FIRST, widened=True, act="q8_0", cpu="gguf", gpu=True, q8=True),
        _t(21, "IQ3_S", QK_K, 110, D_FIRST, act="q8_K", cpu="gguf"),
        _t(22, "IQ2_S", QK_K, 82, D_FIRST, act="q8_K", cpu="gguf", gpu=True),
        _t(23, "IQ4_XS", QK_K, 136, D_FIRST, act="q8_K", cpu="gguf", gpu=True),
        _t(24, "I8", 1, 1),
        _t(25, "I16", 1, 2),
        _t(26, "I32", 1, 4),
        _t(27, "I64", 1, 8),
        _t(28, "F64", 1, 8),
        _t(29, "IQ1_M", QK_K, 56, act="q8_K", cpu="gguf"),  # fp16 super-scale packed in nibbles: no field to widen
        _t(30, "BF16", 1, 2, act="bf16", cpu="gguf", gpu=True),
        _t(34, "TQ1_0", QK_K, 54, TQ1_0_SCALES, act="q8_K", cpu="gguf"),
        _t(35, "TQ2_0", QK_K, 66, TQ2_0_SCALES, act="q8_K", cpu="gguf"),
        _t(39, "MXFP4", 32, 17, act="q8_0", cpu="gguf"),
        _t(40, "NVFP4", 64, 36, act="q8_0", cpu="gguf"),
        # gguf-py 0.19.0 lacks Q1_0 / Q2_0: strata's NumPy definitions after ggml-quants.c
        _t(
            41,
            "Q1_0",
            128,
            18,
            D_FIRST,
            widened=True,
            act="q8_0",
            cpu="strata",
            own=dequant_own.dequantize_q1_0,
            gpu=True,
        ),
        _t(
            42,
            "Q2_0",
            64,
            18,
            D_FIRST,
            widened=True,
            act="q8_0",
            cpu="strata",
            own=dequant_own.dequantize_q2_0,
            gpu=True,
        ),
    )
}

#: Ids that ggml once used and removed (Q4_2, Q4_3, Q4_0_4_4, Q4_0_4_8, Q4_0_8_8, IQ4_NL_4_4, ...).
REMOVED_IDS: frozenset[int] = frozenset({4, 5, 31, 32, 33, 36, 37, 38})

_BY_NAME = {t.name: t for t in QTYPES.values()}

F32 = QTYPES[0]
F16 = QTYPES[1]
BF16 = QTYPES[30]

#: Largest element count a ggml tensor may have (ggml uses int64_t ne).
MAX_ELEMENTS = 2**63 - 1


def qtype(type_id: int, *, tensor: str | None = None, file: str | None = None) -> QuantType:
    """Return the registry row for ``type_id``.

    Raises:
        GGMLTypeError: the id is unknown or was removed from ggml; the message names
            the tensor and the file when given.
    """
    t = QTYPES.get(type_id)
    if t is not None:
        return t
    where = ""
    if tensor is not None:
        where += f" tensor {tensor!r}"
    if file is not None:
        where += f" in {file}"
    why = "was removed from ggml" if type_id in REMOVED_IDS else "is not a ggml type"
    raise GGMLTypeError(
        f"{where.strip() or 'tensor'}: type id {type_id} {why} (known ids: 0-42 less {sorted(REMOVED_IDS)})"
    )


def by_name(name: str) -> QuantType:
    """Registry row by ggml name (``"Q4_K"``). Raises KeyError naming the known names."""
    try:
        return _BY_NAME[name.upper()]
    except KeyError:
        raise KeyError(f"unknown ggml type name {name!r}; known: {', '.join(sorted(_BY_NAME))}") from None


def n_elements(ne: tuple[int, ...] | list[int]) -> int:
    """Product of ``ne`` (ggml order). Raises ShapeError on a negative dim or > 2**63-1 elements."""
    n = 1
    for d in ne:
        d = int(d)
        if d < 0:
            raise ShapeError(f"negative dimension in ne={list(ne)}")
        n *= d
    if n > MAX_ELEMENTS:
        raise ShapeError(f"element count {n} of ne={list(ne)} overflows int64 (max {MAX_ELEMENTS})")
    return n


def tensor_nbytes(type_id: int, ne: tuple[int, ...] | list[int], *, tensor: str | None = None) -> int:
    """Bytes a tensor of this type and shape occupies in a GGUF file (ggml ``ggml_nbytes``).

    ``ne`` is in ggml order (``ne[0]`` = row length). Formula: ``n_elements / block_elems *
    block_bytes``, valid because ggml requires ``ne[0] % block_elems == 0`` (gguf.cpp checks it).

    Raises:
        GGMLTypeError: unknown type id.
        ShapeError: ``ne[0]`` not a multiple of the block size, or element-count overflow.
    """
    t = qtype(type_id, tensor=tensor)
    try:
        n = n_elements(ne)
    except ShapeError as e:
        raise ShapeError(f"{tensor or 'tensor'}: {e}") from None
    ne0 = int(ne[0]) if len(ne) else 1
    if ne0 % t.block_elems:
        raise ShapeError(
            f"{tensor or 'tensor'}: ne[0]={ne0} is not a multiple of the {t.name} block size {t.block_elems}"
        )
    return n // t.block_elems * t.block_bytes


def row_nbytes(type_id: int, ne0: int) -> int:
    """Bytes of one row of ``ne0`` elements (ggml ``ggml_row_size``). Raises like :func:`tensor_nbytes`."""
    return tensor_nbytes(type_id, (ne0,))


def engine_nbytes(pool_type: int, src_type: int, ne: tuple[int, ...] | list[int]) -> int:
    """Bytes a tensor occupies in engine form (what the engine uploads to VRAM).

    - widened types: ``n_blocks * (block_bytes + 2 * n_fp16_fields)`` (f32 scale plane + payload plane);
    - an F32 pool tensor whose source was BF16: 2 bytes per element (re-rounded to bf16, exact);
    - everything else: its pool bytes.

    Raises like :func:`tensor_nbytes`.
    """
    if pool_type == F32.id and src_type == BF16.id:
        return 2 * n_elements(ne)
    t = qtype(pool_type)
    nb = tensor_nbytes(pool_type, ne)
    return nb // t.block_bytes * t.engine_block_bytes


def widened_extra_nbytes(type_id: int, ne: tuple[int, ...] | list[int]) -> int:
    """Bytes added to a tensor by widening its fp16 scales to f32 (0 for types not widened)."""
    t = qtype(type_id)
    return tensor_nbytes(type_id, ne) // t.block_bytes * t.widen_extra_bytes


def bf16_to_f32_bits(u16):
    """BF16 bit patterns (numpy uint16, any shape) -> F32 bit patterns (uint32): ``u16 << 16``.

    Exact for every pattern (ggml ``ggml_compute_bf16_to_fp32``). This is how the pack stores
    BF16 tensors in the pool."""
    import numpy as np

    return np.asarray(u16, dtype="<u2").astype("<u4") << 16


def f32_to_bf16_rne(u32):
    """F32 bit patterns (uint32) -> BF16 bit patterns (uint16), round to nearest even.

    Same as ggml ``ggml_compute_fp32_to_bf16`` (ggml-impl.h) except for NaNs whose low 16 bits
    are zero, which keep their exact upper half instead of being forced quiet: such values
    came from bf16, so re-rounding a pool tensor to 16 bits is bit-exact for all 65,536
    patterns (tested). Other NaNs get the quiet bit, as in ggml, so rounding cannot carry a
    NaN into infinity."""
    import numpy as np

    u = np.asarray(u32, dtype="<u4")
    r = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    lossy_nan = nan & ((u & 0xFFFF) != 0)
    r = np.where(nan, (u >> 16).astype("<u2"), r)
    r = np.where(lossy_nan, r | 0x40, r)
    return r.astype("<u2")
