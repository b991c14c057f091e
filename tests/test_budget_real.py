"""strata-budget on real packs: Gemma 3 270M and Qwen2.5 0.5B (fetched from the package registry,
packed once per session by tests/conftest.py). Expected numbers are derived here from each file's own metadata, with
the formula's source, not by calling the budget formulas."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from strata.budget.audit import audit_pack
from strata.budget.cards import card_preset, load_cards
from strata.budget.plan import PlanOptions, make_plan
from strata.packer.pack import open_pack

pytestmark = pytest.mark.real
MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_packs(gemma_pack, qwen05_pack):
    """The session's real packs (tests/conftest.py builds each once per session)."""
    return {"gemma3-270m": gemma_pack, "qwen2.5-0.5b": qwen05_pack}


@pytest.fixture(scope="session")
def audits(real_packs):
    return {name: audit_pack(p) for name, p in real_packs.items()}


@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-0.5b"])
def test_real_packs_pass_the_audit(audits, real_packs, name):
    res = audits[name]
    assert res.errors == [] and res.warnings == []
    assert res.checks and all(c.ok for c in res.checks)
    assert res.dense_tensors == len(open_pack(real_packs[name]).index.entries)


def test_qwen05b_kv_per_token_from_its_metadata(audits, real_packs):
    m = open_pack(real_packs["qwen2.5-0.5b"]).metadata
    n_layer, n_head, n_head_kv = (
        m["qwen2.block_count"],
        m["qwen2.attention.head_count"],
        m["qwen2.attention.head_count_kv"],
    )
    # head_dim = attention.key_length, which llama.cpp defaults to n_embd / n_head (llama_model_base::load_hparams)
    head_dim = m.get("qwen2.attention.key_length", m["qwen2.embedding_length"] // n_head)
    assert (n_layer, n_head_kv, head_dim) == (24, 2, 64)
    card = card_preset("24G")
    p = make_plan(audits["qwen2.5-0.5b"].facts, card, PlanOptions(n_ctx=4096))
    # K and V, every layer, n_head_kv (not n_head) heads, f16 = 2 B
    assert p.kv_bytes_per_token == 2 * n_layer * n_head_kv * head_dim * 2 == 12_288
    assert p.term("KV cache") == 12_288 * 4096
    # int8 = Q8_0 rows: 34 B per 32 values (ggml-common.h block_q8_0)
    p8 = make_plan(audits["qwen2.5-0.5b"].facts, card, PlanOptions(n_ctx=4096, kv="int8"))
    assert p8.kv_bytes_per_token == 2 * n_layer * (n_head_kv * head_dim // 32 * 34) == 6_528


def test_gemma_sliding_layers_hold_their_window_global_layers_the_context(audits, real_packs):
    m = open_pack(real_packs["gemma3-270m"]).metadata
    n_layer, window = m["gemma3.block_count"], m["gemma3.attention.sliding_window"]
    n_head_kv, k_len, v_len = (
        m["gemma3.attention.head_count_kv"],
        m["gemma3.attention.key_length"],
        m["gemma3.attention.value_length"],
    )
    assert "gemma3.attention.sliding_window_pattern" not in m
    # llama-hparams.cpp:8-22: pattern 6 by default, layer il slides iff il % 6 < 5
    glob = [il for il in range(n_layer) if il % 6 == 5]
    assert glob == [5, 11, 17] and window == 512
    per_layer = n_head_kv * (k_len + v_len) * 2  # f16 K + V per token: 1 x (256 + 256) x 2 = 1024 B
    facts = audits["gemma3-270m"].facts
    assert [L.layer for L in facts.kv_layers if L.window is None] == glob
    card = card_preset("24G")
    for ctx, chunk in ((256, 256), (4096, 256), (32768, 256), (32768, 0), (32768, 64)):
        p = make_plan(facts, card, PlanOptions(n_ctx=ctx, prefill=chunk))
        # a sliding layer holds at most its window plus what one prompt chunk adds (window + chunk - 1,
        # llama.cpp is_masked_swa); a global layer the whole context
        swa_tokens = min(ctx, window + max(chunk, 1) - 1)
        assert p.term("KV cache") == 3 * per_layer * ctx + 15 * per_layer * swa_tokens
        assert p.kv_bytes_per_token == 3 * per_layer == 3072
        assert p.kv_bytes_per_token_window_layers == 15 * per_layer


def test_gemma_plan_on_24g(audits, real_packs):
    pack = open_pack(real_packs["gemma3-270m"])
    defaults, presets = load_cards()
    p = make_plan(audits["gemma3-270m"].facts, card_preset("24G"), PlanOptions(n_ctx=32768, prefill=256))
    # engine form by hand from index.txt: Q8_0 (34 B / 32) and Q5_0 (22 B / 32) carry one fp16 d per
    # block, widened to f32: +2 B per block (docs/FORMAT.md "Quant types"); K-quants and F32 unchanged.
    per_block = {8: 34, 6: 22}
    engine = {
        e.name: e.nbytes + (e.nbytes // per_block[e.type] * 2 if e.type in per_block else 0) for e in pack.index.entries
    }
    assert "output.weight" not in engine  # tied: the head multiplies with token_embd
    assert p.term("output head") == engine["token_embd.weight"]
    assert p.term("token embeddings") == 0
    assert p.term("dense weights") == sum(v for k, v in engine.items() if k != "token_embd.weight")
    assert p.widened_scale_bytes == sum(engine[e.name] - e.nbytes for e in pack.index.entries)
    assert p.term("CUDA context") == defaults.cuda_context_mib * MIB
    m = pack.metadata
    # activations (manifest gemma3 act_per_token): 2 n_embd + q + k + v + attn out (q) + 2 n_ff
    n_embd, n_ff, n_head = (
        m["gemma3.embedding_length"],
        m["gemma3.feed_forward_length"],
        m["gemma3.attention.head_count"],
    )
    q = n_head * m["gemma3.attention.key_length"]
    kv = m["gemma3.attention.head_count_kv"] * m["gemma3.attention.key_length"]
    act = 2 * n_embd + q + 2 * kv + q + 2 * n_ff
    n_vocab = 262_144
    assert p.term("prefill/activations") == 4 * (256 * act + n_vocab)
    assert p.card.total_bytes == presets["24G"].total_bytes == 25_386_352_640
    assert p.free_bytes == p.card.total_bytes - sum(t.bytes for t in p.terms if t.name != "expert cache")
    assert p.fits and p.slots == 0 and p.reserve_bytes == 700 * MIB


def test_real_command_end_to_end(real_packs):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata.budget.cli",
            "check",
            str(real_packs["gemma3-270m"]),
            "--card",
            "24G",
            "--max-context",
            "32768",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "fits" and d["errors"] == [] and d["kv_bytes_per_token"] == 3072
    assert d["card_total_bytes"] == 25_386_352_640
    assert sum(t["bytes"] for t in d["terms"]) == d["used_bytes"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata.budget.cli",
            "check",
            str(real_packs["qwen2.5-0.5b"]),
            "--card-mib",
            "600",
            "--engine",
            "cpp",
            "--batch",
            "4",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "does not fit" in r.stdout and "--ctx" in r.stdout


def test_readme_budget_output_is_what_make_demo_prints(real_packs):
    """README.md "strata-budget check" shows what `make demo` prints for Gemma 3 270M ("a real run"): every
    byte count of its plan table (terms, planned, reserve, card) and of its dense-types table is the command's
    today (the activation term grew by 960 B when the q8 norm kernel began writing its row quantized, and the
    README kept the older figures)."""
    import re

    readme = (ROOT / "README.md").read_text()
    block = readme.split("$ strata-budget check demo-out/pack --card 24G --max-context 8192\n", 1)[1]
    block = block.split("```", 1)[0]
    r = subprocess.run(
        [sys.executable, "-m", "strata.budget.cli", "check", str(real_packs["gemma3-270m"])]
        + ["--card", "24G", "--max-context", "8192", "--json"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    want = {t["name"]: t["bytes"] for t in d["terms"]}
    want |= {"= planned": d["used_bytes"], "reserve (kept free)": d["reserve_bytes"]}
    want["card total"] = d["card_total_bytes"]
    rows = {
        m.group(1): int(m.group(2).replace(",", "")) for m in re.finditer(r"^  (\S.*?)\s{2,}([\d,]+)\s", block, re.M)
    }
    assert {k: rows.get(k) for k in want} == want
    types = {
        t["type"]: [t["tensors"], t["pack_bytes"], t["engine_bytes"], t["payload_bytes"], t["scales_f32_bytes"]]
        + [t["widened_extra_bytes"], t["bf16_saved_bytes"]]
        for t in d["dense_types"]
    }
    shown = {
        m.group(1): [int(v.replace(",", "")) for v in m.group(2).split()]
        for m in re.finditer(r"^  ([A-Z0-9_]+)\s+(\d+(?:\s+[\d,]+){6})$", block, re.M)
    }
    assert shown == types
    assert d["verdict_line"] in block


def test_shifted_offset_in_a_real_pack(real_packs, tmp_path):
    src = real_packs["qwen2.5-0.5b"]
    dst = tmp_path / "pack"
    dst.mkdir()
    for f in os.listdir(src):
        if f == "pool.bin":
            os.link(src / f, dst / f)  # never written: only index.txt is corrupted
        else:
            shutil.copy(src / f, dst / f)
    text = (dst / "index.txt").read_text().split("\n")
    i = next(k for k, ln in enumerate(text) if ln.startswith("blk.3.attn_v.weight "))
    cols = text[i].split(" ")
    cols[3] = str(int(cols[3]) + 64)
    text[i] = " ".join(cols)
    (dst / "index.txt").write_text("\n".join(text))
    res = audit_pack(dst)
    assert "blk.3.attn_v.weight" in {e.tensor for e in res.errors}
