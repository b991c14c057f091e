"""Weight access for the forward pass: the small interface the models are written against.

A model never touches pool bytes. It asks its :class:`Weights` for

- ``get(name)``: a small tensor as an f32 array (norm weights, biases, routers' vectors);
- ``matmul(name, x)``: ``W @ x`` for a weight of ggml shape ``[ne0 = len(x), ne1]`` (the result
  has ``ne1`` values) - the one place a device decides how a quantized weight meets an activation;
- ``rows(name, ids)``: rows of a matrix (embedding lookup), f32 ``[len(ids), ne0]``;
- ``has(name)``: whether an optional tensor (biases, fused qkv, output head) is in the pack.

:class:`CpuWeights` is the NumPy reference: dense weights are dequantized once at load into f32
(bit-identical to ``gguf.quants.dequantize``) and multiplied with BLAS sgemv. The GPU path supplies
its own object with the same methods (engine form in VRAM, its own kernels); ``xp`` tells the
shared layers which array module the activations live in.

Memory choice (measured with ``--verbose``): an untied ``token_embd`` is only ever read by rows,
so it stays quantized in the memory-mapped pool and each row is dequantized when it is looked up
(Qwen2.5 0.5B: 545 MB of f32 not allocated). A tied one (Gemma) is the output head too, which a
GEMV reads whole every token, so it is dequantized once (Gemma: 671 MB f32) and embedding rows
are read from that copy.
"""

from __future__ import annotations

import mmap
from typing import Any, Protocol

import numpy as np

from strata.packer import quants
from strata.packer.packfmt import IndexEntry
from strata.packer.pack import Pack

from .dequant import dequantize_rows
from .numerics import Numerics, numerics, quantize_activation


class Weights(Protocol):
    """What a forward pass may ask of a weight store (see the module docstring)."""

    xp: Any
    # optional: ``nx`` (a strata.engine.numerics.Numerics); a store without it runs the f32 profile

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> Any: ...

    def matmul(self, name: str, x: Any) -> Any: ...

    def rows(self, name: str, ids: list[int]) -> Any: ...


class WeightError(ValueError):
    """Weight bytes that are not what the index says (e.g. a BF16-promoted tensor that is not bf16-exact)."""


def _mat_shape(e: IndexEntry) -> tuple[int, ...]:
    # numpy shape of the dequantized tensor: 1-D for vectors, [rows, ne0] otherwise
    rows = e.ne1 * e.ne2 * e.ne3
    return (e.ne0,) if rows == 1 else (rows, e.ne0)


class CpuWeights:
    """Dense weights of one pack for the NumPy path (see the module docstring).

    ``load(names)`` dequantizes the named tensors into f32 now; tensors not loaded that way are
    served by ``rows`` straight from the memory-mapped pool (quantized). ``nbytes_f32`` counts
    the f32 bytes this object holds. With ``numerics.act_quant`` (the ``llamacpp`` profile),
    ``matmul`` first rounds the activation the way llama.cpp's CPU backend does for
    the weight's type (:mod:`strata.engine.numerics`).
    """

    xp = np

    def __init__(self, pack: Pack, dense: dict[str, IndexEntry], nx: str | Numerics = "f32"):
        # read-only map: a stray write raises instead of corrupting the pack
        self._pool = np.memmap(pack.pool_path, dtype=np.uint8, mode="r")
        self._entries = dense
        self._f32: dict[str, np.ndarray] = {}
        self.nbytes_f32 = 0
        self.nx = numerics(nx)
        # q/k/v (and gate/up) share one input: quantize it once per weight type
        self._last_x: np.ndarray | None = None
        self._last_q: dict[int, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> IndexEntry:
        return self._entries[name]

    def _raw(self, e: IndexEntry) -> np.ndarray:
        rows = e.ne1 * e.ne2 * e.ne3
        return self._pool[e.offset:e.offset + e.nbytes].reshape(rows, e.nbytes // rows)

    def load(self, names: list[str]) -> None:
        """Dequantize ``names`` into f32 arrays held by this object.

        Raises:
            WeightError: an F32 pool tensor promoted from BF16 whose low 16 bits are not all zero
                (the engine re-rounds such tensors to bf16; a non-zero low half means the bytes are
                not what the index says).
        """
        for name in names:
            if name in self._f32:
                continue
            e = self._entries[name]
            raw = self._raw(e)
            if e.src_type == quants.BF16.id:
                low = raw.view(np.uint32) & np.uint32(0xFFFF)
                if low.any():
                    raise WeightError(f"tensor {name}: pool F32 promoted from BF16 has non-zero low 16 bits "
                                      f"({int(np.count_nonzero(low))} values); it is not bf16-exact")
            a = dequantize_rows(raw, e.type, e.ne0, name=name).reshape(_mat_shape(e))
            self._f32[name] = a
            self.nbytes_f32 += a.nbytes
        self._release_pool_pages()

    def _release_pool_pages(self) -> None:
        # The pool pages just read are clean file cache mapped into this process: drop them from
        # its RSS so --verbose shows what the engine holds (they are re-read if a row is needed).
        mm = getattr(self._pool, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)

    def get(self, name: str) -> np.ndarray:
        a = self._f32.get(name)
        if a is None:
            self.load([name])
            a = self._f32[name]
        return a

    def matmul(self, name: str, x: np.ndarray) -> np.ndarray:
        a = self.get(name)
        if self.nx.act_quant:
            t = self._entries[name].type
            if x is not self._last_x:
                self._last_x, self._last_q = x, {}
            xq = self._last_q.get(t)
            if xq is None:
                xq = self._last_q[t] = quantize_activation(np, x, t)
            x = xq
        return a @ x

    def rows(self, name: str, ids: list[int]) -> np.ndarray:
        a = self._f32.get(name)
        if a is not None:
            return a[np.asarray(ids, dtype=np.int64)]
        e = self._entries[name]
        raw = self._raw(e)
        return dequantize_rows(raw[np.asarray(ids, dtype=np.int64)], e.type, e.ne0, name=name)
