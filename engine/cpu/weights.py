"""The CPU device's weight store (:class:`CpuWeights`, the :class:`strata.engine.weights.Weights` interface).

The pool stays memory-mapped read-only and every product runs the quantized kernels of
:mod:`strata.engine.cpu.kernels` on the tensor's native blocks in place - no dequantized copy of any
matrix is kept (a 30B-A3B pack's f32 copies would be ~120 GB). Only vectors (norms, biases: a few KB
each) are held as f32. Start-up reads no weight bytes except the vectors' and the BF16-promoted tensors'
(their bytes are checked), and it reads those with pread, not through the map: no page of the mapping is
resident before the first token.
"""

from __future__ import annotations

import os

import numpy as np

from strata.packer import quants
from strata.packer.pack import Pack
from strata.packer.packfmt import IndexEntry

from ..dequant import dequantize_rows
from ..mapped import MappedFile
from ..numerics import Numerics, numerics, quantize_activation
from ..weights import WeightError
from . import kernels as CK


def _rows(e: IndexEntry) -> int:
    return e.ne1 * e.ne2 * e.ne3


class CpuWeights:
    """Dense weights of one pack for the CPU path (see the module docstring).

    ``matmul`` runs the kernels of :mod:`strata.engine.cpu.kernels` on ``threads`` threads (default: the
    cores this process may use), chosen by ``kernel`` (default ``"exact"`` if ``exact`` else ``"q8"``):
    ``"q8"`` llama.cpp's CPU numerics - the activation quantized to Q8_0 / Q8_K as llama.cpp does for the
    weight's type, integer block dots (a type without an integer kernel runs ``"f32"``); ``"exact"`` the
    GPU's summation order in f32 (bit-identical to the GPU); ``"f32"`` a dequantized row and an f32 dot.
    With ``numerics.act_quant`` (the ``llamacpp`` mode) a product that does not run ``"q8"`` gets its
    activation rounded the way llama.cpp's CPU backend does first (:mod:`strata.engine.numerics`: the
    same values the q8 kernels quantize to). ``nbytes_f32`` counts the f32 vectors this object holds
    (bytes); no f32 copy of a matrix is ever kept.

    Raises:
        ValueError: an unknown ``kernel`` name.
    """

    xp = np

    def __init__(
        self,
        pack: Pack,
        dense: dict[str, IndexEntry],
        nx: str | Numerics = "f32",
        *,
        exact: bool = False,
        threads: int | None = None,
        kernel: str | None = None,
    ):
        # read-only map: a stray write raises instead of corrupting the pack
        self._path = pack.pool_path
        self._pool = np.memmap(pack.pool_path, dtype=np.uint8, mode="r")
        self.mapped_files = [MappedFile(pack.pool_path)]  # watched before every step (strata.engine.mapped)
        self._pool_addr = self._pool.__array_interface__["data"][0] if self._pool.size else 0
        self._entries = dense
        self._vec: dict[str, np.ndarray] = {}
        self.nbytes_f32 = 0
        self.nx = numerics(nx)
        self.kernel = kernel or ("exact" if exact else "q8")
        CK.kernel_for(0, self.kernel)  # an unknown kernel name is refused here, not at the first token
        self.exact = self.kernel == "exact"
        self.threads = threads or CK.default_threads()
        # q/k/v (and gate/up) share one input: quantize it once per weight type (non-q8 kernels)
        self._last_x: np.ndarray | None = None
        self._last_q: dict[int, np.ndarray] = {}
        # per matrix: see _call (resolved on first use); one input-address slot, one scratch buffer (grown)
        self._calls: dict[str, tuple] = {}
        self._keep: list[np.ndarray] = []
        self._xs = np.zeros(1, dtype=np.uint64)
        self._xs_addr = self._xs.__array_interface__["data"][0]
        self._scratch = np.zeros(0, dtype=np.uint8)
        self._scratch_at = 0

    def has(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> IndexEntry:
        return self._entries[name]

    def types(self) -> set[int]:
        """The pool types of the tensors this store serves (the kernels the token path runs)."""
        return {e.type for e in self._entries.values()}

    def raw(self, name: str) -> np.ndarray:
        """The tensor's pool bytes (a read-only view of the mapped pool, no copy)."""
        e = self._entries[name]
        return self._pool[e.offset : e.offset + e.nbytes]

    def _read(self, offset: int, nbytes: int) -> np.ndarray:
        """Pool bytes read with pread (a copy): start-up reads vectors and checks BF16 tensors this way, so
        that no page of the mapping - which the kernels read in place - is faulted in before the first token."""
        with open(self._path, "rb", buffering=0) as f:
            b = os.pread(f.fileno(), nbytes, offset)
        if len(b) != nbytes:
            raise WeightError(f"{self._path}: {nbytes} bytes at {offset} asked, {len(b)} read")
        return np.frombuffer(b, dtype=np.uint8)

    def load(self, names: list[str]) -> None:
        """Check what can be checked without reading weights into memory: every BF16-promoted tensor
        is bf16-exact, and the vectors are read now (so the token path reads matrices only).

        Raises:
            WeightError: an F32 pool tensor promoted from BF16 whose low 16 bits are not all zero
                (its bytes are not what the index says).
        """
        for name in names:
            e = self._entries[name]
            if e.src_type == quants.BF16.id:
                bad = 0
                for off in range(0, e.nbytes, 1 << 24):  # read in 16 MiB pieces, not through the map
                    part = self._read(e.offset + off, min(1 << 24, e.nbytes - off)).view(np.uint32)
                    bad += int(np.count_nonzero(part & np.uint32(0xFFFF)))
                if bad:
                    raise WeightError(
                        f"tensor {name}: pool F32 promoted from BF16 has non-zero low 16 bits "
                        f"({bad} values); it is not bf16-exact"
                    )
            if _rows(e) == 1:
                self.get(name)

    def get(self, name: str) -> np.ndarray:
        """A vector as f32 (held once it is read); a matrix dequantized (not on the token path)."""
        a = self._vec.get(name)
        if a is not None:
            return a
        e = self._entries[name]
        rows = _rows(e)
        raw = (self._read(e.offset, e.nbytes) if rows == 1 else np.asarray(self.raw(name))).reshape(rows, -1)
        a = dequantize_rows(raw, e.type, e.ne0, name=name)
        if rows == 1:
            a = a[0]
            self._vec[name] = a
            self.nbytes_f32 += a.nbytes
        return a

    def _call(self, name: str) -> tuple:
        """(type, kernel that runs it, rows, ne0, the C entry point, its fixed leading arguments) of a matrix,
        resolved once (the token path then makes one ctypes call per product)."""
        c = self._calls.get(name)
        if c is None:
            e = self._entries[name]
            row_bytes = quants.row_nbytes(e.type, e.ne0)
            if e.nbytes != _rows(e) * row_bytes or e.offset + e.nbytes > self._pool.size:
                raise WeightError(
                    f"tensor {name}: {e.nbytes} bytes at {e.offset} are not {_rows(e)} rows of "
                    f"{row_bytes} inside the {self._pool.size}-byte pool"
                )
            kernel = CK.kernel_for(e.type, self.kernel)
            base = np.array([self._pool_addr + e.offset], dtype=np.uint64)
            self._keep.append(base)
            need = CK.scratch_bytes(e.type, kernel, e.ne0, 1, self.threads)
            if need + 64 > self._scratch.size:
                self._scratch = np.zeros(need + 64, dtype=np.uint8)
                p = self._scratch.__array_interface__["data"][0]
                self._scratch_at = p + (-p % 64)
            c = self._calls[name] = (
                e.type,
                kernel,
                _rows(e),
                e.ne0,
                CK.entry_point(e.type, kernel),
                (base.__array_interface__["data"][0], 1, _rows(e), e.ne0, row_bytes, self._xs_addr),
            )
        return c

    #: :meth:`matmul` takes rows of inputs (a prompt chunk: :meth:`strata.engine.decoder.Decoder.forward`)
    matmul_rows = True

    def matmul(self, name: str, x: np.ndarray) -> np.ndarray:
        """``W @ x`` for the matrix ``name`` (ggml ``ne = (ne0, rows)``) and f32 ``x [ne0]``: f32 ``[rows]``;
        or for rows ``x [T, ne0]`` (numpy order, a prompt chunk) ``x @ W.T``: f32 ``[T, rows]``, each row
        bit-identical to the one-row product (:func:`strata.engine.cpu.kernels.call_matmat`).

        Raises:
            ValueError: ``x`` is not ``ne0`` values (per row).
            WeightError: the index entry is not whole rows inside the pool.
        """
        t, kernel, rows, ne0, fn, args = self._call(name)
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 2 and x.shape[1] == ne0:
            if self.nx.act_quant and kernel != "q8":
                x = np.ascontiguousarray(quantize_activation(np, x, t), dtype=np.float32)
            e = self._entries[name]
            base = np.array([self._pool_addr + e.offset], dtype=np.uint64)
            return CK.call_matmat(t, kernel, base, rows, ne0, args[4], [x], self.threads)[0]
        if x.shape != (ne0,):
            raise ValueError(f"{name}: x has shape {x.shape}, the weight's rows have {ne0} values")
        if self.nx.act_quant and kernel != "q8":
            if x is not self._last_x:
                self._last_x, self._last_q = x, {}
            xq = self._last_q.get(t)
            if xq is None:
                xq = self._last_q[t] = quantize_activation(np, x, t)
            x = xq
        out = np.empty(rows, dtype=np.float32)
        self._xs[0] = x.__array_interface__["data"][0]
        fn(*args, out.__array_interface__["data"][0], self.threads, self._scratch_at)
        return out

    def rows(self, name: str, ids: list[int]) -> np.ndarray:
        """Rows ``ids`` of the matrix ``name`` dequantized: f32 ``[len(ids), ne0]`` (numpy order)."""
        e = self._entries[name]
        return CK.dequant_rows(e.type, self.raw(name), e.ne0, ids)
