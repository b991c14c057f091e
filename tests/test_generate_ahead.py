"""The decode loop's launch ahead (strata.engine.generate.decode with a model whose ``launch_ahead`` is True: the
fused GPU step off the hybrid path): the next position's step is queued before the current one is counted and
reported, and nothing a run reports changes - tokens, top pairs, every step's expert counts (hits, misses, PCIe
reads: counts) are the plain loop's; no step is queued that the plain loop would not run (past the last position or
a stop token). On the simulated device (CI), the one-graph MoE path with a host tier (misses read over PCIe).
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine.generate import decode
from strata.engine.gpu.backend import SimBackend
from strata.engine.gpu.fused import FusedDecoder
from strata.engine.sampling import Sampler
from strata.engine.startup import load_engine

PROMPT = [int(i) for i in np.random.default_rng(11).integers(3, 500, size=6)]


def _engine(pack, policy: str):
    # 3 MoE layers x 8 experts = 24 pairs; 10 slots: the rest in the host tier (misses over PCIe, one graph); a new
    # engine per run (the learning cache's swaps change what the next run would hit)
    return load_engine(
        pack, device="cuda", backend=SimBackend(), n_ctx=64, expert_cache=10, miss_tier="pcie", cache_policy=policy
    )


class _Spy:
    """The engine's fused decoder with its launches / waits logged: ``("launch", pos)``, ``("wait",)``, and
    ``("report", pos, queued)`` from the on_step callback (queued: a step was queued when that position was
    reported)."""

    def __init__(self, dec, ahead: bool):
        self.dec, self.ahead, self.log = dec, ahead, []

    def __getattr__(self, name):
        return getattr(self.dec, name)

    @property
    def launch_ahead(self) -> bool:
        return self.ahead and self.dec.launch_ahead

    def launch(self, token, pos, state, logits=True):
        self.log.append(("launch", pos))
        return self.dec.launch(token, pos, state, logits)

    def wait(self, **kw):
        self.log.append(("wait",))
        return self.dec.wait(**kw)

    def step(self, token, pos, state, logits=True):
        self.log.append(("step", pos))
        return self.dec.step(token, pos, state, logits)


def _run(pack, policy: str, ahead: bool, n_new: int, stop_ids=frozenset()):
    engine = _engine(pack, policy)
    dec = engine.model
    assert isinstance(dec, FusedDecoder) and not dec.hybrid and dec.launch_ahead
    spy = _Spy(dec, ahead)
    engine.experts.reset_counts()

    def on_step(st):
        spy.log.append(("report", st.position, dec._queued is not None))

    out, top, steps, stop, _t1, _t2 = decode(
        spy, engine.state, PROMPT, n_new, Sampler(), stop_ids=stop_ids, experts=engine.experts, on_step=on_step
    )
    counts = [(s.position, s.token_out, s.expert_hits, s.expert_misses, s.expert_pcie, s.expert_layers) for s in steps]
    return out, top, counts, stop, spy.log, dec.moe.swaps


@pytest.mark.parametrize("policy", ["fill", "class"])
def test_ahead_reports_what_the_plain_loop_reports(qwen3moe_pack, policy):
    """``class``: the swaps a step's wait() queues come before the next step's launch (the same swaps, counts)."""
    plain = _run(qwen3moe_pack, policy, ahead=False, n_new=10)
    ahead = _run(qwen3moe_pack, policy, ahead=True, n_new=10)
    assert ahead[5] == plain[5] and (ahead[5] > 0) == (policy == "class")  # swaps
    assert ahead[0] == plain[0] and len(ahead[0]) == 10  # tokens
    assert ahead[1] == plain[1]  # top (id, logit) pairs of every emitted step
    assert ahead[2] == plain[2]  # every position's expert counts, per layer
    assert sum(c[4] for c in plain[2]) > 0 and sum(c[2] for c in plain[2]) > 0  # hits and PCIe reads both happen
    log = ahead[4]
    launches = [e[1] for e in log if e[0] == "launch"]
    assert launches == list(range(len(PROMPT) + 10 - 1))  # each position once, in order, none past the last
    assert not [e for e in log if e[0] == "step"]
    # every position but the last was reported with the next one already queued (the device ran meanwhile)
    reports = [e for e in log if e[0] == "report"]
    assert [r[2] for r in reports] == [True] * (len(reports) - 1) + [False]
    assert [e[0] for e in plain[4] if e[0] != "report"] == ["step"] * len(launches)


def test_ahead_queues_nothing_past_a_stop_token(qwen3moe_pack):
    out, *_ = _run(qwen3moe_pack, "fill", ahead=False, n_new=10)
    stop_tok = out[4]
    k = out.index(stop_tok)  # the first time it comes
    got, _top, _counts, stop, log, _swaps = _run(qwen3moe_pack, "fill", True, 10, stop_ids=frozenset({stop_tok}))
    assert stop == "eog" and got == out[: k + 1]
    launches = [e[1] for e in log if e[0] == "launch"]
    assert launches == list(range(len(PROMPT) + k))  # the step that made the stop token is the last one run
    assert [e for e in log if e[0] != "report"][-1] == ("wait",)  # and it was waited for


def test_an_exception_in_a_report_leaves_no_step_queued(qwen3moe_pack):
    """on_step raising (a broken pipe, ^C) while the next step is queued: that step is waited for before the exception
    leaves decode(), so nothing is queued for the next run to count - whose counts are then a fresh run's."""
    engine = _engine(qwen3moe_pack, "fill")
    dec = engine.model

    def boom(st):
        if st.position == len(PROMPT) + 2:
            raise KeyboardInterrupt

    engine.experts.reset_counts()
    with pytest.raises(KeyboardInterrupt):
        decode(dec, engine.state, PROMPT, 10, Sampler(), experts=engine.experts, on_step=boom)
    assert dec._queued is None
    engine.experts.reset_counts()
    *_, steps, _stop, _a, _b = decode(dec, engine.state, PROMPT, 4, Sampler(), experts=engine.experts)
    K = engine.model.hp.n_expert_used
    assert [s.expert_hits + s.expert_misses for s in steps] == [3 * K] * len(steps)  # 3 MoE layers, K each


