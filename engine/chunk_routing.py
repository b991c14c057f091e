"""A prompt chunk's routing of one MoE layer, sorted by expert once (:class:`ChunkRouting`): what the counts of
:meth:`strata.engine.experts.ExpertPath.chunk` and every device's grouping of the chunk's (row, expert) pairs read
(the CPU's :meth:`strata.engine.cpu.experts.CpuExpertPath.chunk_outputs`, the GPU's
:meth:`strata.engine.gpu.chunk.ChunkPath.expert_outputs`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChunkRouting:
    """A prompt chunk's routing of one layer, sorted by expert once for every consumer (the counts and each device's
    grouping). Numpy order: ``ids`` int64 ``[T, k]`` (row ``t``'s experts in selection order); pair ``q = t * k + kk``;
    ``perm`` int64 ``[T * k]``: the pairs sorted by expert, stable (rows ascending within an expert); ``used`` int64
    ``[G]``: the experts used, ascending; ``starts`` / ``counts`` int64 ``[G]``: each used expert's first position in
    ``perm`` and its number of pairs."""

    ids: np.ndarray
    perm: np.ndarray
    used: np.ndarray
    starts: np.ndarray
    counts: np.ndarray

    @staticmethod
    def of(ids) -> ChunkRouting:
        """From ``ids`` (``[T, k]`` ints: an array or rows of a list)."""
        sel = np.asarray(ids, dtype=np.int64)
        if sel.ndim != 2:
            sel = sel.reshape(len(ids), -1)
        flat = sel.ravel()
        perm = np.argsort(flat, kind="stable")
        c = np.bincount(flat) if flat.size else np.zeros(0, np.int64)
        used = np.flatnonzero(c)
        counts = c[used].astype(np.int64)
        starts = np.cumsum(counts) - counts
        return ChunkRouting(sel, perm, used, starts, counts)

    @property
    def k(self) -> int:
        """Experts a row selects."""
        return int(self.ids.shape[1])

    @property
    def first(self) -> np.ndarray:
        """int64 ``[G]``: each used expert's first pair ``q`` (its lowest row routes to it there)."""
        return self.perm[self.starts]


__all__ = ["ChunkRouting"]
