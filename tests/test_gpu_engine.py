"""The GPU engine (strata.engine.gpu.engine) on synthetic packs (strata.testing presets).

Two backends run the same engine logic:
- ``sim`` (NumPy stand-in for the device; runs in CI): start-up order, slot sizing by the budget
  formula, refusal of an expert cache that does not fit, profile fill, hit/miss split;
- ``cuda`` (gpu-marked; skipped with the reason where CuPy or a GPU is absent).

The central property (docs/DESIGN.md "The hit path is all or nothing"): with the expert cache empty,
half full or holding every expert, every step's top logits are IDENTICAL (bit for bit), because a
miss computed on the CPU replays the GPU hit path's arithmetic exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.budget import formulas as F
from strata.engine.errors import ExpertCacheError
from strata.engine.generate import generate
from strata.engine.gpu import kernels as K
from strata.engine.gpu.backend import SimBackend
from strata.engine.startup import load_engine
from strata.layout import experts as LX

GPU_OK, GPU_WHY = K.gpu_available()
skip_no_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")
PROMPT = [1, 2, 3, 4, 5]


#: A qwen3moe whose experts use the types the qwen3next reference model adds (Q2_0, IQ2_S) and Q1_0.
NEW_TYPES = [("IQ2_S", "Q2_0"), ("Q1_0", "Q1_0"), ("Q2_0", "IQ2_S")]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    from strata import testing as synth
    from strata.packer.build import build_pack

    d = tmp_path_factory.mktemp("gpu_packs")
    out = {}
    for name, spec in (
        ("moe", synth.qwen3moe_spec()),
        ("qwen2", synth.qwen2_spec()),
        ("gemma3", synth.gemma3_spec()),
        ("moe_new", synth.qwen3moe_spec(expert_types=NEW_TYPES)),
    ):
        paths = synth.write_model(d / f"{name}.gguf", spec)
        build_pack(paths[0], d / f"{name}-pack", progress=False)
        out[name] = d / f"{name}-pack"
    return out


def _run(eng, n=6):
    return generate(eng, prompt_ids=PROMPT, n_tokens=n, ignore_eos=True)


def _tops_equal(a, b) -> bool:
    return all(
        np.float32(x[1]).tobytes() == np.float32(y[1]).tobytes() and x[0] == y[0]
        for ra, rb in zip(a.top, b.top)
        for x, y in zip(ra, rb)
    ) and len(a.top) == len(b.top)


# ------------------------------------------------------------------ sim backend (CI)


def test_startup_order_and_checkpoint_figures(packs):
    eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend())
    names = [c.name for c in eng.checkpoints]
    # everything the engine holds (the head, the session and the prompt path's kernels and
    # temporaries: docs/DESIGN.md "Start-up order") is allocated before the expert cache measures what is free
    assert names == ["pack", "weights", "head", "session", "prompt path", "expert cache"]
    for c in eng.checkpoints:
        assert {"gpu_free_bytes", "gpu_used_bytes", "pool_used_bytes"} <= set(c.extra)
    warm = eng.checkpoints[names.index("prompt path")].extra
    cache = eng.checkpoints[names.index("expert cache")].extra
    assert cache["free_at_open_bytes"] == warm["gpu_free_bytes"]
    assert cache["gpu_free_bytes"] == warm["gpu_free_bytes"] - cache["cache_bytes"]


def test_auto_slots_come_from_the_budget_formula(packs):
    bk = SimBackend(total_bytes=600 << 20, context_bytes=500 << 20)  # ~100 MiB card left
    eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=bk, vram_reserve_mib=97, miss_tier="cpu")
    sp = eng.gpu.slot_plan
    assert sp.slots == F.expert_slots(sp.free_bytes, sp.reserve_bytes, sp.slot_bytes, sp.cap)
    assert 0 < sp.slots < 24  # the small card holds only part of the 3 x 8 experts
    assert len(eng.experts.cache) == sp.slots  # resident=all: filled in layer, expert order
    assert sp.tier_map_reserved == 0 and eng.gpu.host_tier_bytes == 0


def test_host_tier_mapping_is_reserved_when_the_cache_is_sized(packs):
    """With the host tier (``--miss-tier auto``) the cache is sized with the tier's device mapping reserved beside
    the reserve (budget.formulas.size_with_host_tier): 2 MiB (one driver unit) for this small tier, so a card with
    4 MiB free above the reserve holds 2 MiB of slots fewer; the tier holds every other pair; the mapping the sim
    took equals the budget's; the reserve is still free after start-up."""
    bk = SimBackend(total_bytes=600 << 20, context_bytes=500 << 20)
    base = load_engine(
        packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=bk, vram_reserve_mib=96, miss_tier="cpu"
    )
    n = base.gpu.slot_plan.slots
    bk = SimBackend(total_bytes=600 << 20, context_bytes=500 << 20)
    eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=bk, vram_reserve_mib=96)
    sp, g = eng.gpu.slot_plan, eng.gpu
    assert sp.tier_map_reserved == 2 << 20 == LX.host_tier_map_bytes(g.host_tier_bytes)
    assert sp.slots == F.expert_slots(sp.free_bytes, sp.reserve_bytes + (2 << 20), sp.slot_bytes, sp.cap)
    assert 0 < sp.slots < n < 24
    # the default --cache-policy auto learns here (no profile): the swap scratch slot's pair is in the tier too
    assert g.host_tier_pairs == 24 - sp.slots + 1 and g.host_tier_bytes == (24 - sp.slots + 1) * sp.slot_bytes
    assert g.host_tier_map_bytes == g.host_tier_map_predicted_bytes == 2 << 20
    assert g.free_after_bytes >= g.reserve_bytes and g.miss_tier == "pcie"


