"""Cache policies replayed on routing traces (strata.budget.replay): textbook counts, brute-force
references, and Belady's optimum never beaten."""

from __future__ import annotations

from functools import cache
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.budget.formulas import fill_profile
from strata.budget.replay import (
    POLICIES,
    compare_policies,
    format_table,
    held_out_check,
    next_use,
    replay,
    slot_counts,
    top_share,
)
from strata.budget.trace import RoutingTrace, trace_counts


def trace_of(pairs: list[tuple[int, int]], per_step: int = 1) -> RoutingTrace:
    """A trace of ``(layer, expert)`` accesses, ``per_step`` of them per position (one sequence)."""
    return RoutingTrace.from_rows([(0, i // per_step, L, e) for i, (L, e) in enumerate(pairs)])


BELADY_1966 = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]  # the classic reference string, 3 frames


def test_textbook_reference_string():
    tr = trace_of([(0, e) for e in BELADY_1966])
    assert replay(tr, 3, "lru").misses == 10
    assert replay(tr, 3, "belady").misses == 7
    assert replay(tr, 3, "opt").misses == 7 - 3  # the start-up fill (1, 2, 3) is free: MIN minus 3 cold misses
    assert replay(tr, 4, "lru").misses == 8 and replay(tr, 4, "belady").misses == 6
    r = replay(tr, 3, "belady")
    assert (r.hits, r.admissions, r.evictions, r.accesses) == (5, 7, 4, 12)
    assert r.hit_rate == pytest.approx(5 / 12)


def test_bypass_beats_demand_paging_when_admitting_hurts():
    # one slot, A B A: MIN must load B (evicting A): 3 misses; opt starts with A and leaves it: B misses only
    tr = trace_of([(0, 0), (0, 1), (0, 0)])
    assert replay(tr, 1, "belady").misses == 3 and replay(tr, 1, "opt").misses == 1
    # a static profile fill can beat cold demand paging too (A B A B with one slot)
    tr = trace_of([(0, 0), (0, 1)] * 4)
    prof = trace_counts(tr)
    assert replay(tr, 1, "belady").hits == 0 and replay(tr, 1, "profile", profile=prof).hits == 4
    assert replay(tr, 1, "opt").hits == 4


def test_class_policy_keeps_the_frequent_pair():
    # slots 2, A A A B C A: LFU (decay 1) evicts B (count 1) for C and keeps A; LRU evicts A
    tr = trace_of([(0, 0), (0, 0), (0, 0), (0, 1), (0, 2), (0, 0)])
    assert replay(tr, 2, "class", decay=1.0).hits == 3
    assert replay(tr, 2, "lru").hits == 2
    # with a fast decay, recency wins: at C, A's three old accesses (0.0111) count less than B's two (0.11)
    tr = trace_of([(0, 0), (0, 0), (0, 0), (0, 1), (0, 1), (0, 2), (0, 1)])
    assert replay(tr, 2, "class", decay=0.1).hits == 4  # A A, B, then C evicts A and B hits again
    assert replay(tr, 2, "class", decay=1.0).hits == 3  # LFU: C evicts B (2 < 3), the last B misses


def test_counters_decay_per_step_not_per_access():
    # 4 accesses per step: within a step no decay, so A (2 accesses) outranks B and C (1 each)
    tr = trace_of([(0, 0), (0, 0), (0, 1), (0, 2), (0, 1), (0, 3), (0, 3), (0, 3)], per_step=4)
    r = replay(tr, 2, "class", decay=0.5)
    # step 0: A miss, A hit, B miss, C miss (evicts B: 1 < 2); step 1: B miss (evicts C), D miss, D, D hits
    assert r.hits == 3 and r.evictions == 3


def lru_reference(keys: list[int], slots: int) -> int:
    """Misses of LRU by its definition: a list ordered by last use, the front evicted."""
    order: list[int] = []
    misses = 0
    for k in keys:
        if k in order:
            order.remove(k)
        else:
            misses += 1
            if slots == 0:
                continue
            if len(order) == slots:
                order.pop(0)
        order.append(k)
    return misses


def optimum(keys: list[int], slots: int, *, warm: bool, bypass: bool) -> int:
    """The fewest misses by exhaustive search: free start-up fill of any ``slots`` keys (``warm``) or an
    empty cache, and on a miss any choice of victim, or none (``bypass``)."""
    keys = list(keys)

    @cache
    def f(i: int, state: frozenset) -> int:
        if i == len(keys):
            return 0
        k = keys[i]
        if k in state:
            return f(i + 1, state)
        if slots == 0:
            return 1 + f(i + 1, state)
        options = [state | {k}] if len(state) < slots else [(state - {v}) | {k} for v in state]
        if bypass:
            options.append(state)
        return 1 + min(f(i + 1, s) for s in options)

    if not warm:
        return f(0, frozenset())
    alphabet = sorted(set(keys))
    return min(f(0, frozenset(c)) for c in combinations(alphabet, min(slots, len(alphabet))))


pairs_st = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4)), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(pairs=pairs_st, slots=st.integers(0, 9), per_step=st.integers(1, 4), profile_pairs=pairs_st)
def test_opt_is_never_beaten_and_belady_beats_demand_paging(pairs, slots, per_step, profile_pairs):
    tr = trace_of(pairs, per_step)
    prof = trace_counts(trace_of(profile_pairs)) or [(0, 0, 1)]
    res = {r.policy: r for r in compare_policies(tr, [slots], profile=prof)}
    assert set(res) == set(POLICIES)
    for r in res.values():
        assert r.hits + r.misses == len(pairs) and 0 <= r.hits
        assert res["opt"].misses <= r.misses, (r, res["opt"])
    for p in ("lru", "class"):
        assert res["belady"].misses <= res[p].misses
    keys = [L * 100 + e for L, e in pairs]
    assert res["lru"].misses == lru_reference(keys, slots)
    for decay in (0.5, 1.0):
        assert res["belady"].misses <= replay(tr, slots, "class", decay=decay).misses
        assert res["opt"].misses <= replay(tr, slots, "profile+class", profile=prof, decay=decay).misses


