"""The decayed-frequency expert-cache policy: one definition for the offline replay (:mod:`strata.budget.replay`,
policies ``class`` / ``profile+class``) and the engine's decode-time cache (``strata-engine --cache-policy class``:
:class:`strata.engine.gpu.fused_moe.MoeStep` swaps experts between the VRAM slots and the host tier by its choices).

The rule, exactly (:func:`strata.budget.replay.replay`'s docstring states it too): every (layer, expert) pair has a
counter ``s`` (0 before its first access, kept while it is evicted); at each new step (token) every counter is
multiplied by ``decay``; an access adds 1 to its pair's counter. A miss with a free slot is admitted; a miss with
every slot taken evicts the resident pair with the lowest counter (ties: the least recently used) and is admitted.
Counters may start at a profile's steady state (:func:`profile_seed_scores`). A frequency-with-decay class policy:
the idea of llama.cpp's ``--moe-cache-mib`` expert cache (per-expert counters decayed per token, the lowest
evicted); its source was not available here, so this is our rule, stated, not a port.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

#: The class policy's default decay per step (token): a counter halves in ~14 steps.
DEFAULT_DECAY = 0.95
#: A pair's key: ``layer * PAIR_KEY + expert`` (expert ids below 2**20).
PAIR_KEY = 1 << 20


def learns(policy: str, profile: bool) -> bool:
    """Whether a run with ``--cache-policy policy`` (``auto``, ``fill`` or ``class``) runs the decayed-frequency
    rule at decode time: ``class`` always (where it can swap), ``auto`` (the default) when no expert profile orders
    the fill (``profile`` False), ``fill`` never. Why auto: without a profile the start-up fill is in layer order and
    learning lifts the hit rate (30B-A3B, TokenRouting(0.5), H200: 25.0 -> 66.4% hits at 25% of the pairs in slots, 50.0
    -> 89.3% at 50%, decode 46.8 -> 74.9 tok/s, bench/results/h200-2026-12-02r-cache_policy.log); with one, the
    profile's fill alone hits more than profile + learning in the offline replay (make bench-routing: 87.0 vs 81.4%
    at 25% on the 80B-A3B geometry, bench/results/h200-2026-12-01-bench_routing_qwen3next-80b-a3b.log). One rule for
    the planner (the swap scratch: :func:`strata.layout.experts.expert_capacity`) and the engine."""
    return policy == "class" or (policy == "auto" and not profile)


def option_refusal(cache_policy: str, miss_tier: str) -> str | None:
    """Why ``--cache-policy`` cannot go with ``--miss-tier`` whatever the card, or None: ``class`` swaps experts between
    the VRAM slots and the host tier, which ``--miss-tier cpu`` never builds. The one rule of ``strata-engine`` (its
    options, on a GPU) and ``strata-budget check`` (its plan for strata's engine)."""
    if cache_policy == "class" and miss_tier == "cpu":
        return (
            f"--cache-policy {cache_policy} swaps experts between the VRAM slots and the host tier: it needs "
            "--miss-tier pcie or auto, not cpu"
        )
    return None


def class_refusal(tier_on: bool, slots: int, pairs: int, no_tier: str) -> str | None:
    """Why the class rule cannot run on a cache of ``slots`` slots of ``pairs`` (layer, expert) pairs, or None (it
    can, or has nothing to learn: ``slots >= pairs``): misses going to the CPU (``tier_on`` False; ``no_tier`` says
    why) - it swaps with the host tier - or fewer than 2 slots - one is its swap scratch. The one rule of
    ``strata-budget check`` (which refuses ``--cache-policy class`` there) and the engine (which refuses ``class`` and
    keeps the fill under ``auto``: :func:`strata.engine.gpu.fused_moe.check_policy`)."""
    if slots >= pairs:
        return None
    if not tier_on:
        return f"needs the host tier to swap experts with, and misses here go to the CPU ({no_tier})"
    if slots < 2:
        return f"keeps one of the cache's slots as its swap scratch: {slots} slot(s) leave none for experts"
    return None


def pair_key(layer: int, expert: int) -> int:
    """The key of ``(layer, expert)`` (:data:`PAIR_KEY`)."""
    return int(layer) * PAIR_KEY + int(expert)


def key_pair(key: int) -> tuple[int, int]:
    """``(layer, expert)`` of a :func:`pair_key`."""
    return int(key) // PAIR_KEY, int(key) % PAIR_KEY


def _logaddexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    hi, lo = (a, b) if a >= b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))