def test_fixed_cache_that_does_not_fit_is_refused_with_both_numbers(packs):
    bk = SimBackend(total_bytes=600 << 20, context_bytes=500 << 20)
    # the one sizing rule (budget.formulas.size_expert_cache), the planner's message: N, its bytes, the most that fit
    with pytest.raises(
        ExpertCacheError,
        match=r"--expert-cache 1000 refused: 1000 slots x \d+ B = \d+ B .* at most 24 "
        r"slots fit .* MiB free after the 50 MiB reserve holds \d+\); refusing",
    ):
        load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=bk, expert_cache=1000, vram_reserve_mib=50)


def test_profile_fill_follows_budget_rule():
    rows = [(0, 0, 5), (0, 1, 9), (0, 2, 1), (1, 0, 7), (1, 3, 7), (2, 5, 2)]
    order = F.fill_profile(rows, 3).order
    ref = F.fill_profile(rows, 3)
    assert len(order) == ref.used
    assert order[0] == (0, 1)  # highest count first


@pytest.mark.parametrize("kernel", ["q8", "exact"])
def test_sim_cache_plumbing_tokens_identical_for_empty_half_full_cache(packs, kernel):
    """The plumbing of the hit/miss split on the sim backend with either kernel: the same tokens and top logits
    with 0, 12 and all slots; tokens = the CPU path's with the same kernel. On the sim the hits run the CPU's
    kernel too, so this checks the wiring (slot lookup, miss routing, order and weights of the outputs), not
    that the device's kernels equal the CPU's: that is tests/test_gpu_q8.py and the device run of the gpu
    tests (bench/results/*-gpu_tests.txt)."""
    runs = {}
    for ec in (0, 12, "auto", "12 cpu"):
        n, tier = (12, "cpu") if ec == "12 cpu" else (ec, "auto")
        kw = dict(expert_cache=n, cpu_kernel=kernel, miss_tier=tier)
        eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), **kw)
        runs[ec] = _run(eng)
    assert runs[0].expert_hits == 0 and runs["auto"].expert_misses == 0 and runs[12].expert_hits > 0
    assert runs[0].output_ids == runs[12].output_ids == runs["auto"].output_ids == runs["12 cpu"].output_ids
    assert _tops_equal(runs[0], runs[12]) and _tops_equal(runs[0], runs["auto"])
    assert _tops_equal(runs[0], runs["12 cpu"])
    assert runs[12].expert_pcie == runs[12].expert_misses > 0 and runs["12 cpu"].expert_pcie == 0
    cpu = _run(load_engine(packs["moe"], n_ctx=64, ubatch=1, cpu_kernel=kernel))
    assert cpu.output_ids == runs[0].output_ids


