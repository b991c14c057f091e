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

from strata import testing as synth
from strata.budget.cli import JSON_KEYS, main
from strata.budget.plan import PlanOptions
from strata.packer.build import build_pack

MIB = 1 << 20
KEYS = {
    "verdict",
    "card_total_bytes",
    "terms",
    "free_bytes",
    "reserve_bytes",
    "max_blob",
    "slots",
    "kv_bytes_per_token",
    "recurrent_state_bytes_per_seq",
    "widened_scale_bytes",
    "bf16_saved_bytes",
    "errors",
}

# qwen3next, 8 layers (2 full attention), 64 experts of width 32 per layer: max blob engine form 3 x 36 x 64 B
DIMS = dict(
    n_embd=64,
    n_head=2,
    n_head_kv=1,
    head_dim=32,
    n_expert=64,
    n_ff_exp=32,
    n_ff_shexp=32,
    ssm_d_state=16,
    ssm_n_group=2,
    ssm_dt_rank=2,
    n_vocab=300,
)


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
    """A card whose free memory after the reserve holds fewer slots than there are pairs (``-ub 1``: no prompt chunk
    path, so no cuBLAS share of the runtime term, which alone would not fit a 64 MiB card)."""
    code, d = run_json(
        pack,
        "-ub",
        1,
        "--card-mib",
        64,
        "--cuda-context-mib",
        0,
        "--vram-reserve-mib",
        0,
        "--max-context",
        256,
        "--prefill",
        0,
        "--expert-cache",
        0,
    )
    assert code == 0
    reserve = d["free_bytes"] // MIB
    return (
        [
            "-ub",
            1,
            "--card-mib",
            64,
            "--cuda-context-mib",
            0,
            "--vram-reserve-mib",
            reserve,
            "--max-context",
            256,
            "--prefill",
            0,
        ],
        (d["free_bytes"] - reserve * MIB) // d["max_blob"],
        d["max_blob"],
    )


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
    pq.write_table(
        pa.table({"layer": [r[0] for r in rows], "expert": [r[1] for r in rows], "count": [r[2] for r in rows]}), p
    )
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
    # a profile of every pair: all resident, every routed pair hits in-sample
    code, d = run_json(pack, "--card", "24G", "--max-context", 256, "--expert-profile", p)
    assert d["slots"] == 512 and d["profile"]["expected_hit_rate"] == 1.0
    half = tmp_path / "half.parquet"
    pq.write_table(
        pa.table(
            {
                "layer": [r[0] for r in rows[::2]],
                "expert": [r[1] for r in rows[::2]],
                "count": [r[2] for r in rows[::2]],
            }
        ),
        half,
    )
    # strata's engine: the profile orders the fill, the cache is what fits (the rest fills by admission);
    # the C++ engine never has more slots than profiled pairs (generate.cpp:2941-2960)
    code, d = run_json(pack, "--card", "24G", "--max-context", 256, "--expert-profile", half)
    assert d["slots"] == 512 and d["profile"]["expected_hit_rate"] == 1.0
    code, d = run_json(pack, "--card", "24G", "--max-context", 256, "--expert-profile", half, "--engine", "cpp")
    assert d["slots"] == 256


def test_bad_profiles_exit_2(pack, tmp_path):
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"layer": [0], "expert": [99], "count": [1]}), p)
    code, out = run(pack, "--card", "24G", "--expert-profile", p)
    assert code == 2 and "layer 0 expert 99 is outside 0..63" in out
    pq.write_table(pa.table({"layer": [0], "count": [1]}), p)
    code, out = run(pack, "--card", "24G", "--expert-profile", p)
    assert code == 2 and "lacks column(s) ['expert']" in out


def test_not_fitting_exits_1_and_says_what_to_shrink(pack):
    code, d = run_json(pack, "--engine", "cpp", "--card-mib", 800, "--max-context", 2048, "--batch", 8)
    assert code == 1 and d["verdict"] == "does not fit"
    s = {x["option"]: x for x in d["suggestions"]}
    assert s["--vram-reserve-mib"]["fits_alone"]
    assert int(s["--vram-reserve-mib"]["value"]) < 700


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--card", "20G"], "unknown card '20G'; presets: 80G, 48G, 32G, 24G"),
        (["--card-mib", "0"], "--card-mib 0: a card size must be a positive number of MiB"),
        ([], "no card: give --card"),
        (["--card", "24G", "--card-mib", "1000"], "give --card or --card-mib, not both"),
    ],
)
def test_card_errors_exit_2(pack, args, msg):
    code, out = run(pack, *args)
    assert code == 2 and msg in out


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="a GPU driver is present: measure would work"
)
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
    r = CliRunner().invoke(main, ["check", str(bad), "--card", "24G"])  # the terminal form: one error line on stderr
    assert r.exit_code == 2 and r.stderr.startswith("error: semantic error: ") and "in " + str(bad) in r.stderr


def test_cpp_prefill_model(pack):
    code, d = run_json(
        pack,
        "--engine",
        "cpp",
        "--card",
        "24G",
        "--max-context",
        256,
        "--prefill",
        256,
        "--prefill-model",
        "cpp",
    )
    assert code == 0
    # docs/DESIGN.md "The automatic slot count": prefill_mib = 160 + chunk * 680 / 1024 = 160 + 170
    assert next(t["bytes"] for t in d["terms"] if t["name"] == "prefill/activations") == 330 * MIB


