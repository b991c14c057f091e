"""strata.budget.formulas and the plan arithmetic: worked numbers of docs/DESIGN.md, the SWA and
profile-fill rules, the slot formula, and hypothesis properties of the plan (slots never push the
total past the card; growing any term never grows the slots)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from strata.budget import formulas as F
from strata.budget.cards import CardError, card_from_mib, card_preset, known_cards, load_cards, measure_card
from strata.budget.plan import DenseTensor, ExpertLayerFacts, ModelFacts, PlanInputError, PlanOptions, make_plan
from strata.layout import buffers as LB
from strata.layout import engine_form as LE
from strata.layout import experts as LX
from strata.layout import kv as LK
from strata.packer import quants

MIB = 1 << 20
IQ2_XXS, IQ2_XS, IQ4_NL, Q2_0, Q8_0, Q4_0, F16, F32, BF16, Q4_K = 16, 17, 20, 42, 8, 2, 1, 0, 30, 12


# ----------------------------------------------------------------------------- worked numbers


def test_expert_blob_worked_example():
    # docs/DESIGN.md "Expert sizes change per layer" (the native_experts example),
    # n_embd 2560, expert width 640:
    # layer 0 IQ2_XS gate/up (74 B per 256) + IQ4_NL down (18 B per 32):
    # 2560*640/256*74 = 473,600 each, 640*2560/32*18 = 921,600 -> 1,868,800 B.
    assert LX.expert_blob_bytes(IQ2_XS, IQ2_XS, IQ4_NL, 2560, 640) == 473_600 * 2 + 921_600 == 1_868_800
    # layer 1 IQ2_XXS (66 B per 256) + Q2_0 (18 B per 64): 422,400 * 2 + 460,800 = 1,305,600 B.
    assert LX.expert_blob_bytes(IQ2_XXS, IQ2_XXS, Q2_0, 2560, 640) == 1_305_600
    # layer 1 starts at 512 x 1,868,800 = 956,825,600 in the arena (the worked example's table).
    assert 512 * LX.expert_blob_bytes(IQ2_XS, IQ2_XS, IQ4_NL, 2560, 640) == 956_825_600
    # engine form: IQ4_NL and Q2_0 are widened (fp16 d -> f32: +2 B per block), IQ2_* stay native:
    # IQ4_NL down 640*2560/32 = 51,200 blocks x 20 B = 1,024,000; Q2_0 down 25,600 blocks x 20 B = 512,000.
    assert LX.expert_blob_bytes(IQ2_XS, IQ2_XS, IQ4_NL, 2560, 640, engine=True) == 473_600 * 2 + 1_024_000
    assert LX.expert_blob_bytes(IQ2_XXS, IQ2_XXS, Q2_0, 2560, 640, engine=True) == 422_400 * 2 + 512_000


def test_engine_form_both_directions():
    # BF16 source: pool F32 (4 B) -> engine 16-bit (2 B): saves 2 B per element.
    f = LE.engine_form(F32, BF16, (2560, 512))
    assert (f.pack, f.engine, f.bf16_saved, f.widened_extra) == (2560 * 512 * 4, 2560 * 512 * 2, 2560 * 512 * 2, 0)
    # Q8_0 (34 B per 32, one fp16 d): 4096 blocks -> payload 32 B + f32 scale 4 B per block.
    f = LE.engine_form(Q8_0, Q8_0, (256, 512))
    blocks = 256 * 512 // 32
    assert (f.pack, f.payload, f.scales_f32, f.engine, f.widened_extra) == (
        34 * blocks,
        32 * blocks,
        4 * blocks,
        36 * blocks,
        2 * blocks,
    )
    # Q4_K keeps its native block (super-scales not widened).
    f = LE.engine_form(Q4_K, Q4_K, (256, 4))
    assert f.pack == f.engine == 144 * 4 and f.widened_extra == 0


def test_kv_rows_f16_and_int8():
    assert LK.kv_row_bytes(128, "f16") == 256
    assert LK.kv_row_bytes(128, "f32") == 512  # strata's engine --kv f32
    assert LK.ENGINE_KV_TYPES == ("f16", "f32") and set(LK.ENGINE_KV_TYPES) < set(LK.KV_CACHE_TYPES)
    # int8 = Q8_0 blocks: 34 B per 32 values (llama.cpp --cache-type-k q8_0)
    assert LK.kv_row_bytes(128, "int8") == 4 * 34
    assert LK.kv_bytes_per_token(LK.KVLayer(0, 512, 512, indexer_k=128), "f16") == 2 * (512 + 512 + 128)
    with pytest.raises(KeyError, match="unknown KV cache type 'q4'"):
        LK.kv_row_bytes(128, "q4")


def test_kv_tokens_sliding_window_holds_window_plus_chunk():
    # llama.cpp is_masked_swa: a position sees the window positions p-w+1..p; a chunk of c needs w + c - 1.
    assert LK.kv_tokens(32768, 512, 256) == 512 + 256 - 1
    assert LK.kv_tokens(32768, 512, 0) == 512  # decode path: the window itself
    assert LK.kv_tokens(300, 512, 256) == 300  # never more than the context
    assert LK.kv_tokens(32768, None, 256) == 32768  # full-context layer: the whole context
    assert LK.kv_tokens(262144, None, 256, kv_resident=32768) == 32768


def test_recurrent_state_is_f32_per_sequence():
    # Qwen3-Next-80B (docs/DESIGN.md "Recurrent state per sequence"; llama.cpp llama_hparams::n_embd_r /
    # n_embd_s): d_conv 4, d_inner 4096, n_group 16, d_state 128:
    # conv (4-1)*(4096 + 2*16*128) = 24,576 floats, ssm 128*4096 = 524,288 floats; 36 layers ~ 75.4 MiB.
    layers = [LK.RecurrentLayer(il, 3 * (4096 + 2 * 16 * 128), 128 * 4096) for il in range(36)]
    per_seq = LK.recurrent_state_bytes_per_seq(layers)
    assert per_seq == 36 * 4 * (24_576 + 524_288)
    assert round(per_seq / MIB, 1) == 75.4
    assert LK.recurrent_state_bytes(layers, 4) == 4 * per_seq


def test_cpp_prefill_formula():
    # docs/DESIGN.md "The automatic slot count":
    # prefill_mib = chunk > 0 ? 160 + chunk * 680 / 1024 : 0 (C integer division)
    assert F.cpp_prefill_bytes(0) == 0
    assert F.cpp_prefill_bytes(256) == (160 + 170) * MIB
    assert F.cpp_prefill_bytes(100) == (160 + 66) * MIB


def test_activation_bytes():
    # 256 chunk rows x 1000 f32 activations + one logits row of 5000 f32
    assert F.activation_bytes(256, 1000, 5000) == 4 * (256 * 1000 + 5000)
    assert F.activation_bytes(256, 1000, 5000, logits_all=True) == 4 * 256 * (1000 + 5000)
    assert F.activation_bytes(0, 1000, 5000) == 4 * (1000 + 5000)  # decode path: one row
    assert F.activation_bytes(0, 1000, 5000, batch=4) == 4 * 4 * (1000 + 5000)


def test_expert_slots():
    assert F.expert_slots(10_000, 3_000, 1_000) == 7
    assert F.expert_slots(10_000, 3_000, 1_000, cap=5) == 5
    assert F.expert_slots(2_000, 3_000, 1_000) == 0  # never negative
    assert F.expert_slots(10_000, 0, 0) == 0  # no experts
    # above 1 MiB the cache is taken in whole 2 MiB pages: 3 blobs of 1,000,000 B = 3,000,000 B take 4 MiB
    mib = 1 << 20
    assert F.expert_slots(700 * mib + 4 * mib, 700 * mib, 1_000_000) == 4  # 4,000,000 B -> 2 pages = 4 MiB
    assert F.expert_slots(700 * mib + 4 * mib - 1, 700 * mib, 1_000_000) == 2  # 3 would take 4 MiB > room
    assert F.driver_allocation_bytes(1 << 20) == 1 << 20 and F.driver_allocation_bytes((1 << 20) + 1) == 2 << 20
    assert F.driver_allocation_bytes(1000) == 1024


# ----------------------------------------------------------------------------- profile fill


def test_profile_fill_full_layer_skips_only_its_own_pairs():
    # Layer 0 is hot (counts 100..97), layer 1 cold (counts 10..7): with 4 slots each layer's range
    # is 2 (proportional to its 4 pairs). Ranked fill: 0/0, 0/1 fill layer 0; 0/2 and 0/3 are skipped
    # (layer 0 full) and the fill goes on to layer 1 (the bug #369 ended the fill there).
    pairs = [(0, e, 100 - e) for e in range(4)] + [(1, e, 10 - e) for e in range(4)]
    fill = F.fill_profile(pairs, 4)
    assert [(L.layer, L.range, L.filled) for L in fill.layers] == [(0, 2, 2), (1, 2, 2)]
    assert fill.used == 4
    assert fill.hit_count == 100 + 99 + 10 + 9
    assert fill.hit_rate == pytest.approx((100 + 99 + 10 + 9) / (394 + 34))
    # as many slots as pairs: every pair cached, hit rate 1
    assert F.fill_profile(pairs, 8).hit_rate == 1.0
    assert F.fill_profile(pairs, 100).used == 8


def test_profile_ranges_largest_remainder():
    r = F.layer_ranges({0: 3, 1: 3, 2: 3}, 4)
    assert sum(r.values()) == 4 and r == {0: 2, 1: 1, 2: 1}


def test_profile_rejects_duplicates():
    with pytest.raises(ValueError, match=r"pair \(layer 0, expert 1\) appears twice"):
        F.fill_profile([(0, 1, 5), (0, 1, 6)], 2)


# ----------------------------------------------------------------------------- cards


def test_card_presets_are_the_documented_cuda_totals():
    defaults, presets = load_cards()
    assert set(known_cards()) >= {"24G", "16G", "12G", "8G", "6G"}
    assert presets["24G"].total_bytes == 25_386_352_640 and presets["24G"].total_mib == 24210
    for p in presets.values():
        assert p.source and round(p.total_bytes / MIB) == p.total_mib
    c = card_preset("24g")
    assert c.total_bytes == 25_386_352_640 and c.cuda_context_bytes == defaults.cuda_context_mib * MIB
    assert card_preset("24G", cuda_context_mib=0).cuda_context_bytes == 0


def test_card_errors_never_guess():
    with pytest.raises(CardError, match="unknown card '20G'; presets: 80G, 48G, 32G, 24G"):
        card_preset("20G")
    with pytest.raises(CardError, match="--card-mib 0"):
        card_from_mib(0)
    assert card_from_mib(8000).total_bytes == 8000 * MIB


def test_measure_refuses_cleanly_without_a_gpu(monkeypatch):
    import builtins

    from strata.budget import cards

    real_import = builtins.__import__

    def no_cupy(name, *a, **k):
        if name.startswith("cupy"):
            raise ImportError("no module named cupy (test)")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    monkeypatch.setattr(cards, "nvml_memory", lambda device: None)
    with pytest.raises(CardError, match="no GPU to measure: CuPy is not importable.*NVML"):
        measure_card()


# ----------------------------------------------------------------------------- plan properties


def _facts(n_layer, n_kv_heads, head_dim, n_rec, conv, ssm, dense_elems, blobs, n_expert, ctx_train=4096):
    kv = [LK.KVLayer(il, n_kv_heads * head_dim, n_kv_heads * head_dim) for il in range(n_layer)]
    rec = [LK.RecurrentLayer(n_layer + i, conv, ssm) for i in range(n_rec)]
    dense = [
        DenseTensor(name="token_embd.weight", type=Q8_0, src_type=Q8_0, ne=(256, 64)),
        DenseTensor(name="output.weight", type=Q8_0, src_type=Q8_0, ne=(256, 64)),
        DenseTensor(name="blk.0.w", type=F32, src_type=BF16, ne=(dense_elems,)),
    ]
    experts = [
        ExpertLayerFacts(layer=i, gate_type=Q8_0, up_type=Q8_0, down_type=Q8_0, blob_bytes=b, blob_engine_bytes=b)
        for i, b in enumerate(blobs)
    ]
    return ModelFacts(
        arch="synthetic",
        n_ctx_train=ctx_train,
        n_vocab=64,
        dense=dense,
        head="output.weight",
        embeddings="token_embd.weight",
        kv_layers=kv,
        recurrent_layers=rec,
        act_per_token=1000,
        logits_per_token=64,
        n_expert=n_expert if blobs else 0,
        expert_layers=experts,
    )


facts_st = st.builds(
    _facts,
    n_layer=st.integers(1, 8),
    n_kv_heads=st.integers(1, 4),
    head_dim=st.sampled_from([32, 64, 128]),
    n_rec=st.integers(0, 6),
    conv=st.integers(0, 30_000),
    ssm=st.integers(0, 600_000),
    dense_elems=st.integers(1, 50_000_000),
    blobs=st.lists(st.integers(1, 5_000_000), min_size=0, max_size=6),
    n_expert=st.integers(1, 64),
)
opts_st = st.builds(
    PlanOptions,
    n_ctx=st.integers(1, 65536),
    kv=st.sampled_from(["f16", "int8"]),
    batch=st.integers(1, 8),
    prefill=st.integers(0, 1024),
    vram_reserve_mib=st.integers(0, 2000),
    embeddings_on_host=st.booleans(),
    logits_all=st.booleans(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(facts=facts_st, o=opts_st, card_mib=st.integers(1, 30_000))
def test_slots_never_push_the_total_past_the_card(facts, o, card_mib):
    p = make_plan(facts, card_from_mib(card_mib, cuda_context_mib=300), o, suggest=False)
    assert p.expert_cache_bytes == p.slots * p.max_blob
    assert p.used_bytes == sum(t.bytes for t in p.terms)
    if p.fits:
        assert p.used_bytes + p.reserve_bytes <= p.card.total_bytes
    if p.slots:
        assert p.fits and p.slots <= facts.expert_pairs
        assert p.used_bytes + p.reserve_bytes <= p.card.total_bytes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    facts=facts_st,
    o=opts_st,
    card_mib=st.integers(1, 30_000),
    knob=st.sampled_from(
        [
            "n_ctx",
            "batch",
            "prefill",
            "vram_reserve_mib",
            "kv",
            "embeddings_on_host",
            "logits_all",
            "card",
            "context",
        ]
    ),
    more=st.integers(1, 5000),
)
def test_growing_any_term_never_grows_the_slots(facts, o, card_mib, knob, more):
    card = card_from_mib(card_mib, cuda_context_mib=300)
    base = make_plan(facts, card, o, suggest=False)
    bigger_card = card
    if knob == "kv":
        assume(o.kv == "int8")
        o2 = o.model_copy(update={"kv": "f16"})
    elif knob in ("embeddings_on_host", "logits_all"):
        assume(getattr(o, knob) is (knob == "embeddings_on_host"))
        o2 = o.model_copy(update={knob: not getattr(o, knob)})
    elif knob == "card":
        o2 = o
        bigger_card = card_from_mib(max(1, card_mib - more), cuda_context_mib=300)  # a smaller card
    elif knob == "context":
        o2 = o
        bigger_card = card_from_mib(card_mib, cuda_context_mib=300 + more)  # a bigger context term
    else:
        o2 = o.model_copy(update={knob: getattr(o, knob) + more})
    grown = make_plan(facts, bigger_card, o2, suggest=False)
    assert grown.slots <= base.slots


@settings(max_examples=60, deadline=None)
@given(facts=facts_st, o=opts_st, card_mib=st.integers(1, 30_000), extra=st.integers(1, 50_000_000))
def test_bigger_dense_weights_never_grow_the_slots(facts, o, card_mib, extra):
    card = card_from_mib(card_mib, cuda_context_mib=300)
    base = make_plan(facts, card, o, suggest=False)
    heavier = facts.model_copy(
        update={"dense": facts.dense + [DenseTensor(name="blk.1.w", type=F32, src_type=F32, ne=(extra,))]}
    )
    assert make_plan(heavier, card, o, suggest=False).slots <= base.slots


def test_expert_cache_zero_vs_n_differs_by_n_blobs_and_one_too_many_is_refused():
    facts = _facts(4, 2, 64, 0, 0, 0, 1000, [100_000, 300_000, 200_000], 512)
    card = card_from_mib(500, cuda_context_mib=100)
    auto = make_plan(facts, card, PlanOptions(n_ctx=1024, vram_reserve_mib=300, prefill=0))
    n = auto.slots_fit
    assert 0 < n < facts.expert_pairs
    zero = make_plan(facts, card, PlanOptions(n_ctx=1024, vram_reserve_mib=300, prefill=0, expert_cache=0))
    some = make_plan(facts, card, PlanOptions(n_ctx=1024, vram_reserve_mib=300, prefill=0, expert_cache=n))
    assert some.used_bytes - zero.used_bytes == n * 300_000  # max_blob = the largest engine blob
    assert some.fits and zero.fits
    over = make_plan(facts, card, PlanOptions(n_ctx=1024, vram_reserve_mib=300, prefill=0, expert_cache=n + 1))
    assert not over.fits
    assert over.refused.startswith(f"--expert-cache {n + 1} refused: {n + 1} slots x 300000 B")
    assert f"at most {n} slots fit" in over.refused
    assert over.suggestions[0].option == "--expert-cache" and over.suggestions[0].value == str(n)


def test_plan_refuses_bad_options_and_profiles():
    facts = _facts(2, 1, 64, 0, 0, 0, 10, [1000], 4)
    card = card_from_mib(1000)
    with pytest.raises(PlanInputError, match="--batch 0: must be at least 1"):
        make_plan(facts, card, PlanOptions(batch=0))
    with pytest.raises(PlanInputError, match="layer 7 has no routed experts"):
        make_plan(facts, card, PlanOptions(profile_pairs=[(7, 0, 3)]))
    with pytest.raises(PlanInputError, match="expert 9 is outside 0..3"):
        make_plan(facts, card, PlanOptions(profile_pairs=[(0, 9, 3)]))


def test_non_fitting_plan_says_the_largest_context_that_fits():
    # one full-context layer, 1 KV head of 64: K+V f16 = 256 B per token
    facts = _facts(1, 1, 64, 0, 0, 0, 10, [], 1, ctx_train=1 << 20)
    card = card_from_mib(100, cuda_context_mib=0)
    o = PlanOptions(n_ctx=1 << 20, vram_reserve_mib=10, prefill=0)
    p = make_plan(facts, card, o)
    assert not p.fits
    s = {x.option: x for x in p.suggestions}
    best = int(s["--ctx"].value)
    assert s["--ctx"].fits_alone
    assert make_plan(facts, card, o.model_copy(update={"n_ctx": best}), suggest=False).fits
    assert not make_plan(facts, card, o.model_copy(update={"n_ctx": best + 1}), suggest=False).fits
    # by hand: free = card - dense - head - embd - act; KV = 256 B x ctx must fit in free - reserve
    fixed = sum(t.bytes for t in p.terms if t.name not in ("KV cache", "expert cache"))
    assert best == (100 * MIB - fixed - 10 * MIB) // 256
    assert "--kv" in s and "--embeddings-on-host" in s


def test_quants_registry_agrees_with_engine_form_for_every_widened_type():
    for t in quants.QTYPES.values():
        if t.widened:
            ne = (t.block_elems * 4, 3)
            f = LE.engine_form(t.id, t.id, ne)
            assert f.engine == quants.engine_nbytes(t.id, t.id, ne)
            assert f.widened_extra == 12 * t.widen_extra_bytes


# ----------------------------------------------------------------------------- engine layout


def test_expert_slot_layout_aligns_parts():
    # the reference model's layer 0: every part a multiple of 256 B, so the slot is the engine blob itself
    parts, stride = LX.expert_slot_layout(IQ2_XS, IQ2_XS, IQ4_NL, 2560, 640)
    assert parts == ((0, 473_600), (473_600, 473_600), (947_200, 1_024_000)) and stride == 1_971_200
    assert LX.expert_slot_bytes(IQ2_XS, IQ2_XS, IQ4_NL, 2560, 640) == LX.expert_blob_bytes(
        IQ2_XS, IQ2_XS, IQ4_NL, 2560, 640, engine=True
    )
    # Q3_K (110 B per 256) gate/up at n_embd 256 x width 32: 3520 B each, so up starts at 3584 and
    # down (Q8_0 widened, 256 rows x 36 B = 9216 B) at 7168 (3584 + 3520 = 7104 rounded up); stride 16384
    q3k = quants.by_name("Q3_K").id
    parts, stride = LX.expert_slot_layout(q3k, q3k, Q8_0, 256, 32)
    assert parts == ((0, 3520), (3584, 3520), (7168, 9216)) and stride == 16384
    assert all(off % LX.EXPERT_PART_ALIGN == 0 for off, _ in parts)


def test_engine_buffer_formulas():
    assert LB.matvec_out_bytes((640, 262144)) == 4 * 262144
    assert LB.vector_f32_bytes(F32, F32, (640,)) == 0  # viewed in place
    assert LB.vector_f32_bytes(F32, BF16, (640,)) == 4 * 640  # engine form is bf16: an f32 copy
    assert LB.vector_f32_bytes(F16, F16, (640,)) == 4 * 640
    assert LB.rope_table_bytes(1024, 256) == 2 * 1024 * 128 * 4
    assert LX.expert_hit_buffer_bytes(2560, 640) == 4 * (3 * 640 + 2560)


def test_runtime_term_is_charged_and_can_be_overridden():
    defaults, _ = load_cards()
    c = card_preset("24G")
    assert c.cuda_runtime_bytes == defaults.cuda_runtime_mib * MIB > 0 and "cards.toml" in c.cuda_runtime_source
    assert card_from_mib(4096, cuda_runtime_mib=0).cuda_runtime_bytes == 0
    with pytest.raises(CardError, match="--cuda-runtime-mib -1 is negative"):
        card_preset("24G", cuda_runtime_mib=-1)
    facts = ModelFacts(arch="x", n_ctx_train=64, n_vocab=10)
    p = make_plan(facts, card_from_mib(4096, cuda_context_mib=100, cuda_runtime_mib=7), PlanOptions(n_ctx=64))
    assert p.term("CUDA runtime") == 7 * MIB and p.term("CUDA context") == 100 * MIB


# ----------------------------------------------------------------------------- review fixes (plan API)


def test_kv_int8_needs_whole_q8_0_blocks_per_row_and_per_head():
    card = card_from_mib(4000)
    # head dim unknown (0): the per-token row n_head_kv x head_dim = 1 x 40 is not whole blocks
    facts = _facts(2, 1, 40, 0, 0, 0, 10, [], 1)
    with pytest.raises(PlanInputError) as e:
        make_plan(facts, card, PlanOptions(n_ctx=64, kv="int8"))
    assert str(e.value).startswith(
        "--kv int8: the K cache of layer 0 (blk.0.attn_k.weight) has a row (n_head_kv x key_length) of "
        "40 elements per token, not a multiple of the Q8_0 block of 32 (40 = 1 x 32 + 8); "
        "2 attention layer(s) affected (0..1)"
    )
    assert (e.value.found, e.value.required) == (
        "K row of 40 elements per token",
        "a multiple of 32 elements (Q8_0 block) for --kv int8",
    )
    assert make_plan(facts, card, PlanOptions(n_ctx=64, kv="f16")).term("KV cache") == 2 * 64 * 2 * 40 * 2
    # 2 heads of 48: the row (96) is whole blocks, a head is not (llama.cpp refuses a quantized cache then)
    facts = _facts(3, 2, 48, 0, 0, 0, 10, [], 1).model_copy(update={"head_dim": 48})
    with pytest.raises(
        PlanInputError,
        match=r"has a head dim \(key_length\) of 48 elements, not a multiple of the Q8_0 "
        r"block of 32 \(48 = 1 x 32 \+ 16\); 3 attention layer\(s\) affected \(0..2\)",
    ):
        make_plan(facts, card, PlanOptions(n_ctx=64, kv="int8"))
    assert LK.kv_row_bytes(96, "int8") == 3 * 34  # the formula alone would have accepted it


def test_plan_refuses_bad_profiles_naming_the_row():
    facts = _facts(2, 1, 64, 0, 0, 0, 10, [1000, 1000], 4)
    card = card_from_mib(1000)
    with pytest.raises(
        PlanInputError,
        match=r"p.parquet rows 0 and 2: the pair \(layer 1, expert 3\) appears twice "
        r"\(counts 5 and 7\)",
    ):
        make_plan(facts, card, PlanOptions(profile_pairs=[(1, 3, 5), (0, 1, 6), (1, 3, 7)], profile_path="p.parquet"))
    with pytest.raises(
        PlanInputError, match=r"expert profile row 1: layer 5 has no routed experts \(MoE layers: 0..1\)"
    ):
        make_plan(facts, card, PlanOptions(profile_pairs=[(0, 1, 5), (5, 1, 6)]))
    dense = _facts(2, 1, 64, 0, 0, 0, 10, [], 4)
    with pytest.raises(
        PlanInputError,
        match="this synthetic model has no routed experts, so there is no expert cache for "
        r"its 1 \(layer, expert\) pairs to fill",
    ):
        make_plan(dense, card, PlanOptions(profile_pairs=[(0, 1, 5)]))


def test_expert_cache_cap_is_the_automatic_cap():
    facts = _facts(1, 1, 64, 0, 0, 0, 10, [1000, 1000, 1000], 8)  # 3 x 8 = 24 pairs, memory for far more
    card = card_from_mib(4000)
    auto = make_plan(facts, card, PlanOptions(n_ctx=64))
    assert auto.slots == auto.slots_fit == auto.slots_cap == 24 and auto.fits
    over = make_plan(facts, card, PlanOptions(n_ctx=64, expert_cache=25))
    assert not over.fits and over.slots_fit == 24
    assert "at most 24 slots fit (capped at the model's 24 (layer, expert) pairs" in over.refused
    assert [(s.option, s.value) for s in over.suggestions] == [("--expert-cache", "24")]
    assert make_plan(facts, card, PlanOptions(n_ctx=64, expert_cache=24)).fits


def test_kv_resident_caps_full_context_layers_only():
    """--kv-resident N caps the full-context layers' resident positions; a sliding layer keeps its window
    (+ chunk - 1): Gemma 3 270M at ctx 2048, N = 100, window 512, chunk 1: 100 and 512 positions."""
    assert LK.kv_tokens(2048, None, 1, 100) == 100
    assert LK.kv_tokens(2048, 512, 1, 100) == 512
    assert LK.kv_tokens(2048, 512, 1, None) == 512 and LK.kv_tokens(300, 512, 1, 100) == 300


def test_host_tier_bytes_and_mapping_worked_numbers():
    """The host tier of the docstring's worked example (strata.layout.experts.host_tier_bytes) and its device
    mapping: 8 B per 4 KiB page, in 2 MiB units (strata.layout.experts.host_tier_map_bytes)."""
    from strata.layout import experts as LX

    slot = LX.expert_slot_bytes(12, 12, 14, 2048, 768)  # Q4_K gate/up, Q6_K down at Qwen3-30B-A3B's shape
    assert slot == 884_736 + 884_736 + 1_290_240 == 3_059_712
    assert LX.host_tier_bytes(2144, slot) == 6_560_022_528
    # 6,560,022,528 B = 1,601,568 pages of 4 KiB x 8 B = 12,812,544 B -> 7 units of 2 MiB
    assert LX.host_tier_map_bytes(6_560_022_528) == 7 * (2 << 20)
    assert LX.host_tier_map_bytes(0) == 0 and LX.host_tier_map_bytes(1) == 2 << 20
    with pytest.raises(ValueError, match="must be >= 0"):
        LX.host_tier_bytes(-1, slot)


def test_size_with_host_tier_is_the_fixed_point():
    """Qwen3-30B-A3B-like at ~14 GiB free: the cache sized with the mapping of its own tier reserved. The slot count
    is expert_slots with reserve + the bytes held; the final tier's mapping fits in them; with no mapping it would
    be a few slots more; N asked reserves the mapping of pairs - N."""
    from strata.layout import experts as LX

    slot, pairs, free, reserve = 3_059_712, 6144, 14 << 30, 1 << 30
    size, held, need = F.size_with_host_tier(free, reserve, slot, pairs, None, pairs)
    plain = F.size_expert_cache(free, reserve, slot, pairs)
    assert size.refused is None and size.slots == F.expert_slots(free, reserve + held, slot, pairs)
    assert need == LX.host_tier_map_bytes((pairs - size.slots) * slot) <= held
    assert 0 < plain.slots - size.slots <= -(-held // slot) + 1
    n = size.slots - 100
    fixed, held_n, need_n = F.size_with_host_tier(free, reserve, slot, pairs, n, pairs)
    assert fixed.slots == n and held_n == need_n == LX.host_tier_map_bytes((pairs - n) * slot)
    # every expert fits: no tier, no mapping
    big, _h, none = F.size_with_host_tier(40 << 30, reserve, slot, pairs, None, pairs)
    assert big.slots == pairs and none == 0


def test_presets_for_32g_48g_and_80g_cards():
    """Issue 21 item 9: presets for 32G and 48G cards and the H100 class, each a deviceQuery reading (cards.toml
    names the source); 80GB and 80GiB name the same preset."""

    for name, card, total in (
        ("32G", "NVIDIA GeForce RTX 5090", 33_660_534_784),
        ("48G", "NVIDIA RTX A6000", 51_160_023_040),
        ("80G", "NVIDIA H100 80GB HBM3", 85_017_755_648),
    ):
        c = card_preset(name)
        assert (c.total_bytes, card in c.name) == (total, True) and c.total_bytes // 2**20 == int(c.name.split()[-2])
    assert card_preset("80GB").total_bytes == card_preset("80GiB").total_bytes == 85_017_755_648


def test_smallest_card_preset_the_plan_fits():
    """A plan that does not fit names the smallest preset on which the same plan fits (issue 21 item 9), or "none":
    dense weights of 20e9 F32 elements (BF16 source: 2 B each in engine form, 40 GB) fit the 48G preset and no
    smaller one; 50e9 elements (100 GB) fit none (80G is the largest)."""
    from strata.budget.plan import smallest_card

    o = PlanOptions(engine="strata", n_ctx=256)

    def big(elems):  # a weight matrix (2-D: no f32 vector copy), BF16 source held as 2 B per element
        f = _facts(2, 1, 64, 0, 0, 0, 1, [], 0)
        w = DenseTensor(name="blk.0.w", type=F32, src_type=BF16, ne=(4096, elems // 4096))
        return f.model_copy(update={"dense": [*f.dense[:2], w]})

    fits48 = big(20 * 10**9)
    plan = make_plan(fits48, card_preset("24G"), o)
    assert not plan.fits and plan.smallest_card == card_preset("48G").name
    assert make_plan(fits48, card_preset("48G"), o).fits and not make_plan(fits48, card_preset("32G"), o).fits
    assert smallest_card(big(50 * 10**9), o, 0) == "none"
    assert make_plan(fits48, card_preset("80G"), o).smallest_card is None  # it fits: nothing to name
