"""The pack's build record is ``build.json`` ("manifest" names the architecture contracts);
packs built before the rename keep ``manifest.json``, which is still read (verify's source mtimes,
``build --force``'s is-this-a-pack check)."""

from __future__ import annotations

import json

import pytest

from strata import testing as synth
from strata.packer.build import build_pack
from strata.packer.pack_plan import BuildError
from strata.packer.verify import verify_pack


@pytest.fixture()
def pack(tmp_path):
    paths = synth.write_model(tmp_path / "m.gguf", synth.qwen2_spec())
    build_pack(paths[0], tmp_path / "pack", progress=False)
    return paths[0], tmp_path / "pack"


def test_build_writes_build_json(pack):
    src, p = pack
    rec = json.loads((p / "build.json").read_text())
    assert not (p / "manifest.json").exists()
    assert rec["arch"] == "qwen2" and rec["sources"][0]["file"] == src.name
    assert rec["sources"][0]["bytes"] == src.stat().st_size


def test_legacy_manifest_json_is_still_read(pack):
    src, p = pack
    (p / "build.json").rename(p / "manifest.json")
    res = verify_pack(p)
    assert res.dense_tensors > 0 and not any("unreadable" in w for w in res.warnings)
    src.touch()  # a newer mtime than recorded: verify says so, from the legacy record
    assert any("modified since the pack was built" in w for w in verify_pack(p).warnings)
    build_pack(src, p, force=True, progress=False)  # recognised as a pack: replaced
    assert (p / "build.json").is_file() and not (p / "manifest.json").exists()


def test_a_directory_without_a_build_record_is_not_replaced(pack, tmp_path):
    src, p = pack
    (p / "build.json").unlink()
    with pytest.raises(BuildError, match="is not a strata pack .*build.json"):
        build_pack(src, p, force=True, progress=False)


@pytest.mark.parametrize(
    "damage,message",
    [
        ("missing", r"build\.json: missing \(strata-pack build writes it\); the pack is incomplete"),
        ("empty", r"build\.json: unreadable \(JSONDecodeError: .*\); the pack is corrupt"),
        ("truncated", r"build\.json: unreadable \(JSONDecodeError: .*\); the pack is corrupt"),
        ("pool_bytes", r"build\.json: pool_bytes is \d+, the pack's files say \d+; the pack is corrupt"),
        ("source bytes", r"build\.json: sources \[\('m\.gguf', \d+\)\], index\.txt says \[\('m\.gguf', \d+\)\]"),
    ],
)
def test_verify_refuses_a_damaged_build_record(pack, damage, message):
    """The build record is a pack file: verify names it when it is missing, unreadable, or disagrees with
    index.txt (both values), instead of a warning and "ok"; the exit code is the corrupt pack's (1)."""
    from click.testing import CliRunner

    from strata.packer.cli import main as pack_main
    from strata.packer.verify import VerifyError

    _, p = pack
    f = p / "build.json"
    text = f.read_text()
    if damage == "missing":
        f.unlink()
    elif damage == "empty":
        f.write_text("")
    elif damage == "truncated":
        f.write_text(text[: len(text) // 2])
    elif damage == "pool_bytes":
        rec = json.loads(text)
        rec["pool_bytes"] += 32
        f.write_text(json.dumps(rec))
    else:
        rec = json.loads(text)
        rec["sources"][0]["bytes"] -= 1
        f.write_text(json.dumps(rec))
    with pytest.raises(VerifyError, match=message):
        verify_pack(p)
    r = CliRunner().invoke(pack_main, ["verify", str(p)])
    assert r.exit_code == 1, r.output


def test_verify_refuses_an_expert_shard_edited_in_place(tmp_path):
    """The routed experts stay in the source: the build record keeps, per MoE layer, a sha256 of the first and
    last 256 B of every expert's weights, and verify re-reads them. One byte changed in place (same size) at the
    start of expert 5's down weights of layer 1 is refused naming the layer and both digests (exit 1), where
    size and mtime alone gave a warning and "ok"; a pack recorded before the samples existed says so."""
    from click.testing import CliRunner

    from strata.packer.cli import main
    from strata.packer.expert_samples import expert_sample_digests
    from strata.packer.pack import open_pack
    from strata.packer.verify import VerifyError

    src = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec())[0]
    p = tmp_path / "pack"
    build_pack(src, p, progress=False)
    rec = json.loads((p / "build.json").read_text())
    pk = open_pack(p)
    assert rec["expert_sample_sha256"] == expert_sample_digests([src], pk.experts)
    assert sorted(rec["expert_sample_sha256"]) == [str(L.layer) for L in pk.experts.layers]
    assert not verify_pack(p).warnings
    L = next(L for L in pk.experts.layers if L.layer == 1)
    _part, _shard, off, _n = L.ranges(5)[2]
    size = src.stat().st_size
    with open(src, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    assert src.stat().st_size == size
    with pytest.raises(
        VerifyError,
        match=r"experts of layer 1 \(m\.gguf\): the first and last 256 B of each "
        r"expert's weights hash to [0-9a-f]{16}\.\.\., the build recorded "
        r"[0-9a-f]{16}\.\.\.: the source was modified after the pack was built",
    ):
        verify_pack(p)
    r = CliRunner().invoke(main, ["verify", str(p)])
    assert r.exit_code == 1 and "experts of layer 1" in r.output
    del rec["expert_sample_sha256"]  # an older pack's record: verify says what it could not check
    (p / "build.json").write_text(json.dumps(rec))
    assert any("no expert samples" in w for w in verify_pack(p).warnings)


@pytest.mark.parametrize("value", ["garbage", [1, 2, 3], 42, None, {}, "layers-missing", "layer-extra", "upper-hex"])
def test_a_damaged_expert_sample_record_is_a_corrupt_pack(tmp_path, value):
    """``expert_sample_sha256`` of the wrong type, with a layer missing or extra, or not 64 lower-case hex digits:
    the build record is corrupt (exit 1, the field and what it holds named) - not a traceback, and not blamed on
    the source, which is intact."""
    from strata.packer.verify import VerifyError

    src = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec())[0]
    p = tmp_path / "pack"
    build_pack(src, p, progress=False)
    rec = json.loads((p / "build.json").read_text())
    good = rec["expert_sample_sha256"]
    first = sorted(good, key=int)[0]
    if value == "layers-missing":
        value = {k: v for k, v in good.items() if k != first}
    elif value == "layer-extra":
        value = {**good, "7": good[first]}
    elif value == "upper-hex":
        value = {**good, first: good[first].upper()}
    rec["expert_sample_sha256"] = value
    (p / "build.json").write_text(json.dumps(rec))
    with pytest.raises(
        VerifyError,
        match=r"build\.json: expert_sample_sha256 must map each MoE layer \[.*\] to a "
        r"sha256 \(64 lower-case hex digits\), it holds .*; the pack is corrupt",
    ):
        verify_pack(p)


def test_generate_warns_when_an_expert_shard_changed_since_the_build(tmp_path):
    """The engine reads the routed experts from the source shards: a shard whose mtime differs from the build
    record's is named at start-up with the advice to verify (one stat per shard; verify is the check)."""
    import os

    from click.testing import CliRunner

    from strata.engine.cli import main

    src = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec())[0]
    p = tmp_path / "pack"
    build_pack(src, p, progress=False)
    r = CliRunner().invoke(main, ["generate", str(p), "-p", "hi", "-n", "2"])
    assert r.exit_code == 0 and "modified since the pack was built" not in r.stderr
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    r = CliRunner().invoke(main, ["generate", str(p), "-p", "hi", "-n", "2"])
    assert r.exit_code == 0
    assert (
        f"warning: {src}: modified since the pack was built (mtime differs); its experts' samples still match the "
        "build record" in " ".join(r.stderr.split())
    )


