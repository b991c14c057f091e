"""Card emulation, start-up order and the reserve on a real GPU (gpu-marked: skipped without CuPy and a GPU).

Two groups:

- small synthetic packs (strata.testing presets) on an emulated card: the figures every checkpoint
  records, an allocation past the card refused, ``strata-engine measure --card`` exact;
- the qwen3next reference model at full size (~47 GB, written by bench/device_docs.sh; set ``STRATA_DOCS_PACK`` to
  its pack, ``STRATA_DOCS_PROFILE`` to an expert profile of it) on the emulated 6G card, where a start
  is quick (few slots): the head loaded after the cache refused with the reserve eaten, the prompt path
  inside the plan, ``--expert-cache N`` above the fit refused with both numbers, the profile fill.

The CI versions of the same logic run on the simulated card: tests/test_startup_reserve.py,
tests/test_card_emulation.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from strata.budget import formulas as F
from strata.budget.cards import card_from_mib, card_preset
from strata.engine.gpu import kernels as K

GPU_OK, GPU_WHY = K.gpu_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")]
DOCS = os.environ.get("STRATA_DOCS_PACK")
PROFILE = os.environ.get("STRATA_DOCS_PROFILE")
need_docs = pytest.mark.skipif(
    not (DOCS and Path(DOCS).is_dir()),
    reason="needs the reference model's full-size pack: STRATA_DOCS_PACK (bench/device_docs.sh writes it)",
)
CTX = 4096


def _free_pool():
    import gc

    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


@pytest.fixture(scope="module")
def moe_pack(qwen3moe_pack):
    return qwen3moe_pack  # tests/conftest.py


def test_cuda_emulated_card_checkpoints_and_slots(moe_pack):
    """A 560 MiB card (~33 MiB above the planned 527 MiB context): every checkpoint reports the card's total (the
    physical one larger), the slots are the plan's formula on what was free, the reserve stays free. In a fresh
    process, as the next test: the modules earlier tests of this one loaded (device code, 2026-12-02: 1.4 MiB too
    many after the prompt path's kernels grew) count as this process's memory and would eat the card's margin."""
    code = f"""
from strata.budget import formulas as F
from strata.budget.cards import card_from_mib
from strata.engine.startup import load_engine
card = card_from_mib(560)
eng = load_engine({str(moe_pack)!r}, device="cuda", ubatch=1, n_ctx=256, card=card, vram_reserve_mib=8)
for cp in eng.checkpoints:
    x = cp.extra
    print(f"[emu] {{cp.name}}: free {{x['gpu_free_bytes']}} of {{x['gpu_total_bytes']}} (physical "
          f"{{x['physical_free_bytes']}} of {{x['physical_total_bytes']}})")
    assert x["gpu_total_bytes"] == card.total_bytes and x["physical_total_bytes"] > card.total_bytes
sp = eng.gpu.slot_plan
assert sp.free_bytes <= card.total_bytes
assert sp.slots == F.expert_slots(sp.free_bytes, sp.reserve_bytes, sp.slot_bytes, sp.cap)
assert eng.gpu.free_after_bytes >= 8 * F.MIB
assert "emulated on" in eng.gpu.device
print("CHECKED", sp.slots)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert re.search(r"^CHECKED \d+$", r.stdout, re.M), r.stdout[-2000:]


def test_cuda_allocation_past_the_emulated_card_fails(moe_pack):
    """A 528 MiB card (1 MiB above the planned 527 MiB context): the engine's first allocation past it fails as on
    that card. In a fresh process: arrays earlier tests of this one still hold (freed only later) would count as this
    process's memory and move the point where the card is full."""
    code = (
        "import sys\n"
        "from strata.budget.cards import card_from_mib\n"
        "from strata.engine.gpu.card import CardOutOfMemory\n"
        "from strata.engine.startup import load_engine\n"
        "try:\n"
        f"    load_engine({str(moe_pack)!r}, device='cuda', ubatch=1, n_ctx=256, card=card_from_mib(528), "
        "vram_reserve_mib=0)\n"
        "except CardOutOfMemory as e:\n"
        "    print('REFUSED', e)\n"
        "    sys.exit(0)\n"
        "print('LOADED')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"REFUSED .*out of memory on the emulated card 528 MiB card: .* fails as it would", r.stdout), (
        r.stdout[-2000:]
    )


def test_cuda_measure_on_the_emulated_card(moe_pack):
    from strata.engine.measure import measure_pack, print_measurement

    _free_pool()
    a = measure_pack(str(moe_pack), n_ctx=256, card=card_from_mib(2048), vram_reserve_mib=64, n_tokens=4)
    print_measurement(a)
    assert a.exact_ok and a.reserve_ok, [(t.term, t.diff_bytes) for t in a.terms if t.exact and t.diff_bytes]
    assert a.card_total_bytes == 2048 * F.MIB and a.physical_total_bytes > a.card_total_bytes


# ------------------------------------------------------------------ the qwen3next reference model (full size)


@need_docs
def test_reference_model_head_after_the_cache_eats_the_reserve_and_is_refused():
    from strata.engine.errors import StartupRefused
    from strata.engine.startup import load_engine

    _free_pool()
    late = ("weights", "session", "drafter", "prompt path", "expert cache", "bind", "head")
    with pytest.raises(StartupRefused, match=r"after start-up: \d+ B .* under the 734003200 B .* head 31\d{7} B"):
        load_engine(
            DOCS,
            device="cuda",
            ubatch=1,
            n_ctx=CTX,
            card=card_preset("6G"),
            stage_order=late,
            warmup=False,
            fused=False,
        )  # the fused step binds the head when built: it needs the head first


@need_docs
def test_reference_model_6g_prompt_path_inside_the_plan_or_refused_with_the_numbers():
    from strata.engine.errors import StartupRefused
    from strata.engine.measure import measure_pack, print_measurement

    _free_pool()
    try:
        a = measure_pack(DOCS, n_ctx=CTX, card=card_preset("6G"))
    except StartupRefused as e:  # the other allowed outcome: refused, naming the free bytes, the reserve, each stage
        assert "prompt path" in str(e) and "under the" in str(e)
        return
    print_measurement(a)
    assert a.exact_ok and a.reserve_ok
    act = next(t for t in a.terms if t.term == "prefill/activations")
    print(f"[reference model 6G] prompt path: predicted {act.predicted_bytes} B, measured {act.measured_bytes} B")


@need_docs
def test_reference_model_expert_cache_above_the_fit_is_refused_with_both_numbers():
    from strata.engine.errors import ExpertCacheError
    from strata.engine.startup import load_engine

    _free_pool()
    with pytest.raises(
        ExpertCacheError,
        match=r"--expert-cache 100000 refused: 100000 slots x 2278400 B .* at most \d+ "
        r"slots fit",
    ):
        load_engine(DOCS, device="cuda", ubatch=1, n_ctx=CTX, card=card_preset("6G"), expert_cache=100000, warmup=False)


@need_docs
@pytest.mark.skipif(not (PROFILE and Path(PROFILE).is_file()), reason="needs STRATA_DOCS_PROFILE")
def test_reference_model_profile_fill_skips_only_full_layers():
    from strata.budget.profile import read_profile
    from strata.engine.startup import load_engine

    _free_pool()
    prof = read_profile(PROFILE)
    eng = load_engine(DOCS, device="cuda", ubatch=1, n_ctx=CTX, card=card_preset("6G"), profile=prof, warmup=False)
    slots = eng.gpu.slot_plan.slots
    fill = F.fill_profile(prof, slots)
    assert sorted(eng.experts.cache.where) == sorted(fill.order)
    assert {il for il, _ in eng.experts.cache.where} == {L.layer for L in fill.layers if L.range}
    full = [L.layer for L in fill.layers if L.filled == L.range]
    print(
        f"[reference model 6G] {slots} slots, {len(fill.layers)} profiled layers, {len(full)} filled to their range, "
        f"expected hit rate {fill.hit_rate:.2%}"
    )
