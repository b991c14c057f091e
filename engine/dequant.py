"""Dequantization for the CPU reference path: ``gguf.quants`` itself, row-chunked.

The issue's contract is "bit-for-bit equal to ``gguf.quants.dequantize``"; the simplest way to
honour it is to call gguf-py's per-type ``dequantize_rows`` (the same vectorised block math that
``gguf.quants.dequantize`` runs) on chunks of rows written into one preallocated f32 array. The
chunking is only about memory: gguf-py materialises several temporaries per call, so a whole
262144 x 640 embedding at once would peak at several times its f32 size.

Which dequantizer a type gets is a fact of its registry row
(:attr:`strata.packer.quants.QuantType.cpu_dequant`): a NumPy view for F32 / F16, gguf-py's
class ``gguf.quants.<NAME>``, or strata's own NumPy function (``QuantType.own_dequantize``) for
the two types gguf-py 0.19.0 does not know, Q1_0 and Q2_0 (:mod:`strata.packer.dequant_own`,
after ``dequantize_row_q1_0`` / ``dequantize_row_q2_0`` in llama.cpp's ``ggml/src/ggml-quants.c``).

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
    """gguf-py's class for ``type_id`` if the installed gguf-py can dequantize it (has
    ``dequantize_rows``), else None. A probe of the wheel, independent of the registry."""
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


#: ggml types whose dequantization strata defines itself (gguf-py lacks them), by type id:
#: the registry rows with ``cpu_dequant == "strata"``.
OWN_DEQUANTIZERS = {t.id: t.own_dequantize for t in quants.QTYPES.values() if t.own_dequantize is not None}


def dequantize_blocks(raw: np.ndarray, type_id: int) -> np.ndarray:
    """f32 ``[n_blocks * block_elems]`` of whole blocks ``raw`` (any shape, uint8) of a type that
    strata (``own_dequantize``) or gguf-py dequantizes (no engine-support check: the engine-form
    reference uses this)."""
    t = quants.qtype(type_id)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, t.block_bytes)
    if t.own_dequantize is not None:
        return t.own_dequantize(blocks).reshape(-1)
    import gguf

    return np.asarray(
        gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType(type_id)), dtype=np.float32
    ).reshape(-1)


def supported(type_id: int) -> bool:
    """True when the CPU path can dequantize ``type_id``: the registry marks it engine-supported
    and its row's dequantizer is there (F32/F16 are NumPy views; Q1_0/Q2_0 strata's own; the
    rest need gguf-py's class)."""
    t = quants.QTYPES.get(type_id)
    if t is None or not t.engine_supported:
        return False
    return t.cpu_dequant != "gguf" or _gguf_class(type_id) is not None


def dequantize_rows(
    raw: np.ndarray, type_id: int, ne0: int, *, name: str = "tensor", out: np.ndarray | None = None
) -> np.ndarray:
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
        raise DequantError(
            f"{name}: rows of {raw.shape[1:]} bytes, {quants.QTYPES[type_id].name} x {ne0} needs {row_bytes}"
        )
    if out is None:
        out = np.empty((rows, ne0), dtype=np.float32)
    t = quants.QTYPES[type_id]
    if t.cpu_dequant == "view":  # F32 / F16: IEEE floats of block_bytes bytes, read as they are
        out[...] = raw.view(f"<f{t.block_bytes}")
        return out
    own = t.own_dequantize
    cls = None if own is not None else _gguf_class(type_id)
    bb = t.block_bytes
    step = max(1, CHUNK_ELEMS // max(ne0, 1))
    for r0 in range(0, rows, step):
        # np.asarray: gguf-py's .view() calls want an ndarray, not a memmap slice
        chunk = np.asarray(raw[r0 : r0 + step])
        if own is not None:
            out[r0 : r0 + step] = own(chunk.reshape(-1, bb)).reshape(chunk.shape[0], ne0)
        else:
            out[r0 : r0 + step] = cls.dequantize_rows(chunk)
    return out
