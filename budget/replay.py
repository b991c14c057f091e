"""Expert-cache policies replayed offline on a routing trace, with Belady's optimum beside them.

The cache modelled is strata's (engine/gpu/slots.py, :func:`strata.budget.formulas.size_expert_cache`):
``slots`` slots global across layers, each holding any layer's expert (slots are sized for the largest
blob), so a policy counts experts, not bytes. The trace (:class:`strata.budget.trace.RoutingTrace`) is
one stream of accesses ``(layer, expert)`` in routing order; the cache lives across its sequences (a
server's cache, not one per prompt). An access is a *hit* when the pair is resident, else a *miss* (the
engine then runs that expert on the CPU from the memory-mapped file); a policy may then *admit* the pair
(load it into a slot, evicting one when all are taken). Loads at start-up (a profile fill) are free; every
hit and miss is counted from the first access on.

Policies (:data:`POLICIES`):

- ``profile``: the start-up fill of :func:`strata.budget.formulas.fill_profile` from a profile (of *other*
  prompts, normally), never changed: what ``strata-engine generate --expert-profile`` runs (admission is off
  by default with a profile). On the profile's own trace it hits exactly the fill's expected hit rate (the
  budget's prediction).
- ``profile+admit``: that fill, then first-come admission of misses into the free slots, never evicting
  (engine/gpu/slots.py ``SlotCache.admit``: ``--expert-profile --admit``).
- ``lru``: cold start, every miss admitted, the least recently used pair evicted.
- ``class``: cold start, every miss admitted, the pair with the lowest decayed frequency evicted
  (:func:`replay`'s rule below): a frequency-with-decay class policy, the idea of llama.cpp's
  ``--moe-cache-mib`` expert cache (per-expert counters decayed per token, the lowest evicted). Its
  source was not available here: this is our rule, stated, not a port.
- ``class+bypass``: ``class`` except that a miss whose counter is not above the coldest resident's stays a miss
  (nothing evicted): hot pairs replace cold ones, equally cold ones do not churn. The rule ``strata-engine
  --cache-policy class`` runs (started from its fill), each admission a swap over PCIe.
- ``profile+lru`` / ``profile+class``: the profile fill, then ``lru`` / ``class``; the fill's recency
  order is its rank (the most counted pair most recent), the class counters start at the profile's
  steady state (below).
- ``belady``: Belady's MIN (L. A. Belady, "A study of replacement algorithms for a virtual-storage
  computer", IBM Systems Journal 5(2), 1966): cold start, every miss admitted, the resident pair whose next
  use is farthest in the future (never: infinitely far) evicted: the fewest misses of any policy that
  admits every miss from a cold cache (demand paging), so ``belady <= lru, class``.
- ``opt``: the optimum for this cache: a free start-up fill with the first ``slots`` distinct pairs the
  trace uses (what MIN would load first), then MIN with *bypass*: on a miss the pair is admitted only if
  its next use comes before the farthest resident's (which is evicted), else it runs as a miss and nothing
  changes. Admission being optional (a miss runs on the CPU either way) and the start-up fill free,
  ``opt`` has the fewest misses of every policy here, profile fills included (the exchange argument of
  Belady's proof; tests/test_budget_replay.py checks it against exhaustive search on small traces).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .cache_policy import DEFAULT_DECAY, PAIR_KEY, DecayedFrequency, profile_seed_scores
from .cache_policy import profile_steps as _profile_steps
from .formulas import fill_profile
from .trace import RoutingTrace, trace_counts

#: Every policy :func:`replay` runs, in the order the comparison table prints them.
POLICIES = (
    "profile",
    "profile+admit",
    "lru",
    "class",
    "class+bypass",
    "profile+lru",
    "profile+class",
    "belady",
    "opt",
)
#: Policies that need a profile.
PROFILE_POLICIES = frozenset({"profile", "profile+admit", "profile+lru", "profile+class"})
_KEY = PAIR_KEY  # key = layer * _KEY + expert (expert ids < 2**20): cache_policy.pair_key


@dataclass(frozen=True)
class ReplayResult:
    """One policy replayed at one slot count; counts of expert accesses (not bytes, not tokens).
    ``admissions``: pairs loaded at decode time (the start-up fill not counted); ``evictions``: pairs
    dropped to make room."""

    policy: str
    slots: int
    hits: int
    misses: int
    admissions: int
    evictions: int

    @property
    def accesses(self) -> int:
        """hits + misses."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """hits / accesses (0 for an empty trace)."""
        return self.hits / self.accesses if self.accesses else 0.0

    def as_dict(self) -> dict:
        """The fields plus ``hit_rate`` (JSON-able)."""
        return {**asdict(self), "hit_rate": self.hit_rate}


def _keys(pairs: Iterable[tuple[int, int]]) -> list[int]:
    return [int(L) * _KEY + int(e) for L, e in pairs]


def _profile_order(profile: Sequence[tuple[int, int, int]], slots: int) -> list[int]:
    """Keys of the fill of :func:`fill_profile`, in its load order (highest count first)."""
    return _keys(fill_profile(profile, slots).order)


def _lru(keys: list[int], slots: int, initial: list[int]) -> tuple[int, int, int]:
    """(hits, admissions, evictions) of LRU started with ``initial`` (least recently used first)."""
    cache: OrderedDict[int, None] = OrderedDict((k, None) for k in initial)
    hits = adm = ev = 0
    for k in keys:
        if k in cache:
            cache.move_to_end(k)
            hits += 1
            continue
        if slots <= 0:
            continue
        if len(cache) >= slots:
            cache.popitem(last=False)
            ev += 1
        cache[k] = None
        adm += 1
    return hits, adm, ev


def _class(
    keys: list[int],
    steps: list[int],
    slots: int,
    decay: float,
    initial: list[int],
    seed_scores: dict[int, float],
    bypass: bool = False,
) -> tuple[int, int, int]:
    """(hits, admissions, evictions) of the decayed-frequency policy (:class:`strata.budget.cache_policy.
    DecayedFrequency`, the rule in :func:`replay`; ``bypass``: ``class+bypass``)."""
    pol = DecayedFrequency(slots, decay, initial, seed_scores, bypass=bypass)
    hits = adm = ev = 0
    for k, t in zip(keys, steps):
        hit, victim, admitted = pol.access(k, t)
        hits += hit
        adm += admitted
        ev += victim is not None
    return hits, adm, ev


def next_use(keys: Sequence[int]) -> list[int]:
    """For every access ``i`` of ``keys`` the index of the next access to the same key, ``len(keys)`` when
    there is none (one backward pass, O(n))."""
    n = len(keys)
    nxt = [n] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(keys[i], n)
        last[keys[i]] = i
    return nxt


def _belady(keys: list[int], slots: int, *, bypass: bool, warm: bool) -> tuple[int, int, int]:
    """(hits, admissions, evictions) of MIN: evict the resident key used farthest ahead. ``bypass``: admit a
    miss only if its next use precedes the farthest resident's; ``warm``: start with the first ``slots``
    distinct keys (free). A resident's heap entry is (-next use, key); stale entries skipped."""
    nxt = next_use(keys)
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    if warm and slots > 0:
        for i, k in enumerate(keys):
            if k not in resident:
                resident[k] = i
                heap.append((-i, k))
                if len(resident) >= slots:
                    break
        heapq.heapify(heap)
    hits = adm = ev = 0
    for i, k in enumerate(keys):
        n = nxt[i]
        if k in resident:
            hits += 1
            resident[k] = n
            heapq.heappush(heap, (-n, k))
            continue
        if slots <= 0:
            continue
        if len(resident) >= slots:
            while -heap[0][0] != resident.get(heap[0][1]):
                heapq.heappop(heap)
            far, victim = -heap[0][0], heap[0][1]
            if bypass and far <= n:
                continue  # the new key is needed no sooner than every resident: leave the cache as it is
            heapq.heappop(heap)
            del resident[victim]
            ev += 1
        resident[k] = n
        heapq.heappush(heap, (-n, k))
        adm += 1
    return hits, adm, ev