@settings(max_examples=120, deadline=None)
@given(keys=st.lists(st.integers(0, 4), max_size=10), slots=st.integers(0, 3))
def test_belady_and_opt_equal_exhaustive_search(keys, slots):
    tr = trace_of([(0, k) for k in keys])
    assert replay(tr, slots, "belady").misses == optimum(keys, slots, warm=False, bypass=False)
    assert replay(tr, slots, "opt").misses == optimum(keys, slots, warm=True, bypass=True)


@settings(max_examples=80, deadline=None)
@given(pairs=pairs_st.filter(bool), slots=st.integers(0, 12))
def test_profile_replay_in_sample_is_the_budget_prediction(pairs, slots):
    tr = trace_of(pairs, 2)
    rows = trace_counts(tr)
    fill = fill_profile(rows, slots)
    r = replay(tr, slots, "profile", profile=rows)
    assert r.hits == fill.hit_count and r.hit_rate == pytest.approx(fill.hit_rate)
    chk = held_out_check(tr, tr, slots)
    assert chk.predicted == chk.in_sample == chk.held_out == pytest.approx(fill.hit_rate)
    # profile+admit never evicts and admits only into free slots
    a = replay(tr, slots, "profile+admit", profile=rows)
    assert a.evictions == 0 and a.admissions <= slots - fill.used and a.hits >= r.hits


def test_held_out_check_other_prompts():
    a = trace_of([(0, 0), (0, 1), (0, 0), (0, 2)] * 5)
    b = trace_of([(0, 2), (0, 3), (0, 2), (0, 0)] * 5)
    chk = held_out_check(a, b, 1)  # the fill keeps expert 0 (10 of 20 in-sample, 5 of 20 held out)
    assert (chk.predicted, chk.in_sample, chk.held_out) == (0.5, 0.5, 0.25)
    assert chk.error == -0.25 and chk.as_dict()["prediction_is_in_sample"] is True
    with pytest.raises(ValueError, match="empty"):
        held_out_check(trace_of([]), b, 1)


def test_profile_lru_starts_with_the_fill_most_counted_most_recent():
    prof = [(0, 0, 9), (0, 1, 5), (0, 2, 1)]
    # 2 slots: fill {0, 1}; the access to 3 evicts the least counted (1), so 0 then hits and 1 misses
    tr = trace_of([(0, 3), (0, 0), (0, 1)])
    r = replay(tr, 2, "profile+lru", profile=prof)
    assert (r.hits, r.misses, r.evictions) == (1, 2, 2)
    r = replay(tr, 2, "profile+class", profile=prof, profile_steps=10)
    assert (r.hits, r.misses) == (1, 2)


def test_replay_refusals_and_helpers():
    tr = trace_of([(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'"):
        replay(tr, 1, "fifo")
    with pytest.raises(ValueError, match="needs a profile"):
        replay(tr, 1, "profile")
    with pytest.raises(ValueError, match="slots -1"):
        replay(tr, -1, "lru")
    with pytest.raises(ValueError, match="decay 0"):
        replay(tr, 1, "class", decay=0)
    assert [r.policy for r in compare_policies(tr, [1])] == ["lru", "class", "class+bypass", "belady", "opt"]
    assert next_use([1, 2, 1, 1, 3]) == [2, 5, 3, 5, 5]
    assert slot_counts(100, [0.25, 0.5, 0.251, 0.9]) == [25, 50, 90]
    text = format_table(compare_policies(tr, [1, 2]), {1: "50%"})
    assert text.splitlines()[0].split() == ["slots", "lru", "class", "class+bypass", "belady", "opt"]
    assert "1 (50%)" in text
    t = trace_of([(0, 0)] * 8 + [(0, 1), (0, 2)])
    assert top_share(t, 10) == pytest.approx(0.8) and top_share(t, 20) == pytest.approx(0.9)


def test_trace_steps_concat_select():
    tr = RoutingTrace.from_rows([(0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 1, 3), (0, 1, 0, 1), (1, 0, 0, 5)])
    assert tr.steps().tolist() == [0, 0, 0, 1, 2] and tr.n_steps == 3 and tr.n_expert_used() == 2
    both = RoutingTrace.concat([tr, tr])
    assert both.seq.tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 3] and both.n_steps == 6
    assert tr.select([1]).expert.tolist() == [5]
    assert trace_counts(tr) == [(0, 1, 2), (0, 2, 1), (0, 5, 1), (1, 3, 1)]
    empty = RoutingTrace.concat([])
    assert len(empty) == 0 and empty.n_steps == 0 and trace_counts(empty) == []
    assert np.array_equal(trace_of([]).steps(), np.zeros(0))


def test_class_bypass_keeps_a_cold_miss_out():
    """``class+bypass``: with one slot held by a pair accessed three times, a pair seen once stays a miss (its counter
    is not above the resident's); plain ``class`` admits it, evicting the hot one, which then misses and evicts it."""
    tr = trace_of([(0, 1), (0, 1), (0, 1), (0, 2), (0, 1)])
    assert (replay(tr, 1, "class", decay=1.0).hits, replay(tr, 1, "class", decay=1.0).evictions) == (2, 2)
    r = replay(tr, 1, "class+bypass", decay=1.0)
    assert (r.hits, r.misses, r.admissions, r.evictions) == (3, 2, 1, 0)
