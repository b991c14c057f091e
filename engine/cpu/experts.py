"""The CPU device's expert cache and expert path (:class:`strata.engine.experts.ExpertCache`,
:class:`strata.engine.experts.ExpertPath`): on the CPU every selected expert - hit or miss - is computed from
the memory-mapped shards by the same kernels (:meth:`strata.engine.experts.ShardExperts.ffn_many`), so the
resident set only decides the hit/miss counts.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..experts import ExpertPath, ShardExperts


class CpuExpertCache:
    """The CPU stand-in for the VRAM expert cache: the set of resident (layer, expert) pairs. On the
    CPU every expert is computed from the mapped shard by the same kernels, hit or miss (so the
    result cannot depend on residency); the set only decides the hit/miss counts. Holds no weights
    (``nbytes`` 0). ``kernel``: as :meth:`strata.engine.experts.ShardExperts.ffn_many` (default ``"exact"`` if
    ``exact`` else ``"q8"``)."""

    nbytes = 0

    def __init__(
        self,
        source: ShardExperts,
        pairs: Iterable[tuple[int, int]],
        act_quant: bool = False,
        exact: bool = False,
        threads: int | None = None,
        kernel: str | None = None,
    ):
        self._pairs = set(pairs)
        self._source = source
        self._act_quant, self._threads = act_quant, threads
        self._kernel = kernel or ("exact" if exact else "q8")

    def __len__(self) -> int:
        return len(self._pairs)

    def resident(self, il: int, e: int) -> bool:
        return (il, e) in self._pairs

    def ffn(self, il: int, e: int, x: np.ndarray) -> np.ndarray:
        return self._source.ffn(il, e, x, threads=self._threads, act_quant=self._act_quant, kernel=self._kernel)


class CpuExpertPath(ExpertPath):
    """The CPU engine's :class:`strata.engine.experts.ExpertPath`: every selected expert of a layer - hit or miss,
    the CPU computes both from the mapped shards with the same kernels - in one
    :meth:`strata.engine.experts.ShardExperts.ffn_many` (two OpenMP regions per layer instead of three per expert);
    each output is bit-identical to the one-at-a-time path, so the combined sum is too. ``cache`` (a
    :class:`CpuExpertCache`) only decides the hit/miss counts."""

    def outputs(self, il: int, x, ids: list[int]) -> list:
        ys = self.source.ffn_many(il, list(ids), x, threads=self.threads, act_quant=self.act_quant, kernel=self.kernel)
        for e in ids:
            hit = self.cache is not None and self.cache.resident(il, e)
            self.count(il, int(hit), int(not hit))
        return list(ys)

    def chunk_outputs(self, il: int, X, r) -> np.ndarray:
        """Every selected expert's output on its row, ``[T, k, n_embd]``: the chunk's rows grouped by expert (``r``:
        :class:`strata.engine.experts.ChunkRouting`) and each expert run once on its rows
        (:meth:`strata.engine.experts.ShardExperts.ffn_grouped`); row by row the bits of :meth:`outputs` (hit or
        miss alike)."""
        T, k = r.ids.shape
        order, experts, starts = r.perm, r.used, r.starts
        bounds = [*starts[1:], order.size]
        rows_of = [order[a:b] // k for a, b in zip(starts, bounds)]
        X = np.ascontiguousarray(X, dtype=np.float32)
        ys = self.source.ffn_grouped(
            il,
            [(int(e), X[r]) for e, r in zip(experts, rows_of)],
            threads=self.threads,
            act_quant=self.act_quant,
            kernel=self.kernel,
        )
        out = np.empty((T * k, ys[0].shape[1]), dtype=np.float32)
        for (a, b), y in zip(zip(starts, bounds), ys):
            out[order[a:b]] = y
        return out.reshape(T, k, -1)