@pytest.mark.parametrize("kernel", ["q8", "exact"])
@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_sim_dense_models_match_cpu_tokens(packs, name, kernel):
    sim = _run(load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), cpu_kernel=kernel))
    cpu = _run(load_engine(packs[name], n_ctx=64, ubatch=1, cpu_kernel=kernel))
    assert sim.output_ids == cpu.output_ids


def test_sim_new_expert_types_hit_and_miss_identical(packs):
    """Q1_0, Q2_0 and IQ2_S experts (no audit warning any more): all, some or no hits, misses over PCIe or on the
    CPU, same logits."""
    from strata.budget.audit import audit_pack

    res = audit_pack(packs["moe_new"])
    assert res.errors == [] and res.warnings == []
    runs = {
        ec: _run(
            load_engine(
                packs["moe_new"],
                device="cuda",
                ubatch=1,
                n_ctx=64,
                backend=SimBackend(),
                expert_cache=12 if ec == "12 cpu" else ec,
                cpu_kernel="exact",
                miss_tier="cpu" if ec == "12 cpu" else "auto",
            )
        )
        for ec in (0, 12, "auto", "12 cpu")
    }
    assert runs[12].expert_hits > 0 and runs[12].expert_misses > 0
    assert runs[0].output_ids == runs[12].output_ids == runs["auto"].output_ids == runs["12 cpu"].output_ids
    assert _tops_equal(runs[0], runs[12]) and _tops_equal(runs[0], runs["auto"])
    assert _tops_equal(runs[0], runs["12 cpu"])
    assert runs[12].expert_pcie == runs[12].expert_misses > 0 and runs["12 cpu"].expert_pcie == 0
    assert _run(load_engine(packs["moe_new"], n_ctx=64, ubatch=1, cpu_kernel="exact")).output_ids == runs[0].output_ids


@pytest.mark.parametrize("tier", ["cpu", "pcie"])
def test_sim_stats_per_layer_counts_and_timers(packs, tier, monkeypatch):
    """--stats per position: per-layer hits / misses / misses read over PCIe (counts), the misses read over PCIe
    (the host tier) or run on the CPU (cpu-experts ms > 0 only then); the window line sums the decode positions.
    The prefetch off: the misses' bytes alone (its copies' are tests/test_prefetch.py's)."""
    monkeypatch.setenv("STRATA_PREFETCH", "0")
    eng = load_engine(
        packs["moe"],
        device="cuda",
        ubatch=1,
        n_ctx=64,
        backend=SimBackend(),
        expert_cache=12,
        miss_tier=tier,
        cache_policy="fill",  # the misses' bytes alone (a swap's are test_gpu_cache_policy.py's)
    )
    r = generate(eng, prompt_ids=PROMPT, n_tokens=4, ignore_eos=True, stats=True)
    n_used = int(eng.geometry["n_expert_used"])
    for s in r.steps:
        assert sorted(s.expert_layers) == [0, 1, 2]
        assert all(h + m == n_used for h, m, _p in s.expert_layers.values())
        assert s.expert_hits == sum(v[0] for v in s.expert_layers.values())
        assert (
            s.expert_pcie == (s.expert_misses if tier == "pcie" else 0) == sum(v[2] for v in s.expert_layers.values())
        )
        assert all(p == (m if tier == "pcie" else 0) for _h, m, p in s.expert_layers.values())
        blobs = eng.decoder.moe.blob_bytes  # engine form: gate + up + down of the layer's types
        assert s.pcie_bytes == (
            sum(m * blobs[il] for il, (_h, m, _p) in s.expert_layers.items()) if tier == "pcie" else 0
        )
        assert s.gpu_ms is None and s.busy_ms is None  # sim: no device clock, no floor
        assert s.cpu_expert_ms is not None and s.wait_ms is not None
    assert r.expert_misses > 0 and r.expert_pcie == sum(s.expert_pcie for s in r.steps)
    cpu_ms = sum(s.cpu_expert_ms for s in r.steps)
    assert cpu_ms > 0 if tier == "cpu" else cpu_ms == 0  # misses ran on the CPU / none did
    from strata.engine.generate_cli import stats_line, window_line, window_summary

    s = r.steps[-1]
    line = stats_line(s, None, gpu=True, experts=True)
    h0, m0, p0 = s.expert_layers[0]
    assert "ms (wall)" in line and "gpu n/a ms (event span) | gpu floor n/a ms (device work alone)" in line
    assert f"per layer hits/CPU misses/PCIe misses (counts): 0:{h0}/{m0 - p0}/{p0} " in line
    dec = [x for x in r.steps if x.phase == "decode"]
    w = window_summary(r.steps)
    assert w["positions"] == len(dec) == 3 and w["gpu_ms"] is None  # 4 tokens: the first is not a decode position
    assert w["hits"] == sum(x.expert_hits for x in dec) and w["pcie_misses"] == sum(x.expert_pcie for x in dec)
    assert w["cpu_misses"] == sum(x.expert_misses - x.expert_pcie for x in dec)
    assert w["hits"] + w["cpu_misses"] + w["pcie_misses"] == 3 * 3 * n_used  # 3 positions x 3 MoE layers x K
    assert sum(v[0] for v in w["layers"].values()) == w["hits"] and sorted(w["layers"]) == [0, 1, 2]
    assert w["cpu_expert_ms"] == pytest.approx(sum(x.cpu_expert_ms for x in dec) / 3)
    wl = window_line(w, gpu=True, experts=True)
    assert "stats: window over 3 decode positions" in wl and "gpu n/a ms" in wl
    assert f"summed: experts {w['hits']} hits / {w['cpu_misses']} CPU misses / {w['pcie_misses']} PCIe" in wl
    assert "gpu" not in window_line(w) and "experts" not in window_line(w)  # the CPU path's line, a dense model's
    assert (
        f"{s.expert_misses} misses, {s.expert_pcie} of them over PCIe (counts), {s.pcie_bytes / 2**20:.2f} MiB" in line
    )
    assert len(set(eng.decoder.moe.blob_bytes.values())) == 3  # the preset's three layer types: the sum is per layer


