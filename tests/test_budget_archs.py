"""The contracts beyond the first four (llama dense and Mixtral-style, qwen3, qwen2moe, deepseek2, gpt-oss) end to
end: each preset of strata.testing written, `strata-pack build` and `strata-budget check --card 24G
--ctx 4096` run on it (zero audit errors, every budget term derived twice and equal), and the
per-architecture facts the budget depends on checked by hand.

Expected numbers are derived here from the presets' dimensions with the llama.cpp source cited (the
vendored tree of llama-cpp-python 0.3.36), never by calling strata.budget.formulas. What llama.cpp
itself allocates for the same files is tests/test_budget_llamacpp.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from strata import testing as synth
from strata.budget.audit import audit_pack
from strata.budget.cli import main as budget_main
from strata.manifests.contract import ManifestError, load_manifest
from strata.packer import quants
from strata.packer.build import build_pack
from strata.packer.cli import main as pack_main
from strata.packer.pack import open_pack

MIB = 1 << 20
NEW = {
    "llama": synth.llama_spec,
    "llama_moe": synth.llama_moe_spec,
    "qwen3": synth.qwen3_spec,
    "qwen2moe": synth.qwen2moe_spec,
    "deepseek2": synth.deepseek2_spec,
    "gpt_oss": synth.gpt_oss_spec,
    # a legacy (pre-MLA) deepseek2 file: attn_kv_b, no *_mla keys, one K/V head per query head
    "deepseek2_mha": lambda: synth.deepseek2_spec(
        params={"n_head_kv": 4, "head_dim": 96, "head_dim_v": 64, "expert_gating_func": 1}
    ),
}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    """Every preset packed with the `strata-pack build` command."""
    d = tmp_path_factory.mktemp("archs")
    out = {}
    for name, fn in NEW.items():
        [src] = synth.write_model(d / f"{name}.gguf", fn())
        r = CliRunner().invoke(pack_main, ["build", str(src), "-o", str(d / name), "--no-progress"])
        assert r.exit_code == 0, r.output
        out[name] = d / name
    return out


@pytest.mark.parametrize("name", list(NEW))
def test_pack_and_budget_check_pass(name, packs):
    r = CliRunner().invoke(budget_main, ["check", str(packs[name]), "--card", "24G", "--ctx", "4096", "--json"])
    d = json.loads(r.output)
    assert r.exit_code == 0, d["errors"]
    assert d["verdict"] == "fits" and d["errors"] == [] and d["n_ctx"] == 4096
    res = audit_pack(packs[name])
    assert res.errors == [] and res.checks and all(c.ok for c in res.checks)
    assert {"k_per_token", "v_per_token", "act_per_token", "logits_per_token"} <= {c.term for c in res.checks}
    # every tensor of the source is in the pack (dense) or in the expert table: nothing dropped
    p = open_pack(packs[name])
    n_src = len(synth.plan_tensors(NEW[name]()))
    n_exp = sum(3 for _ in (p.experts.layers if p.experts else ()))
    assert len(p.index.entries) + n_exp == n_src


def _kv(pack):
    f = audit_pack(pack).facts
    return [(L.layer, L.k, L.v, L.window) for L in f.kv_layers]


def test_kv_rows_llama_qwen3_qwen2moe(packs):
    # llama-hparams.cpp n_embd_k_gqa = n_embd_head_k x n_head_kv: 64 x 2 KV heads (GQA; never n_head 4 or 8)
    for name in ("llama", "llama_moe", "qwen3", "qwen2moe"):
        assert _kv(packs[name]) == [(0, 128, 128, None), (1, 128, 128, None)], name


def test_kv_rows_mla_latent_plus_rope_and_no_v(packs):
    # deepseek2 MLA (conversion/deepseek.py): head_count_kv 1, key_length = kv_lora_rank 128 + rope 32;
    # llama-kv-cache.cpp allocates K rows of n_embd_k_gqa = 1 x 160 and no V (has_v = !is_mla): 160 + 0,
    # on all 3 layers (the dense lead layer has attention too). A per-head cache would be 4 x 96 + 4 x 64.
    assert _kv(packs["deepseek2"]) == [(il, 160, 0, None) for il in range(3)]
    # legacy MHA file: head_count_kv = head_count 4, key_length 96 (64 nope + 32 rope), value_length 64
    assert _kv(packs["deepseek2_mha"]) == [(il, 4 * 96, 4 * 64, None) for il in range(3)]


def test_kv_rows_gpt_oss_alternate_sliding_window(packs):
    # llama-hparams.cpp set_swa_pattern(2): layer il sliding iff il % 2 < 1 -> 0 and 2 of window 128, 1 full
    assert _kv(packs["gpt_oss"]) == [(0, 128, 128, 128), (1, 128, 128, None), (2, 128, 128, 128)]


def test_llama_dense_or_experts_from_expert_count(packs):
    dense, moe = open_pack(packs["llama"]), open_pack(packs["llama_moe"])
    assert "llama.expert_count" not in dense.metadata and dense.experts is None
    assert {"blk.0.ffn_gate.weight", "blk.1.ffn_down.weight", "rope_freqs.weight"} <= {
        e.name for e in dense.index.entries
    }
    assert moe.metadata["llama.expert_count"] == 8 and "blk.0.ffn_gate.weight" not in {
        e.name for e in moe.index.entries
    }
    # Mixtral's experts are feed_forward_length (256) wide: src/models/llama.cpp {n_embd, n_ff, n_expert}
    q4k, q6k, q8, q5k = (quants.by_name(t) for t in ("Q4_K", "Q6_K", "Q8_0", "Q5_K"))
    want = [
        2 * 256 * 256 // 256 * q4k.block_bytes + 256 * 256 // 256 * q6k.block_bytes,
        2 * 256 * 256 // 32 * q8.block_bytes + 256 * 256 // 256 * q5k.block_bytes,
    ]
    assert [r.blob_bytes for r in moe.experts.layers] == want == [127_488, 184_320]


def test_deepseek2_dense_lead_and_shared_experts(packs):
    p = open_pack(packs["deepseek2"])
    names = {e.name for e in p.index.entries}
    assert [r.layer for r in p.experts.layers] == [1, 2]  # leading_dense_block_count 1
    assert {
        "blk.0.ffn_up.weight",
        "blk.1.ffn_gate_shexp.weight",
        "blk.2.exp_probs_b.bias",
        "blk.0.attn_k_b.weight",
        "blk.0.attn_q_a_norm.weight",
    } <= names
    assert "blk.1.ffn_up.weight" not in names and "blk.0.ffn_gate_inp.weight" not in names
    shexp = next(e for e in p.index.entries if e.name == "blk.1.ffn_down_shexp.weight")
    assert tuple(shexp.ne[:2]) == (256 * 1, 256)  # n_ff_exp x expert_shared_count
    legacy = {e.name for e in open_pack(packs["deepseek2_mha"]).index.entries}
    assert "blk.0.attn_kv_b.weight" in legacy and "blk.0.attn_k_b.weight" not in legacy


def test_gpt_oss_sinks_and_biases_are_dense(packs):
    p = open_pack(packs["gpt_oss"])
    ent = {e.name: e for e in p.index.entries}
    assert tuple(ent["blk.0.attn_sinks.weight"].ne[:1]) == (8,)  # one per query head
    assert tuple(ent["blk.2.ffn_down_exps.bias"].ne[:2]) == (256, 8) and ent["blk.2.ffn_down_exps.bias"].type == 0
    mx = quants.by_name("MXFP4")
    assert all((r.gate_type, r.up_type, r.down_type) == (mx.id,) * 3 for r in p.experts.layers)
    assert [r.blob_bytes for r in p.experts.layers] == [3 * 256 * 256 // 32 * 17] * 3 == [104_448] * 3


def test_round_194_mla_cache_sized_per_head_is_caught(packs, monkeypatch):
    # Sizing the MLA cache from the decompressed heads (n_head x qk head) makes the budget TIGHTER, so no
    # total catches it; the tensors' derivation (attn_kv_a_mqa rows: latent + rope) does, on every layer.
    m = load_manifest("deepseek2")
    monkeypatch.setattr(m.state, "k_per_token", "n_head * qk_head")
    errs = [e for e in audit_pack(packs["deepseek2"]).errors if "k_per_token" in e.message]
    assert [e.tensor for e in errs] == [f"blk.{il}.attn_kv_a_mqa.weight" for il in range(3)]
    assert errs[0].found.startswith("k_per_token = 160 elements") and errs[0].required.startswith("k_per_token = 384")
    # and a V cache llama.cpp never allocates under MLA
    monkeypatch.setattr(m.state, "k_per_token", "n_head_kv * head_dim")
    monkeypatch.setattr(m.state, "v_per_token", "n_head_kv * head_dim_v")
    errs = [e for e in audit_pack(packs["deepseek2"]).errors if "v_per_token" in e.message]
    assert len(errs) == 3 and errs[0].found.startswith("v_per_token = 0 elements")


def test_mla_keys_that_do_not_describe_the_latent_are_refused(tmp_path):
    # head_count_kv 4 with the *_mla keys: a K row per query head, which llama.cpp's MLA graph never writes
    spec = synth.deepseek2_spec(params={**synth.deepseek2_spec().params, "n_head_kv": 4})
    [src] = synth.write_model(tmp_path / "bad.gguf", spec)
    with pytest.raises(ManifestError, match=r"n_head_kv == 1 and head_dim == kv_lora_rank \+ rope_dim"):
        build_pack(src, tmp_path / "pack", progress=False)


def test_gpt_oss_head_width_must_be_the_rope_width(tmp_path):
    # q/k/v are n_rot wide per head, cache rows key_length: llama.cpp needs them equal
    [src] = synth.write_model(tmp_path / "g.gguf", synth.gpt_oss_spec(dims={"rope_dim": 32}))
    with pytest.raises(
        ManifestError, match=r"g\.gguf: metadata key gpt-oss\.rope\.dimension_count = 32 is refused.*head_dim = 64"
    ):
        build_pack(src, tmp_path / "pack", progress=False)


def test_llama_rope_dim_refused_like_llama_cpp(tmp_path):
    # llama-model.cpp load_hparams: "invalid n_rot" for LLM_ARCH_LLAMA unless rope.dimension_count == head dim
    [src] = synth.write_model(tmp_path / "l.gguf", synth.llama_spec(dims={"rope_dim": 32}))
    with pytest.raises(
        ManifestError, match=r"l\.gguf: metadata key llama\.rope\.dimension_count = 32 is refused.*head_dim = 64"
    ):
        build_pack(src, tmp_path / "pack", progress=False)
