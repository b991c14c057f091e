"""Start-up order, the reserve and the drafter, on the simulated card (CI): docs/DESIGN.md "Start-up order".

- the head before the cache: the head loaded after the expert cache eats the reserve; the engine
  measures it after start-up and refuses to start that way (the one order keeps it free);
- the reserve and the prompt buffers: free memory below the reserve when the cache opens (the prompt
  path's buffers on top of the rest) is refused with the numbers, never a silent allocation on top of
  the reserve; the plan says "does not fit" on the same card;
- ``--expert-cache N`` above what fits is refused with N and the most that fits;
- the profile fill skips only a full layer's own pairs, in the engine as in the planner;
- the drafter (NextN draft blocks): its own stage and terms, its bind bytes in the reserve, and what a
  bigger draft head does to the slots and the reserve;
- the decode path the budget reads is the one the engine takes, on every preset.

The same on an H200 with the full-size qwen3next reference model: tests/test_startup_reserve_gpu.py
(gpu-marked).
"""

from __future__ import annotations

import os

import pytest

from strata import testing as synth
from strata.budget import engine_terms as ET
from strata.budget import formulas as F
from strata.budget.audit import audit_pack
from strata.budget.cards import card_from_mib
from strata.budget.plan import PlanOptions, make_plan
from strata.engine.errors import ExpertCacheError, GenerateError, StartupRefused
from strata.engine.gpu.backend import SimBackend
from strata.engine.startup import load_engine
from strata.layout import buffers as LB
from strata.layout import engine_form as LE
from strata.layout import kv as LK
from strata.packer.build import build_pack

CTX = 500 << 20  # the simulated card's CUDA context


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    d = tmp_path_factory.mktemp("startup")
    out = {}
    for name, spec in (
        ("moe", synth.qwen3moe_spec()),
        ("qwen2", synth.qwen2_spec()),
        ("gemma3", synth.gemma3_spec()),
        ("qwen3", synth.qwen3_spec()),
        ("qwen2moe", synth.qwen2moe_spec()),
        ("llama", synth.llama_spec()),
        ("qwen3next", synth.qwen3next_spec()),
    ):
        paths = synth.write_model(d / f"{name}.gguf", spec)
        build_pack(paths[0], d / f"{name}-pack", progress=False)
        out[name] = d / f"{name}-pack"
    # the qwen3next reference model scaled down (4 layers, 8 experts) with a NextN draft head, and the same with the
    # draft head's shared_head_head Q1_0 -> Q4_K (the bigger draft head; shard 2 shared)
    kw = dict(n_layer=4, n_expert=8, n_vocab=5000, nextn=1, workers=2)
    a = synth.write_reference_model(d / "docs.gguf", draft_head_type="Q1_0", **kw)
    b = synth.write_reference_model(d / "docs-big.gguf", draft_head_type="Q4_K", only={0}, **kw)
    os.link(a[1], b[1])
    for name, p in (("docs", a[0]), ("docs-big", b[0])):
        build_pack(p, d / f"{name}-pack", progress=False)
        out[name] = d / f"{name}-pack"
    return out


def _sim(total: int) -> SimBackend:
    return SimBackend(total_bytes=total, context_bytes=CTX, card_name=f"{total} B card")


def test_budget_reads_the_decode_path_the_engine_takes(packs):
    for name in ("moe", "qwen2", "gemma3", "qwen3", "qwen2moe", "llama", "qwen3next"):
        eng = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend())
        facts = audit_pack(packs[name], bf16_scan=False).facts
        assert ET.decode_path(facts) == ("fused" if eng.gpu.fused else "generic"), (name, eng.gpu.decode_path)
        if eng.gpu.fused:  # the one definition of the fused buffers: the engine's own count
            act, _, exact = ET.activation_term(facts, 64)
            assert exact and act == eng.gpu.fused_buffer_bytes, name


#: the generic path without warm-up: nothing reads the head before the first token, so a test can load it late
LATE_OK = dict(fused=False, warmup=False)