@pytest.mark.parametrize("name", ["moe", "gemma3", "qwen2"])
def test_sim_audit_exact_terms_equal_the_budget(packs, name):
    from strata.engine.measure import measure_pack as run_audit

    a = run_audit(str(packs[name]), n_ctx=200, backend=SimBackend())
    terms = {t.term: t for t in a.terms}
    assert a.exact_ok, [(t.term, t.predicted_bytes, t.measured_bytes) for t in a.terms if t.exact and t.diff_bytes]
    assert terms["KV cache"].measured_bytes > 0 and terms["engine buffers"].measured_bytes > 0
    assert sum(t.measured_bytes for t in a.terms) == a.measured_total_bytes
    if name == "gemma3":  # layer 0 slides (window 128) over a 200-position context: a ring of 128
        assert terms["KV cache"].measured_bytes == 2 * 2 * 64 * (128 + 200)  # K+V, f16, 1 KV head of 64
    if name == "moe":
        # the preset's layers: (Q4_K, Q8_0), (IQ2_XS, IQ4_NL), (Q6_K, Q5_0) as (gate/up, down) at 256 x 256
        slot = max(LX.expert_slot_bytes(g, g, d, 256, 256) for g, d in ((12, 8), (17, 20), (14, 6)))
        assert terms["expert cache"].measured_bytes == a.slots * slot


