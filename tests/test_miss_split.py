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
    """30B-A3B with no expert resident (384 misses a token, 48 MoE layers; the H200's 80 us over PCIe, 40 us on the
    CPU): share round(40 / 120, 2) = 0.33; split 48 x 50 + 384 x max(0.33 x 80, 0.67 x 40) = 2,400 + 10,291.2 us
    against 384 x 80 = 30,720 us in one graph: split. 50 misses: 2,400 + 1,340 = 3,740 > 0.9 x 4,000: one graph."""
    c = MS.choose(80.0, 40.0, 384, 48)
    assert c.share == 0.33
    assert c.why == (
        "split 0.33 PCIe / 0.67 CPU: 384 misses a token x 80 us over PCIe = 30.7 ms in one graph; split 0.33 with the "
        "CPU's 40 us an expert: 12.7 ms (+ 50 us a layer for the hybrid step)"
    )
    one = MS.choose(80.0, 40.0, 50, 48)
    assert one.share == 1.0 and one.why.startswith("all over PCIe: 50 misses a token x 80 us over PCIe = 4.0 ms")
    assert MS.choose(80.0, 40.0, 0, 48).share == 1.0  # nothing misses: nothing to split
    assert MS.choose(1.0, 1e6, 384, 48).share == 1.0  # a CPU that cannot help: one graph
    assert MS.choose(1e6, 1.0, 384, 48).share == 0.01  # a link that cannot: the tier keeps 1% (clamped, not 0)
    for bad in ((0.0, 40.0, 1, 1), (80.0, -1.0, 1, 1), (80.0, 40.0, -1, 1)):
        with pytest.raises(ValueError, match="miss split"):
            MS.choose(*bad)


def test_expected_misses_from_the_profile_or_the_resident_fraction():
    assert MS.expected_misses(8, 48, 0, 6144, None) == 384.0
    assert MS.expected_misses(8, 48, 4608, 6144, None) == 96.0  # 3/4 resident, routing taken as uniform
    assert MS.expected_misses(8, 48, 9000, 6144, None) == 0.0
    assert MS.expected_misses(8, 48, 10, 6144, 0.75) == 96.0  # the profile's hit rate wins


def test_split_tier_pairs_per_layer_by_expert_id():
    rest = [(1, 5), (1, 2), (1, 9), (3, 0), (3, 7)]
    assert MS.split_tier_pairs(rest, 0.5) == ([(1, 5), (1, 2), (3, 0)], [(1, 9), (3, 7)])
    assert MS.split_tier_pairs(rest, 1.0) == (rest, [])
    note: dict = {}
    assert MS.tier_pairs(rest, 0.01, note) == [(1, 2), (3, 0)]
    assert note == {"miss split": "2 pairs in the host tier (PCIe), 3 on the CPU (share 0.01 asked, 0.40 of the pairs)"}


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
    pairs = 3 * 8  # the preset's 3 MoE layers x 8 experts: ceil(0.01 x 8) = 1 a layer in the tier
    assert (
        n["miss split"]
        == f"3 pairs in the host tier (PCIe), 21 on the CPU (share 0.01 asked, {3 / pairs:.2f} of the pairs)"
    )
    assert n["shard prefetch"] != "not needed (every miss is read from the host tier)"
    assert n["cache policy"].startswith("auto: fill") and "a share 0.99 of them" in n["cache policy"]
    r = generate(eng, prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    assert (r.output_ids, r.top) == (full.output_ids, full.top)
    assert 0 < r.expert_pcie < r.expert_misses
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
