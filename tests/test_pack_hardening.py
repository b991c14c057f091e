"""Refusals found by a hostile review: --force safety, impossible geometry, strict readers,
verify against every pack file, CLI exit codes and JSON on failure, interruption cleanup."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from strata import testing as synth
from strata.manifests.contract import ManifestError
from strata.packer.build import _rename_noreplace, build_pack
from strata.packer.pack import open_pack
from strata.packer.pack_plan import BuildError
from strata.packer.packfmt import PackFormatError, read_index, read_metadata
from strata.packer.verify import VerifyError, verify_pack


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "strata.packer.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    paths = synth.write_model(d / "m.gguf", synth.qwen3moe_spec(n_shards=3, empty_first_shard=True))
    return paths


@pytest.fixture
def pack(moe, tmp_path):
    out = tmp_path / "pack"
    build_pack(moe[0], out, progress=False)
    return out


# ------------------------------------------------------------------ --force never destroys data


def test_force_refuses_the_source_directory(moe, tmp_path):
    src_dir = tmp_path / "models"
    shutil.copytree(moe[0].parent, src_dir)
    with pytest.raises(BuildError, match="the output directory holds the source"):
        build_pack(src_dir / moe[0].name, src_dir, force=True, progress=False)
    with pytest.raises(BuildError, match="the output directory holds the source"):
        build_pack(src_dir / moe[0].name, tmp_path, force=True, progress=False)  # a parent of the sources
    assert sorted(p.name for p in src_dir.iterdir()) == sorted(p.name for p in moe[0].parent.iterdir())
    r = cli("build", src_dir / moe[0].name, "-o", ".", "--force", cwd=src_dir)
    assert r.returncode == 2 and "holds the source" in r.stderr and "Traceback" not in r.stderr
    assert len(list(src_dir.iterdir())) == len(list(moe[0].parent.iterdir()))


def test_force_refuses_a_directory_that_is_not_a_pack(moe, tmp_path):
    u = tmp_path / "u"
    u.mkdir()
    (u / "thesis.txt").write_text("x")
    with pytest.raises(BuildError, match="is not a strata pack .* refusing to replace it even with --force"):
        build_pack(moe[0], u, force=True, progress=False)
    # without --force the hint does not send the user to --force (which would refuse too)
    with pytest.raises(BuildError) as e:
        build_pack(moe[0], u, progress=False)
    assert str(e.value) == (
        f"{u} exists and is not a strata pack (no index.txt and build.json); refusing to replace it (choose another "
        "path; --force replaces packs only)"
    )
    assert (u / "thesis.txt").read_text() == "x"
    f = tmp_path / "file"
    f.write_text("y")
    with pytest.raises(BuildError, match="exists and is not a directory"):
        build_pack(moe[0], f, force=True, progress=False)


def test_parent_must_exist_and_nothing_is_created(moe, tmp_path):
    with pytest.raises(BuildError, match="parent directory .*np1/np2 does not exist"):
        build_pack(moe[0], tmp_path / "np1" / "np2" / "p", progress=False)
    assert not (tmp_path / "np1").exists()
    (tmp_path / "afile").write_text("x")  # a parent (or an ancestor) that is a file is said to be one
    for out in (tmp_path / "afile" / "p", tmp_path / "afile" / "x" / "p"):
        with pytest.raises(BuildError, match=r"afile is a file, not a directory"):
            build_pack(moe[0], out, progress=False)
    with pytest.raises(
        BuildError,
        match=r"afile exists and is not a directory; refusing to replace it \(choose "
        r"another path\)",
    ):  # no "--force" hint: --force replaces packs only
        build_pack(moe[0], tmp_path / "afile", progress=False)
    assert (tmp_path / "afile").read_text() == "x"


def test_rename_noreplace_refuses_a_target_that_appeared(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with pytest.raises(BuildError, match="appeared while the pack was being built"):
        _rename_noreplace(a, b)
    assert a.exists() and b.exists()


@pytest.mark.parametrize("align", [1, 8, 3, 1 << 40])
def test_alignment_range(moe, tmp_path, align):
    with pytest.raises(BuildError, match=f"pack alignment {align} must be a power of two in \\[16, 1048576\\]"):
        build_pack(moe[0], tmp_path / "p", align=align, progress=False)


# ------------------------------------------------------------------ impossible geometry


def _gemma(tmp_path, **dims):
    return synth.write_model(tmp_path / "g.gguf", synth.gemma3_spec(dims=dims))[0]


@pytest.mark.parametrize(
    "dims,needle",
    [
        ({"context_length": 0}, "gemma3 metadata: gemma3.context_length (param n_ctx_train) is 0, must be >= 1"),
        ({"n_head": 0}, "gemma3 metadata: gemma3.attention.head_count (param n_head) is 0, must be >= 1"),
        (
            {"rms_eps": math.nan},
            "gemma3 metadata: gemma3.attention.layer_norm_rms_epsilon (param rms_eps) is nan, must be finite and > 0",
        ),
        (
            {"rope_freq_base": -1.0},
            "gemma3 metadata: gemma3.rope.freq_base (param rope_base) is -1.0, must be finite and > 0",
        ),
    ],
)
def test_impossible_geometry_refused_at_build(tmp_path, dims, needle):
    src = _gemma(tmp_path, **dims)
    with pytest.raises(ManifestError) as ei:
        build_pack(src, tmp_path / "p", progress=False)
    assert needle in str(ei.value)
    assert not (tmp_path / "p").exists()


def test_sliding_window_pattern_zero_means_every_layer_sliding(tmp_path):
    # llama.cpp src/llama-hparams.cpp set_swa_pattern: is_swa = n_pattern == 0 || il % n_pattern < n_pattern - 1
    src = _gemma(tmp_path, sliding_window_pattern=0)
    build_pack(src, tmp_path / "p", progress=False)
    from strata.manifests.contract import geometry_from_params

    g = geometry_from_params("gemma3", open_pack(tmp_path / "p").geometry_params)
    assert g.layer_kinds == ["swa", "swa"]


@pytest.mark.parametrize(
    "n,needle",
    [
        (4_000_000_000, "qwen2.block_count (param n_layer) is 4000000000, larger than any real model"),
        (1_000_000, "n_layer 1000000 is outside 1..4096"),
    ],
)
def test_huge_block_count_refused_before_iterating(tmp_path, n, needle):
    src = tmp_path / "h.gguf"
    kv = {
        "qwen2.block_count": n,
        "qwen2.context_length": 64,
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 2,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    synth.write_header_only(src, "qwen2", kv, [("blk.0.attn_norm.weight", "F32", (64,))], data="random")
    with pytest.raises(ManifestError, match=needle.replace("(", "\\(").replace(")", "\\)")):
        build_pack(src, tmp_path / "p", progress=False)


def test_block_count_must_match_the_layers_present(tmp_path):
    src = tmp_path / "h.gguf"
    kv = {
        "qwen2.block_count": 3,
        "qwen2.context_length": 64,
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 2,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    synth.write_header_only(
        src,
        "qwen2",
        kv,
        [("blk.0.attn_norm.weight", "F32", (64,)), ("blk.1.attn_norm.weight", "F32", (64,))],
        data="random",
    )
    with pytest.raises(BuildError, match="metadata block_count is 3 but the tensors hold layers 0..1 \\(2 distinct\\)"):
        build_pack(src, tmp_path / "p", progress=False)


# ------------------------------------------------------------------ strict readers


def _first_data(lines):
    return next(i for i, line in enumerate(lines) if line and not line.startswith("#"))


def _edit(path, old, new, count=1):
    t = path.read_bytes()
    assert old in t, old
    path.write_bytes(t.replace(old, new, count))


def test_crlf_and_missing_final_newline_refused(pack):
    idx = pack / "index.txt"
    good = idx.read_bytes()
    idx.write_bytes(good.replace(b"\n", b"\r\n"))
    with pytest.raises(PackFormatError, match=r"index.txt:1: carriage return"):
        read_index(idx)
    idx.write_bytes(good[:-1])
    with pytest.raises(PackFormatError, match="no newline at the end"):
        read_index(idx)


@pytest.mark.parametrize("bad", ["+140288", "140_288", "0640", "\u0661\u0662"])
def test_integers_exactly_as_written(pack, bad):
    idx = pack / "index.txt"
    lines = idx.read_text().split("\n")
    i = _first_data(lines)
    row = lines[i].split(" ")
    row[4] = bad  # nbytes column
    lines[i] = " ".join(row)
    idx.write_text("\n".join(lines))
    with pytest.raises(
        PackFormatError, match=rf"index.txt:{i + 1}: column nbytes: .* is not a non-negative decimal integer"
    ):
        read_index(idx)


def test_metadata_bool_must_be_true_or_false(pack):
    _edit(pack / "metadata.txt", b"tokenizer.ggml.add_bos_token bool false", b"tokenizer.ggml.add_bos_token bool yes")
    with pytest.raises(PackFormatError, match="bool value 'yes' is not true/false"):
        read_metadata(pack / "metadata.txt")


def test_unknown_geometry_key_refused(pack):
    with open(pack / "geometry.txt", "a") as f:
        f.write("n_mystery 3\n")
    from strata.manifests.contract import geometry_from_params

    with pytest.raises(ManifestError, match=r"keys \['n_mystery'\] are not params of qwen3moe's manifest"):
        geometry_from_params("qwen3moe", open_pack(pack).geometry_params)


# ------------------------------------------------------------------ verify checks every file


def test_verify_catches_swapped_shard_names(pack, moe):
    t = (pack / "native_experts.txt").read_text()
    a, b = moe[1].name, moe[2].name
    (pack / "native_experts.txt").write_text(t.replace(a, "@@").replace(b, a).replace("@@", b))
    with pytest.raises(VerifyError, match="native_experts.txt shards .* differ from the model's shards"):
        verify_pack(pack)


def test_verify_catches_index_type_and_align(pack):
    idx = pack / "index.txt"
    good = idx.read_text()
    lines = good.split("\n")
    i = _first_data(lines)
    row = lines[i].split(" ")
    row[1] = "0" if row[1] != "0" else "1"
    lines[i] = " ".join(row)
    idx.write_text("\n".join(lines))
    with pytest.raises(VerifyError, match=f"index.txt tensor {row[0]}: type: pack {row[1]} source"):
        verify_pack(pack)
    idx.write_text(good.replace("# align 64 ", "# align 4096 "))
    with pytest.raises(VerifyError, match="offset \\d+ is not a multiple of align 4096"):
        verify_pack(pack)


def test_verify_catches_geometry_and_metadata_edits(pack):
    _edit(pack / "geometry.txt", b"n_ctx_train 2048", b"n_ctx_train 4096")
    _edit(pack / "metadata.txt", b"qwen3moe.context_length int 2048", b"qwen3moe.context_length int 4096")
    with pytest.raises(VerifyError, match="geometry.txt differs from the source: n_ctx_train: pack 4096 source 2048"):
        verify_pack(pack)
    _edit(pack / "geometry.txt", b"n_ctx_train 4096", b"n_ctx_train 2048")
    with pytest.raises(VerifyError, match="metadata.txt key qwen3moe.context_length: pack 4096 source 2048"):
        verify_pack(pack)


def test_verify_a_geometry_value_its_manifest_refuses_is_a_corrupt_pack(pack):
    """One geometry.txt number edited to a value the manifest's rules refuse (n_head_kv 4 -> 3: n_head % n_head_kv)
    is a corrupt pack - exit 1, both numbers - like any other edited number, not exit 2 "not a pack" (the new user's
    finding: the exit code depended on which number was edited); a key the manifest lacks stays a refusal (exit 2)."""
    g = (pack / "geometry.txt").read_text()
    kv = re.search(r"^n_head_kv (\d+)$", g, re.M).group(1)
    (pack / "geometry.txt").write_text(g.replace(f"\nn_head_kv {kv}\n", "\nn_head_kv 3\n"))
    r = cli("verify", pack)
    assert r.returncode == 1 and f"geometry.txt differs from the source: n_head_kv: pack 3 source {kv}" in r.stderr
    (pack / "geometry.txt").write_text(g + "foo 1\n")
    r = cli("verify", pack)
    assert r.returncode == 2 and "keys ['foo'] are not params" in r.stderr


def test_verify_truncated_pool_is_a_mismatch(pack):
    with open(pack / "pool.bin", "r+b") as f:
        f.truncate(100)
    r = cli("verify", pack)
    assert r.returncode == 1 and "pool.bin has 100" in r.stderr


def test_moved_sources_found_with_source_dir(moe, tmp_path):
    src = tmp_path / "models"
    shutil.copytree(moe[0].parent, src)
    build_pack(src / moe[0].name, tmp_path / "p", progress=False)
    moved = tmp_path / "moved"
    os.rename(src, moved)
    r = cli("verify", tmp_path / "p", "--json")  # a moved source is bad input (2), not a mismatch (1)
    assert r.returncode == 2 and json.loads(r.stdout)["ok"] is False
    assert f"not found at {src / moe[0].name}" in r.stderr and "--source-dir" in r.stderr
    r = cli("verify", tmp_path / "p", "--source-dir", moved)
    assert r.returncode == 0, r.stderr
    assert open_pack(tmp_path / "p", source_dir=moved).shard_path(2) == moved / moe[2].name
    # the budget audit reads the shards' headers too: refused without, audited with --source-dir
    budget = [sys.executable, "-m", "strata.budget.cli", "check", str(tmp_path / "p"), "--card", "24G", "--json"]
    r = subprocess.run(budget, capture_output=True, text=True)
    assert (
        r.returncode == 2
        and f"cannot re-read expert shard 0 at {src / moe[0].name} (moved? pass --source-dir DIR)" in r.stdout
    )
    r = subprocess.run(budget + ["--source-dir", str(moved)], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["verdict"] == "fits", r.stdout[-800:] + r.stderr[-800:]
    r = subprocess.run(budget + ["--source-dir", str(tmp_path / "nodir")], capture_output=True, text=True)
    assert r.returncode == 2 and "--source-dir" in r.stdout and "no such directory" in r.stdout


# ------------------------------------------------------------------ CLI: exit codes, JSON, interruption


def test_cli_errors_are_one_line_exit_2_with_json(tmp_path):
    (tmp_path / "not.gguf").write_text("hello, not a model")
    r = cli("build", tmp_path / "not.gguf", "-o", tmp_path / "p", "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert json.loads(r.stdout) == {
        "ok": False,
        "error": f"{tmp_path / 'not.gguf'}: bad magic b'hell', expected b'GGUF' (not a GGUF file)",
    }
    (tmp_path / "f").write_text("x")
    r = cli("build", tmp_path / "not.gguf", "-o", tmp_path / "f" / "p")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = cli("inspect", tmp_path, "--parquet", tmp_path / "nope" / "x.parquet")
    assert r.returncode == 2 and "not a strata pack (no index.txt)" in r.stderr
    r = cli("fetch", "no-such-model", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["ok"] is False and "no-such-model" in r.stderr


def test_sigterm_mid_build_leaves_no_temp_dir(scratch):
    src = synth.write_big_dense(scratch / "big.gguf", 512 << 20)
    out = scratch / "out"
    out.mkdir()
    p = subprocess.Popen(
        [sys.executable, "-m", "strata.packer.cli", "build", str(src), "-o", str(out / "p")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not list(out.glob(".p.tmp-*/pool.bin")):
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    if p.returncode == 0:
        pytest.skip("the build finished before the signal arrived")
    assert (
        p.returncode == 143 and "error: interrupted by SIGTERM; nothing was written" in err and "Traceback" not in err
    )
    assert list(out.iterdir()) == []


def test_more_experts_per_token_than_experts_refused(pack, tmp_path):
    """A reviewer set n_expert_used 9 with 8 experts: the engine silently ran 8. The manifest's
    checks refuse it wherever a geometry is built (packer, budget, engine)."""
    from strata.manifests.contract import geometry_from_params

    _edit(pack / "geometry.txt", b"n_expert_used 2", b"n_expert_used 9")
    with pytest.raises(
        ManifestError,
        match=r"qwen3moe: geometry violates n_expert_used <= n_expert \(n_expert = 8, n_expert_used = 9\)",
    ):
        geometry_from_params("qwen3moe", open_pack(pack).geometry_params)
    r = subprocess.run(
        [sys.executable, "-m", "strata.budget.cli", "check", str(pack), "--card", "24G"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "n_expert_used <= n_expert" in (r.stdout + r.stderr)


def test_two_builds_into_one_output_do_not_both_write_it(moe, tmp_path):
    """Issue 21 item 5: a second build of an output another build is writing is refused at once, naming the lock and
    the pid (it used to warn that the first one's live temporary directory was "left from an interrupted build", and
    with --force both reported success); the first build's temporary directory is untouched. With no build running,
    a leftover temporary directory is reported as one and the build goes on; the lock file is gone afterwards."""
    import fcntl

    out = tmp_path / "p"
    live = tmp_path / ".p.tmp-live"
    live.mkdir()  # what a running build has beside its output
    lock = tmp_path / ".p.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX)  # the running build holds the lock
    try:
        heard: list[str] = []
        for force in (False, True):
            with pytest.raises(
                BuildError, match=r"another strata-pack build is writing it \(lock .*\.p\.lock held by pid 4242\)"
            ):
                build_pack(moe[0], out, force=force, progress=False, on_warning=heard.append)
        assert heard == [] and live.is_dir() and not out.exists()
    finally:
        os.close(fd)
    heard = []
    build_pack(moe[0], out, progress=False, on_warning=heard.append)
    assert heard == [f"{live} is left from an interrupted build; remove it"]
    assert (out / "index.txt").is_file() and not lock.exists()


def test_a_legal_250_byte_output_name_builds(moe, tmp_path):
    """Issue 21 item 4: a 250-byte output name (legal: NAME_MAX is 255) was refused because the temporary directory
    beside it, ``.NAME.tmp-XXXXXXXX``, is longer than 255 bytes. The build's sidecars (temporary directories, the
    lock, Parquet's partial file) cut the name short with a hash (packer.outputs.sidecar_name); a leftover of an
    interrupted build of that output is still found as one."""
    from click.testing import CliRunner

    from strata.packer.cli import main as pack_main
    from strata.packer.outputs import NAME_MAX_BYTES, sidecar_name

    out = tmp_path / ("p" * 250)
    for suffix in (".tmp-", ".old-", ".lock"):
        side = sidecar_name(out, suffix)
        assert len(side.encode()) + 8 <= NAME_MAX_BYTES and side.endswith(suffix) and side.startswith(".ppp")
    assert sidecar_name(tmp_path / "short", ".tmp-") == ".short.tmp-"  # the plain form whenever it fits
    left = tmp_path / (sidecar_name(out, ".tmp-") + "abcdefgh")
    left.mkdir()
    heard: list[str] = []
    build_pack(moe[0], out, progress=False, on_warning=heard.append)
    assert (out / "index.txt").is_file() and heard == [f"{left} is left from an interrupted build; remove it"]
    table = tmp_path / ("t" * 246 + ".pq")  # 250 bytes: inspect's Parquet goes through a partial file beside it
    r = CliRunner().invoke(pack_main, ["inspect", str(out), "--parquet", str(table)])
    assert r.exit_code == 0 and table.is_file(), r.output