def test_sim_kv_f32_doubles_the_kv_term(packs):
    from strata.engine.measure import measure_pack as run_audit

    a16 = {t.term: t for t in run_audit(str(packs["qwen2"]), n_ctx=64, backend=SimBackend()).terms}
    a32 = {t.term: t for t in run_audit(str(packs["qwen2"]), n_ctx=64, kv="f32", backend=SimBackend()).terms}
    assert a32["KV cache"].measured_bytes == 2 * a16["KV cache"].measured_bytes == a32["KV cache"].predicted_bytes


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("kernel", ["q8", "exact"])
@pytest.mark.parametrize("name", ["moe", "qwen2", "gemma3"])
def test_cuda_tokens_match_cpu(packs, name, kernel):
    eng = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, cpu_kernel=kernel)
    r = _run(eng, 8)
    cpu = _run(load_engine(packs[name], n_ctx=64, ubatch=1, cpu_kernel=kernel), 8)
    diff = max(abs(a[1] - b[1]) for ra, rb in zip(r.top, cpu.top) for a, b in zip(ra, rb))
    print(
        f"\n[gpu-engine] {name}: cuda {r.output_ids} cpu {cpu.output_ids} max|top logit diff|={diff:.2e} "
        f"decode {r.tokens_per_second:.1f} tok/s"
    )
    assert r.output_ids == cpu.output_ids


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("kernel", ["q8", "exact"])
def test_cuda_new_expert_types_tokens_identical(packs, kernel):
    runs = {}
    for ec in (0, 12, "auto", "12 cpu"):
        kw = dict(expert_cache=12, miss_tier="cpu") if ec == "12 cpu" else dict(expert_cache=ec)
        runs[ec] = _run(load_engine(packs["moe_new"], device="cuda", ubatch=1, n_ctx=64, cpu_kernel=kernel, **kw), 8)
    cpu = _run(load_engine(packs["moe_new"], n_ctx=64, ubatch=1, cpu_kernel=kernel), 8)
    print(f"\n[gpu-engine] Q1_0/Q2_0/IQ2_S experts: cuda {runs[0].output_ids} cpu {cpu.output_ids}")
    assert runs[0].output_ids == runs[12].output_ids == runs["auto"].output_ids == cpu.output_ids
    assert runs["12 cpu"].output_ids == cpu.output_ids and runs[12].expert_pcie > 0
    assert _tops_equal(runs[0], runs[12]) and _tops_equal(runs[0], runs["auto"])
    assert _tops_equal(runs[0], runs["12 cpu"])


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_ring_equals_full_cache(packs):
    """gemma3 (window 128): a 150-position run wraps the ring; logits equal the full cache's bit for bit."""
    ids = [int(i) for i in np.random.default_rng(3).integers(3, 500, size=142)]
    tops = {}
    for sliding in ("ring", "full"):
        eng = load_engine(packs["gemma3"], device="cuda", ubatch=1, n_ctx=160, sliding=sliding)
        tops[sliding] = generate(eng, prompt_ids=ids, n_tokens=8, ignore_eos=True)
    assert tops["ring"].output_ids == tops["full"].output_ids and _tops_equal(tops["ring"], tops["full"])


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("name,kv", [("moe", "f16"), ("gemma3", "f16"), ("qwen2", "f32")])
def test_cuda_audit(packs, name, kv):
    from strata.engine.measure import measure_pack as run_audit
    from strata.engine.measure import print_measurement as _print_audit

    a = run_audit(str(packs[name]), n_ctx=256, kv=kv)
    _print_audit(a)
    assert a.exact_ok and all("equal" in c for c in a.pool_checks), a.pool_checks
    assert a.total_ok


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_stats(packs):
    eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, expert_cache=12)
    r = generate(eng, prompt_ids=PROMPT, n_tokens=4, ignore_eos=True, stats=True)
    from strata.engine.generate_cli import stats_line

    for s in r.steps:
        print(stats_line(s, None, gpu=True, experts=True))
        assert s.gpu_ms is not None and s.gpu_ms > 0 and s.wait_ms is not None and s.expert_layers


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_hit_miss_bit_identical_and_no_decode_allocation(packs):
    import cupy as cp

    runs = {}
    for ec in (0, 12, "auto", "12 cpu"):
        n, tier = (12, "cpu") if ec == "12 cpu" else (ec, "auto")
        eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, expert_cache=n, miss_tier=tier)
        runs[ec] = _run(eng, 8)
        grown = cp.get_default_memory_pool().total_bytes() - eng.gpu.pool_after_warmup
        print(
            f"\n[gpu-engine] moe --expert-cache {ec}: {runs[ec].output_ids} hits {runs[ec].expert_hits} "
            f"misses {runs[ec].expert_misses}; pool growth during decode {grown} B"
        )
        assert grown == 0, f"decode allocated {grown} B of new device memory"
    assert runs[0].expert_hits == 0 and runs["auto"].expert_misses == 0 and runs[12].expert_hits > 0
    assert runs[0].output_ids == runs[12].output_ids == runs["auto"].output_ids == runs["12 cpu"].output_ids
    assert _tops_equal(runs[0], runs[12]) and _tops_equal(runs[0], runs["auto"])
    assert _tops_equal(runs[0], runs["12 cpu"])
    assert runs[12].expert_pcie == runs[12].expert_misses > 0 and runs["12 cpu"].expert_pcie == 0