def replay(
    trace: RoutingTrace,
    slots: int,
    policy: str,
    *,
    profile: Sequence[tuple[int, int, int]] | None = None,
    profile_steps: int | None = None,
    decay: float = DEFAULT_DECAY,
) -> ReplayResult:
    """Replay ``policy`` (one of :data:`POLICIES`, module docstring) on ``trace`` with ``slots`` global slots.

    ``profile``: ``(layer, expert, count)`` rows (an expert profile, e.g. :func:`strata.budget.trace.trace_counts`
    of other prompts' trace) for the ``profile*`` policies; ``profile_steps``: the positions it was counted
    over (default: its busiest layer's count / ``n_expert_used``).

    The ``class`` rule, exactly: every (layer, expert) pair has a counter ``s`` (0 before its first access,
    kept when it is evicted); at each new step (token) every counter is multiplied by ``decay``; an access
    adds 1 to its pair's counter. A miss with a free slot is admitted; a miss with all slots taken evicts
    the resident pair with the lowest counter (ties: the least recently used) and is admitted. With a
    profile the counters start at ``(count / profile_steps) / (1 - decay)`` (the steady state of the
    profile's rate; ``count`` at ``decay = 1``, no decay: plain LFU with history).

    Raises:
        ValueError: an unknown policy, a ``profile*`` policy without a profile, ``slots < 0`` or ``decay``
            outside (0, 1].
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; policies: {', '.join(POLICIES)}")
    if policy in PROFILE_POLICIES and profile is None:
        raise ValueError(f"cache policy {policy!r} needs a profile")
    if slots < 0:
        raise ValueError(f"slots {slots} < 0")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay {decay} is outside (0, 1]")
    keys = (trace.layer * _KEY + trace.expert).tolist()
    fill = _profile_order(profile, slots) if profile is not None and policy in PROFILE_POLICIES else []
    if policy == "profile":
        res = set(fill)
        hits, adm, ev = sum(1 for k in keys if k in res), 0, 0
    elif policy == "profile+admit":
        res, hits, adm = set(fill), 0, 0
        for k in keys:
            if k in res:
                hits += 1
            elif len(res) < slots:
                res.add(k)
                adm += 1
        ev = 0
    elif policy in ("lru", "profile+lru"):
        hits, adm, ev = _lru(keys, slots, fill[::-1])
    elif policy in ("class", "class+bypass", "profile+class"):
        seed: dict[int, float] = {}
        if policy == "profile+class":
            assert profile is not None
            p_steps = profile_steps or _profile_steps(profile, trace.n_expert_used())
            seed = profile_seed_scores(profile, p_steps, decay)
        hits, adm, ev = _class(keys, trace.steps().tolist(), slots, decay, fill, seed, policy == "class+bypass")
    else:
        hits, adm, ev = _belady(keys, slots, bypass=policy == "opt", warm=policy == "opt")
    return ReplayResult(policy, int(slots), int(hits), len(keys) - int(hits), int(adm), int(ev))


def compare_policies(
    trace: RoutingTrace,
    slot_counts: Iterable[int],
    *,
    profile: Sequence[tuple[int, int, int]] | None = None,
    profile_steps: int | None = None,
    policies: Sequence[str] = POLICIES,
    decay: float = DEFAULT_DECAY,
) -> list[ReplayResult]:
    """:func:`replay` of every policy in ``policies`` (the ``profile*`` ones only with a profile) at every slot
    count, in that order (slot count outer). Raises what :func:`replay` raises."""
    out = []
    for n in slot_counts:
        for p in policies:
            if p in PROFILE_POLICIES and profile is None:
                continue
            out.append(replay(trace, n, p, profile=profile, profile_steps=profile_steps, decay=decay))
    return out


def format_table(results: Sequence[ReplayResult], slot_labels: dict[int, str] | None = None) -> str:
    """The comparison as text: one row per slot count, one column per policy, hit rates in percent
    (``slot_labels``: e.g. ``{384: "25%"}`` printed beside the count)."""
    policies = list(dict.fromkeys(r.policy for r in results))
    by = {(r.slots, r.policy): r for r in results}
    head = f"{'slots':>12s} " + " ".join(f"{p:>13s}" for p in policies)
    lines = [head]
    for n in dict.fromkeys(r.slots for r in results):
        lab = f"{n}" + (f" ({slot_labels[n]})" if slot_labels and n in slot_labels else "")
        cells = [f"{100 * by[n, p].hit_rate:12.1f}%" if (n, p) in by else f"{'-':>13s}" for p in policies]
        lines.append(f"{lab:>12s} " + " ".join(cells))
    return "\n".join(lines)


@dataclass(frozen=True)
class HeldOutCheck:
    """The budget's hit-rate prediction checked on held-out prompts, at one slot count (fractions of
    accesses). ``predicted``: ``fill_profile(profile, slots).hit_rate``, what ``strata-budget check
    --expert-profile`` reports - in-sample, measured on the profile's own prompts; ``in_sample``: the
    ``profile`` policy replayed on the profile's own trace (equal to ``predicted`` by construction);
    ``held_out``: the same fill replayed on the trace of other prompts: what the prediction is worth."""

    slots: int
    predicted: float
    in_sample: float
    held_out: float
    profile_steps: int
    held_out_steps: int

    @property
    def error(self) -> float:
        """held_out - predicted (negative: the prediction was optimistic)."""
        return self.held_out - self.predicted

    def as_dict(self) -> dict:
        """The fields plus ``error`` and ``prediction_is_in_sample`` (always true: the budget's figure is)."""
        return {**asdict(self), "error": self.error, "prediction_is_in_sample": True}


def held_out_check(profile_trace: RoutingTrace, held_out_trace: RoutingTrace, slots: int) -> HeldOutCheck:
    """Profile on ``profile_trace`` (:func:`trace_counts`), predict the hit rate at ``slots`` the budget's
    way (:func:`fill_profile`), and measure it by replaying the ``profile`` policy on ``held_out_trace``.

    Raises:
        ValueError: an empty profile trace.
    """
    rows = trace_counts(profile_trace)
    if not rows:
        raise ValueError("held_out_check: the profile trace is empty")
    pred = fill_profile(rows, slots).hit_rate
    ins = replay(profile_trace, slots, "profile", profile=rows).hit_rate
    out = replay(held_out_trace, slots, "profile", profile=rows).hit_rate
    return HeldOutCheck(int(slots), pred, ins, out, profile_trace.n_steps, held_out_trace.n_steps)


def slot_counts(n_pairs: int, fractions: Iterable[float]) -> list[int]:
    """``round(f * n_pairs)`` for each fraction (e.g. 0.25, 0.5, 0.75, 0.9 of every (layer, expert) pair),
    at least 1, in the given order, duplicates dropped."""
    return list(dict.fromkeys(max(1, round(float(f) * int(n_pairs))) for f in fractions))


def top_share(trace: RoutingTrace, n_expert: int, fraction: float = 0.1) -> float:
    """Share of a layer's selections that went to its ``ceil(fraction * n_expert)`` most selected experts
    (at least one), averaged over the layers in ``trace``: the concentration a skew gives (about
    ``fraction`` when routing is uniform and the trace long; 1 when every token picks the same experts)."""
    shares = []
    n_top = max(1, math.ceil(fraction * int(n_expert)))
    for L in np.unique(trace.layer):
        c = np.sort(np.bincount(trace.expert[trace.layer == L]))[::-1]
        shares.append(c[:n_top].sum() / c.sum())
    return float(np.mean(shares)) if shares else 0.0


__all__ = [
    "DEFAULT_DECAY",
    "POLICIES",
    "PROFILE_POLICIES",
    "HeldOutCheck",
    "ReplayResult",
    "compare_policies",
    "format_table",
    "held_out_check",
    "next_use",
    "replay",
    "slot_counts",
    "top_share",
]
