"""Dequantization for the CPU reference path: ``gguf.quants`` itself, row-chunked.

The issue's contract is "bit-for-bit equal to ``gguf.quants.dequantize``"; the simplest way to
honour it is to call gguf-py's per-type ``dequantize_rows`` (the same vectorised block math that
``gguf.quants.dequantize`` runs) on chunks of rows written into one preallocated f32 array. The
chunking is only about memory: gguf-py materialises several temporaries per call, so a whole
262144 x 640 embedding at once would peak at several times its f32 size.

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


def supported(type_id: int) -> bool:
    """True when the CPU path can dequantize ``type_id``: the registry marks it engine-supported
    and gguf-py implements it (F32/F16 need no gguf-py class)."""
    t = quants.QTYPES.get(type_id)
    if t is None or not t.engine_supported:
        return False
    return type_id in (quants.F32.id, quants.F16.id) or _gguf_class(type_id) is not None


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
    cls = _gguf_class(type_id)
    step = max(1, CHUNK_ELEMS // max(ne0, 1))
    for r0 in range(0, rows, step):
        # np.asarray: gguf-py's .view() calls want an ndarray, not a memmap slice
        out[r0:r0 + step] = cls.dequantize_rows(np.asarray(raw[r0:r0 + step]))
    return out
