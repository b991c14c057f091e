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


@dataclass(frozen=True)
class DeferredCounts:
    """A chunk layer's per-row counts not known yet (its ids are still on the device:
    :meth:`strata.engine.experts.ExpertPath.replay` computes them with :func:`chunk_row_counts` once they come down):
    the layer's residency when it ran, per expert id - ``resident`` bool ``[n_expert]``, ``tier_bytes`` int64
    ``[n_expert]`` (bytes read over PCIe, 0 where resident or in no host tier)."""

    resident: np.ndarray
    tier_bytes: np.ndarray


def chunk_row_counts(sel: np.ndarray, resident: np.ndarray, tier_bytes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per row of a chunk layer's selection ``sel`` (int ``[T, k]``, expert ids): ``(hits, misses, PCIe misses,
    bytes)`` (int64 ``[T]`` each, counts and bytes) given per expert id whether it is ``resident`` (bool) and the
    ``tier_bytes`` a miss of it reads from a host tier (int64). A chunk reads each host-tier expert once: its bytes go
    to the first row that routes to it, so the rows sum to the bytes the chunk read."""
    sel = np.asarray(sel, dtype=np.int64)
    T, k = sel.shape
    hits = resident[sel].sum(axis=1).astype(np.int64)
    pcie = (tier_bytes[sel] > 0).sum(axis=1).astype(np.int64)
    flat = sel.reshape(-1)
    _ids, first = np.unique(flat, return_index=True)
    first_bytes = np.bincount(first // k, weights=tier_bytes[flat[first]], minlength=T).astype(np.int64)
    return hits, k - hits, pcie, first_bytes


__all__ = ["ChunkRouting", "DeferredCounts", "chunk_row_counts"]
