"""strata.budget.audit on synthetic packs: a qwen3next file with 48 layers and full attention every
4th layer, deliberate corruptions (each caught with the tensor named and the numbers), the
round-194 error, and the plan numbers derived by hand from the pack's own metadata.

Expected values are computed here from metadata.txt with the formula's source cited, never by
calling strata.budget.formulas.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from strata import testing as synth
from strata.budget.audit import audit_pack
from strata.budget.cards import card_from_mib
from strata.budget.plan import PlanOptions, make_plan
from strata.manifests.contract import load_manifest
from strata.packer.build import build_pack
from strata.packer.pack import open_pack

MIB = 1 << 20

# 48 layers, interval 4 (layers 3, 7, ..., 47 full attention): small dims so the whole file is ~2 MB.
# Expert types mix widened (Q4_0, Q8_0, IQ4_NL) and plain types; ssm_ba and attn_gate are BF16 so
# the pool holds BF16-promoted tensors.
Q3N_DIMS = dict(
    n_embd=64,
    n_head=2,
    n_head_kv=1,
    head_dim=32,
    n_expert=4,
    n_ff_exp=32,
    n_ff_shexp=32,
    ssm_d_state=16,
    ssm_n_group=2,
    ssm_dt_rank=2,
    n_vocab=300,
    context_length=2048,
)
Q3N_EXPERTS = [("Q4_0", "Q8_0"), ("Q8_0", "IQ4_NL"), ("Q4_0", "Q4_0"), ("Q8_0", "Q8_0")] * 12


def q3n_spec(**kw):
    return synth.qwen3next_spec(
        n_layers=48,
        expert_types=Q3N_EXPERTS,
        dims=dict(Q3N_DIMS),
        tensor_types={"ssm_ba": "BF16", "attn_gate": "BF16"},
        **kw,
    )


def write_variant(path: Path, spec, edit=lambda ts: ts, kv_edit=lambda kv: kv) -> Path:
    """Write ``spec`` through synth's header writer with random data, after ``edit`` changed the
    tensor list ``(name, type id, ne)`` and ``kv_edit`` the metadata: files synth's presets cannot make."""
    kv = {k: synth.KV(vt, v, sub) for k, vt, v, sub in synth.model_kv(spec)}
    tensors = edit([(t.name, t.type_id, t.ne) for t in synth.plan_tensors(spec)])
    synth.write_header_only(path, spec.arch, kv_edit(kv), tensors, data="random")
    return path


