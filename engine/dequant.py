"""Dequantization for the CPU reference path: ``gguf.quants`` itself, row-chunked.

The issue's contract is "bit-for-bit equal to ``gguf.quants.dequantize``"; the simplest way to
honour it is to call gguf-py's per-type ``dequantize_rows`` (the same vectorised block math that
``gguf.quants.dequantize`` runs) on chunks of rows written into one preallocated f32 array. The
chunking is only about memory: gguf-py materialises several temporaries per call, so a whole
262144 x 640 embedding at once would peak at several times its f32 size.

Two types gguf-py 0.19.0 does not know are defined here, after ggml's reference C
(``ggml/src/ggml-quants.c``, llama.cpp as vendored in llama-cpp-python 0.3.36, lines 419-456):

- **Q1_0** (id 41, ``block_q1_0``: fp16 ``d`` + ``qs[16]``, 128 values): bit ``j % 8`` of
  ``qs[j / 8]`` set -> ``+d``, clear -> ``-d`` (``dequantize_row_q1_0``: ``bit ? d : neg_d``);
- **Q2_0** (id 42, ``block_q2_0``: fp16 ``d`` + ``qs[16]``, 64 values): ``q = (qs[j / 4] >> 2 (j % 4)) & 3``
  -> ``(q - 1) * d`` (``((int)q - 1) * d``: the int converted to float, then one f32 multiply, so
  ``q = 1`` with a negative ``d`` gives ``-0.0`` as in C).

The GPU path keeps weights in engine form and has its own kernels; ``tests/test_engine_dequant.py``
pins this module to ``gguf.quants.dequantize`` for every type the engine accepts.
"""

from __future__ import annotations

import numpy as np

from strata.packer import quants

#: Output elements per gguf-py call (4 Mi floats = 16 MiB of f32 per chunk).
CHUNK_ELEMS = 1 << 22


class DequantError(ValueError):
    """A type the CPU path cannot dequantize (names the tensor and the type)."""


def _gguf_class(type_id: int):
    import gguf.quants as gq
    from gguf import GGMLQuantizationType

    try:
        name = GGMLQuantizationType(type_id).name
    except ValueError:
        return None
    cls = getattr(gq, name, None)
    if cls is None or not hasattr(cls, "dequantize_rows"):
        return None
    cls.init_grid()  # IQ types build their grids lazily; idempotent
    return cls


def _d_f32(blocks: np.ndarray) -> np.ndarray:
    """The fp16 ``d`` at byte 0 of each block, widened exactly to f32, as a column."""
    return blocks[:, 0:2].copy().view("<f2").astype(np.float32)


def dequantize_q1_0(blocks: np.ndarray) -> np.ndarray:
    """Q1_0 blocks (``uint8[n, 18]``) -> f32 ``[n, 128]`` (ggml ``dequantize_row_q1_0``)."""
    d = _d_f32(blocks)
    bits = np.unpackbits(blocks[:, 2:18], axis=1, bitorder="little")  # value j = bit j % 8 of byte j / 8
    return np.where(bits.astype(bool), d, -d).astype(np.float32)


def dequantize_q2_0(blocks: np.ndarray) -> np.ndarray:
    """Q2_0 blocks (``uint8[n, 18]``) -> f32 ``[n, 64]`` (ggml ``dequantize_row_q2_0``)."""
    d = _d_f32(blocks)
    qs = blocks[:, 2:18]
    q = (qs[:, :, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & np.uint8(3)  # [n, 16, 4]: value 4i + k
    qf = (q.reshape(len(blocks), 64).astype(np.int32) - 1).astype(np.float32)  # (int)q - 1, converted
    return qf * d


#: ggml types whose dequantization strata defines itself (gguf-py lacks them), by type id.
OWN_DEQUANTIZERS = {41: dequantize_q1_0, 42: dequantize_q2_0}


def dequantize_blocks(raw: np.ndarray, type_id: int) -> np.ndarray:
    """f32 ``[n_blocks * block_elems]`` of whole blocks ``raw`` (any shape, uint8) of a type in
    :data:`OWN_DEQUANTIZERS` or gguf-py (no registry check: the engine-form reference uses this)."""
    t = quants.qtype(type_id)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, t.block_bytes)
    own = OWN_DEQUANTIZERS.get(type_id)
    if own is not None:
        return own(blocks).reshape(-1)
    import gguf

    return np.asarray(gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType(type_id)),
                      dtype=np.float32).reshape(-1)


def supported(type_id: int) -> bool:
    """True when the CPU path can dequantize ``type_id``: the registry marks it engine-supported
    and gguf-py implements it (F32/F16 need no gguf-py class; Q1_0/Q2_0 are defined here)."""
    t = quants.QTYPES.get(type_id)
    if t is None or not t.engine_supported:
        return False
    return type_id in (quants.F32.id, quants.F16.id) or type_id in OWN_DEQUANTIZERS or _gguf_class(type_id) is not None


def dequantize_rows(raw: np.ndarray, type_id: int, ne0: int, *, name: str = "tensor",
                    out: np.ndarray | None = None) -> np.ndarray:
    """Dequantize ``raw`` (uint8, shape ``[rows, row_bytes]``) of ggml type ``type_id`` to f32
    ``[rows, ne0]``, bit-identical to ``gguf.quants.dequantize``.

    Raises:
        DequantError: unsupported type, or ``raw`` rows that are not ``ne0`` elements of the type.
    """
    if not supported(type_id):
        t = quants.QTYPES.get(type_id)
        raise DequantError(f"{name}: ggml type {t.name if t else type_id} has no CPU dequantizer in strata's engine")
    rows = raw.shape[0]
    row_bytes = quants.row_nbytes(type_id, ne0)
    if raw.ndim != 2 or raw.shape[1] != row_bytes:
        raise DequantError(f"{name}: rows of {raw.shape[1:]} bytes, {quants.QTYPES[type_id].name} x {ne0} needs {row_bytes}")
    if out is None:
        out = np.empty((rows, ne0), dtype=np.float32)
    if type_id == quants.F32.id:
        out[...] = raw.view(np.float32)
        return out
    if type_id == quants.F16.id:
        out[...] = raw.view(np.float16)
        return out
    own = OWN_DEQUANTIZERS.get(type_id)
    cls = None if own is not None else _gguf_class(type_id)
    bb = quants.QTYPES[type_id].block_bytes
    step = max(1, CHUNK_ELEMS // max(ne0, 1))
    for r0 in range(0, rows, step):
        # np.asarray: gguf-py's .view() calls want an ndarray, not a memmap slice
        chunk = np.asarray(raw[r0:r0 + step])
        if own is not None:
            out[r0:r0 + step] = own(chunk.reshape(-1, bb)).reshape(chunk.shape[0], ne0)
        else:
            out[r0:r0 + step] = cls.dequantize_rows(chunk)
    return out
