"""Issue 19 item 2: the share of a layer's misses the host tier takes, the rest on the CPU
(strata.engine.gpu.miss_split): the model's arithmetic in exact figures, the choice's wiring at start-up on the sim
(its link given by the test), and the tokens unchanged by whichever split is chosen; the mapped-read probe on CUDA."""

from __future__ import annotations

import pytest

from strata.engine.generate import generate
from strata.engine.gpu import kernels as K
from strata.engine.gpu import miss_split as MS
from strata.engine.gpu import slots as SL
from strata.engine.gpu.backend import SimBackend
from strata.engine.startup import load_engine

GPU_OK, GPU_WHY = K.gpu_available()
PROMPT = [1, 2, 3, 4, 5]


def test_choose_splits_where_both_tiers_beat_one_and_says_the_figures():
    """30B-A3B with no expert resident (384 misses a token, 48 MoE layers, 8 a layer; the H200's 80 us over PCIe, 40
    us on the CPU): share round(40 / 120, 2) = 0.33, in whole experts keep_table(0.33)[8] = 2 over PCIe and 6 on the
    CPU: split 48 x 50 + 48 x max(2 x 80, 6 x 40) = 2,400 + 11,520 us against 384 x 80 = 30,720 us in one graph:
    split. 50 misses (one a layer, kept 0 of 1 in the tier): 2,400 + 50 x 40 = 4,400 > 0.9 x 4,000: one graph. Two
    experts a token at 2,000 / 4,700 us (share 0.70): keep_table gives both to PCIe - no split, whatever the model's
    continuous share says (the review's case: a hybrid step that sends the CPU nothing)."""
    c = MS.choose(80.0, 40.0, 384, 48, 8)
    assert c.share == 0.33 and MS.keep_table(0.33, 8)[8] == 2
    assert c.why == (
        "split 0.33 PCIe / 0.67 CPU: 384 misses a token x 80 us over PCIe = 30.7 ms in one graph; split 0.33 with the "
        "CPU's 40 us an expert: 13.9 ms (+ 50 us a layer for the hybrid step)"
    )
    one = MS.choose(80.0, 40.0, 50, 48, 8)
    assert one.share == 1.0 and one.why.startswith("all over PCIe: 50 misses a token x 80 us over PCIe = 4.0 ms")
    assert "4.4 ms" in one.why
    assert MS.keep_table(0.70, 2) == [0, 1, 2] and MS.choose(2000.0, 4700.0, 32, 32, 2).share == 1.0
    assert MS.choose(80.0, 40.0, 0, 48, 8).share == 1.0  # nothing misses: nothing to split
    assert MS.choose(1.0, 1e6, 384, 48, 8).share == 1.0  # a CPU that cannot help: one graph
    assert MS.choose(1e6, 1.0, 384, 48, 8).share == 0.01  # a link that cannot: 0.01 (clamped), every miss on the CPU
    for bad in ((0.0, 40.0, 1, 1, 8), (80.0, -1.0, 1, 1, 8), (80.0, 40.0, -1, 1, 8), (80.0, 40.0, 1, 1, 0)):
        with pytest.raises(ValueError, match="miss split"):
            MS.choose(*bad)


def test_expected_misses_from_the_profile_or_the_resident_fraction():
    assert MS.expected_misses(8, 48, 0, 6144, None) == 384.0
    assert MS.expected_misses(8, 48, 4608, 6144, None) == 96.0  # 3/4 resident, routing taken as uniform
    assert MS.expected_misses(8, 48, 9000, 6144, None) == 0.0
    assert MS.expected_misses(8, 48, 10, 6144, 0.75) == 96.0  # the profile's hit rate wins