def test_a_retargeted_or_edited_source_is_refused_at_load(tmp_path):
    """Issue 21 item 3: a symlink pointed at another GGUF of the same size (the dense weights of one file, the experts
    of another) was used silently; load now re-reads the experts' samples when a source resolves elsewhere than the
    build record says or its mtime changed, and refuses a difference (exit 2, the shard and the layer named), while
    the same bytes elsewhere (sources moved) still load."""
    import os
    import shutil

    from click.testing import CliRunner

    from strata.engine.cli import main

    for d in ("a", "b", "hf"):
        (tmp_path / d).mkdir()
    a = synth.write_model(tmp_path / "a" / "m.gguf", synth.qwen3moe_spec())[0]
    b = synth.write_model(tmp_path / "b" / "m.gguf", synth.qwen3moe_spec(seed=7))[0]
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    link = tmp_path / "hf" / "m.gguf"
    link.symlink_to(a)
    p = tmp_path / "pack"
    build_pack(link, p, progress=False)
    assert CliRunner().invoke(main, ["generate", str(p), "-p", "hi", "-n", "2"]).exit_code == 0
    link.unlink()
    link.symlink_to(b)  # the same name, size and (copied) mtime, other bytes
    st = a.stat()
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = CliRunner().invoke(main, ["generate", str(p), "-p", "hi", "-n", "2"])
    assert r.exit_code == 2 and f"error: {link}: not the source the pack was built from: experts of layer" in r.stderr
    c = tmp_path / "c"  # the same bytes moved elsewhere: loads
    c.mkdir()
    shutil.copy2(a, c / "m.gguf")
    link.unlink()
    link.symlink_to(c / "m.gguf")
    r = CliRunner().invoke(main, ["generate", str(p), "-p", "hi", "-n", "2"])
    assert r.exit_code == 0, r.stderr


def test_a_pack_of_an_older_strata_gets_one_message_everywhere(pack):
    """Issue 21 item 6: a pack whose geometry.txt lacks a param the manifest now has (what an older strata wrote,
    reproduced with the build of commit b76d6a5~1: gemma3's rope_dim) - verify, budget check and generate all refuse
    it with exit 2 and the same "rebuild it" line, instead of verify calling it corrupt."""
    from click.testing import CliRunner

    from strata.budget.cli import main as budget_main
    from strata.engine.cli import main as engine_main
    from strata.packer.cli import main as pack_main

    pack = pack[1]
    geo = pack / "geometry.txt"
    lines = geo.read_text(encoding="utf-8").splitlines(keepends=True)
    geo.write_text("".join(x for x in lines if not x.startswith("rope_dim ")), encoding="utf-8")
    want = (
        "geometry.txt: param 'rope_dim' of qwen2 is missing (a pack built by an older strata? rebuild it from its "
        "GGUF: strata-pack build GGUF -o PACK --force)"
    )
    outs = {}
    for name, main, args in (
        ("verify", pack_main, ["verify", str(pack)]),
        ("budget", budget_main, ["check", str(pack), "--card", "24G", "--ctx", "64"]),
        ("generate", engine_main, ["generate", str(pack), "-p", "hi", "-n", "1"]),
    ):
        r = CliRunner().invoke(main, args)
        outs[name] = r.output
        flat = " ".join(r.output.split())  # budget's table wraps long lines
        assert r.exit_code == 2 and want in flat and "Traceback" not in r.output, (name, r.output)