def test_a_refused_next_step_still_reports_this_one(qwen3moe_pack):
    """guard() (a mapped file changed) refusing the step queued ahead: the position that ended is reported first, as
    the plain loop reports it before its next guard()."""
    from strata.engine.errors import GenerateError

    def reported(ahead: bool) -> list[int]:
        engine = _engine(qwen3moe_pack, "fill")
        spy, calls, seen = _Spy(engine.model, ahead), [0], []

        def guard():
            calls[0] += 1
            if calls[0] == len(PROMPT) + 3:
                raise GenerateError("file changed")

        with pytest.raises(GenerateError, match="file changed"):
            decode(spy, engine.state, PROMPT, 10, Sampler(), experts=engine.experts, guard=guard,
                   on_step=lambda st: seen.append(st.position))  # fmt: skip
        assert engine.model._queued is None
        return seen

    assert reported(True) == reported(False) == list(range(len(PROMPT) + 2))


@pytest.mark.parametrize("cache", ["resident", "tier, no free slot", "admits"])
def test_a_step_is_counted_after_the_next_is_queued_where_nothing_can_change_residency(qwen3moe_pack, cache):
    """The routing record's counting (take_record: ~125 us a token on the 30B-A3B) runs after the next step is queued
    - off the device's critical path - where no admission or swap can follow from it (every expert resident; a full
    cache with its misses in the host tier and nothing learning); where one can (free slots admitting), it runs before,
    as the plain loop's. Either way every position's counts are the plain loop's."""
    kw = {
        "resident": {"resident": "all"},
        "tier, no free slot": {"expert_cache": 10, "miss_tier": "pcie", "cache_policy": "fill"},
        "admits": {"expert_cache": 20, "resident": "half", "miss_tier": "pcie", "cache_policy": "fill", "admit": True},
    }[cache]

    def run(ahead: bool):
        engine = load_engine(qwen3moe_pack, device="cuda", backend=SimBackend(), n_ctx=64, **kw)
        dec, moe, log = engine.model, engine.model.moe, []
        settle = moe.settle

        def spy_settle():
            if moe._held is not None:
                log.append(dec._queued is not None)  # a held record counted: was the next step queued?
            settle()

        moe.settle = spy_settle
        engine.experts.reset_counts()
        spy = _Spy(dec, ahead)
        *_, steps, _stop, _a, _b = decode(spy, engine.state, PROMPT, 8, Sampler(), experts=engine.experts)
        return [(s.expert_hits, s.expert_misses, s.expert_pcie, s.expert_layers) for s in steps], log, dec

    plain, _log, _dec = run(False)
    ahead, log, dec = run(True)
    assert ahead == plain and sum(c[0] for c in plain) > 0
    assert not dec.hybrid
    if cache == "admits":  # counted before the next launch while a slot is free, after it once none is
        assert log[0] is False and dec.moe.cache.free_slots == 0 and log[-2] is True, log
    else:
        assert log == [True] * (len(PROMPT) + 8 - 2) + [False], log
