"""The decode-time cache policy (``--cache-policy class``): strata.budget.cache_policy's rule, the engine swapping
experts between the VRAM slots and the host tier by it (strata.engine.gpu.fused_moe.MoeStep.swap).

On the simulated device (CI) and on CUDA (gpu-marked): the tokens and top logits of a run that swaps are the every-
expert-resident run's, bit for bit; after the run every pair is in exactly one place, its bytes there are its engine
form, and the device's slot table says where; a prompt chunk after swaps reads the moved experts. The policy's
decisions are the offline replay's. Refusals name the option.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.budget.cache_policy import DecayedFrequency, key_pair, pair_key, profile_seed_scores, profile_steps
from strata.budget.replay import replay
from strata.budget.trace import RoutingTrace
from strata.engine.errors import ExpertCacheError, GenerateError
from strata.engine.generate import generate
from strata.engine.gpu import kernels as K
from strata.engine.gpu.backend import SimBackend
from strata.engine.startup import load_engine

GPU_OK, GPU_WHY = K.gpu_available()
BACKENDS = ["sim", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=GPU_WHY)])]


@pytest.fixture(scope="module")
def pack(qwen3moe_pack):
    return qwen3moe_pack  # tests/conftest.py: the qwen3moe preset (3 MoE layers, 8 experts)


def _engine(pack, backend: str, **kw):
    if backend == "sim":
        return load_engine(pack, device="cuda", backend=SimBackend(), **kw)
    return load_engine(pack, device="cuda", **kw)


def _ids(n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 500, size=n)]


def test_pair_keys_and_seed_scores():
    assert pair_key(3, 7) == 3 * 2**20 + 7 and key_pair(pair_key(47, 511)) == (47, 511)
    prof = [(0, 1, 30), (0, 2, 10), (1, 5, 40)]
    assert profile_steps(prof, 2) == 20  # the busiest layer: 40 selections of 2 a step
    assert profile_seed_scores(prof, 20, 0.5) == {pair_key(0, 1): 3.0, pair_key(0, 2): 1.0, pair_key(1, 5): 4.0}
    assert profile_seed_scores(prof, 20, 1.0)[pair_key(1, 5)] == 40.0
    with pytest.raises(ValueError, match="outside"):
        DecayedFrequency(2, decay=0.0)
    with pytest.raises(ValueError, match="3 initial keys for 2 slots"):
        DecayedFrequency(2, initial=[1, 2, 3])


def test_decisions_on_a_written_trace():
    """Two slots, decay 0.5, the counters worked out by hand: keys 1 and 2 fill the slots, 3 evicts the lower counter
    (key 1), a hit on 2, then 1 comes back and evicts 3 (whose counter has decayed below 2's)."""
    pol = DecayedFrequency(2, decay=0.5)
    assert pol.access(1, 0) == (False, None, True)
    assert pol.access(2, 1) == (False, None, True)  # step 1: key 1's counter is 0.5, key 2's 1
    assert pol.access(3, 2) == (False, 1, True)  # step 2: 1 -> 0.25, 2 -> 0.5, 3 -> 1: key 1 evicted
    assert pol.access(2, 2) == (True, None, False)  # 2 -> 1.5
    assert pol.access(1, 3) == (False, 3, True)  # step 3: 3 -> 0.5, 2 -> 0.75, 1 -> 0.125 + 1: key 3 evicted
    assert 1 in pol and 2 in pol and 3 not in pol and len(pol) == 2


def test_engine_policy_decisions_are_the_replays():
    """The engine feeds the policy a step's routing record in routing order (layer, then selection): on a trace
    whose steps are tokens, DecayedFrequency over those keys gives the replay's 'class' and 'class+bypass' counts."""
    rng = np.random.default_rng(2)
    L, E, k, n = 3, 16, 2, 60
    sel = np.stack([np.stack([rng.choice(E, size=k, replace=False, p=np.r_[[0.3] * 2, [0.4 / 14] * 14]) for _ in
                              range(L)]) for _ in range(n)])  # fmt: skip
    trace = RoutingTrace.from_rows([(0, t, il, int(e)) for t in range(n) for il in range(L) for e in sel[t, il]])
    for policy, bypass in (("class", False), ("class+bypass", True)):  # the engine runs the second
        want = replay(trace, 10, policy)
        pol = DecayedFrequency(10, bypass=bypass)
        hits = adm = ev = 0
        for t in range(n):
            for il in range(L):
                for e in sel[t, il].tolist():
                    h, v, a = pol.access(pair_key(il, e), t)
                    hits, adm, ev = hits + h, adm + a, ev + (v is not None)
        assert (hits, adm, ev) == (want.hits, want.admissions, want.evictions)
        assert ev > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_swaps_keep_the_tokens_and_every_pair_in_one_place(pack, backend):
    """A third of the pairs in slots, the rest in the host tier, ``--cache-policy class``: 24 generated tokens swap
    experts; the tokens and top logits equal the every-expert-resident run's bit for bit; then every pair is in
    exactly one of the slots and the tier, the bytes there are its engine form, the device's table says so; a
    second prompt (chunks of 8) after the swaps still equals the resident run."""
    prompt = _ids(20, 3)
    ref = _engine(pack, backend, n_ctx=96, ubatch=8)
    want = generate(ref, prompt_ids=prompt, n_tokens=24, ignore_eos=True)
    pairs = len(ref.experts.chunk_path.layout.layouts) * ref.model.hp.n_expert
    eng = _engine(pack, backend, n_ctx=96, ubatch=8, expert_cache=pairs // 3, miss_tier="pcie", cache_policy="class")
    moe, cache, tier = eng.decoder.moe, eng.experts.cache, eng.experts.tier
    assert moe.policy is not None and cache.capacity == cache.n_slots - 1 == pairs // 3 - 1
    got = generate(eng, prompt_ids=prompt, n_tokens=24, ignore_eos=True)
    assert got.output_ids == want.output_ids and got.top == want.top
    assert moe.swaps > 0 and moe.policy_steps == 24  # a step each: the last prompt position and 23 generated tokens
    # every swap moved a slot each way over PCIe: in the counts and in the steps' "MiB over PCIe"
    assert eng.experts.counts.swaps == moe.swaps
    steps = [st for st in got.steps if st.phase != "prompt"]  # the fused steps (the prompt ran in chunks)
    reads = sum(v[2] * moe.blob_bytes[il] for st in steps for il, v in st.expert_layers.items())
    assert sum(st.pcie_bytes for st in steps) == reads + 2 * moe.swaps * cache.slot_bytes
    where, hosted = set(cache.where), set(tier.where)
    assert not where & hosted and len(where | hosted) == pairs and len(where) == cache.capacity
    table = np.asarray(moe.bk.to_host(moe.slot_of)).reshape(-1, moe.E)
    sb = cache.slot_bytes
    storage = np.asarray(moe.bk.to_host(cache.storage))
    for (il, e), s in list(cache.where.items())[:12]:
        assert table[il, e] == s
        blob = b"".join(ef.tobytes() for _p, ef in cache.engine_parts(il, e))
        parts = cache.layouts[il]
        got_bytes = b"".join(storage[s * sb + p.offset : s * sb + p.offset + p.nbytes].tobytes() for p in parts)
        assert got_bytes == blob
    for (il, e), h in list(tier.where.items())[:12]:
        assert table[il, e] == -2 - h
        parts = cache.layouts[il]
        got_bytes = b"".join(tier.storage[h * sb + p.offset : h * sb + p.offset + p.nbytes].tobytes() for p in parts)
        assert got_bytes == b"".join(ef.tobytes() for _p, ef in cache.engine_parts(il, e))
    prompt2 = _ids(30, 9)
    a = generate(ref, prompt_ids=prompt2, n_tokens=4, ignore_eos=True)
    b = generate(eng, prompt_ids=prompt2, n_tokens=4, ignore_eos=True)
    assert a.output_ids == b.output_ids and a.top == b.top


def test_class_policy_refusals(pack):
    with pytest.raises(GenerateError, match="--cache-policy class swaps experts .* not cpu"):
        _engine(pack, "sim", n_ctx=64, expert_cache=10, miss_tier="cpu", cache_policy="class")
    with pytest.raises(GenerateError, match="--cache-policy 'lfu': expected one of fill, class"):
        _engine(pack, "sim", n_ctx=64, cache_policy="lfu")
    with pytest.raises(ExpertCacheError, match="keeps one of the cache's slots as its swap scratch: 1 slot"):
        _engine(pack, "sim", n_ctx=64, expert_cache=1, miss_tier="pcie", cache_policy="class")
    eng = _engine(pack, "sim", n_ctx=64, cache_policy="class")  # every expert fits: nothing to learn, no scratch
    assert eng.decoder.moe.policy is None and eng.experts.cache.capacity == eng.experts.cache.n_slots


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_up_pcie_probe(pack, backend):
    """With a host tier and the chunk path's staging slots the start-up times host tier -> VRAM copies: on CUDA a
    rate between 1 and 1,000 GB/s, in the notes; on the simulated device no figure (it has no link to measure)."""
    eng = _engine(pack, backend, n_ctx=64, ubatch=8, expert_cache=6, miss_tier="pcie")
    got = eng.gpu.pcie_gbs_measured
    if backend == "sim":
        assert got is None
    else:
        assert 1.0 < got < 1000.0
    one = _engine(pack, backend, n_ctx=64, ubatch=1, expert_cache=6, miss_tier="pcie")  # no staging: no probe
    assert one.gpu.pcie_gbs_measured is None


def test_measure_counts_the_scratch_slots_pair_in_the_host_tier(pack):
    """``strata-engine measure`` with the learning cache: the host tier holds one pair more than the plan's tier at
    the same slots (the scratch slot's), and measure predicts exactly that, saying why."""
    from strata.engine.measure import measure_pack

    a = measure_pack(
        str(pack), backend=SimBackend(), device="cuda", n_ctx=64, expert_cache=6, miss_tier="pcie", cache_policy="class"
    )
    b = measure_pack(str(pack), backend=SimBackend(), device="cuda", n_ctx=64, expert_cache=6, miss_tier="pcie")
    assert a.scratch_slots == 1 and b.scratch_slots == 0
    slot = b.host_tier_bytes // 18  # 24 pairs, 6 slots: 18 pairs in the tier without the policy, 19 with it
    assert b.host_tier_bytes == b.host_tier_predicted_bytes == 18 * slot
    assert a.host_tier_bytes == a.host_tier_predicted_bytes == 19 * slot
    assert any("scratch slot leaves out" in n for n in a.notes)
