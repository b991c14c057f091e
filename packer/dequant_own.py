"""NumPy dequantizers of the two ggml types that gguf-py 0.19.0 lacks: Q1_0 and Q2_0.

The registry rows of :mod:`strata.packer.quants` reference these functions (``QuantType.own_dequantize``);
:mod:`strata.engine.dequant` dispatches through the row, so the CPU reference path, the
engine-form reference (:func:`strata.engine.engine_form.dequantize_engine_form`) and the GPU
kernel tests all use this one definition. Written after ggml's reference C,
``ggml/src/ggml-quants.c`` (llama.cpp as vendored in llama-cpp-python 0.3.36, lines 419-456),
block structs ``block_q1_0`` / ``block_q2_0`` in ``ggml/src/ggml-common.h``:

- **Q1_0** (id 41, fp16 ``d`` + ``qs[16]``, 128 values per 18-byte block): bit ``j % 8`` of
  ``qs[j / 8]`` set -> ``+d``, clear -> ``-d`` (``dequantize_row_q1_0``: ``bit ? d : neg_d``);
- **Q2_0** (id 42, fp16 ``d`` + ``qs[16]``, 64 values per 18-byte block):
  ``q = (qs[j / 4] >> 2 (j % 4)) & 3`` -> ``(q - 1) * d`` (``((int)q - 1) * d``: the int
  converted to float, then one f32 multiply, so ``q = 1`` with a negative ``d`` gives ``-0.0``
  as in C).

Both take whole blocks, ``uint8[n_blocks, 18]``, and return ``float32[n_blocks, block_elems]``
(the calling convention of gguf-py's ``dequantize_blocks``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["dequantize_q1_0", "dequantize_q2_0"]


def _d_f32(blocks: np.ndarray) -> np.ndarray:
    """The fp16 ``d`` at byte 0 of each block, widened exactly to f32, as a column ``[n, 1]``."""
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