def test_f32_kernel_is_refused_on_the_gpu_path(packs):
    """``--kernel f32`` would compute the misses in f32 while the hits run the GPU's kernels (the tokens would
    depend on the cache): refused before anything loads, naming the two kernels that keep misses = hits."""
    from strata.engine.errors import GenerateError

    with pytest.raises(GenerateError, match=r"--kernel f32 runs on the CPU only: .* use q8 \(the default\) or exact"):
        load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend(), cpu_kernel="f32")


def test_sim_profile_never_shrinks_the_cache_and_the_rest_is_filled_at_start_up(packs):
    """A profile of two pairs on a card where every expert fits: the cache has as many slots as without a profile
    (the budget's count), the profiled pairs first and every other pair after them, so nothing misses and the
    tokens equal the no-profile run's (the cache cannot change the tokens)."""
    prof = [(0, 3, 9), (1, 5, 4)]
    full = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend())
    eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), profile=prof)
    pairs = len(eng.experts.source.layers) * int(eng.geometry["n_expert"])
    assert eng.gpu.slot_plan.slots == full.gpu.slot_plan.slots == pairs
    assert eng.gpu.fill == f"profile (2 pairs) + {pairs - 2} more in layer order"
    r, ref = _run(eng), _run(full)
    assert r.expert_misses == 0 and r.output_ids == ref.output_ids


def test_sim_measure_host_tier_equals_the_plan(packs):
    """strata-engine measure on a small simulated card: the host tier the engine pinned equals the plan's at the
    engine's slots (exact), its device mapping is a term of both (the sim takes the budget's figure), and every
    exact term agrees."""
    from strata.engine.measure import measure_pack

    bk = SimBackend(total_bytes=600 << 20, context_bytes=500 << 20)
    a = measure_pack(str(packs["moe"]), n_ctx=64, backend=bk, vram_reserve_mib=64, expert_cache=12)
    terms = {t.term: t for t in a.terms}
    # 24 pairs, 12 slots, the default --cache-policy auto learning (no profile): 12 + the scratch slot's pair
    assert a.miss_tier == "pcie" and a.host_tier_bytes == a.host_tier_predicted_bytes == 13 * 156_672
    assert terms["host tier mapping"].measured_bytes == terms["host tier mapping"].predicted_bytes == 2 << 20
    assert a.exact_ok and any("host tier (pinned host memory)" in n and "(equal; exact" in n for n in a.notes)


def test_host_tier_that_does_not_fit_host_memory(packs, monkeypatch):
    """A host tier above the available host memory (MemAvailable less 4 GiB): ``--miss-tier pcie`` is refused with
    both numbers; ``auto`` keeps the misses on the CPU (the hybrid path) and says why; the tokens do not change."""
    from strata.engine.gpu import slots as SL

    monkeypatch.setattr(SL, "mem_available", lambda: (4 << 30) + 1000)  # 1000 B of room: no tier fits
    with pytest.raises(
        ExpertCacheError, match=r"--miss-tier pcie: host tier: \d+ experts x \d+ B = \d+ B .* above the 1000 B"
    ):
        load_engine(
            packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), expert_cache=12, miss_tier="pcie"
        )
    eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), expert_cache=12)
    assert (
        eng.gpu.miss_tier.startswith("cpu (a host tier of ")
        and "MiB) of available host memory less 4 GiB)" in eng.gpu.miss_tier
    )
    assert eng.decoder.hybrid and eng.gpu.host_tier_bytes == 0 and eng.gpu.slot_plan.tier_map_reserved == 0
    monkeypatch.undo()
    ref = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), expert_cache=12)
    assert not ref.decoder.hybrid and ref.gpu.miss_tier == "pcie"
    assert _run(eng).output_ids == _run(ref).output_ids


