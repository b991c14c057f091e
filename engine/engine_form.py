"""Engine form: THE definition of how a weight sits in the engine's memory (VRAM or host).

The pack stores weights in *pool form* (``pool.bin``: source GGUF bytes, BF16 promoted to F32)
and the experts stay in the GGUF shards in native blocks. Before a kernel reads a tensor the
engine converts it to *engine form*:

- **Widened types** (``strata.packer.quants.QTYPES[t].widened``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  IQ4_NL, Q1_0, Q2_0): every kernel takes ``const float* scales``, so the blocks are split into

  * a **scale plane**: ``float32[n_blocks, n_fields]``, each fp16 scale field (``d``, and ``m``
    for Q4_1/Q5_1; offsets ``QuantType.fp16_scale_offsets``) widened to f32 - exact, every fp16
    value is an f32 value; ``n_fields`` (``QuantType.engine_scale_fields``) is 1 or 2;
  * a **payload plane**: ``uint8[n_blocks, block_bytes - 2*n_fields]``, the block bytes with
    the scale fields removed, in their original order.

  One engine-form buffer is ``scale plane || payload plane`` (scale plane at byte 0, payload at
  byte ``4 * n_fields * n_blocks``, which is a multiple of 4), so it is
  ``n_blocks * (block_bytes + 2 * n_fields)`` bytes = ``quants.engine_nbytes``.
  Block ``b`` (row-major: ``b = row * (ne0 / block_elems) + j``) has its scales at
  ``scales[b * n_fields : (b + 1) * n_fields]`` and its payload at
  ``payload[b * payload_block_bytes :]``.
- **BF16 sources** (pool type F32, source type BF16): re-rounded to bf16 (``uint16[n]``); exact,
  because each pool value is ``bf16 << 16`` (``quants.f32_to_bf16_rne`` reproduces the original
  bits, NaNs included). Anything with non-zero low halves is refused: it is not a promoted BF16
  tensor, so the caller has the wrong bytes (the wanted failure is at load time, with the name).
- **Everything else** (F32, F16, K-quants, IQ grid types, ...): native blocks, bytes unchanged.

This module is NumPy only: the CPU engine, the GPU upload path, the budget audit and the tests
all use these functions, so the byte layout is defined once. The GPU kernels
(``strata.engine.gpu.kernels``) read exactly this layout.

Sources: block structs ``ggml/src/ggml-common.h`` (llama.cpp; the fp16 field offsets are the
registry's, :data:`strata.packer.quants.QTYPES`), ``ggml_compute_bf16_to_fp32`` /
``ggml_compute_fp32_to_bf16`` in ``ggml/src/ggml-impl.h`` (the exact BF16 re-round).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from strata.packer import quants
from strata.packer.quants import QuantType

__all__ = [
    "EngineFormError",
    "EngineLayout",
    "engine_layout",
    "engine_type",
    "to_engine_form",
    "from_engine_form",
    "split_widened",
    "join_widened",
    "dequantize_engine_form",
]

Kind = Literal["widened", "native", "bf16"]


class EngineFormError(ValueError):
    """Bytes that cannot be put into (or taken out of) engine form: wrong size, or an F32 pool
    tensor said to come from BF16 whose low halves are not zero. Names the tensor when given."""


@dataclass(frozen=True)
class EngineLayout:
    """Where the parts of one tensor sit inside its engine-form buffer (all sizes in bytes).

    Attributes:
        type_id: ggml type the kernels see (``BF16`` for an F32 pool tensor from BF16, else the pool type).
        kind: ``"widened"`` (scale plane + payload plane), ``"native"`` (blocks unchanged) or ``"bf16"``.
        n_elements: values in the tensor.
        n_blocks: blocks (``n_elements / block_elems``; ``n_elements`` for plain types).
        n_fields: fp16 scale fields widened per block (0 unless ``kind == "widened"``).
        nbytes: total engine-form bytes (== ``quants.engine_nbytes``).
        scales_offset, scales_nbytes: the f32 scale plane (``4 * n_fields * n_blocks`` bytes at 0).
        payload_offset, payload_nbytes: the payload plane, or the native blocks / bf16 values.
        payload_block_bytes: payload bytes per block (block bytes for native types).
    """

    type_id: int
    kind: Kind
    n_elements: int
    n_blocks: int
    n_fields: int
    nbytes: int
    scales_offset: int
    scales_nbytes: int
    payload_offset: int
    payload_nbytes: int
    payload_block_bytes: int

    @property
    def qtype(self) -> QuantType:
        return quants.qtype(self.type_id)


def engine_type(pool_type: int, src_type: int) -> int:
    """The ggml type a kernel reads: BF16 for a pool F32 tensor promoted from BF16, else ``pool_type``."""
    if pool_type == quants.F32.id and src_type == quants.BF16.id:
        return quants.BF16.id
    return int(pool_type)


def engine_layout(pool_type: int, src_type: int, ne: tuple[int, ...] | list[int]) -> EngineLayout:
    """Layout of a tensor of pool type ``pool_type`` (source type ``src_type``), shape ``ne``
    (ggml order, ``ne[0]`` = row length) in engine form.

    ``nbytes`` equals :func:`strata.packer.quants.engine_nbytes` by construction (tested).
    Raises ``GGMLTypeError`` / ``ShapeError`` like ``quants.tensor_nbytes``.
    """
    n = quants.n_elements(ne)
    et = engine_type(pool_type, src_type)
    if et == quants.BF16.id and pool_type == quants.F32.id:
        quants.tensor_nbytes(pool_type, ne)  # shape checks
        return EngineLayout(et, "bf16", n, n, 0, 2 * n, 0, 0, 0, 2 * n, 2)
    t = quants.qtype(pool_type)
    nbytes = quants.tensor_nbytes(pool_type, ne)
    n_blocks = nbytes // t.block_bytes
    nf, pb = t.engine_scale_fields, t.engine_payload_bytes  # 0 and block_bytes for native blocks
    sb = 4 * nf * n_blocks
    return EngineLayout(
        t.id, "widened" if t.widened else "native", n, n_blocks, nf, sb + pb * n_blocks, 0, sb, sb, pb * n_blocks, pb
    )


def _payload_columns(t: QuantType) -> np.ndarray:
    """Byte columns of a block that are not fp16 scale fields, in order."""
    drop = set()
    for o in t.fp16_scale_offsets:
        drop.update((o, o + 1))
    return np.array([i for i in range(t.block_bytes) if i not in drop], dtype=np.intp)


def split_widened(raw: np.ndarray, type_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Split native blocks of a widened type into ``(scales, payload)``.

    Args:
        raw: the blocks' bytes (any shape, ``uint8``, size a multiple of ``block_bytes``).
        type_id: a widened type (``QTYPES[type_id].widened``).

    Returns:
        ``scales``: ``float32[n_blocks, n_fields]`` (fp16 fields in offset order, widened exactly);
        ``payload``: ``uint8[n_blocks, block_bytes - 2 * n_fields]``.
    """
    t = quants.qtype(type_id)
    if not t.widened:
        raise EngineFormError(f"{t.name} is not a widened type (native blocks stay as they are)")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if b.size % t.block_bytes:
        raise EngineFormError(f"{t.name}: {b.size} bytes is not a whole number of {t.block_bytes}-byte blocks")
    blocks = b.reshape(-1, t.block_bytes)
    scales = np.empty((blocks.shape[0], len(t.fp16_scale_offsets)), dtype="<f4")
    for k, o in enumerate(t.fp16_scale_offsets):
        scales[:, k] = blocks[:, o : o + 2].copy().view("<f2")[:, 0].astype(np.float32)
    payload = blocks[:, _payload_columns(t)]
    return scales, np.ascontiguousarray(payload)


