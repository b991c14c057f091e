"""Issue 19 item 2: the share of a layer's misses the host tier takes, the rest on the CPU
(strata.engine.gpu.miss_split): the model's arithmetic in exact figures, the choice's wiring at start-up on the sim
(its link given by the test), and the tokens unchanged by whichever split is chosen; the mapped-read probe on CUDA."""

from __future__ import annotations

import pytest

from strata.engine.generate import generate
from strata.engine.gpu import kernels as K
from strata.engine.gpu import miss_split as MS
from strata.engine.gpu.backend import SimBackend
from strata.engine.startup import load_engine

GPU_OK, GPU_WHY = K.gpu_available()
PROMPT = [1, 2, 3, 4, 5]


def test_choose_splits_where_both_tiers_beat_one_and_says_the_figures():
    """30B-A3B with no expert resident (384 misses a token, 48 MoE layers; the H200's 80 us over PCIe, 40 us on the
    CPU): share round(40 / 120, 2) = 0.33; split 48 x 100 + 384 x max(0.33 x 80, 0.67 x 40) = 4,800 + 10,291.2 us
    against 384 x 80 = 30,720 us in one graph: split. 100 misses: 4,800 + 2,680 = 7,480 > 0.9 x 8,000: one graph."""
    c = MS.choose(80.0, 40.0, 384, 48)
    assert c.share == 0.33
    assert c.why == (
        "split 0.33 PCIe / 0.67 CPU: 384 misses a token x 80 us over PCIe = 30.7 ms in one graph; split 0.33 with the "
        "CPU's 40 us an expert: 15.1 ms (+ 100 us a layer for the hybrid step)"
    )
    one = MS.choose(80.0, 40.0, 100, 48)
    assert one.share == 1.0 and one.why.startswith("all over PCIe: 100 misses a token x 80 us over PCIe = 8.0 ms")
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
    assert note == {"miss split": "2 pairs in the host tier (PCIe), 3 on the CPU (share 0.01)"}


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
    eng = _eng(qwen3moe_pack, expert_cache=0)
    n = _notes(eng)
    assert eng.decoder.hybrid, n
    assert n["miss split choice"].startswith("split 0.01 PCIe / 0.99 CPU: ")
    assert "us an expert on the CPU" in n["cpu experts"] and n["miss split"].endswith("(share 0.01)")
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
    """The probe reads 64 MiB of mapped host memory: a positive rate below 1 TB/s (PCIe: tens of GB/s), the bytes."""
    gbs, n = MS.probe_mapped_read()
    assert n == MS.PROBE_READ_BYTES and 1.0 < gbs < 1000.0