@pytest.fixture(scope="module")
def q3n(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("q3n")
    [src] = synth.write_model(d / "q3n.gguf", q3n_spec())
    build_pack(src, d / "pack", progress=False)
    return d / "pack"


@pytest.fixture
def q3n_copy(q3n, tmp_path) -> Path:
    dst = tmp_path / "pack"
    shutil.copytree(q3n, dst)
    return dst


def md(pack: Path) -> dict:
    return open_pack(pack).metadata


def errors_for(res, tensor: str):
    return [e for e in res.errors if e.tensor == tensor]


# ----------------------------------------------------------------------------- the valid file


def test_synthetic_qwen3next_passes_and_every_term_is_derived_twice(q3n):
    res = audit_pack(q3n)
    assert res.errors == []
    assert res.expert_layers == 48 and res.dense_tensors == len(open_pack(q3n).index.entries)
    assert all(c.ok for c in res.checks)
    terms = {c.term for c in res.checks}
    assert {
        "k_per_token",
        "v_per_token",
        "conv_state",
        "ssm_state",
        "act_per_token",
        "logits_per_token",
        "expert blob",
        "dense weights, engine form",
        "widened scale bytes",
        "bf16 saved bytes",
    } <= terms
    # KV terms checked on the 12 attention layers, recurrent terms on the 36 others
    assert sorted(int(c.where.split()[1]) for c in res.checks if c.term == "k_per_token") == list(range(3, 48, 4))
    assert len([c for c in res.checks if c.term == "conv_state"]) == 36
    assert res.bf16_tensors == 72 and res.bf16_values_scanned > 0


def test_kv_is_charged_to_the_12_attention_layers_only(q3n):
    m = md(q3n)
    a = "qwen3next"
    n_layer, interval = m[f"{a}.block_count"], m[f"{a}.full_attention_interval"]
    # llama.cpp src/models/qwen3next.cpp load_arch_hparams: layer il is full attention iff
    # (il + 1) % interval == 0
    attention = [il for il in range(n_layer) if (il + 1) % interval == 0]
    assert len(attention) == 12
    # K and V rows per token per layer: n_head_kv x key_length / value_length elements, f16 = 2 B each
    per_layer = (
        2 * m[f"{a}.attention.head_count_kv"] * (m[f"{a}.attention.key_length"] + m[f"{a}.attention.value_length"])
    )
    res = audit_pack(q3n)
    assert [L.layer for L in res.facts.kv_layers] == attention
    card = card_from_mib(24000)
    for ctx in (1000, 2048, 6000):
        p = make_plan(res.facts, card, PlanOptions(n_ctx=ctx, prefill=64))
        assert p.kv_bytes_per_token == 12 * per_layer == 12 * 2 * 1 * (32 + 32)
        assert p.term("KV cache") == 12 * per_layer * ctx


def test_recurrent_state_is_constant_in_context_and_linear_in_batch(q3n):
    m = md(q3n)
    a = "qwen3next"
    d_conv, d_inner = m[f"{a}.ssm.conv_kernel"], m[f"{a}.ssm.inner_size"]
    n_group, d_state = m[f"{a}.ssm.group_count"], m[f"{a}.ssm.state_size"]
    # llama.cpp src/llama-hparams.cpp llama_hparams::n_embd_r / n_embd_s:
    # n_embd_r = (d_conv-1)(d_inner + 2 n_group d_state),
    # n_embd_s = d_state d_inner, both f32, one row per sequence, on the 36 recurrent layers
    per_seq = 36 * 4 * ((d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner)
    assert per_seq == 36 * 4 * (3 * (32 + 64) + 16 * 32) == 115_200
    facts = audit_pack(q3n).facts
    card = card_from_mib(24000)
    seen = set()
    for ctx in (64, 2048, 65536):
        p = make_plan(facts, card, PlanOptions(n_ctx=ctx))
        seen.add(p.term("recurrent state"))
        assert p.recurrent_state_bytes_per_seq == per_seq
    assert seen == {per_seq}
    for batch in (1, 2, 3, 8):
        assert make_plan(facts, card, PlanOptions(n_ctx=2048, batch=batch)).term("recurrent state") == batch * per_seq


def test_expert_blobs_and_max_blob_from_the_types(q3n):
    facts = audit_pack(q3n).facts
    # per expert gate/up [n_embd 64, n_ff_exp 32], down [32, 64] = 2048 values each; Q4_0 18 B / 32,
    # Q8_0 34 B / 32, IQ4_NL 18 B / 32 (docs/FORMAT.md "Quant types"); engine form widens d: +2 B per block.
    blocks = 64 * 32 // 32
    want = {0: (18 + 18 + 34) * blocks, 1: (34 + 34 + 18) * blocks, 2: (18 * 3) * blocks, 3: (34 * 3) * blocks}
    for L in facts.expert_layers:
        assert L.blob_bytes == want[L.layer % 4]
        assert L.blob_engine_bytes == want[L.layer % 4] + 3 * 2 * blocks
    assert facts.max_blob_engine == (36 * 3) * blocks == 6912
    assert facts.max_blob_source == 102 * blocks == 6528


# ----------------------------------------------------------------------------- corruptions


def test_kv_projection_sized_with_n_head_is_caught(tmp_path):
    # The tightening error: attn_k holds n_head heads instead of n_head_kv. Totals only grow, so a
    # budget that only checks totals passes it; the audit names the tensor and both shapes.
    spec = synth.qwen2_spec()
    d = spec.dims
    wrong = d.n_head * d.head_dim  # 4 x 64 = 256 instead of n_head_kv x head_dim = 128

    def edit(ts):
        return [(n, t, (ne[0], wrong) if n == "blk.1.attn_k.weight" else ne) for n, t, ne in ts]

    src = write_variant(tmp_path / "q2.gguf", spec, edit)
    build_pack(src, tmp_path / "pack", progress=False)
    res = audit_pack(tmp_path / "pack")
    errs = errors_for(res, "blk.1.attn_k.weight")
    shape = [e for e in errs if "shape" in e.message]
    assert shape and shape[0].found == "[256, 256]" and shape[0].required == "[256, 128]"
    kv = [e for e in errs if "k_per_token" in e.message]
    assert (
        kv and kv[0].found.startswith("k_per_token = 256 elements") and kv[0].required.startswith("k_per_token = 128")
    )
    assert all(e.tensor == "blk.1.attn_k.weight" for e in res.errors)


def test_wrong_blob_bytes_in_one_layer_is_caught(q3n_copy):
    p = q3n_copy / "native_experts.txt"
    lines = p.read_text().split("\n")
    i = next(k for k, ln in enumerate(lines) if ln.startswith("5 "))
    cols = lines[i].split(" ")
    right = int(cols[4])
    cols[4] = str(right + 2)
    lines[i] = " ".join(cols)
    p.write_text("\n".join(lines))
    res = audit_pack(q3n_copy)
    # the types x geometry finding (the row also fails "blob_bytes is the sum of its parts")
    errs = [e for e in errors_for(res, "blk.5.ffn_down_exps.weight") if e.required.startswith("blob_bytes")]
    assert errs, res.errors
    assert errs[0].found == f"blob_bytes {right + 2} (native_experts.txt:layer 5)"
    assert errs[0].required.startswith(f"blob_bytes {right} = gate ")
    assert {e.tensor for e in res.errors} == {"blk.5.ffn_down_exps.weight"}


def test_bf16_values_that_are_not_bf16_exact_are_caught(q3n_copy):
    pack = open_pack(q3n_copy)
    e = next(x for x in pack.index.entries if x.name == "blk.0.ssm_ba.weight")
    assert e.src_type == 30 and e.type == 0
    with open(q3n_copy / "pool.bin", "r+b") as f:
        f.seek(e.offset + 4 * 5)
        v = np.frombuffer(f.read(4), "<u4")[0]
        f.seek(e.offset + 4 * 5)
        f.write(np.uint32(v | 0x1234).tobytes())
    res = audit_pack(q3n_copy)
    [err] = res.errors
    assert err.tensor == "blk.0.ssm_ba.weight"
    assert err.found.startswith(f"1 of {e.nbytes // 4} values with nonzero low 16 bits (first: element 5 = 0x")
    assert "low 16 bits zero" in err.required
    assert audit_pack(q3n_copy, bf16_scan=False).errors == []  # the scan is what catches it


@pytest.mark.parametrize("shift", [64, 8])
def test_shifted_offset_is_caught(q3n_copy, shift):
    p = q3n_copy / "index.txt"
    lines = p.read_text().split("\n")
    i = next(k for k, ln in enumerate(lines) if ln.startswith("blk.10.attn_qkv.weight "))
    cols = lines[i].split(" ")
    cols[3] = str(int(cols[3]) + shift)
    lines[i] = " ".join(cols)
    p.write_text("\n".join(lines))
    res = audit_pack(q3n_copy)
    named = {e.tensor for e in res.errors}
    assert "blk.10.attn_qkv.weight" in named, res.errors
    msgs = " | ".join(e.message for e in res.errors)
    if shift == 8:
        assert "pool offset" in msgs and "is not a multiple of align 64" in msgs
    else:
        assert "gap after" in msgs or "overlaps blk.10.attn_qkv.weight" in msgs


def test_every_failure_is_listed_not_just_the_first(q3n_copy):
    p = q3n_copy / "index.txt"
    text = p.read_text().split("\n")
    for name in ("blk.0.attn_qkv.weight", "blk.20.attn_qkv.weight"):
        i = next(k for k, ln in enumerate(text) if ln.startswith(name + " "))
        cols = text[i].split(" ")
        cols[3] = str(int(cols[3]) + 4)
        text[i] = " ".join(cols)
    p.write_text("\n".join(text))
    g = q3n_copy / "geometry.txt"
    g.write_text(g.read_text().replace("\nn_head_kv 1\n", "\nn_head_kv 2\n"))
    res = audit_pack(q3n_copy)
    named = {e.tensor for e in res.errors}
    assert {"blk.0.attn_qkv.weight", "blk.20.attn_qkv.weight", "geometry.txt:n_head_kv"} <= named


def test_round_194_a_formula_too_big_is_caught_by_the_tensors(q3n, monkeypatch):
    # The budget term itself wrong (4x, say): it TIGHTENS the budget, so no total catches it; the
    # second derivation from the tensors does.
    m = load_manifest("qwen3next")
    monkeypatch.setattr(m.state, "k_per_token", "n_head * head_dim")
    res = audit_pack(q3n)
    errs = [e for e in res.errors if "k_per_token" in e.message]
    assert len(errs) == 12
    assert errs[0].tensor == "blk.3.attn_k.weight"
    assert errs[0].found.startswith("k_per_token = 32 elements") and errs[0].required.startswith("k_per_token = 64")


def test_round_194_indexer_key_store_is_one_shared_head(tmp_path, monkeypatch):
    # The reference model's indexer: 4 query heads, ONE cached key head (indexer.attn_k [n_embd, 128]).
    spec = synth.qwen3next_spec(dims={"n_embd": 256})
    E = spec.dims.n_embd

    def edit(ts):
        out = []
        for n, t, ne in ts:
            out.append((n, t, ne))
            if n.endswith(".attn_k_norm.weight"):
                p = n[: -len("attn_k_norm.weight")]
                out += [
                    (p + "indexer.attn_q_b.weight", 8, (E, 4 * 32)),
                    (p + "indexer.attn_k.weight", 8, (E, 32)),
                    (p + "indexer.k_norm.weight", 0, (32,)),
                    (p + "indexer.proj.weight", 8, (E, 4)),
                ]
        return out

    def kv_edit(kv):
        kv["qwen3next.attention.indexer.head_count"] = synth.KV(4, 4)  # GGUF u32
        kv["qwen3next.attention.indexer.key_length"] = synth.KV(4, 32)
        return kv

    src = write_variant(tmp_path / "idx.gguf", spec, edit, kv_edit)
    build_pack(src, tmp_path / "pack", progress=False)
    res = audit_pack(tmp_path / "pack")
    assert res.errors == []
    facts = res.facts
    assert [L.indexer_k for L in facts.kv_layers] == [32]  # one head of 32, not 4 x 32
    m = load_manifest("qwen3next")
    monkeypatch.setattr(m.state, "indexer_k_per_token", "indexer_n_head * indexer_head_dim")  # the round-194 sizing
    bad = audit_pack(tmp_path / "pack")
    [err] = bad.errors
    assert err.tensor == "blk.3.indexer.attn_k.weight"
    assert err.found.startswith("indexer_k_per_token = 32 elements") and err.required.startswith(
        "indexer_k_per_token = 128"
    )


def test_missing_unexpected_and_choice_conflicts_are_named(tmp_path):
    spec = synth.qwen2_spec()
    E = spec.dims.n_embd

    def edit(ts):
        ts = [x for x in ts if x[0] != "blk.0.ffn_up.weight"]
        ts.append(("blk.1.attn_qkv.weight", 8, (E, E + 2 * 128)))  # fused qkv beside the separate q/k/v
        return ts

    src = write_variant(tmp_path / "q2.gguf", spec, edit)
    build_pack(src, tmp_path / "pack", progress=False)
    # a tensor no role names is refused at build (tests/test_pack_build.py); in a pack edited after its build, the
    # audit names it: blk.1.ffn_norm.weight renamed in index.txt
    idx = tmp_path / "pack" / "index.txt"
    idx.write_text(idx.read_text().replace("blk.1.ffn_norm.weight ", "blk.1.mystery.weight "))
    res = audit_pack(tmp_path / "pack")
    missing = [
        e
        for e in errors_for(res, "blk.0.ffn_up.weight")
        if e.message.startswith("tensor blk.0.ffn_up.weight is missing; the qwen2 contract requires it")
    ]
    assert missing and missing[0].required == f"[{E}, {spec.dims.n_ff}]" and missing[0].found == "absent"
    [unexpected] = errors_for(res, "blk.1.mystery.weight")
    assert (
        unexpected.message.startswith("tensor blk.1.mystery.weight is not in the qwen2 contract")
        and unexpected.found == f"[{E}]"
    )
    conflict = [e for e in res.errors if "qkv tensors present are not exactly one option" in e.message]
    assert conflict and "blk.1.attn_qkv.weight" in conflict[0].found


def test_norm_with_a_quantized_type_is_refused(tmp_path):
    spec = synth.qwen2_spec()

    def edit(ts):
        return [(n, 8 if n == "blk.0.attn_norm.weight" else t, ne) for n, t, ne in ts]

    src = write_variant(tmp_path / "q2.gguf", spec, edit)
    build_pack(src, tmp_path / "pack", progress=False)
    [err] = audit_pack(tmp_path / "pack").errors
    assert (err.tensor, err.found, err.required) == ("blk.0.attn_norm.weight", "Q8_0", "F32")


def test_expert_stride_against_the_shard_table(q3n_copy):
    p = q3n_copy / "native_experts.txt"
    lines = p.read_text().split("\n")
    i = next(k for k, ln in enumerate(lines) if ln.startswith("9 "))
    cols = lines[i].split(" ")
    cols[8] = str(int(cols[8]) + 32)  # gate_stride
    lines[i] = " ".join(cols)
    p.write_text("\n".join(lines))
    [err] = audit_pack(q3n_copy).errors
    assert err.tensor == "blk.9.ffn_gate_exps.weight"
    assert err.found.startswith("gate_stride ") and err.required.endswith("(shard tensor table)")


def test_split_shards_and_fused_gate_up(tmp_path):
    spec = synth.qwen3next_spec(fused_gate_up=True, n_shards=3)
    paths = synth.write_model(tmp_path / "f.gguf", spec)
    build_pack(paths[0], tmp_path / "pack", progress=False)
    res = audit_pack(tmp_path / "pack")
    assert res.errors == [] and res.expert_layers == 4
    assert len({c.where for c in res.checks if c.term == "expert blob"}) == 4


def test_tensor_without_a_role_is_refused_at_build(tmp_path):
    """Issue 21 item 12: a routing bias the architecture does not have (deepseek2's ``exp_probs_b`` in a qwen3moe
    file) and a misspelt norm are refused by ``strata-pack build``, naming the file, the tensor, its shape and the
    count, as llama.cpp refuses a file with tensors its loader does not create; nothing is written."""
    from strata.packer.pack_plan import BuildError

    spec = synth.qwen3moe_spec()
    E = spec.dims.n_expert

    def edit(ts):
        return ts + [("blk.0.exp_probs_b.bias", 0, (E,)), ("blk.1.ffn_nrom.weight", 0, (spec.dims.n_embd,))]

    src = write_variant(tmp_path / "m.gguf", spec, edit)
    with pytest.raises(BuildError) as e:
        build_pack(src, tmp_path / "pack", progress=False)
    assert str(e.value) == (
        f"{src}: tensor blk.0.exp_probs_b.bias [{E}] is not in the qwen3moe contract (no role for it in "
        "manifests/qwen3moe.toml) (and 1 more: blk.1.ffn_nrom.weight); llama.cpp refuses a file with tensors its "
        "loader does not create; refusing to pack it"
    )
    assert not (tmp_path / "pack").exists()
    from click.testing import CliRunner

    from strata.packer.cli import main as pack_main

    r = CliRunner().invoke(pack_main, ["build", str(src), "-o", str(tmp_path / "pack")])
    assert r.exit_code == 2 and f"error: {e.value}" in r.output and not (tmp_path / "pack").exists(), r.output


@pytest.mark.llama_cpp
def test_llama_cpp_refuses_a_tensor_without_a_role(llama_cpp, tmp_path):
    """The reference for the refusal above: llama.cpp loads the file without the extra tensor and refuses it with."""
    spec = synth.qwen3moe_spec()
    ok = write_variant(tmp_path / "ok.gguf", spec)
    bad = write_variant(tmp_path / "bad.gguf", spec, lambda ts: ts + [("blk.0.exp_probs_b.bias", 0, (8,))])
    llama_cpp.Llama(model_path=str(ok), verbose=False, n_ctx=32)
    with pytest.raises(ValueError):
        llama_cpp.Llama(model_path=str(bad), verbose=False, n_ctx=32)


def test_a_truncated_expert_shard_is_one_error_with_both_sizes(q3n, tmp_path):
    """A source shard cut short (a copy interrupted): one error naming the shard, the tensor that runs past its end,
    where it ends and the file's size, not one more 'tensor missing' per state term and layer for the experts that
    shard holds (the audit could not read them; it did not find them absent)."""
    src = q3n.parent / "q3n.gguf"
    size = src.stat().st_size
    cut = tmp_path / "q3n.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(size - 4096))
    res = audit_pack(q3n, source_dir=tmp_path)
    assert len(res.errors) == 1, [e.message for e in res.errors]
    e = res.errors[0]
    assert e.tensor == "shard 0 q3n.gguf"
    assert re.search(
        rf"cannot re-read expert shard 0 at {re.escape(str(cut))}: tensor '[^']+' \([^)]+\) ends at \d+, beyond the "
        rf"end of the file \({size - 4096} bytes\): truncated data",
        e.message,
    ), e.message