def _used_before_cache(pack, reserve_mib: int) -> tuple[int, int, int]:
    """(bytes allocated before the cache in the one order, the head stage's bytes, one slot's bytes)."""
    eng = load_engine(
        pack, device="cuda", ubatch=1, n_ctx=64, backend=_sim(24 << 30), vram_reserve_mib=reserve_mib, **LATE_OK
    )
    m = eng.gpu.marks
    return (
        m["prompt path"]["gpu_used_bytes"] - CTX,
        m["head"]["gpu_used_bytes"] - m["weights"]["gpu_used_bytes"],
        eng.gpu.slot_plan.slot_bytes,
    )


def test_head_after_the_cache_eats_the_reserve_and_is_refused(packs):
    reserve = 1  # MiB
    before, head, slot = _used_before_cache(packs["moe"], reserve)
    # a card on which the cache, opened before the head, takes the room of 10 slots (in the driver's whole
    # pages: formulas.expert_slots) and leaves the reserve plus what its last page does not use
    room = F.driver_allocation_bytes(10 * slot)
    n = F.expert_slots(reserve * F.MIB + room, reserve * F.MIB, slot)
    assert n >= 10 and F.driver_allocation_bytes(n * slot) <= room
    left = reserve * F.MIB + room - n * slot  # the sim counts what was asked, not pages
    assert head > left - reserve * F.MIB
    total = CTX + (before - head) + reserve * F.MIB + room
    late = ("weights", "session", "prompt path", "expert cache", "head")
    with pytest.raises(
        StartupRefused,
        match=rf"after start-up: {left - head} B .* free on .*, under the "
        rf"{reserve * F.MIB} B .* that must stay free .* head {head} B",
    ):
        load_engine(
            packs["moe"],
            device="cuda",
            ubatch=1,
            n_ctx=64,
            backend=_sim(total),
            vram_reserve_mib=reserve,
            stage_order=late,
            **LATE_OK,
        )
    eng = load_engine(
        packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=_sim(total), vram_reserve_mib=reserve, **LATE_OK
    )
    assert [c.name for c in eng.checkpoints] == ["pack", "weights", "head", "session", "prompt path", "expert cache"]
    assert eng.gpu.slot_plan.slots < 10 and eng.gpu.free_after_bytes >= reserve * F.MIB  # the head came first


def test_fused_step_before_the_head_is_refused_by_name(packs):
    """The fused step binds every matrix, the head included, when the prompt path is built: an order that
    loads the head later is refused with the reason (the start-up order tests turn the fused step off)."""
    late = ("weights", "session", "prompt path", "expert cache", "head")
    with pytest.raises(
        GenerateError, match=r"binds the output head \(output\.weight\) .* load 'head' before 'prompt path'"
    ):
        load_engine(
            packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=_sim(24 << 30), stage_order=late, warmup=False
        )


def test_stage_orders_that_cannot_run_are_refused(packs):
    with pytest.raises(GenerateError, match="'session' must come before 'prompt path'"):
        load_engine(
            packs["moe"],
            device="cuda",
            ubatch=1,
            n_ctx=64,
            backend=SimBackend(),
            stage_order=("weights", "head", "prompt path", "session", "expert cache"),
        )
    with pytest.raises(GenerateError, match="expected a permutation of"):
        load_engine(
            packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), stage_order=("weights", "head")
        )


def test_prompt_path_on_top_of_the_reserve_is_refused_with_the_numbers(packs):
    """A card where the prompt path's buffers leave less than the reserve: refused when the cache opens,
    naming the free bytes, the reserve and each stage's memory; the plan says it does not fit either."""
    reserve = 2
    eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=_sim(24 << 30), vram_reserve_mib=reserve)
    m = eng.gpu.marks
    prompt = m["prompt path"]["gpu_used_bytes"] - m["session"]["gpu_used_bytes"]
    assert prompt == eng.gpu.fused_buffer_bytes > 0  # the fused step's buffers (the sim caches no temporaries)
    total = CTX + (m["session"]["gpu_used_bytes"] - CTX) + reserve * F.MIB + prompt // 2
    with pytest.raises(
        StartupRefused,
        match=rf"expert cache: {reserve * F.MIB - prompt + prompt // 2} B .* free .* under "
        rf"the {reserve * F.MIB} B .* prompt path {prompt} B",
    ):
        load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=_sim(total), vram_reserve_mib=reserve)
    facts = audit_pack(packs["moe"], bf16_scan=False).facts
    card = card_from_mib(1, cuda_context_mib=0, cuda_runtime_mib=0).model_copy(
        update={"total_bytes": total, "cuda_context_bytes": CTX}
    )
    p = make_plan(facts, card, PlanOptions(engine="strata", n_ctx=64, vram_reserve_mib=reserve))
    assert not p.fits and p.term("prefill/activations") == eng.gpu.fused_buffer_bytes


