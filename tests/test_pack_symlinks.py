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
