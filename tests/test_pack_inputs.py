"""What ``strata-pack build`` refuses before anything is copied, and how a failed write is reported:
a foreign shard named with the tensor and both shapes, a big-endian GGUF named as one,
a disk without room for pool.bin (bytes needed vs free), a full disk mid-copy and a target directory
that cannot be written, each naming the pack path the user gave (never the hidden temporary
directory) and leaving nothing behind.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf.constants import GGUFValueType

from strata import testing as synth
from strata.packer import build as B
from strata.packer.build import build_pack
from strata.packer.cli import main as pack_main
from strata.packer.findings import fmt_ne
from strata.packer.gguf_file import GGUFError, read_header
from strata.packer.outputs import OutputError
from strata.packer.pack_plan import BuildError


def _left(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_foreign_shard_refused_naming_shard_tensor_and_both_shapes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = synth.write_model(tmp_path / "a" / "m.gguf", synth.qwen2_spec(n_shards=2))  # n_embd 256, n_ff 512
    b = synth.write_model(tmp_path / "b" / "m.gguf", synth.qwen2_spec(n_shards=2, dims={"n_ff": 1024}))
    shutil.copyfile(b[1], a[1])  # the second shard of another model: same names, same split.* keys, other shapes
    required = {"ffn_gate": (256, 512), "ffn_up": (256, 512), "ffn_down": (512, 256)}
    first = next(t for t in read_header(a[1]).tensors if t.name.split(".")[2] in required)
    assert fmt_ne(first.ne) != fmt_ne(required[first.name.split(".")[2]])
    msg = (
        f"{a[1]}: tensor {first.name} has shape {fmt_ne(first.ne)}, but the geometry of the first shard {a[0].name} "
        f"(qwen2) requires {fmt_ne(required[first.name.split('.')[2]])} (ggml ne): a shard of another model "
        f"(foreign shard); refusing to pack it"
    )
    with pytest.raises(BuildError) as e:
        build_pack(a[0], tmp_path / "p", progress=False)
    assert str(e.value) == msg
    assert _left(tmp_path) == ["a", "b"]
    r = CliRunner().invoke(pack_main, ["build", str(a[0]), "-o", str(tmp_path / "p")])
    assert r.exit_code == 2 and r.stderr == f"error: {msg}\n"


def test_big_endian_gguf_named_as_such(tmp_path):
    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(p, "qwen2", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("qwen2.block_count", 1)
    w.add_tensor("x.weight", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    msg = (
        f"{p}: this GGUF file is big-endian (its version 50331648 read byte-swapped is 3); strata reads "
        f"little-endian GGUF only (gguf-py's gguf-convert-endian converts it)"
    )
    with pytest.raises(GGUFError) as e:
        read_header(p)
    assert str(e.value) == msg
    r = CliRunner().invoke(pack_main, ["build", str(p), "-o", str(tmp_path / "pk")])
    assert r.exit_code == 2 and r.stderr == f"error: {msg}\n"
    r = CliRunner().invoke(pack_main, ["inspect", str(p)])
    assert r.exit_code == 2 and "big-endian" in r.stderr


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return synth.write_model(tmp_path_factory.mktemp("dense") / "m.gguf", synth.qwen2_spec())[0]


def _pool_bytes(src) -> int:
    return B.layout_pool(B.open_model(src), B.DEFAULT_ALIGN).pool_bytes


def test_not_enough_free_space_refused_before_copying(dense, tmp_path, monkeypatch):
    import strata.packer.outputs as O

    monkeypatch.setattr(O, "free_bytes", lambda d: 1000)
    copied = []
    monkeypatch.setattr(B, "write_pool", lambda *a, **k: copied.append(1))
    out = tmp_path / "p"
    pool = _pool_bytes(dense)
    need = pool + (16 << 20)  # pool.bin + the tables' allowance (build.TABLES_ALLOWANCE_BYTES)
    assert B.TABLES_ALLOWANCE_BYTES == 16 << 20
    r = CliRunner().invoke(pack_main, ["build", str(dense), "-o", str(out)])
    assert r.exit_code == 2 and not copied
    assert r.stderr == (
        f"error: {out}: not enough free space: the pack (pool.bin {pool:,} bytes + up to 16 MiB of "
        f"tables) needs {need:,} bytes "
        f"({need / 2**20:,.1f} MiB), 1,000 bytes (0.0 MiB) free on the filesystem of {tmp_path}; "
        f"nothing was written\n"
    )
    assert _left(tmp_path) == []


def test_full_disk_mid_copy_names_the_pack_and_the_bytes(dense, tmp_path, monkeypatch):
    import strata.packer.outputs as O

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(B, "_copy_range", full)
    monkeypatch.setattr(O, "free_bytes", lambda d: 4096 if d != "/" else 0)
    monkeypatch.setattr(B, "check_free_space", lambda *a, **k: None)  # the disk filled up after the check
    out = tmp_path / "p"
    need = _pool_bytes(dense) + B.TABLES_ALLOWANCE_BYTES
    with pytest.raises(OutputError) as e:
        build_pack(dense, out, progress=False)
    assert str(e.value) == (
        f"{out}: no space left on the device: the output needs {need:,} bytes ({need / 2**20:,.1f} MiB), "
        f"4,096 bytes (0.0 MiB) free now on the filesystem of {tmp_path}; nothing was written"
    )
    assert _left(tmp_path) == []  # the temporary directory is gone


def test_unwritable_target_names_the_pack_not_the_temporary_directory(dense, tmp_path, monkeypatch):
    def denied(prefix, dir):
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / f"{prefix}abc123"))

    monkeypatch.setattr(B.tempfile, "mkdtemp", denied)
    out = tmp_path / "p"
    r = CliRunner().invoke(pack_main, ["build", str(dense), "-o", str(out)])
    assert r.exit_code == 2
    assert (
        r.stderr
        == f"error: {out}: cannot write here: {tmp_path} is not writable (Permission denied); nothing was written\n"
    )
    assert ".tmp-" not in r.stderr


def test_inspect_piped_output_is_never_cut(tmp_path):
    """A pipe gets every name and shape whole (the old table cut them to 80 columns)."""
    import subprocess
    import sys

    spec = synth.qwen3moe_spec()
    src = synth.write_model(tmp_path / "moe.gguf", spec)[0]
    r = subprocess.run(
        [sys.executable, "-m", "strata.packer.cli", "inspect", str(src)],
        capture_output=True,
        text=True,
        env={"COLUMNS": "40", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("blk.2.ffn_down_exps.weight ")]
    assert len(lines) == 1 and "[256, 256, 8]" in lines[0] and len(lines[0]) > 40


def test_fetch_write_failures_name_the_model_file(tmp_path, monkeypatch):
    import strata.packer.fetch as fetch
    import strata.packer.outputs as O

    spec = fetch.load_specs()["gemma3-270m"]
    target = tmp_path / spec.file
    monkeypatch.setattr(O, "free_bytes", lambda d: 10 << 20)
    r = CliRunner().invoke(pack_main, ["fetch", "gemma3-270m", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr == (
        f"error: {target}: not enough free space: the model gemma3-270m ({spec.file}) needs {spec.size:,} bytes "
        f"({spec.size / 2**20:,.1f} MiB), 10,485,760 bytes (10.0 MiB) free on the filesystem of {tmp_path}; "
        "nothing was written\n"
    )
    monkeypatch.setattr(O, "free_bytes", lambda d: 1 << 40)

    def denied(prefix, suffix, dir):
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / f"{prefix}x{suffix}"))

    monkeypatch.setattr(fetch.tempfile, "mkstemp", denied)
    r = CliRunner().invoke(pack_main, ["fetch", "gemma3-270m", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2
    assert (
        r.stderr
        == f"error: {target}: cannot write here: {tmp_path} is not writable (Permission denied); nothing was written\n"
    )
    assert _left(tmp_path) == []


def test_outputs_never_overwrite_inputs_packs_or_ggufs(dense, tmp_path):
    """inspect --parquet: an existing file needs --force; the input itself, a pack's file and any GGUF are
    refused even with --force (exit 2, the file named, its bytes unchanged)."""
    pack = tmp_path / "p"
    build_pack(dense, pack, progress=False)
    before = {p: p.read_bytes() for p in (dense, pack / "pool.bin")}
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"\0" * 60)
    cases = [
        ([str(dense), "--parquet", str(dense), "--force"], "is this command's input"),
        ([str(pack), "--parquet", str(pack / "pool.bin"), "--force"], f"is inside the pack {pack}"),
        ([str(dense), "--parquet", str(other), "--force"], "is a GGUF file"),
        ([str(dense), "--parquet", str(tmp_path)], "is a directory"),
    ]
    for args, msg in cases:
        r = CliRunner().invoke(pack_main, ["inspect", *args])
        assert r.exit_code == 2 and msg in r.stderr, (args, r.stderr)
    assert all(p.read_bytes() == b for p, b in before.items()) and other.stat().st_size == 64
    out = tmp_path / "t.parquet"
    assert CliRunner().invoke(pack_main, ["inspect", str(dense), "--parquet", str(out)]).exit_code == 0
    r = CliRunner().invoke(pack_main, ["inspect", str(dense), "--parquet", str(out)])
    assert r.exit_code == 2 and f"{out} already exists; pass --force to replace it" in r.stderr
    assert CliRunner().invoke(pack_main, ["inspect", str(dense), "--parquet", str(out), "--force"]).exit_code == 0


def test_outputs_refuse_fifos_and_new_files_inside_a_pack(dense, tmp_path):
    """A FIFO as the output is refused (opening it to look would block forever), and a new file inside a pack
    directory is refused too: a pack holds only its own files (build --force replaces it whole)."""
    import os

    pack = tmp_path / "p"
    build_pack(dense, pack, progress=False)
    fifo = tmp_path / "f.parquet"
    os.mkfifo(fifo)
    r = CliRunner().invoke(pack_main, ["inspect", str(dense), "--parquet", str(fifo), "--force"])
    assert r.exit_code == 2 and "exists and is not a regular file" in r.stderr
    r = CliRunner().invoke(pack_main, ["inspect", str(dense), "--parquet", str(pack / "new.parquet")])
    assert r.exit_code == 2 and f"is inside the pack {pack}; a pack directory holds only the pack's files" in r.stderr
    assert not (pack / "new.parquet").exists()


def test_build_force_refuses_a_pack_directory_holding_other_files(dense, tmp_path):
    """--force replaces a pack directory whole: one that also holds a user's file (here a GGUF another pack
    was built from) is refused naming the file, and nothing is touched."""
    pack = tmp_path / "p"
    build_pack(dense, pack, progress=False)
    (pack / "inside.gguf").write_bytes(b"GGUF" + bytes(60))
    r = CliRunner().invoke(pack_main, ["build", str(dense), "-o", str(pack), "--force"])
    assert r.exit_code == 2 and "holds files that are not the pack's (inside.gguf)" in r.stderr
    assert (pack / "inside.gguf").stat().st_size == 64


def test_verify_source_dir_that_does_not_exist_is_refused(dense, tmp_path):
    pack = tmp_path / "p"
    build_pack(dense, pack, progress=False)
    r = CliRunner().invoke(pack_main, ["verify", str(pack), "--source-dir", str(tmp_path / "nodir")])
    assert (
        r.exit_code == 2 and f"--source-dir {tmp_path / 'nodir'}: no such directory; nothing was compared" in r.stderr
    )


def test_a_pack_is_not_built_inside_another_pack(dense, tmp_path):
    """-o PACK/inner would leave a foreign directory in PACK (which --force then refuses to replace): refused before
    anything is written, naming the pack."""
    pack = tmp_path / "p"
    build_pack(dense, pack, progress=False)
    before = sorted(x.name for x in pack.iterdir())
    r = CliRunner().invoke(pack_main, ["build", str(dense), "-o", str(pack / "inner")])
    assert r.exit_code == 2 and f"is inside the pack {pack}" in r.stderr
    assert sorted(x.name for x in pack.iterdir()) == before


def test_verify_source_dir_is_the_only_place_looked_at(dense, tmp_path):
    """--source-dir names where the sources are now: a directory without them is refused naming the path there,
    even when the build-time directory still holds them (a copy elsewhere must be what gets compared)."""
    pack = tmp_path / "p"
    build_pack(dense, pack, progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(pack_main, ["verify", str(pack), "--source-dir", str(empty)])
    assert r.exit_code != 0 and f"not found at {empty / Path(dense).name}" in r.stderr
    r = CliRunner().invoke(pack_main, ["verify", str(pack), "--source-dir", str(Path(dense).parent)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "key, typed, shown",
    [
        ("block_count", (GGUFValueType.INT32, 2), "i32"),
        ("block_count", (GGUFValueType.UINT64, 2), "u64"),
        ("attention.layer_norm_rms_epsilon", (GGUFValueType.FLOAT64, 1e-6), "f64"),
    ],
)
def test_hyperparameter_of_another_gguf_type_is_refused_as_llama_cpp_does(tmp_path, key, typed, shown):
    """Issue 21 item 12: llama.cpp reads an architecture's hyperparameters with their exact GGUF type and refuses a
    file where one has another ('key ... has wrong type i32 but expected type u32'); strata packed such a file.
    Now build (and a plan from the GGUF) refuse it by name, exit 2, nothing written."""
    from click.testing import CliRunner

    from strata.budget.cli import main as budget_main
    from strata.packer.cli import main as pack_main

    spec = synth.qwen2_spec().model_copy(update={"extra_kv": {key: typed}})
    src = synth.write_model(tmp_path / "m.gguf", spec)[0]
    want = "u32" if key == "block_count" else "f32"
    r = CliRunner().invoke(pack_main, ["build", str(src), "-o", str(tmp_path / "p")])
    assert r.exit_code == 2 and not (tmp_path / "p").exists()
    assert f"qwen2.{key} = " in r.stderr and f"is a GGUF {shown}; llama.cpp reads it as {want} and refuses" in r.stderr
    r = CliRunner().invoke(budget_main, ["check", str(src), "--card", "16G"])
    assert r.exit_code == 2 and f"has wrong type {shown} but expected type {want}" in r.stderr
    ok = synth.write_model(tmp_path / "ok.gguf", synth.qwen2_spec())[0]  # the same model, u32 / f32: packs
    assert CliRunner().invoke(pack_main, ["build", str(ok), "-o", str(tmp_path / "q")]).exit_code == 0


def test_a_merge_that_is_not_tokens_is_refused_at_build(tmp_path, monkeypatch):
    """Issue 21 item 12: a GGUF whose merges do not match its tokens packed, verified and failed only at generate;
    the build now applies the engine's rule (packer.tokenizer_rules.merge_refusal, one definition) and refuses it,
    exit 2, naming the merge, the missing token and the file; nothing is written."""
    from strata.packer.cli import main as pack_main
    from strata.testing.tokenizer import synth_tokenizer, tokenizer_kv

    tok = synth_tokenizer(512)
    kv = tokenizer_kv(tok, add_bos=False)
    merges = list(tok.merges)
    k = 3
    a, b = merges[k].split(" ", 1)
    merges[k] = f"{a} {b}\u00a7"  # the second piece and the merged piece are not tokens
    kv = [(key, t, merges if key == "tokenizer.ggml.merges" else v, sub) for key, t, v, sub in kv]
    src = synth.write_model(tmp_path / "m.gguf", synth.qwen2_spec(), tokenizer=kv)[0]
    r = CliRunner().invoke(pack_main, ["build", str(src), "-o", str(tmp_path / "p")])
    assert r.exit_code == 2 and not (tmp_path / "p").exists()
    assert f"{src}: tokenizer.ggml.merges: merge {k} ({a!r} + {b + chr(0xA7)!r}) needs the token" in r.stderr
    assert "which is not in the vocabulary (512 tokens)" in r.stderr
    good = synth.write_model(tmp_path / "g.gguf", synth.qwen2_spec(), tokenizer=tokenizer_kv(tok, add_bos=False))[0]
    assert CliRunner().invoke(pack_main, ["build", str(good), "-o", str(tmp_path / "q")]).exit_code == 0
    # a pack built before the rule from such a GGUF (the check skipped): verify refuses it, naming the merge
    monkeypatch.setattr(B, "check_tokenizer", lambda model: None)
    B.build_pack(src, tmp_path / "old", progress=False)
    monkeypatch.undo()
    r = CliRunner().invoke(pack_main, ["verify", str(tmp_path / "old")])
    assert r.exit_code == 1 and f"merge {k} ({a!r} + {b + chr(0xA7)!r}) needs the token" in r.output
    assert "the engine refuses this tokenizer at load" in r.output


def _patch_byte(src: Path, dst: Path, marker: bytes, at: int) -> None:
    """A copy of ``src`` with the byte ``at`` after ``marker`` set to 0xE9 (Latin-1 'é': not UTF-8 on its own)."""
    d = bytearray(src.read_bytes())
    d[d.index(marker) + at] = 0xE9
    dst.write_bytes(bytes(d))


def test_metadata_that_is_not_utf8_loads_as_in_llama_cpp(tmp_path):
    """Issue 21 item 12: llama.cpp loads a GGUF whose general.name (or another key or string value) is not UTF-8; strata
    refused it. Now the value is kept (escaped in metadata.txt, shown as its bytes) and the key is left out of the
    pack (nothing reads it); build, verify, a plan and generate run. A tensor name that is not UTF-8 is still refused
    (llama.cpp cannot find such a tensor either)."""
    from strata.budget.cli import main as budget_main
    from strata.engine.cli import main as engine_main
    from strata.packer.cli import main as pack_main
    from strata.packer.pack import read_pack

    spec = synth.qwen2_spec().model_copy(update={"extra_kv": {"/general.name": "x", "/general.zzz": "v"}})
    ok = synth.write_model(tmp_path / "ok.gguf", spec)[0]
    bad = tmp_path / "bad.gguf"
    _patch_byte(ok, bad, b"general.name", len("general.name") + 4 + 8)  # the value's first byte
    _patch_byte(bad, bad, b"general.zzz", len("general.z"))  # a byte of the key
    r = CliRunner().invoke(pack_main, ["build", str(bad), "-o", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "p" / "metadata.txt").read_text()
    assert "general.name str \\udce9\n" in md and "general.z" not in md  # the key that is not UTF-8: left out
    assert read_pack(tmp_path / "p").metadata["general.name"] == "\udce9"
    assert CliRunner().invoke(pack_main, ["verify", str(tmp_path / "p")]).exit_code == 0
    for args in (["check", str(tmp_path / "p")], ["check", str(bad)]):
        assert CliRunner().invoke(budget_main, [*args, "--card", "16G", "--ctx", "64"]).exit_code == 0
    r = CliRunner().invoke(engine_main, ["generate", str(tmp_path / "p"), "-p", "hi", "-n", "2", "--ctx", "64"])
    assert r.exit_code == 0, r.output
    tensor = tmp_path / "tensor.gguf"
    _patch_byte(ok, tensor, b"token_embd.weight", 0)
    r = CliRunner().invoke(pack_main, ["build", str(tensor), "-o", str(tmp_path / "q")])
    assert r.exit_code == 2 and "is not valid UTF-8" in r.stderr