def profile_steps(profile: Sequence[tuple[int, int, int]], n_used: int) -> int:
    """Steps (tokens) a profile of ``(layer, expert, count)`` rows was counted over, when not recorded: its busiest
    layer's count / ``n_used`` (experts a token selects), at least 1."""
    per_layer: dict[int, int] = {}
    for L, _e, c in profile:
        per_layer[int(L)] = per_layer.get(int(L), 0) + int(c)
    return max(1, -(-max(per_layer.values(), default=0) // max(n_used, 1)))


def profile_seed_scores(
    profile: Sequence[tuple[int, int, int]], steps: int, decay: float = DEFAULT_DECAY
) -> dict[int, float]:
    """Counters at a profile's steady state, by :func:`pair_key`: ``(count / steps) / (1 - decay)`` (a pair
    accessed at the profile's rate every step), or ``count`` at ``decay = 1`` (no decay: LFU with history)."""
    return {pair_key(L, e): float(c) if decay == 1.0 else (c / steps) / (1.0 - decay) for L, e, c in profile}


class DecayedFrequency:
    """The decayed-frequency policy's state (module docstring) over ``slots`` slots: which keys are resident, every
    key's counter. :meth:`access` takes one access and says what the rule does.

    Counters are kept as ``log(s * decay**-t)`` (t = step): a uniform decay then changes no order and an access at
    step t adds ``decay**-t``; log space keeps long runs finite. Residents sit in a heap keyed (score, last access),
    stale entries skipped.

    ``initial``: keys resident at the start (a start-up fill), in load order - the first loaded is the first out
    among equal counters; ``seed``: starting counters by key (e.g. :func:`profile_seed_scores`); ``bypass``: a miss
    whose counter is not above the coldest resident's is not admitted (the replay's ``class+bypass``, the engine's
    rule: equally cold pairs do not churn over PCIe).

    Raises:
        ValueError: ``decay`` outside (0, 1], ``slots < 0``, or more initial keys than slots.
    """

    def __init__(
        self,
        slots: int,
        decay: float = DEFAULT_DECAY,
        initial: Sequence[int] = (),
        seed: dict[int, float] | None = None,
        bypass: bool = False,
    ):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay {decay} is outside (0, 1]")
        if slots < 0 or len(initial) > slots:
            raise ValueError(f"{len(initial)} initial keys for {slots} slots")
        self.slots = int(slots)
        self.bypass = bool(bypass)
        self._lam = -math.log(decay)
        self._logs: dict[int, float] = {k: math.log(s) for k, s in (seed or {}).items() if s > 0}
        self._resident: dict[int, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, int]] = []
        for j, k in enumerate(initial):
            entry = (self._logs.get(k, -math.inf), -len(initial) + j)
            self._resident[k] = entry
            self._heap.append((*entry, k))
        heapq.heapify(self._heap)
        self._i = 0  # accesses so far (the recency of an entry)

    def __contains__(self, key: int) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def access(self, key: int, step: int) -> tuple[bool, int | None, bool]:
        """One access of ``key`` at ``step`` (steps ascending): ``(hit, evicted key or None, admitted)``."""
        i, self._i = self._i, self._i + 1
        score = _logaddexp(self._logs.get(key, -math.inf), step * self._lam)
        self._logs[key] = score
        victim = None
        if key in self._resident:
            hit, admitted = True, False
        elif self.slots <= 0:
            return False, None, False
        else:
            hit, admitted = False, True
            if len(self._resident) >= self.slots:
                while True:
                    s0, i0, k0 = self._heap[0]
                    if self._resident.get(k0) == (s0, i0):
                        break
                    heapq.heappop(self._heap)
                if self.bypass and score <= s0:  # not hotter than the coldest resident: it stays a miss
                    return False, None, False
                heapq.heappop(self._heap)
                del self._resident[k0]
                victim = k0
        self._resident[key] = (score, i)
        heapq.heappush(self._heap, (score, i, key))
        if len(self._heap) > 4 * max(len(self._resident), 1) + 1024:  # drop stale entries now and then
            self._heap = [(s, j, kk) for kk, (s, j) in self._resident.items()]
            heapq.heapify(self._heap)
        return hit, victim, admitted


__all__ = [
    "DEFAULT_DECAY",
    "PAIR_KEY",
    "DecayedFrequency",
    "class_refusal",
    "option_refusal",
    "key_pair",
    "learns",
    "pair_key",
    "profile_seed_scores",
    "profile_steps",
]
