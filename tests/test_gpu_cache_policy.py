"""The decode-time cache policy (``--cache-policy class``): strata.budget.cache_policy's rule, the engine swapping
experts between the VRAM slots and the host tier by it (strata.engine.gpu.fused_moe.MoeStep.swap).

On the simulated device (CI) and on CUDA (gpu-marked): the tokens and top logits of a run that swaps are the every-
expert-resident run's, bit for bit; after the run every pair is in exactly one place, its bytes there are its engine
form, and the device's slot table says where; a prompt chunk after swaps reads the moved experts. The policy's
decisions are the offline replay's. Refusals name the option.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from strata.budget.cache_policy import (
    DecayedFrequency,
    key_pair,
    learns,
    pair_key,
    profile_seed_scores,
    profile_steps,
)
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


def _rule_reference(accesses, slots, decay, initial=(), seed=None, bypass=False):
    """The decayed-frequency rule written out the plain way, independent of DecayedFrequency's log-space heap: float
    counters multiplied by ``decay`` at each new step, +1 an access; the victim is the resident with the lowest
    counter, ties to the least recent access (the initial fill: in load order, before any access); with ``bypass`` a
    miss whose counter is not above the victim's stays a miss. ``accesses``: (key, step). Returns each access's
    ``(hit, victim, admitted)``."""
    counter = dict(seed or {})
    last = {k: -len(initial) + j for j, k in enumerate(initial)}
    resident, out, step = list(initial), [], 0
    for i, (k, t) in enumerate(accesses):
        while step < t:
            counter = {kk: c * decay for kk, c in counter.items()}
            step += 1
        counter[k] = counter.get(k, 0.0) + 1.0
        if k in resident:
            last[k] = i
            out.append((True, None, False))
            continue
        victim = None
        if len(resident) >= slots:
            victim = min(resident, key=lambda r: (counter.get(r, 0.0), last[r]))
            if bypass and counter[k] <= counter.get(victim, 0.0):
                out.append((False, None, False))
                continue
            resident.remove(victim)
        resident.append(k)
        last[k] = i
        out.append((False, victim, True))
    return out


@pytest.mark.parametrize("bypass", [False, True])
def test_policy_is_the_rule_written_out(bypass):
    """DecayedFrequency (log-space counters, a heap of residents) against the rule written out plainly
    (:func:`_rule_reference`) on 1,200 accesses of a skewed routing, with an initial fill and profile-seeded counters:
    every decision the same; and the replay's 'class' / 'class+bypass' counts are those decisions'."""
    rng = np.random.default_rng(5 + bypass)
    L, E, k, n = 3, 16, 2, 200
    p = rng.dirichlet(np.full(E, 0.3))
    sel = [[rng.choice(E, size=k, replace=False, p=p) for _ in range(L)] for _ in range(n)]
    acc = [(pair_key(il, int(e)), t) for t in range(n) for il in range(L) for e in sel[t][il]]
    initial = [pair_key(0, e) for e in range(6)]
    seed = {pair_key(1, 3): 4.0, pair_key(0, 2): 0.5}
    want = _rule_reference(acc, 10, 0.9, initial, seed, bypass)
    pol = DecayedFrequency(10, 0.9, initial, seed, bypass=bypass)
    assert [pol.access(key, t) for key, t in acc] == want
    assert sum(v is not None for _h, v, _a in want) > 20  # evictions happened
    trace = RoutingTrace.from_rows([(0, t, il, int(e)) for t in range(n) for il in range(L) for e in sel[t][il]])
    got = replay(trace, 10, "class+bypass" if bypass else "class", decay=0.9)
    cold = _rule_reference(acc, 10, 0.9, bypass=bypass)
    assert (got.hits, got.admissions, got.evictions) == (
        sum(h for h, _v, _a in cold),
        sum(a for _h, _v, a in cold),
        sum(v is not None for _h, v, _a in cold),
    )


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
    fill = list(cache.where)  # the start-up fill in load order: the rule's initial residents
    records, swaps = [], []
    learn, swap = moe._learn_from, moe.swap
    moe._learn_from = lambda rec: records.append(rec.copy()) or learn(rec)
    moe.swap = lambda out, into: swaps.append((out, into)) or swap(out, into)
    got = generate(eng, prompt_ids=prompt, n_tokens=24, ignore_eos=True)
    # the engine's swaps are the rule's admissions, fed the steps' records in routing order (layer, selection)
    acc = [(pair_key(il, int(e)), t + 1) for t, rec in enumerate(records) for j, il in enumerate(moe.layers)
           for e in rec[j, 0]]  # fmt: skip
    rule = _rule_reference(acc, cache.capacity, 0.95, [pair_key(*pr) for pr in fill], bypass=True)
    assert swaps == [(key_pair(v), key_pair(key)) for (key, _t), (_h, v, a) in zip(acc, rule) if a]
    assert got.output_ids == want.output_ids and got.top == want.top
    assert moe.swaps > 0 and moe.policy_steps == 24  # a step each: the last prompt position and 23 generated tokens
    # every swap moved a slot each way over PCIe: in the counts and in the steps' "MiB over PCIe"
    assert eng.experts.counts.swaps == moe.swaps
    steps = [st for st in got.steps if st.phase != "prompt"]  # the fused steps (the prompt ran in chunks)
    reads = sum(v[2] * moe.blob_bytes[il] for st in steps for il, v in st.expert_layers.items())
    # and the prefetch's copies (each a blob span) less the misses they served (each its parts: counted in reads)
    pf = moe.prefetch
    ahead = int((pf.totals[:, 0] * pf.span - pf.totals[:, 1] * pf.blob).sum())
    assert pf.active and eng.experts.counts.prefetched == int(pf.totals[:, 0].sum()) > 0
    assert sum(st.pcie_bytes for st in steps) == reads + 2 * moe.swaps * cache.slot_bytes + ahead
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
    with pytest.raises(GenerateError, match="--cache-policy 'lfu': expected one of auto, fill, class"):
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
    """``strata-engine measure`` with the learning cache: the host tier holds one pair more than without it at the
    same slots (the scratch slot's), and the plan (``--cache-policy class`` planned: layout.experts.host_tier_pairs)
    predicts exactly that, saying why."""
    from strata.engine.measure import measure_pack

    a = measure_pack(
        str(pack), backend=SimBackend(), device="cuda", n_ctx=64, expert_cache=6, miss_tier="pcie", cache_policy="class"
    )
    b = measure_pack(
        str(pack), backend=SimBackend(), device="cuda", n_ctx=64, expert_cache=6, miss_tier="pcie", cache_policy="fill"
    )
    c = measure_pack(str(pack), backend=SimBackend(), device="cuda", n_ctx=64, expert_cache=6, miss_tier="pcie")
    assert a.scratch_slots == 1 and b.scratch_slots == 0 and c.scratch_slots == 1  # c: the default, auto, learns
    slot = b.host_tier_bytes // 18  # 24 pairs, 6 slots: 18 pairs in the tier without the policy, 19 with it
    assert b.host_tier_bytes == b.host_tier_predicted_bytes == 18 * slot
    assert a.host_tier_bytes == a.host_tier_predicted_bytes == 19 * slot
    assert c.host_tier_bytes == c.host_tier_predicted_bytes == 19 * slot
    # auto with --resident pinning the fill keeps it (no scratch): the plan says the same
    d = measure_pack(
        str(pack), backend=SimBackend(), device="cuda", n_ctx=64, expert_cache=6, miss_tier="pcie", resident="half"
    )
    assert d.scratch_slots == 0 and d.host_tier_bytes == d.host_tier_predicted_bytes == 18 * slot
    assert any("scratch slot leaves out" in n for n in a.notes)


def test_refusals_name_the_numbers_and_a_refused_swap_moves_nothing(pack):
    """check_policy's refusals name the option, the reason and the slots; SlotCache / HostTier.replace refuse a pair
    already placed, naming it and where it is; MoeStep.swap refused that way leaves the maps, the table and the bytes
    as they were (the checks come before any copy)."""
    from strata.engine.gpu.fused_moe import check_policy

    def asked(policy, profile=None):  # the options check_policy reads
        return types.SimpleNamespace(
            cache_policy=policy,
            learns=learns(policy, profile is not None),
            profile=profile,
            resident="all",
            miss_tier="auto",
        )

    note: dict = {}
    with pytest.raises(ExpertCacheError, match=r"misses here go to the CPU \(cpu \(no room\)\)"):
        check_policy(asked("class"), False, 5, 24, "cpu (no room)", note)
    with pytest.raises(ExpertCacheError, match=r"1 slot\(s\) leave none for experts"):
        check_policy(asked("class"), True, 1, 24, "", note)
    assert (
        check_policy(asked("class"), True, 24, 24, "", note) is False
        and "nothing to learn (24 slots" in note["cache policy"]
    )
    assert check_policy(asked("fill"), False, 1, 24, "", {}) is False
    # auto (the default): class without a profile where it can swap, else the fill, said - never a refusal
    assert check_policy(asked("auto"), True, 6, 24, "", note) is True and note["cache policy"].startswith("auto: class")
    assert check_policy(asked("auto", [(0, 1, 5)]), True, 6, 24, "", note) is False
    assert note["cache policy"].startswith("auto: fill (the profile")
    assert check_policy(asked("auto"), False, 6, 24, "cpu (no room)", note) is False
    assert note["cache policy"] == (
        "auto: fill (the class rule needs the host tier to swap experts with, and misses here go to the CPU (cpu "
        "(no room)))"
    )
    assert check_policy(asked("auto"), True, 1, 24, "", note) is False and "1 slot(s)" in note["cache policy"]
    eng = _engine(pack, "sim", n_ctx=64, ubatch=8, expert_cache=6, miss_tier="pcie", cache_policy="class")
    moe, cache, tier = eng.decoder.moe, eng.experts.cache, eng.experts.tier
    a, b = list(cache.where)[:2]
    h, h2 = list(tier.where)[:2]
    before = (dict(cache.where), dict(tier.where), bytes(cache.storage), bytes(tier.storage), moe.slot_of.copy())
    with pytest.raises(KeyError, match=rf"blk\.{b[0]} expert {b[1]} in the host tier"):
        moe.swap(a, b)  # b is resident: it cannot come in from the tier
    with pytest.raises(KeyError, match=rf"blk\.{h[0]} expert {h[1]} must be in a slot"):
        moe.swap(h, h2)  # h is not in a slot
    after = (dict(cache.where), dict(tier.where), bytes(cache.storage), bytes(tier.storage), moe.slot_of.copy())
    assert before[:4] == after[:4] and np.array_equal(before[4], after[4]) and moe.swaps == 0
    with pytest.raises(ValueError, match=rf"blk\.{h[0]} expert {h[1]} is already in host slot {tier.where[h]}"):
        tier.replace(a, h)
    with pytest.raises(ValueError, match=rf"blk\.{b[0]} expert {b[1]} is already in slot {cache.where[b]}"):
        cache.replace(a, b)
    assert dict(cache.where) == before[0] and dict(tier.where) == before[1]


def test_capacity_rule_and_the_plan(pack):
    """layout.experts.expert_capacity / host_tier_pairs: the scratch slot only where the policy has something to
    learn (2 <= slots < pairs); ``strata-budget check --engine strata --cache-policy class`` plans the tier with the
    scratch slot's pair (18 -> 19 of 24 at 6 slots), as the engine builds it."""
    from click.testing import CliRunner

    from strata.budget.cli import main as budget_main
    from strata.layout import experts as LX

    assert [LX.expert_capacity(24, s, True) for s in (0, 1, 2, 6, 23, 24, 30)] == [0, 1, 1, 5, 22, 24, 30]
    assert [LX.host_tier_pairs(24, s, True) for s in (1, 2, 6, 24)] == [23, 23, 19, 0]
    assert [LX.host_tier_pairs(24, s) for s in (1, 2, 6, 24, 30)] == [23, 22, 18, 0, 0]

    def tier(*extra):
        args = ["check", str(pack), "--engine", "strata", "--card", "24G", "--expert-cache", "6", "--json", *extra]
        r = CliRunner().invoke(budget_main, args)
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["host_tier_bytes"]

    fill, learn, auto = tier("--cache-policy", "fill"), tier("--cache-policy", "class"), tier()
    assert fill % 18 == 0 and learn == fill // 18 * 19 == auto  # auto without a profile: the class policy's tier
    # refused where the engine refuses it (budget.cache_policy.option_refusal / class_refusal: one rule each), with
    # the reason; auto plans
    for extra, why in (
        (["--miss-tier", "cpu"], "--cache-policy class swaps experts between the VRAM slots and the host tier: it "
         "needs --miss-tier pcie or auto, not cpu"),
        (["--expert-cache", "1"], "--cache-policy class keeps one of the cache's slots as its swap scratch: 1 slot(s) "
         "leave none for experts"),
    ):  # fmt: skip
        args = ["check", str(pack), "--engine", "strata", "--card", "24G", "--expert-cache", "6", *extra]
        r = CliRunner().invoke(budget_main, [*args, "--cache-policy", "class"])
        assert r.exit_code == 2 and why in " ".join(r.output.split()), r.output
        assert CliRunner().invoke(budget_main, args).exit_code == 0  # auto: the fill there
    # another engine's plan: strata's options are said to be unused, not dropped silently
    args = ["check", str(pack), "--engine", "cpp", "--card", "24G", "--cache-policy", "class", "--miss-tier", "cpu"]
    r = CliRunner().invoke(budget_main, args)
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "--cache-policy class: an option of strata's engine (--engine strata); not used" in text
    assert "--miss-tier cpu: an option of strata's engine" in text