def join_widened(scales: np.ndarray, payload: np.ndarray, type_id: int) -> np.ndarray:
    """Inverse of :func:`split_widened`: native blocks (``uint8[n_blocks * block_bytes]``).

    Exact: each f32 scale came from an fp16 value, so narrowing it back is lossless (checked).
    """
    t = quants.qtype(type_id)
    nf = len(t.fp16_scale_offsets)
    sc = np.asarray(scales, dtype="<f4").reshape(-1, nf)
    pl = np.asarray(payload, dtype=np.uint8).reshape(sc.shape[0], t.payload_block_bytes)
    blocks = np.empty((sc.shape[0], t.block_bytes), dtype=np.uint8)
    blocks[:, _payload_columns(t)] = pl
    for k, o in enumerate(t.fp16_scale_offsets):
        h = sc[:, k].astype("<f2")
        back = h.astype("<f4")
        bad = (back.view("<u4") != sc[:, k].view("<u4")) & ~np.isnan(sc[:, k])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise EngineFormError(f"{t.name}: scale {sc[i, k]!r} of block {i} is not an fp16 value")
        blocks[:, o : o + 2] = h.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def to_engine_form(
    raw: np.ndarray, pool_type: int, src_type: int, ne: tuple[int, ...] | list[int], *, name: str | None = None
) -> np.ndarray:
    """Convert one tensor's pool-form bytes to its engine-form buffer.

    Args:
        raw: pool-form bytes (``uint8``, e.g. a slice of the memory-mapped ``pool.bin`` or of a
            GGUF shard for an expert), exactly ``quants.tensor_nbytes(pool_type, ne)`` long.
        pool_type, src_type: index.txt's ``type`` and ``src_type`` columns (experts: both the
            GGUF type).
        ne: ggml shape (``ne[0]`` = row length).
        name: tensor name for error messages.

    Returns:
        ``uint8[engine_layout(...).nbytes]``: scale plane (f32 LE) then payload plane for widened
        types; bf16 LE values for BF16 sources; the same bytes for everything else (a copy).

    Raises:
        EngineFormError: wrong byte count; a "BF16" pool tensor whose F32 values are not bf16 values.
    """
    lay = engine_layout(pool_type, src_type, ne)
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    want = quants.tensor_nbytes(pool_type, ne)
    who = name or "tensor"
    if b.size != want:
        raise EngineFormError(f"{who}: {b.size} bytes given, {quants.qtype(pool_type).name} {list(ne)} needs {want}")
    if lay.kind == "native":
        return b.copy()
    if lay.kind == "bf16":
        u32 = b.view("<u4")
        low = (u32 & np.uint32(0xFFFF)) != 0
        if low.any():
            i = int(np.flatnonzero(low)[0])
            raise EngineFormError(
                f"{who}: pool F32 value {i} (bits 0x{int(u32[i]):08x}) has non-zero low 16 bits; "
                "a tensor promoted from BF16 cannot, so these are not its bytes"
            )
        return quants.f32_to_bf16_rne(u32).view(np.uint8).copy()
    scales, payload = split_widened(b, pool_type)
    out = np.empty(lay.nbytes, dtype=np.uint8)
    out[: lay.scales_nbytes] = scales.reshape(-1).view(np.uint8)
    out[lay.payload_offset :] = payload.reshape(-1)
    return out