def test_keep_table_balances_the_two_tiers_per_count():
    """keep[c]: the t of c that minimises max(t x (1 - share), (c - t) x share), the larger on a tie. Share 0.5 and
    8 selected: 4 and 4 (a layer's split no longer binomial), one alone stays on the link (0.5 either way: the tie);
    share 0.6 (the CPU the slower) and 8: t = 5 gives max(5 x 0.4, 3 x 0.6) = 2.0, t = 4 gives max(1.6, 2.4): 5; share
    1 keeps all, share 0.01 none of 8 (t = 1 already costs 0.99 against 8 x 0.01)."""
    assert MS.keep_table(0.5, 8) == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert MS.keep_table(0.6, 8) == [0, 1, 1, 2, 2, 3, 4, 4, 5]
    assert MS.keep_table(1.0, 4) == [0, 1, 2, 3, 4]
    assert MS.keep_table(0.01, 8) == [0] * 9
    assert MS.split_note(0.5, 2, 96) == (
        "per token: of a layer's c selected experts in the host tier, keep[c] read over PCIe, the rest on the CPU "
        "(share 0.5; keep[0..2] = [0, 1, 1]; the tier holds all 96 non-resident pairs)"
    )
    assert MS.keep_table(0.0, 8) == [0] * 9  # (the tuner's keep 0: every miss on the CPU)
    for bad in ((-0.1, 8), (1.5, 8), (0.5, 0)):
        with pytest.raises(ValueError, match="miss split"):
            MS.keep_table(*bad)


def test_split_tuner_walks_to_the_fastest_keep_and_holds_it():
    """SplitTuner on step times that are best at keep 3 (10 ms + 1 ms a step away), from the start-up's 5, one step
    a window: it times 5, then 4 (the neighbour), moves there and times 3, moves and times 2, goes back to 3 and holds
    it (None for ``recheck`` steps), then times 3 again; the first step after each change is not counted; a start-up
    choice of all k over PCIe starts at k - 1 (k is the one-graph step's)."""
    tu = MS.SplitTuner(8, 5, window=1, recheck=4)
    cost = {t: (10 + abs(t - 3)) / 1000 for t in range(8)}
    seq, cur = [], 5
    for _ in range(10):
        got = tu.observe(cost[cur])
        seq.append(got)
        cur = got if got is not None else cur
    assert seq == [4, None, 3, None, 2, None, 3, None, None, None]
    assert tu.t == 3 and tu.describe() == (
        "keep 3 of 8 over PCIe (start-up's 5; median step ms by keep: 2: 11.00, 3: 10.00, 4: 11.00, 5: 12.00)"
    )
    # after recheck (4) held steps: 3 timed anew (its first step dropped), then its neighbour 2 tried
    assert [tu.observe(cost[3]) for _ in range(2)] == [None, 2] and tu.times == {3: 0.01}
    assert MS.SplitTuner(8, 8).t == 7 and MS.SplitTuner(4, 0).t == 0
    w = MS.SplitTuner(4, 2, window=3)
    assert [w.observe(s) for s in (0.03, 0.01, 0.02)] == [None, None, 1]  # the median of 3 windows' steps: 20 ms
    assert w.times == {2: 0.02}
    for bad in ((1, 0), (8, 9), (8, -1)):
        with pytest.raises(ValueError, match="tuner"):
            MS.SplitTuner(*bad)


def _eng(pack, **kw):
    return load_engine(pack, device="cuda", ubatch=1, n_ctx=48, backend=SimBackend(), cpu_kernel="exact", **kw)


def _notes(eng) -> dict:
    return {k: v for cp in eng.checkpoints for k, v in cp.extra.items()}