def test_old_value_name_documents_is_a_hidden_alias_of_cpp(pack):
    # old scripts keep working: "documents" (the earlier name of the reference C++ engine) plans the same and
    # the JSON says "cpp"; --help lists only the new names
    args = ("--card", "24G", "--max-context", 256, "--prefill", 256)
    new = run_json(pack, *args, "--engine", "cpp", "--prefill-model", "cpp")
    old = run_json(pack, *args, "--engine", "documents", "--prefill-model", "documents")
    assert old[0] == new[0] == 0 and old[1]["terms"] == new[1]["terms"]
    assert (old[1]["options"]["engine"], old[1]["options"]["prefill_model"]) == ("cpp", "cpp")
    assert PlanOptions(engine="documents", prefill_model="documents") == PlanOptions(engine="cpp", prefill_model="cpp")
    help_text = CliRunner().invoke(main, ["check", "--help"]).output
    assert "[strata|cpp]" in help_text and "[geometry|cpp]" in help_text and "documents" not in help_text
    code, out = run(pack, *args, "--engine", "c++")
    assert code == 2 and "'strata', 'cpp'" in out and "documents" not in out


def test_a_context_that_does_not_fit_is_suggested_as_ctx(pack):
    """A user asks for more context than the card holds: the suggestion names the option as --help lists it
    first, --ctx (the verdict's "e.g. ..." and the JSON's option), not its alias --max-context beside a
    "--ctx N fits too"."""
    code, d = run_json(pack, "--card", "8G", "--ctx", 99_999_999)
    assert code == 1
    ctx = [s for s in d["suggestions"] if s["option"] == "--ctx"]
    assert len(ctx) == 1 and ctx[0]["fits_alone"] and all(s["option"] != "--max-context" for s in d["suggestions"])
    n = int(ctx[0]["value"])
    assert 4096 < n < 99_999_999 and run(pack, "--card", "8G", "--ctx", n)[0] == 0
    assert run(pack, "--card", "8G", "--ctx", n + 1)[0] == 1
    code, out = run(pack, "--card", "8G", "--ctx", 99_999_999)
    assert code == 1 and f"e.g. --ctx {n} (the largest context that fits is {n} tokens" in " ".join(out.split())
    assert "--max-context" not in out


def test_cpp_engine_options_on_the_strata_plan_are_said_not_dropped(pack):
    """--prefill, --prefill-model, --logits-all and --embeddings-on-host size the C++ engine's plan only; given
    with the default --engine strata they change nothing, and the plan says so (a warning naming each, in the
    table output and --json) instead of ignoring them silently. --engine cpp uses them: no warning."""
    extra = ("--prefill", 64, "--prefill-model", "cpp", "--logits-all", "--embeddings-on-host")
    code, plain = run_json(pack, "--card", "24G", "--ctx", 256)
    code2, d = run_json(pack, "--card", "24G", "--ctx", 256, *extra)
    assert code == code2 == 0
    assert [(t["name"], t["bytes"]) for t in d["terms"]] == [(t["name"], t["bytes"]) for t in plain["terms"]]
    want = (
        "--prefill 64, --prefill-model cpp, --logits-all, --embeddings-on-host: the reference C++ engine's "
        "option(s), not used for strata's engine"
    )
    assert [w for w in d["warnings"] if w.startswith(want)] and not any(
        "C++ engine's option" in w for w in plain["warnings"]
    )
    code, out = run(pack, "--card", "24G", "--ctx", 256, "--logits-all")
    assert code == 0 and "warning: --logits-all: the reference C++ engine's option(s), not used" in " ".join(
        out.split()
    )
    code, c = run_json(pack, "--card", "24G", "--ctx", 256, "--engine", "cpp", *extra)
    assert code == 0 and not any("C++ engine's option" in w for w in c["warnings"])


def test_tables_print_and_the_real_command_runs(pack):
    code, out = run(pack, "--card", "12G", "--max-context", 1024)
    assert code == 0
    assert "VRAM plan: 12G (NVIDIA GeForce RTX 3060 12 GB, 12044 MiB)" in out
    assert "fits: 12G" in out and "expert slots" in out
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata.budget.cli",
            "check",
            str(pack),
            "--card",
            "8G",
            "--max-context",
            "512",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["verdict"] == "fits"


def test_kv_f32_doubles_the_kv_term_and_runtime_override(pack):
    _, d16 = run_json(pack, "--card", "24G", "--max-context", 256)
    _, d32 = run_json(pack, "--card", "24G", "--max-context", 256, "--kv", "f32")
    kv = {k: next(t["bytes"] for t in d["terms"] if t["name"] == "KV cache") for k, d in (("f16", d16), ("f32", d32))}
    assert kv["f32"] == 2 * kv["f16"] > 0 and d32["kv_bytes_per_token"] == 2 * d16["kv_bytes_per_token"]
    _, d0 = run_json(pack, "--card", "24G", "--max-context", 256, "--cuda-runtime-mib", 0)
    rt = {
        k: next(t["bytes"] for t in d["terms"] if t["name"] == "CUDA runtime") for k, d in (("default", d16), ("0", d0))
    }
    assert rt["0"] == 0 and d0["free_bytes"] - d16["free_bytes"] == rt["default"] > 0


# ----------------------------------------------------------------------------- review fixes: input errors
# Every user error is one `error: ...` line on stderr and exit 2 (exit 1 means "does not fit"); with
# --json, stdout holds one object with every key of a success (null where it does not apply),
# verdict "error" and the error as {tensor, found, required, message}.


