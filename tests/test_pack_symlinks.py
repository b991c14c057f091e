"""GGUFs reached through symlinks in another directory - the Hugging Face hub cache layout
(``snapshots/REV/NAME.gguf -> ../../blobs/HASH``), the commonest way people have GGUFs: the pack records the
directory the user named, so verify, the budget and the engine find every shard (issue: a pack recorded the
blob directory with the snapshot's file name and everything after build refused it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from strata import testing as synth
from strata.budget.cli import main as budget_main
from strata.engine.cli import main as engine_main
from strata.packer.cli import main as pack_main
from strata.packer.pack import open_pack


def _hub_layout(root: Path, spec) -> list[Path]:
    """Write ``spec`` as blobs named by a fake hash and link them from ``snapshots/REV`` under their GGUF names;
    returns the snapshot paths (what a user passes to build)."""
    (root / "staging").mkdir(parents=True)
    made = synth.write_model(root / "staging" / "model.gguf", spec)
    blobs, snap = root / "blobs", root / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    out = []
    for i, p in enumerate(made):
        blob = blobs / f"{i:02d}deadbeef{i:02d}"
        p.rename(blob)
        link = snap / p.name
        link.symlink_to(os.path.relpath(blob, snap))
        out.append(link)
    return out


@pytest.mark.parametrize("n_shards", [1, 2])
def test_hub_cache_symlinks_build_a_pack_every_tool_accepts(tmp_path, n_shards):
    links = _hub_layout(tmp_path / "hub", synth.qwen3moe_spec(n_shards=n_shards))
    assert all(p.is_symlink() and p.resolve().parent.name == "blobs" for p in links)
    pack = tmp_path / "pack"
    r = CliRunner().invoke(pack_main, ["build", str(links[0]), "-o", str(pack)])
    assert r.exit_code == 0, r.output
    opened = open_pack(pack)
    names = [Path(p).name for p in links]
    for name in names:  # found where the user keeps the model: the snapshot, through the link
        assert opened.source_path(name) == links[0].parent / name
        assert opened.source_path(name).exists()
    r = CliRunner().invoke(pack_main, ["verify", str(pack)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(budget_main, ["check", str(pack), "--card", "24G", "--ctx", "256"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(engine_main, ["generate", str(pack), "-p", "hello", "-n", "2", "--ctx", "64", "--json"])
    assert r.exit_code == 0, r.output


def test_file_names_with_spaces_and_non_utf8_bytes_pack_and_run(tmp_path):
    """Issue 21 item 4: "model (1).gguf" is a common name (a second download) and was refused; a split set named with
    spaces and a name that is not UTF-8 alike. The pack holds such names in the escaped ``# source-x`` / ``# shard-x``
    lines (plain names keep the plain lines); build, verify, check and generate all work and find the shards."""
    from click.testing import CliRunner

    from strata.budget.cli import main as budget_main
    from strata.engine.cli import main as engine_main
    from strata.packer.cli import main as pack_main
    from strata.packer.pack import read_pack

    one = synth.write_model(tmp_path / "model (1).gguf", synth.qwen3moe_spec())
    split = synth.write_model(tmp_path / "my model.gguf", synth.qwen3moe_spec(n_shards=2))
    raw = os.fsdecode(b"caf\xe9.gguf")  # Latin-1 bytes: not UTF-8; Python keeps them as surrogates
    os.rename(synth.write_model(tmp_path / "tmp.gguf", synth.qwen2_spec())[0], tmp_path / raw)
    for i, src in enumerate([one[0], split[1], tmp_path / raw]):
        out = tmp_path / f"pack{i}"
        r = CliRunner().invoke(pack_main, ["build", str(src), "-o", str(out)])
        assert r.exit_code == 0, r.output
        index = (out / "index.txt").read_text()
        assert "# source-x " in index and ("\\udce9" if i == 2 else "\\x20") in index
        pack = read_pack(out)
        assert {n for n, _ in pack.index.sources} <= {p.name for p in tmp_path.iterdir()}
        assert CliRunner().invoke(pack_main, ["verify", str(out)]).exit_code == 0
        assert CliRunner().invoke(budget_main, ["check", str(out), "--card", "16G", "--ctx", "64"]).exit_code == 0
        r = CliRunner().invoke(engine_main, ["generate", str(out), "-p", "hi", "-n", "2", "--ctx", "64"])
        assert r.exit_code == 0, r.output
    # Parquet outputs and inputs named with non-UTF-8 bytes (pyarrow takes no such path: file objects)
    table = tmp_path / os.fsdecode(b"t\xe9.parquet")
    r = CliRunner().invoke(pack_main, ["inspect", str(tmp_path / raw), "--parquet", str(table)])
    assert r.exit_code == 0 and table.is_file(), r.output
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld\n")
    prof = tmp_path / os.fsdecode(b"p\xe9.parquet")
    r = CliRunner().invoke(
        engine_main, ["profile", str(tmp_path / "pack0"), "--prompts", str(prompts), "-n", "2", "-o", str(prof)]
    )
    assert r.exit_code == 0 and prof.is_file(), r.output
    r = CliRunner().invoke(
        budget_main, ["check", str(tmp_path / "pack0"), "--card", "16G", "--ctx", "64", "--expert-profile", str(prof)]
    )
    assert r.exit_code == 0, r.output
    experts = (tmp_path / "pack1" / "native_experts.txt").read_text()
    assert "# shard-x 0 my\\x20model-00001-of-00002.gguf" in experts
    plain = tmp_path / "plain"
    assert (
        CliRunner()
        .invoke(
            pack_main, ["build", str(synth.write_model(tmp_path / "m.gguf", synth.qwen2_spec())[0]), "-o", str(plain)]
        )
        .exit_code
        == 0
    )
    assert "# source m.gguf " in (plain / "index.txt").read_text()  # plain names: the lines older packs have