def test_start_up_chooses_the_split_on_its_probes_and_the_tokens_do_not_change(qwen3moe_pack, monkeypatch):
    """No expert resident, ``--miss-tier auto``: on a slow link (the sim's, given: 0.001 GB/s) the start-up measures
    the CPU and splits each layer's misses (the hybrid step, notes with both figures and the model's), on a fast one
    (1e6 GB/s) keeps every miss in one graph; ``--miss-tier pcie`` and ``--cache-policy class`` keep them all over
    PCIe whatever the link; the sim without a link figure never splits. Tokens and top logits bit for bit the same as
    every expert resident in every case; shard pages prefetched where the CPU computes some."""
    full = generate(_eng(qwen3moe_pack, resident="all"), prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    monkeypatch.delenv("STRATA_PCIE_SHARE", raising=False)
    assert not _eng(qwen3moe_pack, expert_cache=0).decoder.hybrid  # SIM_LINK_GBS None: no link, no split
    monkeypatch.setattr(MS, "SIM_LINK_GBS", 0.001)
    monkeypatch.setattr(SL, "probe_cpu_experts", lambda *a: (50.0, 4, 1, 5))  # the CPU's figure given: no timing
    eng = _eng(qwen3moe_pack, expert_cache=0)
    n = _notes(eng)
    assert eng.decoder.hybrid, n
    assert (
        n["miss split choice"].startswith("split 0.01 PCIe / 0.99 CPU: ")
        and "CPU's 50 us an expert" in n["miss split choice"]
    )
    assert n["cpu experts"].startswith("50 us an expert on the CPU (measured: 4 experts a call, ")
    assert n["cpu experts"].endswith("medians (5 calls, on layers spread over the model, from layer 1))")
    assert n["miss split"] == MS.split_note(0.01, eng.decoder.moe.K, 3 * 8)  # the preset's 3 MoE layers x 8 experts
    assert n["shard prefetch"] != "not needed (every miss is read from the host tier)"
    assert n["cache policy"].startswith("auto: fill") and "a share 0.99 of them" in n["cache policy"]
    r = generate(eng, prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    assert (r.output_ids, r.top) == (full.output_ids, full.top)
    assert r.expert_pcie == 0 < r.expert_misses  # share 0.01: keep[c] = 0, every miss on the CPU
    for kw in ({"miss_tier": "pcie"}, {"cache_policy": "class", "expert_cache": 2}):
        e = _eng(qwen3moe_pack, **{"expert_cache": 0, **kw})
        assert not e.decoder.hybrid and "miss split choice" not in _notes(e), kw
    n = _notes(_eng(qwen3moe_pack, expert_cache=10, miss_tier="cpu"))  # every miss on the CPU: said so, no share
    assert "miss split choice" not in n and n["cache policy"].endswith("misses here go to the CPU (--miss-tier cpu))")
    monkeypatch.setattr(MS, "SIM_LINK_GBS", 1e6)
    eng = _eng(qwen3moe_pack, expert_cache=0)
    assert not eng.decoder.hybrid
    assert _notes(eng)["miss split choice"].startswith("all over PCIe: ")
    r = generate(eng, prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    assert (r.output_ids, r.top) == (full.output_ids, full.top)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")
def test_cuda_mapped_read_probe_measures_a_rate():
    """The probe reads at least 64 MiB and 4 L2 caches of mapped host memory: a positive rate below 1 TB/s (PCIe: tens
    of GB/s), the bytes."""
    import cupy as cp

    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"])
    gbs, n = MS.probe_mapped_read()
    assert n == max(MS.PROBE_READ_BYTES, -(-4 * l2 // 16) * 16) and 1.0 < gbs < 1000.0


def test_no_split_where_the_cache_learns_or_a_probe_fails(qwen3moe_pack, monkeypatch):
    """``auto`` without a profile on a cache the class rule can run (2+ slots, fewer than all pairs): no split - the
    rule swaps misses in from the host tier, and the split's miss count would be the fill's - said in the notes; a
    probe that raises leaves every miss over PCIe with the error in the note (no figure rather than a guess)."""
    monkeypatch.delenv("STRATA_PCIE_SHARE", raising=False)
    monkeypatch.setattr(MS, "SIM_LINK_GBS", 0.001)
    eng = _eng(qwen3moe_pack, expert_cache=4)
    n = _notes(eng)
    assert not eng.decoder.hybrid and n["cache policy"].startswith("auto: class"), n
    assert n["miss split choice"] == "none: the cache learns (the class rule swaps misses in from the host tier)"

    def broken(*a):
        raise RuntimeError("probe: 0 ms")

    monkeypatch.setattr(SL, "probe_cpu_experts", broken)
    eng = _eng(qwen3moe_pack, expert_cache=0)
    assert not eng.decoder.hybrid
    assert _notes(eng)["miss split choice"] == (
        "all over PCIe (a probe failed, no split chosen: RuntimeError: probe: 0 ms)"
    )


@pytest.mark.parametrize("opts", [{"miss_tier": "cpu"}, {"cache_policy": "class", "expert_cache": 2}])
def test_a_share_the_options_leave_nothing_to_split_is_refused_before_the_weights(qwen3moe_pack, monkeypatch, opts):
    from strata.engine.errors import ExpertCacheError

    monkeypatch.setenv("STRATA_PCIE_SHARE", "0.5")
    opt = "--miss-tier cpu" if "miss_tier" in opts else "--cache-policy class"
    with pytest.raises(ExpertCacheError, match=f"STRATA_PCIE_SHARE=0.5: .* but {opt} leaves nothing to split"):
        _eng(qwen3moe_pack, **opts)
    monkeypatch.setenv("STRATA_PCIE_SHARE", "1")  # every miss in the tier: nothing to refuse under class
    if "cache_policy" in opts:
        assert not _eng(qwen3moe_pack, **opts).decoder.hybrid


def test_sim_tuner_changes_the_split_between_steps_not_the_tokens(qwen3moe_pack, monkeypatch):
    """The split's tuner (on the sim by hand: the start-up makes one on CUDA only, where step times mean something)
    rewrites moe_route's keep table between steps as it searches: the tokens and top logits stay those of every
    expert resident, bit for bit, and the table in force is keep_table(t / k) of the last t applied."""
    import numpy as np

    full = generate(_eng(qwen3moe_pack, resident="all"), prompt_ids=PROMPT, n_tokens=8, ignore_eos=True)
    monkeypatch.setenv("STRATA_PCIE_SHARE", "0.5")
    eng = _eng(qwen3moe_pack, expert_cache=0, miss_tier="pcie")
    moe = eng.decoder.moe
    assert moe.tuner is None  # the sim: none made
    moe.tuner = MS.SplitTuner(moe.K, MS.keep_table(0.5, moe.K)[moe.K], window=1)
    applied = []
    apply = moe.apply_keep
    monkeypatch.setattr(moe, "apply_keep", lambda t: (applied.append(t), apply(t)))
    r = generate(eng, prompt_ids=PROMPT, n_tokens=8, ignore_eos=True)
    assert (r.output_ids, r.top) == (full.output_ids, full.top)
    assert applied and np.asarray(moe.keep).tolist() == MS.keep_table(applied[-1] / moe.K, moe.K)


@pytest.mark.parametrize("native", [1, 3])
def test_sim_split_cpu_reads_the_host_tier_where_it_holds_native_bytes(tmp_path, native, monkeypatch):
    """With a split the host tier holds every non-resident pair: the CPU's misses of a layer whose three parts are
    native in engine form (Q4_K / Q6_K: no fp16 scale widened) are read from the tier's pinned copy, not the shard
    (the same bytes: no second copy kept hot); a layer with a widened part (Q5_0, IQ4_NL) reads the shard. The tokens
    and top logits are those of every expert resident either way; the shards' pages are prefetched only where some
    layer reads them."""
    import numpy as np

    from strata import testing as synth
    from strata.packer.build import build_pack

    types = [("Q4_K", "Q6_K")] * native + [("IQ2_XS", "IQ4_NL"), ("Q6_K", "Q5_0")][: 3 - native]
    [src] = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec(expert_types=types))
    build_pack(src, tmp_path / "pack", progress=False)

    def q8(**kw):  # the engine's default kernels: q8 on the GPU, the CPU's misses "q8-exact" (the same bits)
        return load_engine(tmp_path / "pack", device="cuda", ubatch=1, n_ctx=48, backend=SimBackend(), **kw)

    full = generate(q8(resident="all"), prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    monkeypatch.setenv("STRATA_PCIE_SHARE", "0.5")
    eng = q8(expert_cache=0, miss_tier="pcie")
    moe = eng.decoder.moe
    r = generate(eng, prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    assert (r.output_ids, r.top) == (full.output_ids, full.top) and r.expert_pcie < r.expert_misses
    assert [moe.cpu_reads_tier(il) for il in moe.layers] == [True] * native + [False] * (3 - native)
    lo = moe.tier.storage.__array_interface__["data"][0]
    hi = lo + moe.tier.nbytes
    for il in moe.layers:
        lm = moe.layer_misses(il)
        if lm.fast:  # (the other path reads the shards through ffn_many)
            addr = np.concatenate([lm.g, lm.u, lm.d]).astype(np.int64)
            assert ((lo <= addr) & (addr < hi)).all() == moe.cpu_reads_tier(il), il
    prefetch = _notes(eng)["shard prefetch"]
    if native == 3:
        assert prefetch == "not needed (every miss is read from the host tier, the CPU's too)"
    else:
        assert prefetch.startswith("started (")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")
def test_cuda_split_cpu_reads_the_pinned_host_tier(tmp_path, monkeypatch):
    """On CUDA the host tier is pinned, mapped memory; with a split the CPU's misses of native layers (Q4_K / Q6_K)
    read it through its host address while the GPU reads the same pages over PCIe: the tokens and top logits equal
    every expert resident, the CPU's addresses lie inside the tier, the shards are not prefetched; the split's tuner
    (made on CUDA where STRATA_PCIE_SHARE is unset) runs without changing a token."""
    import numpy as np

    from strata import testing as synth
    from strata.packer.build import build_pack

    [src] = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec(expert_types=[("Q4_K", "Q6_K")] * 3))
    build_pack(src, tmp_path / "pack", progress=False)

    def cuda(**kw):
        eng = load_engine(tmp_path / "pack", device="cuda", ubatch=1, n_ctx=48, **kw)
        return eng, generate(eng, prompt_ids=PROMPT, n_tokens=12, ignore_eos=True)

    _e, full = cuda(resident="all")
    monkeypatch.setenv("STRATA_PCIE_SHARE", "0.5")
    eng, r = cuda(expert_cache=0, miss_tier="pcie")
    moe = eng.decoder.moe
    assert eng.decoder.hybrid and (r.output_ids, r.top) == (full.output_ids, full.top)
    assert 0 < r.expert_pcie < r.expert_misses
    lo = moe.tier.storage.__array_interface__["data"][0]
    for il in moe.layers:
        lm = moe.layer_misses(il)
        assert moe.cpu_reads_tier(il) and lm.fast
        addr = np.concatenate([lm.g, lm.u, lm.d]).astype(np.int64)
        assert ((lo <= addr) & (addr < lo + moe.tier.nbytes)).all(), il
    assert _notes(eng)["shard prefetch"] == "not needed (every miss is read from the host tier, the CPU's too)"
    monkeypatch.delenv("STRATA_PCIE_SHARE")
    eng = load_engine(tmp_path / "pack", device="cuda", ubatch=1, n_ctx=48, expert_cache=0, miss_tier="pcie")
    moe = eng.decoder.moe
    moe.set_split(0.5)  # (the start-up splits only where its probes say so; here the split is asked for the tuner)
    moe.tuner = MS.SplitTuner(moe.K, MS.keep_table(0.5, moe.K)[moe.K], window=1)
    r = generate(eng, prompt_ids=PROMPT, n_tokens=12, ignore_eos=True)
    assert (r.output_ids, r.top) == (full.output_ids, full.top) and moe.tuner.times
