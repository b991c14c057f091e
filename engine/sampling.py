"""Choosing the next token from one row of logits (host numpy, f32).

Greedy by default (``temperature == 0``): the argmax, lowest id on ties (what numpy.argmax and
the reference fixtures do). With a temperature: keep the ``top_k`` highest logits (0 = all), then
the smallest prefix of them, by probability, whose mass reaches ``top_p`` (1.0 = all), then draw
from ``softmax(logits / temperature)`` over what is left with a seeded ``numpy.random.Generator``
(same seed, same tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sampler:
    """Sampling settings and the seeded generator (one per generation)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature {self.temperature} is not a finite number")
        if not math.isfinite(self.top_p):
            raise ValueError(f"top_p {self.top_p} is not a finite number")
        if self.seed < 0:
            raise ValueError(f"seed {self.seed} < 0 (numpy's generator takes a non-negative integer)")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} < 0")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} < 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} is outside (0, 1]")
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> dict:
        return {
            "mode": "greedy" if self.greedy else "sample",
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
        }

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        x = logits.astype(np.float64)
        idx = np.argsort(-x, kind="stable")
        if self.top_k:
            idx = idx[: self.top_k]
        with np.errstate(over="ignore"):
            z = x[idx] / self.temperature
        if not np.isfinite(z).all():  # a temperature so small that logit / T overflows: the same p from the
            with np.errstate(over="ignore"):  # differences to the largest (0 there, -inf or finite)
                z = (x[idx] - x[idx[0]]) / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            idx, p = idx[:keep], p[:keep] / p[:keep].sum()
        return int(idx[self.rng.choice(len(idx), p=p)])


#: Block length of :func:`top_k_pairs`' block-maximum route (rows of at least max(k, 8) blocks).
_TOPK_BLOCK = 512


def _top_k_pairs_partition(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    part = np.argpartition(-logits, k - 1)[:k]
    kth = logits[part].min()
    cand = np.flatnonzero(logits >= kth)
    order = sorted(cand.tolist(), key=lambda i: (-float(logits[i]), i))[:k]
    return [(int(i), float(logits[i])) for i in order]


def top_k_pairs(logits: np.ndarray, k: int = 5) -> list[tuple[int, float]]:
    """The ``k`` highest ``(id, logit)`` pairs, by logit descending then id ascending.

    Definition: ``kth`` = the k-th largest value; every id with a logit >= ``kth``, sorted by
    (-logit, id), first ``k``. For long rows (a 262144-token vocabulary, every decode step) the
    threshold comes from block maxima instead of a partition of the whole row: the k-th largest of
    the maxima of 512-value blocks is the value of k distinct elements, so it is <= ``kth``; the ids at
    or above it are a superset of the definition's candidates and sorting them gives the same first
    ``k`` (ties by id included). ~25x faster than ``argpartition`` on 262144 values (one pass of
    maxima instead of a selection); rows with NaN take the partition route.
    """
    n = logits.shape[0]
    k = min(k, n)
    if k < 1:
        return []
    if n // _TOPK_BLOCK >= max(k, 8):  # at least k blocks: k distinct maxima
        m = n - n % _TOPK_BLOCK
        bm = logits[:m].reshape(-1, _TOPK_BLOCK).max(axis=1)
        if m < n:
            bm = np.append(bm, logits[m:].max())
        if not np.isnan(bm).any():  # a NaN anywhere makes its block's maximum NaN
            thr = np.partition(bm, bm.size - k)[bm.size - k]
            cand = np.flatnonzero(logits >= thr)
            order = sorted(cand.tolist(), key=lambda i: (-float(logits[i]), i))[:k]
            return [(int(i), float(logits[i])) for i in order]
    return _top_k_pairs_partition(logits, k)
