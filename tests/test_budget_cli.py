"""`strata-budget check` end to end (click's runner in-process, one real subprocess): exit codes,
--json keys, --expert-cache refusals, profiles, card errors, the help text."""

from __future__ import annotations

import ctypes.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from strata.budget.cli import main
from strata.packer import synth
from strata.packer.build import build_pack

MIB = 1 << 20
KEYS = {"verdict", "card_total_bytes", "terms", "free_bytes", "reserve_bytes", "max_blob", "slots", "kv_bytes_per_token",
        "recurrent_state_bytes_per_seq", "widened_scale_bytes", "bf16_saved_bytes", "errors"}

# qwen3next, 8 layers (2 full attention), 64 experts of width 32 per layer: max blob engine form 3 x 36 x 64 B
DIMS = dict(n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_expert=64, n_ff_exp=32, n_ff_shexp=32,
            ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=2, n_vocab=300)


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    spec = synth.qwen3next_spec(n_layers=8, expert_types=[("Q8_0", "Q8_0"), ("Q4_0", "IQ4_NL")] * 4, dims=DIMS)
    [src] = synth.write_model(d / "m.gguf", spec)
    build_pack(src, d / "pack", progress=False)
    return d / "pack"


def run(*args):
    r = CliRunner().invoke(main, ["check", *map(str, args)])
    return r.exit_code, r.output


def run_json(*args):
    code, out = run(*args, "--json")
    return code, json.loads(out)


def test_help_documents_the_exit_codes():
    r = CliRunner().invoke(main, ["check", "--help"])
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "0 the pack passes the audit and the plan fits the card" in text
    assert "1 the plan does not fit" in text
    assert "2 semantic error in the pack" in text


def test_json_has_every_key_and_the_numbers_add_up(pack):
    code, d = run_json(pack, "--card", "24G", "--max-context", "4096")
    assert code == 0 and d["verdict"] == "fits"
    assert KEYS <= set(d)
    assert d["card_total_bytes"] == 25_386_352_640
    assert d["free_bytes"] == d["card_total_bytes"] - sum(t["bytes"] for t in d["terms"] if t["name"] != "expert cache")
    assert d["reserve_bytes"] == 700 * MIB
    assert d["max_blob"] == 3 * 36 * 64  # Q8_0 gate/up/down: 64 blocks of 34 B, widened to 36 B
    assert d["slots"] == 8 * 64  # the card holds every (layer, expert) pair: capped there
    # K + V f16 on the 2 full-attention layers (3, 7): 2 x 1 head x (32 + 32) x 2 B
    assert d["kv_bytes_per_token"] == 2 * 2 * 32 * 2
    assert not any("default" in w for w in d["warnings"])


def test_default_context_is_flagged(pack):
    code, d = run_json(pack, "--card", "24G")
    assert code == 0
    assert any("budgeted at the model's maximum context, 2048 tokens" in w for w in d["warnings"])
    assert d["n_ctx"] == 2048


def _tight_card(pack):
    """A card whose free memory after the reserve holds fewer slots than there are pairs."""
    code, d = run_json(pack, "--card-mib", 64, "--cuda-context-mib", 0, "--vram-reserve-mib", 0, "--max-context", 256,
                       "--prefill", 0, "--expert-cache", 0)
    assert code == 0
    reserve = d["free_bytes"] // MIB
    return ["--card-mib", 64, "--cuda-context-mib", 0, "--vram-reserve-mib", reserve, "--max-context", 256, "--prefill", 0], \
        (d["free_bytes"] - reserve * MIB) // d["max_blob"], d["max_blob"]


def test_expert_cache_zero_vs_n_and_one_slot_too_many(pack):
    args, most, blob = _tight_card(pack)
    assert 0 < most < 8 * 64, "the tight card should hold some slots but not every pair"
    c0, zero = run_json(pack, *args, "--expert-cache", 0)
    cn, some = run_json(pack, *args, "--expert-cache", most)
    assert c0 == cn == 0
    assert some["used_bytes"] - zero["used_bytes"] == most * blob
    ca, auto = run_json(pack, *args)
    assert ca == 0 and auto["slots"] == most
    code, out = run(pack, *args, "--expert-cache", most + 1)
    assert code == 1
    line = " ".join(out.split())
    assert f"--expert-cache {most + 1} refused: {most + 1} slots x {blob} B" in line
    assert f"at most {most} slots fit" in line