def test_fixed_cache_above_what_fits_is_refused_on_the_emulated_card(packs):
    card = card_from_mib(520, cuda_context_mib=500)
    with pytest.raises(
        ExpertCacheError,
        match=r"--expert-cache 25 refused: 25 slots x \d+ B = \d+ B .* at most 24 slots "
        r"fit \(capped at the 24 \(layer, expert\) pairs",
    ):
        load_engine(packs["moe"], device="sim", ubatch=1, n_ctx=64, card=card, vram_reserve_mib=1, expert_cache=25)
    eng = load_engine(
        packs["moe"], device="sim", ubatch=1, n_ctx=64, card=card, vram_reserve_mib=1, expert_cache="auto"
    )
    fit = eng.gpu.slot_plan.slots
    small = card_from_mib(505, cuda_context_mib=500)
    e2 = load_engine(packs["moe"], device="sim", ubatch=1, n_ctx=64, card=small, vram_reserve_mib=1)
    n = e2.gpu.slot_plan.slots
    assert n < fit
    with pytest.raises(
        ExpertCacheError, match=rf"--expert-cache {n + 1} refused: .* at most {n} slots fit .* holds {n}\)"
    ):
        load_engine(packs["moe"], device="sim", ubatch=1, n_ctx=64, card=small, vram_reserve_mib=1, expert_cache=n + 1)


