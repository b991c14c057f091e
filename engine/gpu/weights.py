"""The :class:`strata.engine.weights.Weights` interface over device memory (engine form).

Matrices live in engine form (:mod:`strata.engine.engine_form`: f32 scale planes for the widened
types, native blocks for K-quants and IQ types, BF16 re-rounded from the pool's F32), uploaded by
byte offset from the memory-mapped ``pool.bin``. Every size is one function of
:mod:`strata.layout` (the budget's "dense weights", "output head" and "engine buffers").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from strata.engine import engine_form as EF
from strata.layout import buffers as LB
from strata.packer import quants
from strata.packer.pack import Pack
from strata.packer.packfmt import IndexEntry

from ..cpu import kernels as cpukernels
from ..dequant import dequantize_rows
from ..errors import GenerateError
from .backend import Backend


def rows_of(e: IndexEntry) -> int:
    """Rows of a tensor (``ne1 * ne2 * ne3``): what a matvec produces."""
    return e.ne1 * e.ne2 * e.ne3


class DeviceWeights:
    """The :class:`strata.engine.weights.Weights` interface over VRAM.

    Matrices live in engine form (one device buffer each, ``engine_bytes`` counts them exactly);
    ``matmul`` runs the type's matvec kernel into an f32 output preallocated per tensor at upload
    (``output_bytes``), so the token loop allocates no output memory. Vectors (norms, biases) are
    read as f32 by ``get``: an F32 vector's engine-form buffer is viewed as f32 (no copy), others
    get an f32 copy (``f32_vector_bytes``). Tensors read only by rows (an untied ``token_embd``)
    stay in the memory-mapped pool on the host: one row is dequantized there per token and copied
    up into a preallocated buffer (``row_bytes``; the budget's "embeddings on host").
    Every size is one function of :mod:`strata.layout.buffers` (the budget's "engine buffers").
    """

    def __init__(self, pack: Pack, dense: dict[str, IndexEntry], backend: Backend):
        self.backend = backend
        self.xp = backend.xp
        self._pool = np.memmap(pack.pool_path, dtype=np.uint8, mode="r")
        self._entries = dense
        self._buf: dict[str, Any] = {}
        self._type: dict[str, int] = {}
        self._out: dict[str, Any] = {}
        self._f32: dict[str, Any] = {}
        self._row_buf: Any = None
        self.engine_bytes = 0
        self.f32_vector_bytes = 0
        self.output_bytes = 0
        self.row_bytes = 0
        #: the prompt-chunk path (:class:`strata.engine.gpu.chunk.ChunkPath`), set at the prompt-path stage
        #: when the engine takes prompts in chunks; None: one position at a time
        self.chunk: Any = None

    @property
    def matmul_rows(self) -> bool:
        """Whether :meth:`matmul` takes a chunk's rows (a 2-D input): the chunk path is set."""
        return self.chunk is not None

    def has(self, name: str) -> bool:
        """Whether ``name`` is one of this pack's dense tensors (uploaded or not yet)."""
        return name in self._entries

    def uploaded(self, name: str) -> bool:
        """Whether ``name`` is on the device in engine form (its start-up stage has run)."""
        return name in self._buf

    def entry(self, name: str) -> IndexEntry:
        return self._entries[name]

    def _raw(self, e: IndexEntry) -> np.ndarray:
        return self._pool[e.offset : e.offset + e.nbytes]

    def matrices(self) -> list[str]:
        """The uploaded tensors of more than one row (what :meth:`matmul` multiplies)."""
        return [n for n in self._buf if rows_of(self._entries[n]) > 1]

    def types(self) -> set[int]:
        """Kernel types of the uploaded tensors."""
        return set(self._type.values())

    def upload(self, names: Iterable[str]) -> int:
        """Upload ``names`` in engine form (by byte offset from the pool); returns engine bytes added.

        One call makes three device allocations (:func:`strata.layout.buffers.arena_layout`), not three
        per tensor: the engine-form tensors, the f32 GEMV outputs of the matrices, the f32 copies of the
        vectors whose engine form is not F32 - each tensor a view at a 256-byte aligned offset. Few large
        allocations instead of hundreds keep the driver's rounding of each one out of the budget (the
        "CUDA runtime" term counts what is left: :func:`strata.budget.formulas_gpu.allocation_rounding_bytes`)."""
        todo = [n for n in dict.fromkeys(names) if n not in self._buf]
        if not todo:
            return 0
        ents = [self._entries[n] for n in todo]
        sizes = [quants.engine_nbytes(e.type, e.src_type, e.ne) for e in ents]
        offs, total = LB.arena_layout(sizes)
        arena = self.backend.empty_bytes(total)
        outs = [LB.matvec_out_bytes(e.ne) if rows_of(e) > 1 else 0 for e in ents]
        vecs = [LB.vector_f32_bytes(e.type, e.src_type, e.ne) if rows_of(e) == 1 else 0 for e in ents]
        o_offs, o_total = LB.arena_layout(outs)
        v_offs, v_total = LB.arena_layout(vecs)
        out_arena = self.backend.empty_bytes(o_total) if o_total else None
        vec_arena = self.backend.empty_bytes(v_total) if v_total else None
        added = 0
        for k, (name, e) in enumerate(zip(todo, ents)):
            ef = EF.to_engine_form(self._raw(e), e.type, e.src_type, e.ne, name=name)
            assert ef.size == sizes[k], (name, ef.size, sizes[k])
            buf = arena[offs[k] : offs[k] + sizes[k]]
            self.backend.copy_into(buf, ef)
            self._buf[name] = buf
            self._type[name] = EF.engine_type(e.type, e.src_type)
            added += ef.size
            if rows_of(e) == 1:  # a vector: f32 for get()
                if vecs[k] == 0:  # engine form is F32 already: view it
                    self._f32[name] = buf.view(self.xp.float32)
                else:
                    v = dequantize_rows(np.asarray(self._raw(e)).reshape(1, -1), e.type, e.ne0, name=name)[0]
                    assert v.nbytes == vecs[k]
                    dst = vec_arena[v_offs[k] : v_offs[k] + vecs[k]]
                    self.backend.copy_into(dst, v.view(np.uint8))
                    self._f32[name] = dst.view(self.xp.float32)
                self.f32_vector_bytes += vecs[k]
            else:
                self._out[name] = out_arena[o_offs[k] : o_offs[k] + outs[k]].view(self.xp.float32)
                self.output_bytes += outs[k]
        self.engine_bytes += added
        return added

    def alloc_row_buffer(self, name: str) -> int:
        """Preallocate the f32 row ``rows(name, [id])`` is looked up into; returns its bytes."""
        e = self._entries[name]
        nb = LB.embedding_row_bytes(e.ne0)
        self._row_buf = self.backend.empty_f32(nb // 4)
        self.row_bytes += nb
        return nb

    @property
    def buffer_bytes(self) -> int:
        """Engine buffers held here: GEMV outputs, f32 vector copies, the embedding row."""
        return self.output_bytes + self.f32_vector_bytes + self.row_bytes

    def get(self, name: str):
        a = self._f32.get(name)
        if a is not None:
            return a
        # a matrix asked for whole (not on the token path of the models here): dequantize on the host
        e = self._entries[name]
        rows = rows_of(e)
        m = dequantize_rows(np.asarray(self._raw(e)).reshape(rows, -1), e.type, e.ne0, name=name)
        return self.xp.asarray(m)

    def matmul(self, name: str, x):
        """``W @ x`` for a vector ``x [ne0]`` (the type's matvec kernel into the preallocated output), or ``X @ W.T``
        for a chunk's rows ``X [T, ne0]`` (numpy order; :meth:`strata.engine.gpu.chunk.ChunkPath.matmul`)."""
        e = self._entries[name]
        if getattr(x, "ndim", 1) == 2:
            if self.chunk is None:
                raise GenerateError(f"{name}: a chunk of {x.shape[0]} rows, but no prompt-chunk path is set up")
            return self.chunk.matmul(self._type[name], self._buf[name], rows_of(e), e.ne0, x)
        return self.backend.matvec(self._type[name], self._buf[name], rows_of(e), e.ne0, x, out=self._out[name])

    def matvec_args(self, name: str) -> tuple[int, Any, int, int, Any]:
        """``(kernel type, engine-form buffer, rows, ne0, preallocated output)`` of a matrix: what a
        launch list (:mod:`strata.engine.gpu.fused`) binds once."""
        e = self._entries[name]
        return self._type[name], self._buf[name], rows_of(e), e.ne0, self._out[name]

    def vector_args(self, name: str) -> tuple[int, Any, int, int, None]:
        """A 1-D tensor as a one-row F32 matrix for a matvec launch (a dot product with the input):
        ``(GGML F32, its f32 copy as bytes, 1, ne0, None)`` - no preallocated output (the caller
        gives one)."""
        e = self._entries[name]
        if rows_of(e) != 1:
            raise GenerateError(f"{name}: {rows_of(e)} rows, not a vector")
        return quants.F32.id, self._f32[name].view(self.xp.uint8), 1, e.ne0, None

    def host_f32(self, name: str) -> np.ndarray:
        """The whole tensor ``name`` dequantized to f32 on the host from the memory-mapped pool
        (numpy ``[rows, ne0]``): for small weights a kernel reads as plain floats (the delta net's conv)."""
        e = self._entries[name]
        rows = rows_of(e)
        return dequantize_rows(np.asarray(self._raw(e)).reshape(rows, -1), e.type, e.ne0, name=name)

    def host_row(self, name: str, row: int, out: np.ndarray) -> None:
        """Dequantize row ``row`` of ``name`` on the host from the memory-mapped pool into ``out``
        (f32, e.g. pinned memory): the values :meth:`rows` and the CPU path give."""
        e = self._entries[name]
        rows = rows_of(e)
        if not 0 <= row < rows:
            raise GenerateError(f"{name}: row {row} outside 0..{rows - 1}")
        raw = np.asarray(self._raw(e)).reshape(rows, -1)
        try:  # the C dequantizer (the CPU path's rows: the same floats as gguf-py's, ~20x faster per token)
            out[...] = cpukernels.dequant_rows(e.type, raw.reshape(-1), e.ne0, [row])[0]
        except cpukernels.CpuKernelError:  # no C compiler: gguf-py's dequantizer
            out[...] = dequantize_rows(raw[row : row + 1], e.type, e.ne0, name=name)[0]

    def rows(self, name: str, ids: list[int]):
        e = self._entries[name]
        rows = rows_of(e)
        raw = np.asarray(self._raw(e)).reshape(rows, -1)[np.asarray(ids, dtype=np.int64)]
        host = dequantize_rows(raw, e.type, e.ne0, name=name)
        if len(ids) == 1 and self._row_buf is not None and self._row_buf.size == e.ne0:
            self.backend.copy_into(self._row_buf, host[0])
            return self._row_buf.reshape(1, e.ne0)
        return self.xp.asarray(host)


__all__ = ["DeviceWeights", "rows_of"]