@pytest.fixture(scope="module")
def dense_pack(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dense")
    [src] = synth.write_model(d / "q2.gguf", synth.qwen2_spec())
    build_pack(src, d / "pack", progress=False)
    return d / "pack"


@pytest.fixture(scope="module")
def small_moe_pack(tmp_path_factory) -> Path:
    """qwen3moe preset: 3 MoE layers x 8 experts = 24 (layer, expert) pairs."""
    d = tmp_path_factory.mktemp("moe24")
    [src] = synth.write_model(d / "m.gguf", synth.qwen3moe_spec())
    build_pack(src, d / "pack", progress=False)
    return d / "pack"


def run_input_error(*args) -> tuple[str, dict]:
    """Run `check ARGS` with and without --json: both exit 2 without a traceback; returns the one
    stderr line and the --json error entry (after checking the object's shape)."""
    r = CliRunner().invoke(main, ["check", *map(str, args)])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output and r.stdout == ""
    lines = r.stderr.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    rj = CliRunner().invoke(main, ["check", *map(str, args), "--json"])
    assert rj.exit_code == 2
    d = json.loads(rj.stdout)
    assert tuple(d) == JSON_KEYS  # the shape of a success
    assert d["verdict"] == "error" and d["verdict_line"] == lines[0]
    assert all(d[k] is None for k in JSON_KEYS if k not in ("verdict", "verdict_line", "errors", "seconds"))
    [e] = d["errors"]
    assert set(e) == {"tensor", "found", "required", "message"} and "error: " + e["message"] == lines[0]
    return " ".join(lines[0].split()), e


def test_json_keys_are_the_same_for_success_and_semantic_error(pack, tmp_path):
    code, d = run_json(pack, "--card", "24G", "--max-context", 256)
    assert code == 0 and tuple(d) == JSON_KEYS
    bad = tmp_path / "pack"
    shutil.copytree(pack, bad)
    (bad / "geometry.txt").write_text((bad / "geometry.txt").read_text().replace("\nn_expert 64\n", "\nn_expert 65\n"))
    code, d = run_json(bad, "--card", "24G")
    assert code == 2 and tuple(d) == JSON_KEYS and d["verdict"] == "semantic error"


def _profile(path: Path, **cols) -> Path:
    pq.write_table(pa.table(cols), path)
    return path


@pytest.mark.parametrize(
    "cols, want, tensor, found",
    [
        (
            dict(layer=[0, 0, 1], expert=[3, 3, 1], count=[5, 6, 7]),
            "rows 0 and 1: the pair (layer 0, expert 3) appears twice (counts 5 and 6)",
            "row 1",
            "(layer 0, expert 3) again (first at row 0)",
        ),
        (
            dict(layer=["0", "1"], expert=[1, 2], count=[5, 6]),
            "column layer has type string, an expert profile needs integer columns",
            ":layer",
            "string",
        ),
        (dict(layer=[0, 1], expert=[[1], [2]], count=[5, 6]), "column expert has type list<", ":expert", "list<"),
        (
            dict(layer=[0, 1], expert=[1, 2], count=[5.0, 6.5]),
            "column count has type double, an expert profile needs integer columns",
            ":count",
            "double",
        ),
        (dict(layer=[0, 1], expert=[1, 2], count=[True, False]), "column count has type bool", ":count", "bool"),
        (
            dict(layer=[0, 1], expert=[1, 2], count=[5, -6]),
            "row 1: count -6 is negative (layer 1, expert 2, count -6)",
            "row 1",
            "count -6",
        ),
        (dict(layer=[0, -1], expert=[1, 2], count=[5, 6]), "row 1: layer -1 is negative", "row 1", "layer -1"),
        (
            dict(layer=[0, 99], expert=[1, 2], count=[5, 6]),
            "row 1: layer 99 has no routed experts (MoE layers: 0..7)",
            "row 1",
            "layer 99",
        ),
        (
            dict(layer=[0, 1], expert=[1, 64], count=[5, 6]),
            "row 1: layer 1 expert 64 is outside 0..63",
            "row 1",
            "expert 64",
        ),
        (
            dict(layer=pa.array([0, 1]), expert=pa.array([1, 2]), count=pa.array([5, None], pa.int64())),
            "column count has 1 null value(s), the first at row 1",
            ":count",
            "1 null(s)",
        ),
        (
            dict(layer=pa.array([], pa.int32()), expert=pa.array([], pa.int32()), count=pa.array([], pa.int64())),
            "the expert profile has no rows",
            "profile.parquet",
            "0 rows",
        ),
    ],
)
def test_bad_profile_is_one_error_line_exit_2(pack, tmp_path, cols, want, tensor, found):
    p = _profile(tmp_path / "profile.parquet", **cols)
    line, e = run_input_error(pack, "--card", "24G", "--max-context", 256, "--expert-profile", p)
    assert f"error: {p}" in line and want in line
    assert e["tensor"].endswith(tensor) and found in e["found"]


def test_float_profile_names_the_value_truncation_would_change(pack, tmp_path):
    p = _profile(tmp_path / "f.parquet", layer=[0, 1, 2], expert=[1, 2, 3], count=[5.0, 6.0, 7.25])
    line, _ = run_input_error(pack, "--card", "24G", "--expert-profile", p)
    assert "column count has type double" in line and "never truncated" in line and "row 2 holds 7.25" in line


def test_missing_or_unreadable_profile_file(pack, tmp_path):
    line, e = run_input_error(pack, "--card", "24G", "--expert-profile", tmp_path / "nope.parquet")
    assert line == f"error: --expert-profile {tmp_path / 'nope.parquet'}: no such file"
    assert e["found"] == "no such file" and "Parquet" not in line
    junk = tmp_path / "junk.parquet"
    junk.write_text("layer,expert,count\n0,1,2\n")
    line, _ = run_input_error(pack, "--card", "24G", "--expert-profile", junk)
    assert f"--expert-profile {junk}: not a readable Parquet file" in line


def test_profile_for_a_dense_model_is_refused(dense_pack, tmp_path):
    # Chosen over a warning: a profile names (layer, expert) pairs; a model without routed experts
    # has none, so the profile cannot mean what the user thinks (wrong pack or wrong profile).
    p = _profile(tmp_path / "p.parquet", layer=[0, 1, 1], expert=[1, 2, 3], count=[5, 6, 7])
    line, e = run_input_error(dense_pack, "--card", "24G", "--max-context", 256, "--expert-profile", p)
    assert (
        f"--expert-profile {p}: this qwen2 model has no routed experts, so there is no expert cache for its 3 "
        "(layer, expert) pairs to fill"
    ) in line
    assert e["tensor"] == str(p) and e["required"] == "a model with routed experts"
    code, _ = run(dense_pack, "--card", "24G", "--max-context", 256)
    assert code == 0  # the same command without the profile plans


@pytest.fixture(scope="module")
def head40_pack(tmp_path_factory) -> Path:
    """gemma3 with key_length 40: a K/V head is not whole Q8_0 blocks of 32."""
    d = tmp_path_factory.mktemp("hd40")
    [src] = synth.write_model(d / "g.gguf", synth.gemma3_spec(dims={"head_dim": 40}))
    build_pack(src, d / "pack", progress=False)
    return d / "pack"


def test_kv_int8_on_heads_that_are_not_whole_q8_0_blocks(head40_pack):
    line, e = run_input_error(head40_pack, "--card", "24G", "--max-context", 256, "--kv", "int8")
    assert (
        "--kv int8: the K cache of layer 0 (blk.0.attn_k.weight) has a head dim (key_length) of 40 elements, "
        "not a multiple of the Q8_0 block of 32 (40 = 1 x 32 + 8); 2 attention layer(s) affected (0..1); "
        "use --kv f16 or --kv f32"
    ) in line
    assert e["tensor"] == "blk.0.attn_k.weight" and e["found"].startswith("K head of 40 elements")
    assert e["required"] == "a multiple of 32 elements (Q8_0 block) for --kv int8"
    assert run(head40_pack, "--card", "24G", "--max-context", 256)[0] == 0  # f16 plans
    # a plan that does not fit never suggests the int8 cache it cannot use
    code, d = run_json(head40_pack, "--card-mib", 900, "--max-context", 1 << 20)
    assert code == 1 and d["suggestions"] and all(s["option"] != "--kv" for s in d["suggestions"])


@pytest.mark.parametrize(
    "option, value",
    [
        ("--card-mib", "99999999999999999999999"),
        ("--card-mib", str((16 << 20) + 1)),
        ("--cuda-context-mib", "99999999999"),
        ("--vram-reserve-mib", "99999999999"),
    ],
)
def test_absurd_sizes_are_refused_with_the_number(pack, option, value):
    args = [option, value] if option == "--card-mib" else ["--card", "24G", option, value]
    line, e = run_input_error(pack, *args, "--max-context", 256)
    assert line.startswith(
        f"error: {option} {value}: {int(value):,} MiB is more than 16 TiB (16,777,216 MiB), larger than any GPU"
    )
    lo = 1 if option == "--card-mib" else 0
    assert e["tensor"] == option and e["found"] == f"{value} MiB" and e["required"] == f"{lo}..16777216 MiB (16 TiB)"
    if option == "--card-mib":
        code, d = run_json(pack, "--card-mib", 16 << 20, "--max-context", 256)  # 16 TiB itself is a size
        assert code == 0 and d["card_total_bytes"] == 16 << 40


def test_geometry_that_breaks_the_byte_formulas_is_a_named_semantic_error(small_moe_pack, tmp_path):
    # n_ff_exp 40: one expert's down slice [40, 256] cannot be Q8_0 blocks of 32 (was a ShapeError traceback)
    bad = tmp_path / "pack"
    shutil.copytree(small_moe_pack, bad)
    md = bad / "metadata.txt"
    key = "qwen3moe.expert_feed_forward_length int"
    md.write_text(md.read_text().replace(f"{key} 256", f"{key} 40"))
    r = CliRunner().invoke(main, ["check", str(bad), "--card", "24G", "--max-context", "256"])
    assert (
        r.exit_code == 2
        and (r.exception is None or isinstance(r.exception, SystemExit))
        and "Traceback" not in r.output
    )
    code, d = run_json(bad, "--card", "24G", "--max-context", 256)
    assert code == 2 and d["verdict"] == "semantic error" and tuple(d) == JSON_KEYS
    e = next(x for x in d["errors"] if x["tensor"] == "blk.0.ffn_down_exps.weight" and "slice" in x["message"])
    assert e["found"] == "one expert's down slice ne [40, 256] of Q8_0"
    assert e["required"] == "ne[0] a multiple of the Q8_0 block of 32"
    assert e["message"] == (
        "layer 0: one expert's down slice [40, 256] (from n_embd 256, n_ff_exp 40) is not whole "
        "Q8_0 blocks of 32: ne[0] = 40"
    )


def test_any_other_evaluation_error_is_one_line_exit_2(pack, monkeypatch):
    from strata.budget import cli
    from strata.packer import quants

    def boom(*a, **k):
        raise quants.ShapeError("blk.3.attn_k.weight: ne[0]=40 is not a multiple of the Q8_0 block size 32")

    monkeypatch.setattr(cli, "audit_pack", boom)
    line, e = run_input_error(pack, "--card", "24G")
    assert line == (
        f"error: {pack}: cannot audit the pack: blk.3.attn_k.weight: ne[0]=40 is not a multiple of the "
        "Q8_0 block size 32"
    )


# ----------------------------------------------------------------------------- --expert-cache and its cap


def test_expert_cache_above_the_pairs_is_refused_with_the_automatic_cap(small_moe_pack, tmp_path):
    code, auto = run_json(small_moe_pack, "--card", "24G", "--max-context", 256)
    assert code == 0 and auto["slots"] == auto["slots_cap"] == 24  # 3 layers x 8 experts, capped there
    blob = auto["max_blob"]
    code, out = run(small_moe_pack, "--card", "24G", "--max-context", 256, "--expert-cache", 100)
    line = " ".join(out.split())
    assert code == 1
    assert (
        f"--expert-cache 100 refused: 100 slots x {blob} B = {100 * blob} B ({100 * blob / MIB:.1f} MiB) asked, "
        f"at most 24 slots fit (capped at the model's 24 (layer, expert) pairs, as the automatic value is"
    ) in line
    code, d = run_json(small_moe_pack, "--card", "24G", "--max-context", 256, "--expert-cache", 100)
    assert code == 1 and d["verdict"] == "does not fit" and d["slots_fit"] == auto["slots"] == 24
    assert [(s["option"], s["value"], s["fits_alone"]) for s in d["suggestions"]] == [("--expert-cache", "24", True)]
    assert not any("more than" in w for w in d["warnings"])  # refused, not charged with a warning
    assert run(small_moe_pack, "--card", "24G", "--max-context", 256, "--expert-cache", 24)[0] == 0
    # a profile orders the fill and never makes the cache smaller than what fits: the same 24 slots as without
    # one (the 19 past its 5 pairs are filled by admission at decode time), the same cap for --expert-cache
    p = _profile(tmp_path / "p.parquet", layer=[0, 0, 1, 2, 2], expert=[0, 1, 2, 3, 4], count=[9, 8, 7, 6, 5])
    code, a = run_json(small_moe_pack, "--card", "24G", "--max-context", 256, "--expert-profile", p)
    assert code == 0 and a["slots"] == a["slots_cap"] == auto["slots"] == 24
    assert (
        run_json(small_moe_pack, "--card", "24G", "--max-context", 256, "--expert-profile", p, "--expert-cache", 6)[0]
        == 0
    )
    code, d = run_json(
        small_moe_pack, "--card", "24G", "--max-context", 256, "--expert-profile", p, "--expert-cache", 25
    )
    assert code == 1 and "--expert-cache 25 refused" in d["refused"]
    assert "at most 24 slots fit (capped at the model's 24 (layer, expert) pairs" in d["refused"]


def test_expert_cache_refusal_names_both_limits_when_both_apply(pack):
    # 8 x 64 = 512 pairs; a card whose memory holds fewer: "at most" is the memory figure (= automatic)
    args, most, blob = _tight_card(pack)
    code, auto = run_json(pack, *args)
    code, d = run_json(pack, *args, "--expert-cache", 600)
    assert code == 1 and d["slots_fit"] == auto["slots"] == most < 512
    assert f"at most {most} slots fit (capped at the model's 512 (layer, expert) pairs" in d["refused"]
    reserve = args[args.index("--vram-reserve-mib") + 1]
    assert f"after the {reserve} MiB reserve holds {most})" in d["refused"]


# ----------------------------------------------------------------------------- suggestions: safest first

SAFETY_ORDER = [
    "--expert-cache",
    "--ctx",
    "--kv",
    "--batch",
    "--prefill",
    "--embeddings-on-host",
    "--kv-resident",
    "--vram-reserve-mib",
]


def test_suggestions_are_safest_first_and_the_verdict_picks_the_safest_that_fits(pack):
    # a context far beyond what fits: shrinking the context, the KV type, the resident KV or the
    # reserve each fits alone; the verdict's "e.g." is the context, never the reserve
    code, d = run_json(pack, "--engine", "cpp", "--card-mib", 1500, "--max-context", 1_500_000)
    assert code == 1
    opts = [s["option"] for s in d["suggestions"]]
    assert opts == sorted(opts, key=SAFETY_ORDER.index) and opts[-1] == "--vram-reserve-mib"
    s = {x["option"]: x for x in d["suggestions"]}
    assert s["--ctx"]["fits_alone"] and s["--vram-reserve-mib"]["fits_alone"]
    best = int(s["--ctx"]["value"])
    # the largest context that fits is above the trained 2048: the suggestion says so
    assert d["verdict_line"].endswith(
        f"e.g. --ctx {best} (the largest context that fits is {best} tokens, above the model's trained "
        f"context of 2048 tokens (it was not trained for more; --ctx 2048 fits too)); the smallest card preset the "
        f"same plan fits is {d['smallest_card']}"
    )
    assert d["smallest_card"] == "6G (NVIDIA GeForce RTX 2060, 5917 MiB)"
    assert run(pack, "--engine", "cpp", "--card-mib", 1500, "--max-context", best)[0] == 0
    assert run(pack, "--engine", "cpp", "--card-mib", 1500, "--max-context", best + 1)[0] == 1


def test_reserve_is_never_suggested_below_the_low_line_and_every_knob_is_listed_alike(pack):
    # 700 MiB: even a 256 MiB reserve does not fit; the reserve is listed at 256, not below, and
    # no single change fits, which the verdict says instead of suggesting a risky reserve
    code, d = run_json(pack, "--engine", "cpp", "--card-mib", 700, "--max-context", 2048, "--batch", 8)
    assert code == 1
    s = {x["option"]: x for x in d["suggestions"]}
    assert (s["--vram-reserve-mib"]["value"], s["--vram-reserve-mib"]["fits_alone"]) == ("256", False)
    assert "never suggested" in s["--vram-reserve-mib"]["text"] and "256 MiB" in s["--vram-reserve-mib"]["text"]
    assert all(int(x["value"]) >= 256 for x in d["suggestions"] if x["option"] == "--vram-reserve-mib")
    assert "--vram-reserve-mib" not in d["verdict_line"]
    assert d["verdict_line"].endswith(
        "no single change fits on its own: combine the suggestions; the smallest card preset the same plan fits "
        "is 6G (NVIDIA GeForce RTX 2060, 5917 MiB)"
    )
    assert d["smallest_card"] == "6G (NVIDIA GeForce RTX 2060, 5917 MiB)"
    # consistency: a knob that saves memory is listed even when it cannot fit alone, at its limit
    # (the prefill was omitted in that case while the context was listed)
    assert [x["option"] for x in d["suggestions"]] == SAFETY_ORDER[1:]
    assert {k: (s[k]["value"], s[k]["fits_alone"]) for k in ("--ctx", "--batch", "--prefill", "--kv-resident")} == {
        "--ctx": ("1", False),
        "--batch": ("1", False),
        "--prefill": ("0", False),
        "--kv-resident": ("1", False),
    }
    assert all(x["saves_bytes"] > 0 for x in d["suggestions"])
    # 800 MiB: the reserve alone fits at 261 MiB (>= 256): offered, last
    code, d = run_json(pack, "--engine", "cpp", "--card-mib", 800, "--max-context", 2048, "--batch", 8)
    r = d["suggestions"][-1]
    assert (r["option"], r["value"], r["fits_alone"]) == ("--vram-reserve-mib", "261", True)
    assert "last resort" in r["text"]


# ----------------------------------------------------------------------------- table output


@pytest.fixture(scope="module")
def unsupported_pack(tmp_path_factory) -> Path:
    """qwen2 with every matrix IQ3_S, a type strata's engine has no kernel for: one warning per tensor."""
    d = tmp_path_factory.mktemp("iq3")
    [src] = synth.write_model(d / "q.gguf", synth.qwen2_spec(dense_type="IQ3_S", tensor_types={}, n_layers=4))
    build_pack(src, d / "pack", progress=False)
    return d / "pack"


def test_identical_audit_warnings_are_one_table_line_and_all_in_json(unsupported_pack):
    code, d = run_json(unsupported_pack, "--card", "24G", "--max-context", 256)
    assert code == 0
    ws = d["audit_warnings"]
    n = len(ws)
    assert n == 2 + 4 * 7  # token_embd, output + per layer q, k, v, output, gate, up, down
    names = [w["tensor"] for w in ws]
    assert len(set(names)) == n and all(w["found"] == "IQ3_S" for w in ws)
    code, out = run(unsupported_pack, "--card", "24G", "--max-context", 256)
    text = " ".join(out.split())
    assert out.count("audit warning:") == 1
    assert (
        f"audit warning: {n} tensors: type IQ3_S has no strata engine kernel yet (the budget holds; strata's engine "
        f"refuses the type at load): {', '.join(names[:3])} and {n - 3} more (all in --json)"
    ) in text


def test_table_details_need_no_file_outside_the_repository(pack):
    # the C++ engine's prefill model, a low reserve (warning) and a plan that does not fit (suggestions)
    code, out = run(
        pack,
        "--engine",
        "cpp",
        "--card-mib",
        700,
        "--max-context",
        2048,
        "--prefill-model",
        "cpp",
        "--vram-reserve-mib",
        300,
    )
    assert code == 1
    text = " ".join(out.split())
    assert "prompt buffers of the reference C++ engine (measured): 160 MiB + 256 tokens x 680 KiB" in text
    code, out2 = run(pack, "--card-mib", 4000, "--max-context", 2048, "--vram-reserve-mib", 100)
    assert code == 0 and "under 256 MiB, where a serving engine's memory check reports LOW" in " ".join(out2.split())
    help_text = CliRunner().invoke(main, ["check", "--help"]).output
    for t in (out, out2, help_text):
        for ref in ("DESIGN", "generate.cpp", ".md", "2941"):
            assert ref not in t, (ref, t)


def test_kv_resident_above_the_context_is_refused(pack):
    """--kv-resident N caps the KV positions kept in VRAM: above the context it would be capped silently while the
    plan's line said N, so it is refused with both numbers (exit 2)."""
    cpp = ["check", str(pack), "--card", "24G", "--ctx", "2048", "--engine", "cpp"]
    r = CliRunner().invoke(main, [*cpp, "--kv-resident", "100000"])
    assert r.exit_code == 2 and "--kv-resident 100000: more positions than the context (2048); at most 2048" in r.stderr
    assert CliRunner().invoke(main, [*cpp, "--kv-resident", "2048"]).exit_code == 0


def test_options_strata_s_engine_does_not_have_are_refused_by_name(pack):
    """Issue 21 item 9: --kv-resident (streaming old KV from the host) and --batch N > 1 are the reference C++
    engine's; for --engine strata (the default) they are refused by name (exit 2), and no suggestion offers
    --kv-resident to strata's engine."""
    for args, msg in (
        (
            ["--kv-resident", "512"],
            "--kv-resident 512: strata's engine keeps every KV position in VRAM (it streams none from the host) (plan",
        ),
        (["--batch", "4"], "--batch 4: strata's engine decodes one sequence (plan"),
    ):
        r = CliRunner().invoke(main, ["check", str(pack), "--card", "24G", "--ctx", "2048", *args])
        assert r.exit_code == 2 and f"error: {msg} the reference C++ engine with --engine cpp" in r.stderr
    code, d = run_json(pack, "--card-mib", 700, "--ctx", "8192")
    assert code == 1 and d["suggestions"] and "--kv-resident" not in {s["option"] for s in d["suggestions"]}


#: A 4 MiB card with no context, runtime or chunk buffers and a 1 MiB reserve: no expert gets a slot.
# a 5 MiB card and no expert slot asked: every pair in the host tier (at 4 MiB its 2 MiB mapping no longer fits beside
# the expert prefetch's staging slots, 4 x 156,672 B)
TINY_CARD = (
    "--card-mib", 5, "--cuda-context-mib", 0, "--cuda-runtime-mib", 0, "--vram-reserve-mib", 1, "-ub", 1,
    "--expert-cache", 0,
)  # fmt: skip


def test_host_tier_is_planned_for_strata_and_not_for_cpu_misses_or_the_cpp_engine(small_moe_pack):
    """A 5 MiB card and no expert slot asked (``--expert-cache 0``): strata's engine with misses over PCIe
    (``--miss-tier auto``, the default) plans the 24 pairs in a host tier of 24 x 156,672 B (pinned host memory, named
    in the verdict) and its device mapping (one 2 MiB unit) as a VRAM term; ``--miss-tier cpu`` and ``--engine cpp``
    plan neither."""
    args = (small_moe_pack, *TINY_CARD)
    args += ("--max-context", 64, "--no-bf16-scan")
    code, d = run_json(*args)
    terms = {t["name"]: t["bytes"] for t in d["terms"]}
    assert code == 0 and d["slots"] == 0 and d["host_tier_bytes"] == 24 * 156_672 == 3_760_128
    assert terms["host tier mapping"] == 2 << 20
    assert "0 expert slots (0.0 MiB), every expert in a 3.6 MiB host tier (pinned host memory)" in d["verdict_line"]
    for more in (("--miss-tier", "cpu"), ("--engine", "cpp")):
        code, d = run_json(*args, *more)
        assert d["host_tier_bytes"] == 0 and "host tier mapping" not in {t["name"] for t in d["terms"]}, more
        assert "host tier" not in d["verdict_line"]
    code, out = run(*args, "--miss-tier", "gpu")
    assert code == 2 and "'gpu' is not one of 'auto', 'pcie', 'cpu'" in out


@pytest.mark.parametrize("kind", ["split moe", "dense"])
def test_plan_from_the_gguf_header_equals_the_plan_of_its_pack(tmp_path, kind):
    """``strata-budget check FILE.gguf`` (issue 21 item 7): the same audit and plan as the pack that file builds -
    every VRAM term, the slots, the host tier - for a split MoE (from any shard) and a dense model, from the headers
    alone (no pool byte copied: nothing is written beside the source), and says so."""
    spec = synth.qwen3moe_spec().model_copy(update={"n_shards": 3}) if kind == "split moe" else synth.qwen2_spec()
    (tmp_path / "src").mkdir()
    files = synth.write_model(tmp_path / "src" / "m.gguf", spec)
    assert len(files) == (3 if kind == "split moe" else 1)
    build_pack(files[0], tmp_path / "pack", progress=False)
    args = ("--card", "16G", "--max-context", 256, "--no-bf16-scan", "--json")
    code_p, p = run(tmp_path / "pack", *args)
    before = sorted((tmp_path / "src").iterdir())
    for src in files if kind == "split moe" else files[:1]:
        code_g, g = run(src, *args)
        assert code_g == code_p == 0
        p_, g_ = json.loads(p), json.loads(g)
        assert g_["terms"] == p_["terms"] and g_["slots"] == p_["slots"] and g_["used_bytes"] == p_["used_bytes"]
        assert g_["host_tier_bytes"] == p_["host_tier_bytes"] and g_["verdict_line"] == p_["verdict_line"]
        assert g_["audit"]["planned_from"] == "gguf header" and g_["audit"]["pack"] == str(src)
        assert p_["audit"]["planned_from"] == "pack"
    assert sorted((tmp_path / "src").iterdir()) == before  # nothing written beside the source
    code, out = run(files[0], "--card", "16G", "--max-context", 256)
    assert code == 0 and f"planned from the GGUF header of {files[0]}" in " ".join(out.split())


def test_plan_from_a_file_that_is_not_a_gguf_is_refused(tmp_path, monkeypatch):
    """A file that is not a GGUF: exit 2, one line naming it and the reason; a plan from a GGUF (refused or not)
    leaves nothing in the temporary directory and nothing beside the file."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"GGUX" + bytes(60))
    code, out = run(bad, "--card", "16G")
    assert code == 2 and f"error: {bad}: cannot plan from this GGUF: bad magic b'GGUX'" in out
    code, out = run(tmp_path / "nothing.gguf", "--card", "16G")
    assert code == 2 and f"error: {tmp_path / 'nothing.gguf'}: no such file or directory" in out
    assert list(scratch.iterdir()) == []  # the refused plan's temporary directory is gone
    good = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec())[0]
    assert run(good, "--card", "16G", "--max-context", 256)[0] == 0
    assert list(scratch.iterdir()) == []  # and a finished plan's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "notes.gguf", "tmp"]  # nothing beside the files


def test_host_memory_terms_and_warnings(small_moe_pack):
    """Issue 21 item 8: host memory beside the VRAM terms - the dense pool and the routed experts (page cache) and the
    host tier (pinned) - in --json (``host_ram_bytes``, ``host_terms``) and the text; a machine with less RAM is
    named (host_ram_warnings with a small machine)."""
    from types import SimpleNamespace

    from strata.budget.cli import host_ram_warnings

    args = (small_moe_pack, *TINY_CARD)
    code, d = run_json(*args, "--max-context", 64, "--no-bf16-scan")
    terms = {t["name"]: t["bytes"] for t in d["host_terms"]}
    assert terms["host tier (pinned)"] == d["host_tier_bytes"] == 24 * 156_672
    # the preset's three layers: (Q4_K, Q8_0), (IQ2_XS, IQ4_NL), (Q6_K, Q5_0) at 256 x 256, 8 experts each
    blobs = [2 * 36_864 + 69_632, 2 * 18_944 + 36_864, 2 * 53_760 + 45_056]
    assert terms["routed experts (page cache)"] == 8 * sum(blobs)
    assert d["host_ram_bytes"] == sum(terms.values()) and terms["dense pool (page cache)"] > 0
    code, out = run(*args, "--max-context", 64, "--no-bf16-scan")
    assert "host memory: " in out and "host tier (pinned) 3.6 MiB" in " ".join(out.split())
    plan = SimpleNamespace(host_tier_bytes=d["host_tier_bytes"], host_ram_bytes=d["host_ram_bytes"])
    warn = host_ram_warnings(plan, 4 << 30)  # a 4 GiB machine: no room for pinned memory, page cache holds it
    assert len(warn) == 1 and warn[0].startswith("host tier: 0.00 GiB of pinned memory do not fit this machine's 4.00")
    assert len(host_ram_warnings(plan, 1 << 20)) == 2 and host_ram_warnings(plan, 64 << 30) == []


def test_gguf_header_plan_has_the_pack_s_model_identity(tmp_path):
    """An expert profile recorded on a pack is accepted when planning from the GGUF it was built from (a helper found
    it refused: the header plan's pool was all zeros, so its routers hashed to another model). The header pack holds
    the router weights and nothing else (a sparse pool)."""
    from strata.budget.profile import model_identity
    from strata.packer.build import header_pack
    from strata.packer.pack import read_pack

    (tmp_path / "src").mkdir()
    files = synth.write_model(tmp_path / "src" / "m.gguf", synth.qwen3moe_spec().model_copy(update={"n_shards": 2}))
    build_pack(files[0], tmp_path / "pack", progress=False)
    h = header_pack(files[1], tmp_path / "hdr")
    assert model_identity(read_pack(h)) == model_identity(read_pack(tmp_path / "pack"))
    pool = h / "pool.bin"
    assert pool.stat().st_size == (tmp_path / "pack" / "pool.bin").stat().st_size
    assert pool.stat().st_blocks * 512 < pool.stat().st_size  # holes: the dense weights were not copied


def test_a_refused_profile_exits_2_every_time(pack, tmp_path, monkeypatch):
    """A profile refused right after pyarrow read it (a duplicated pair) exits 2, not 134: with a threaded read the
    process died in std::terminate in 8 of 30 real runs (2026-12-02), pyarrow's pool threads still running at exit;
    every Parquet read is single-threaded now (packer.parquet_io). Checked both ways: the read is asked with
    use_threads=False, and 8 real processes all exit 2 with the refusal (with the threaded read this part failed in 2
    of 3 runs of the test)."""
    import pyarrow.parquet as real_pq

    from strata.packer import parquet_io

    bad = _profile(tmp_path / "dup.parquet", layer=[0, 0], expert=[3, 3], count=[5, 6])
    seen = []
    monkeypatch.setattr(real_pq, "read_table", lambda f, **kw: seen.append(kw) or real_pq.ParquetFile(f).read())
    with open(bad, "rb") as f:
        assert parquet_io.read_parquet_table(f).num_rows == 2 and seen == [{"use_threads": False}]
    monkeypatch.undo()
    argv = [sys.executable, "-m", "strata.budget.cli", "check", str(pack), "--card", "24G"]
    argv += ["--expert-profile", str(bad)]
    for _ in range(8):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "appears twice" in r.stderr + r.stdout, (r.returncode, r.stderr[-500:])
