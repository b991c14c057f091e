"""Choosing the next token from one row of logits (host numpy, f32), as llama.cpp's sampler chain does.

Greedy by default (``temperature == 0``, no penalty): the argmax, lowest id on ties (what numpy.argmax and
the reference fixtures do). Otherwise the steps of llama.cpp's default chain, in its order
(common/common.h ``common_params_sampling::samplers``; src/llama-sampling.cpp for each step):

1. penalties over the last ``repeat_last_n`` tokens of the history (the prompt's included, as llama-cli accepts
   them): a token seen ``c`` times has its logit divided by ``repeat_penalty`` when positive, multiplied when not,
   then ``c * frequency_penalty + (c > 0) * presence_penalty`` subtracted (f32, ``llama_sampler_penalties_apply``);
2. ``top_k`` highest logits (0 = all);
3. ``top_p``: the smallest prefix, by probability of the softmax of the logits so far (no temperature yet), whose
   mass reaches ``top_p`` (1.0 = all);
4. ``min_p``: the logits at least ``max + log(min_p)`` (a probability at least ``min_p`` times the largest; 0 = off);
5. temperature: ``softmax(logits / temperature)`` over what is left (at temperature 0 with a penalty: the argmax);
6. a draw with a seeded ``numpy.random.Generator`` (same seed, same tokens; ``seed=-1``: a random seed, drawn
   once and reported by :meth:`Sampler.describe`). llama.cpp draws with std::mt19937, so the draws themselves
   differ; the distribution each draw comes from is the one llama.cpp's chain leaves (tests/test_sampling_llama_cpp.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: ``--seed`` that asks for a random seed (llama.cpp's ``LLAMA_DEFAULT_SEED`` is 0xFFFFFFFF, given as -1).
RANDOM_SEED = -1


@dataclass
class Sampler:
    """Sampling settings and the seeded generator (one per generation); the module docstring gives the chain.

    Raises:
        ValueError: a setting outside its range, naming it (temperature >= 0, top_k >= 0, 0 < top_p <= 1,
            0 <= min_p <= 1, repeat_penalty > 0, repeat_last_n >= -1 (-1: the whole history), seed >= -1).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)} is not a finite number")
        if self.seed < RANDOM_SEED:
            raise ValueError(f"seed {self.seed} < -1 (a non-negative integer, or -1 for a random seed)")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} < 0")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} < 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} is outside (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p {self.min_p} is outside [0, 1]")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty {self.repeat_penalty} must be > 0 (1.0 = off)")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n {self.repeat_last_n} < -1 (-1: the whole history, 0: off)")
        if self.seed == RANDOM_SEED:
            self.seed = int(np.random.SeedSequence().entropy % 2**32)
        self.rng = np.random.default_rng(self.seed)

    @property
    def penalized(self) -> bool:
        """A penalty step is on (it reads the history)."""
        off = self.repeat_penalty == 1.0 and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
        return not off and self.repeat_last_n != 0

    @property
    def greedy(self) -> bool:
        """The argmax of the row as it comes (no temperature, no penalty): the device's logit summary is enough."""
        return self.temperature == 0.0 and not self.penalized

    def describe(self) -> dict:
        return {
            "mode": "greedy" if self.temperature == 0.0 else "sample",
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": self.repeat_last_n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "chain": "penalties, top_k, top_p, min_p, temperature, dist (llama.cpp's order)",
        }

    def penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Step 1 on a copy of ``logits`` (f32, numpy order ``[n_vocab]``): the tokens of the last ``repeat_last_n``
        of ``history`` (-1: all), as ``llama_sampler_penalties_apply`` (src/llama-sampling.cpp) in f32."""
        x = np.array(logits, dtype=np.float32, copy=True)
        if not self.penalized:
            return x
        window = history if self.repeat_last_n == -1 else history[-self.repeat_last_n :]
        rep = np.float32(self.repeat_penalty)
        for tok, c in Counter(int(t) for t in window).items():
            if not 0 <= tok < x.size:
                continue
            v = x[tok]
            v = v * rep if v <= 0 else v / rep
            x[tok] = v - (np.float32(c) * np.float32(self.frequency_penalty) + np.float32(self.presence_penalty))
        return x

    def candidates(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-5: the token ids left (best first) and the probabilities the draw uses (f64, summing to 1)."""
        x = self.penalize(logits, history).astype(np.float64)
        idx = np.argsort(-x, kind="stable")
        if self.top_k:
            idx = idx[: self.top_k]
        if self.top_p < 1.0:
            z = x[idx] - x[idx[0]]
            p = np.exp(z)
            p /= p.sum()
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            idx = idx[: min(keep, idx.size)]
        if self.min_p > 0.0:
            idx = idx[x[idx] >= x[idx[0]] + math.log(self.min_p)]
        if self.temperature == 0.0:
            return idx[:1], np.ones(1)
        with np.errstate(over="ignore"):  # differences to the largest: no overflow at tiny temperatures
            z = (x[idx] - x[idx[0]]) / self.temperature
        p = np.exp(z)
        return idx, p / p.sum()

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        idx, p = self.candidates(logits, history)
        if idx.size == 1:
            return int(idx[0])
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