def test_profile_fill_and_hit_rate(pack, tmp_path):
    args, most, _blob = _tight_card(pack)
    # 8 layers x 64 experts; counts: expert e of layer L routed 1000 - 10 e + L times
    rows = [(L, e, 1000 - 10 * e + L) for L in range(8) for e in range(64)]
    p = tmp_path / "profile.parquet"
    pq.write_table(pa.table({"layer": [r[0] for r in rows], "expert": [r[1] for r in rows], "count": [r[2] for r in rows]}), p)
    code, d = run_json(pack, *args, "--expert-profile", p)
    assert code == 0
    prof = d["profile"]
    assert prof["pairs"] == 512 and prof["slots"] == most == prof["filled"]
    # ranges: every layer has 64 pairs, so `most` slots split evenly, remainder to the lower layers;
    # each layer keeps its hottest experts (expert 0, 1, ...)
    base, extra = divmod(most, 8)
    ranges = [base + (1 if L < extra else 0) for L in range(8)]
    assert [x["range"] for x in prof["layers"]] == ranges
    hit = sum(1000 - 10 * e + L for L in range(8) for e in range(ranges[L]))
    assert prof["expected_hit_rate"] == pytest.approx(hit / sum(r[2] for r in rows))
    # a profile caps the automatic slots at its pairs
    code, d = run_json(pack, "--card", "24G", "--max-context", 256, "--expert-profile", p)
    assert d["slots"] == 512 and d["profile"]["expected_hit_rate"] == 1.0
    half = tmp_path / "half.parquet"
    pq.write_table(pa.table({"layer": [r[0] for r in rows[::2]], "expert": [r[1] for r in rows[::2]],
                             "count": [r[2] for r in rows[::2]]}), half)
    code, d = run_json(pack, "--card", "24G", "--max-context", 256, "--expert-profile", half)
    assert d["slots"] == 256  # never more slots than profiled pairs (generate.cpp:2941-2960)


def test_bad_profiles_exit_2(pack, tmp_path):
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"layer": [0], "expert": [99], "count": [1]}), p)
    code, out = run(pack, "--card", "24G", "--expert-profile", p)
    assert code == 2 and "layer 0 expert 99 is outside 0..63" in out
    pq.write_table(pa.table({"layer": [0], "count": [1]}), p)
    code, out = run(pack, "--card", "24G", "--expert-profile", p)
    assert code == 2 and "lacks column(s) ['expert']" in out


def test_not_fitting_exits_1_and_says_what_to_shrink(pack):
    code, d = run_json(pack, "--card-mib", 800, "--max-context", 2048, "--batch", 8)
    assert code == 1 and d["verdict"] == "does not fit"
    s = {x["option"]: x for x in d["suggestions"]}
    assert s["--vram-reserve-mib"]["fits_alone"]
    assert int(s["--vram-reserve-mib"]["value"]) < 700


@pytest.mark.parametrize("args, msg", [
    (["--card", "20G"], "unknown card '20G'; presets: 24G"),
    (["--card-mib", "0"], "--card-mib 0: a card size must be a positive number of MiB"),
    ([], "no card: give --card"),
    (["--card", "24G", "--card-mib", "1000"], "give --card or --card-mib, not both"),
])
def test_card_errors_exit_2(pack, args, msg):
    code, out = run(pack, *args)
    assert code == 2 and msg in out


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="a GPU driver is present: measure would work")
def test_card_measure_refuses_cleanly_without_a_gpu(pack):
    code, out = run(pack, "--card", "measure")
    assert code == 2
    assert "--card measure: no GPU to measure" in out


def test_semantic_error_exits_2_with_json_errors(pack, tmp_path):
    bad = tmp_path / "pack"
    shutil.copytree(pack, bad)
    g = bad / "geometry.txt"
    g.write_text(g.read_text().replace("\nn_expert 64\n", "\nn_expert 65\n"))
    code, d = run_json(bad, "--card", "24G")
    assert code == 2 and d["verdict"] == "semantic error"
    e = next(x for x in d["errors"] if x["tensor"] == "geometry.txt:n_expert")
    assert e["found"] == "65" and e["required"].startswith("64 ")


def test_documents_prefill_model(pack):
    code, d = run_json(pack, "--card", "24G", "--max-context", 256, "--prefill", 256, "--prefill-model", "documents")
    assert code == 0
    # BRIEF.md: prefill_mib = 160 + chunk * 680 / 1024 = 160 + 170
    assert next(t["bytes"] for t in d["terms"] if t["name"] == "prefill/activations") == 330 * MIB


def test_tables_print_and_the_real_command_runs(pack):
    code, out = run(pack, "--card", "12G", "--max-context", 1024)
    assert code == 0
    assert "VRAM plan: 12G (NVIDIA GeForce RTX 3060 12 GB, 12044 MiB)" in out
    assert "fits: 12G" in out and "expert slots" in out
    r = subprocess.run([sys.executable, "-m", "strata.budget.cli", "check", str(pack), "--card", "8G", "--max-context", "512",
                        "--json"], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["verdict"] == "fits"


def test_kv_f32_doubles_the_kv_term_and_runtime_override(pack):
    _, d16 = run_json(pack, "--card", "24G", "--max-context", 256)
    _, d32 = run_json(pack, "--card", "24G", "--max-context", 256, "--kv", "f32")
    kv = {k: next(t["bytes"] for t in d["terms"] if t["name"] == "KV cache") for k, d in (("f16", d16), ("f32", d32))}
    assert kv["f32"] == 2 * kv["f16"] > 0 and d32["kv_bytes_per_token"] == 2 * d16["kv_bytes_per_token"]
    _, d0 = run_json(pack, "--card", "24G", "--max-context", 256, "--cuda-runtime-mib", 0)
    rt = {k: next(t["bytes"] for t in d["terms"] if t["name"] == "CUDA runtime") for k, d in (("default", d16), ("0", d0))}
    assert rt["0"] == 0 and d0["free_bytes"] - d16["free_bytes"] == rt["default"] > 0