def test_host_tier_mapping_that_does_not_fit_above_the_reserve(packs):
    """1 MiB between the free bytes and the reserve: the host tier's mapping (one 2 MiB unit) cannot fit, so
    ``--miss-tier auto`` starts without a tier (misses on the CPU, said why) and the budget plans the same, fitting;
    ``pcie`` is refused naming the mapping and both numbers (a helper found the budget saying "fits" with -0.8 MiB
    left and the engine refusing at start-up)."""
    from strata.budget.audit import audit_pack
    from strata.budget.cards import card_from_mib
    from strata.budget.plan import PlanOptions, make_plan

    reserve = 96
    probe = load_engine(
        packs["moe"],
        device="cuda",
        ubatch=1,
        n_ctx=64,
        backend=SimBackend(600 << 20, 500 << 20),
        miss_tier="cpu",
        vram_reserve_mib=reserve,
    )
    sp = probe.gpu.slot_plan
    total = (600 << 20) - (sp.free_bytes - reserve * 2**20) + (1 << 20)  # 1 MiB above the reserve at the cache
    eng = load_engine(
        packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(total, 500 << 20), vram_reserve_mib=reserve
    )
    g = eng.gpu
    assert g.slot_plan.free_bytes - g.slot_plan.reserve_bytes == 1 << 20
    assert g.miss_tier.startswith("cpu (the host tier's device mapping (2097152 B) does not fit between the ")
    assert eng.decoder.hybrid and g.host_tier_bytes == 0 and g.free_after_bytes >= g.reserve_bytes
    assert g.slot_plan.slots == F.expert_slots(1 << 20, 0, g.slot_plan.slot_bytes, 24) == 6
    with pytest.raises(ExpertCacheError, match=r"--miss-tier pcie: the host tier's device mapping \(2097152 B\)"):
        load_engine(
            packs["moe"],
            device="cuda",
            ubatch=1,
            n_ctx=64,
            backend=SimBackend(total, 500 << 20),
            vram_reserve_mib=reserve,
            miss_tier="pcie",
        )
    facts = audit_pack(packs["moe"], bf16_scan=False).facts
    card = card_from_mib(1, cuda_context_mib=0, cuda_runtime_mib=0).model_copy(update={"total_bytes": 10 << 30})
    o = PlanOptions(engine="strata", n_ctx=64, vram_reserve_mib=reserve)
    free = make_plan(facts, card, o).free_bytes  # what the plan's terms leave on a big card
    card = card.model_copy(update={"total_bytes": (10 << 30) - free + reserve * 2**20 + (1 << 20)})
    p = make_plan(facts, card, o)
    assert p.fits and p.host_tier_bytes == 0 and "host tier mapping" not in {t.name for t in p.terms}
    assert p.slots == 6


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("tier", ["cpu", "pcie"])
def test_cuda_stats_gpu_floor_is_the_devices_own_work(packs, tier):
    """--stats' gpu floor (issue 19 item 6): the one-graph step (misses over PCIe) never waits for the host, so its
    floor is its event span; the hybrid step (misses on the CPU) waits at each MoE layer, so its floor - the sum of
    its graph segments - is positive and below the span, by at least the time the host spent on the misses."""
    from strata.engine.generate_cli import window_line, window_summary

    eng = load_engine(
        packs["moe"], device="cuda", ubatch=1, n_ctx=64, expert_cache=12, miss_tier=tier, cache_policy="fill"
    )
    generate(eng, prompt_ids=PROMPT, n_tokens=3, ignore_eos=True)
    assert eng.decoder.busy_events is None  # no segment events without --stats
    r = generate(eng, prompt_ids=PROMPT, n_tokens=6, ignore_eos=True, stats=True)
    for s in r.steps:
        assert s.gpu_ms is not None and s.busy_ms is not None and 0 < s.busy_ms <= s.gpu_ms
        if tier == "pcie":
            assert s.busy_ms == s.gpu_ms
        elif s.cpu_expert_ms > 0:
            assert s.busy_ms < s.gpu_ms
    w = window_summary(r.steps)
    assert 0 < w["busy_ms"] <= w["gpu_ms"]
    assert f"gpu floor {w['busy_ms']:.2f} ms (the device's own work" in window_line(w, True, True)