def test_profile_fill_skips_only_a_full_layers_pairs_in_the_engine(packs):
    # layer 0's experts carry the highest counts; with 6 slots over 3 layers its range (2) fills first,
    # and the fill goes on into layers 1 and 2 (the bug ended the whole fill at the first full layer)
    prof = [(0, e, 100 - e) for e in range(8)] + [(1, e, 10 - e) for e in range(4)] + [(2, e, 5 - e) for e in range(4)]
    eng = load_engine(
        packs["moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), expert_cache=6, profile=prof
    )
    fill = F.fill_profile(prof, 6)
    resident = sorted(eng.experts.cache.where)
    assert resident == sorted(fill.order) and {il for il, _ in resident} == {0, 1, 2}
    assert [L.filled for L in fill.layers] == [L.range for L in fill.layers] == [3, 2, 1]
    assert eng.gpu.filled == 6 and (0, 7) not in eng.experts.cache.where


# ------------------------------------------------------------------ the drafter


def test_nextn_draft_head_in_the_contract_budget_and_engine(packs):
    facts = audit_pack(packs["docs"]).facts
    assert facts.draft_layers == [4] and facts.n_layer == 4
    assert facts.expert_pairs == 4 * 8 and len(facts.expert_layers) == 5  # the draft block's experts: no slot
    draft = [t for t in facts.dense if facts.is_draft(t.name)]
    assert {t.name for t in draft} >= {"blk.4.nextn.eh_proj.weight", "blk.4.attn_q.weight", "blk.4.ffn_gate_inp.weight"}
    card = card_from_mib(24210)
    p = make_plan(facts, card, PlanOptions(engine="strata", n_ctx=256))
    names = [t.name for t in p.terms]
    assert (
        names.index("draft head")
        < names.index("prefill/activations")
        < names.index("expert cache")
        < names.index("draft head bind")
    )
    assert p.term("draft head") == sum(LE.engine_form(t.type, t.src_type, t.ne).engine for t in draft)
    # the bind bytes: GEMV outputs + f32 vectors + the draft block's K/V for 256 positions + the eh_proj row
    kv_row = LK.kv_bytes_per_token(LK.KVLayer(4, 2 * 256, 2 * 256), "f16")
    assert (
        p.draft_bind_bytes
        == p.term("draft head bind")
        == LB.draft_bind_bytes([(t.type, t.src_type, t.ne) for t in draft], kv_row, 256, 2560)
    )
    eng = load_engine(
        packs["docs"], device="sim", ubatch=1, n_ctx=256, card=card, warmup=False
    )  # sim: no warm-up steps
    assert [c.name for c in eng.checkpoints] == [
        "pack",
        "weights",
        "head",
        "session",
        "drafter",
        "prompt path",
        "expert cache",
        "bind",
    ]
    assert eng.gpu.draft_engine_bytes == p.term("draft head") and eng.gpu.draft_bind_bytes == p.draft_bind_bytes
    assert 4 not in eng.experts.source.layers and eng.model.hp.n_layer == 4
    auto = next(c for c in eng.checkpoints if c.name == "expert cache").extra["auto"]
    assert f"700 MiB reserved (+{p.draft_bind_bytes / F.MIB:.1f} MiB for the draft head) -> 32 slots" in auto


def test_a_bigger_draft_head_costs_slots_and_keeps_the_reserve(packs):
    """A version bump (the C++ engine's draft head grew by 110-180 MiB and pushed 16 GB cards under the stall
    line), scaled: the bigger head's weights and bind bytes come out of the slots; the reserve stays free."""
    base, big = (audit_pack(packs[k], bf16_scan=False).facts for k in ("docs", "docs-big"))
    grown = ET.draft_weights_bytes(big) - ET.draft_weights_bytes(base)
    assert grown == (2560 * 5000 // 256 * 144) - (2560 * 5000 // 128 * 20)  # Q4_K vs Q1_0 (engine form: widened)
    slot = base.max_slot_bytes
    probe = load_engine(
        packs["docs"], device="sim", ubatch=1, n_ctx=256, card=card_from_mib(24210), vram_reserve_mib=64, warmup=False
    )
    need = probe.gpu.marks["prompt path"]["gpu_used_bytes"]
    total_mib = -(-(need + 64 * F.MIB + 20 * slot + probe.gpu.draft_bind_bytes) // F.MIB)  # ~20 slots fit
    card = card_from_mib(total_mib, cuda_context_mib=527)
    runs = {
        k: load_engine(packs[k], device="sim", ubatch=1, n_ctx=256, card=card, vram_reserve_mib=64, warmup=False)
        for k in ("docs", "docs-big")
    }
    s = {k: e.gpu.slot_plan.slots for k, e in runs.items()}
    assert s["docs"] < 32 and s["docs"] - s["docs-big"] in (grown // slot, grown // slot + 1)
    for e in runs.values():
        assert e.gpu.free_after_bytes >= 64 * F.MIB  # the reserve stays free (measured)
    # the plan moves the same way; a slot count recorded for the old head is refused for the new one
    plans = {
        k: make_plan(f, card, PlanOptions(engine="strata", n_ctx=256, vram_reserve_mib=64, ubatch=1))
        for k, f in (("docs", base), ("docs-big", big))
    }
    # the plan also charges the kernel modules: the bigger head's Q4_K is a type the model already loads,
    # its Q1_0 one module less (budget "CUDA runtime"); the slots move by what all the terms move
    moved = sum(
        plans["docs-big"].term(t) - plans["docs"].term(t) for t in ("draft head", "draft head bind", "CUDA runtime")
    )
    assert moved <= grown
    assert plans["docs"].slots - plans["docs-big"].slots in (moved // slot, moved // slot + 1)
    with pytest.raises(
        ExpertCacheError, match=rf"--expert-cache {s['docs']} refused: .* at most {s['docs-big']} slots fit"
    ):
        load_engine(
            packs["docs-big"],
            device="sim",
            ubatch=1,
            n_ctx=256,
            card=card,
            vram_reserve_mib=64,
            expert_cache=s["docs"],
            warmup=False,
        )
