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


@pytest.fixture(scope="module")
def engine(qwen3moe_pack):
    # 3 MoE layers x 8 experts = 24 pairs; 10 slots: the rest in the host tier (misses over PCIe, one graph)
    return load_engine(qwen3moe_pack, device="cuda", backend=SimBackend(), n_ctx=64, expert_cache=10, miss_tier="pcie")


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

    def wait(self):
        self.log.append(("wait",))
        return self.dec.wait()

    def step(self, token, pos, state, logits=True):
        self.log.append(("step", pos))
        return self.dec.step(token, pos, state, logits)


def _run(engine, ahead: bool, n_new: int, stop_ids=frozenset()):
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
    return out, top, counts, stop, spy.log


def test_ahead_reports_what_the_plain_loop_reports(engine):
    plain = _run(engine, ahead=False, n_new=10)
    ahead = _run(engine, ahead=True, n_new=10)
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


def test_ahead_queues_nothing_past_a_stop_token(engine):
    out, *_ = _run(engine, ahead=False, n_new=10)
    stop_tok = out[4]
    k = out.index(stop_tok)  # the first time it comes
    got, _top, counts, stop, log = _run(engine, ahead=True, n_new=10, stop_ids=frozenset({stop_tok}))
    assert stop == "eog" and got == out[: k + 1]
    launches = [e[1] for e in log if e[0] == "launch"]
    assert launches == list(range(len(PROMPT) + k))  # the step that made the stop token is the last one run
    assert engine.model._queued is None