def from_engine_form(buf: np.ndarray, pool_type: int, src_type: int, ne: tuple[int, ...] | list[int]) -> np.ndarray:
    """Inverse of :func:`to_engine_form`: pool-form bytes (``uint8``). Exact for every input
    :func:`to_engine_form` accepts (tested)."""
    lay = engine_layout(pool_type, src_type, ne)
    b = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    if b.size != lay.nbytes:
        raise EngineFormError(f"engine-form buffer of {b.size} bytes, layout needs {lay.nbytes}")
    if lay.kind == "native":
        return b.copy()
    if lay.kind == "bf16":
        return quants.bf16_to_f32_bits(b.view("<u2")).astype("<u4").view(np.uint8)
    scales = b[: lay.scales_nbytes].view("<f4").reshape(lay.n_blocks, lay.n_fields)
    payload = b[lay.payload_offset :].reshape(lay.n_blocks, lay.payload_block_bytes)
    return join_widened(scales, payload, pool_type)


def dequantize_engine_form(
    buf: np.ndarray, pool_type: int, src_type: int, ne: tuple[int, ...] | list[int]
) -> np.ndarray:
    """NumPy reference dequantization of an engine-form buffer: ``float32`` with numpy shape
    ``reversed(ne)`` (rows of ``ne[0]``), via ``gguf.quants.dequantize`` of the native blocks
    (strata's own for Q1_0 and Q2_0, which gguf-py lacks: the row's ``own_dequantize``).
    The GPU kernels must equal this bit for bit."""
    import gguf

    from strata.engine.dequant import dequantize_blocks

    lay = engine_layout(pool_type, src_type, ne)
    shape = tuple(int(d) for d in reversed(list(ne)))
    if lay.kind == "bf16":
        b = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
        return quants.bf16_to_f32_bits(b.view("<u2")).view("<f4").reshape(shape)
    raw = from_engine_form(buf, pool_type, src_type, ne)
    t = quants.qtype(pool_type)
    if t.own_dequantize is not None:
        return dequantize_blocks(raw, t.id).reshape(shape)
    qt = gguf.GGMLQuantizationType(t.id)
    nb_row = raw.size // max(1, quants.n_elements(ne) // int(ne[0])) if len(ne) else raw.size
    out = gguf.quants.dequantize(raw.reshape(-1, nb_row), qt)
    return np.asarray(out, dtype=np.float32).reshape(shape)
