"""The GPU engine (strata.engine.gpu.engine) on synthetic packs (packer/synth presets).

Two backends run the same engine logic:
- ``sim`` (NumPy stand-in for the device; runs in CI): start-up order, slot sizing by the budget
  formula, refusal of an expert cache that does not fit, profile fill, hit/miss split;
- ``cuda`` (gpu-marked; skipped with the reason where CuPy or a GPU is absent).

The central property (BRIEF.md "The hit path is all or nothing"): with the expert cache empty,
half full or holding every expert, every step's top logits are IDENTICAL (bit for bit), because a
miss computed on the CPU replays the GPU hit path's arithmetic exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.budget import formulas as F
from strata.engine.generate import generate, load_engine
from strata.engine.gpu import kernels as K
from strata.engine.gpu.backend import SimBackend
from strata.engine.gpu.engine import ExpertCacheError, load_engine_gpu, profile_pairs

GPU_OK, GPU_WHY = K.gpu_available()
skip_no_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    from strata.packer import synth
    from strata.packer.build import build_pack

    d = tmp_path_factory.mktemp("gpu_packs")
    out = {}
    for name, spec in (("moe", synth.qwen3moe_spec()), ("qwen2", synth.qwen2_spec()), ("gemma3", synth.gemma3_spec())):
        paths = synth.write_model(d / f"{name}.gguf", spec)
        build_pack(paths[0], d / f"{name}-pack", progress=False)
        out[name] = d / f"{name}-pack"
    return out


def _run(eng, n=6):
    return generate(eng, prompt_ids=PROMPT, n_tokens=n, ignore_eos=True)


def _tops_equal(a, b) -> bool:
    return all(np.float32(x[1]).tobytes() == np.float32(y[1]).tobytes() and x[0] == y[0]
               for ra, rb in zip(a.top, b.top) for x, y in zip(ra, rb)) and len(a.top) == len(b.top)


# ------------------------------------------------------------------ sim backend (CI)

def test_startup_order_and_checkpoint_figures(packs):
    eng = load_engine_gpu(packs["moe"], n_ctx=64, backend=SimBackend())
    names = [c.name for c in eng.checkpoints]
    assert names == ["pack", "weights", "head", "session", "expert cache", "prompt path"]
    for c in eng.checkpoints:
        assert {"gpu_free_bytes", "gpu_used_bytes", "pool_used_bytes"} <= set(c.extra)
    # head before the cache, session before the cache: free memory at the cache is what is left
    head = eng.checkpoints[names.index("head")].extra
    cache = eng.checkpoints[names.index("expert cache")].extra
    assert cache["free_at_open_bytes"] <= head["gpu_free_bytes"]


def test_auto_slots_come_from_the_budget_formula(packs):
    bk = SimBackend(total_bytes=600 << 20, context_bytes=500 << 20)  # ~100 MiB card left
    eng = load_engine_gpu(packs["moe"], n_ctx=64, backend=bk, vram_reserve_mib=97)
    sp = eng.gpu.slot_plan
    assert sp.slots == F.expert_slots(sp.free_bytes, sp.reserve_bytes, sp.slot_bytes, sp.cap)
    assert 0 < sp.slots < 24  # the small card holds only part of the 3 x 8 experts
    assert len(eng.experts.cache) == sp.slots  # resident=all: filled in layer, expert order


def test_fixed_cache_that_does_not_fit_is_refused_with_both_numbers(packs):
    bk = SimBackend(total_bytes=600 << 20, context_bytes=500 << 20)
    with pytest.raises(ExpertCacheError, match=r"--expert-cache 1000: 1000 slots x \d+ B = \d+ B, but \d+ B free"):
        load_engine_gpu(packs["moe"], n_ctx=64, backend=bk, expert_cache=1000, vram_reserve_mib=50)


def test_profile_fill_follows_budget_rule():
    rows = [(0, 0, 5), (0, 1, 9), (0, 2, 1), (1, 0, 7), (1, 3, 7), (2, 5, 2)]
    order = profile_pairs(rows, 3)
    ref = F.fill_profile(rows, 3)
    assert len(order) == ref.used
    assert order[0] == (0, 1)  # highest count first


def test_sim_tokens_identical_for_empty_half_full_cache(packs):
    runs = {}
    for ec in (0, 12, "auto"):
        eng = load_engine_gpu(packs["moe"], n_ctx=64, backend=SimBackend(), expert_cache=ec)
        runs[ec] = _run(eng)
    assert runs[0].expert_hits == 0 and runs["auto"].expert_misses == 0 and runs[12].expert_hits > 0
    assert runs[0].output_ids == runs[12].output_ids == runs["auto"].output_ids
    assert _tops_equal(runs[0], runs[12]) and _tops_equal(runs[0], runs["auto"])
    cpu = _run(load_engine(packs["moe"], n_ctx=64))
    assert cpu.output_ids == runs[0].output_ids


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_sim_dense_models_match_cpu_tokens(packs, name):
    sim = _run(load_engine_gpu(packs[name], n_ctx=64, backend=SimBackend()))
    cpu = _run(load_engine(packs[name], n_ctx=64))
    assert sim.output_ids == cpu.output_ids


# ------------------------------------------------------------------ CUDA

@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("name", ["moe", "qwen2", "gemma3"])
def test_cuda_tokens_match_cpu(packs, name):
    eng = load_engine_gpu(packs[name], n_ctx=64, device="cuda")
    r = _run(eng, 8)
    cpu = _run(load_engine(packs[name], n_ctx=64), 8)
    diff = max(abs(a[1] - b[1]) for ra, rb in zip(r.top, cpu.top) for a, b in zip(ra, rb))
    print(f"\n[gpu-engine] {name}: cuda {r.output_ids} cpu {cpu.output_ids} max|top logit diff|={diff:.2e} "
          f"decode {r.tokens_per_second:.1f} tok/s")
    assert r.output_ids == cpu.output_ids


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_hit_miss_bit_identical_and_no_decode_allocation(packs):
    import cupy as cp

    runs = {}
    for ec in (0, 12, "auto"):
        eng = load_engine_gpu(packs["moe"], n_ctx=64, device="cuda", expert_cache=ec)
        runs[ec] = _run(eng, 8)
        grown = cp.get_default_memory_pool().total_bytes() - eng.gpu.pool_after_warmup
        print(f"\n[gpu-engine] moe --expert-cache {ec}: {runs[ec].output_ids} hits {runs[ec].expert_hits} "
              f"misses {runs[ec].expert_misses}; pool growth during decode {grown} B")
        assert grown == 0, f"decode allocated {grown} B of new device memory"
    assert runs[0].expert_hits == 0 and runs["auto"].expert_misses == 0 and runs[12].expert_hits > 0
    assert runs[0].output_ids == runs[12].output_ids == runs["auto"].output_ids
    assert _tops_equal(runs[0], runs[12]) and _tops_equal(runs[0], runs["auto"])

