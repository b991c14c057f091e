"""An MoE pack whose shards moved (another mount, another machine, a copied pack): the engine's commands take
``--source-dir`` as ``strata-pack verify`` and ``strata-budget check`` do, and the refusal without it says so."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from strata import testing as synth
from strata.engine.cli import main as engine_main
from strata.packer.build import build_pack


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """(pack, the directory the shards are in now): built from ``src/``, then ``src/`` renamed ``moved/``."""
    root = tmp_path_factory.mktemp("moved")
    (root / "src").mkdir()
    paths = synth.write_model(root / "src" / "m.gguf", synth.qwen3moe_spec(n_shards=2))
    build_pack(paths[0], root / "pack", progress=False)
    shutil.move(root / "src", root / "moved")
    return root / "pack", root / "moved"


def test_generate_without_source_dir_names_the_missing_shard_and_the_option(moved):
    pack, now = moved
    r = CliRunner().invoke(engine_main, ["generate", str(pack), "-p", "hi", "-n", "2", "--ctx", "64"])
    assert r.exit_code == 2
    src = now.parent / "src"
    assert r.output.strip().splitlines()[-1] == (
        f"error: {pack}/native_experts.txt: expert shard 0 {src}/m-00001-of-00002.gguf is missing (routed experts "
        "stay in the GGUF shards; moved? pass --source-dir DIR)"
    )


def test_generate_and_profile_with_source_dir_run_from_the_new_place(moved, tmp_path):
    pack, now = moved
    r = CliRunner().invoke(
        engine_main, ["generate", str(pack), "-p", "hi", "-n", "2", "--ctx", "64", "--json", "--source-dir", str(now)]
    )
    assert r.exit_code == 0, r.output
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe capital\n", encoding="utf-8")
    out = tmp_path / "p.parquet"
    r = CliRunner().invoke(
        engine_main,
        ["profile", str(pack), "--prompts", str(prompts), "-o", str(out), "-n", "2", "--ctx", "64"]
        + ["--source-dir", str(now)],
    )
    assert r.exit_code == 0, r.output
    assert out.is_file()


@pytest.mark.parametrize("cmd", ["generate", "profile"])
def test_source_dir_that_is_not_a_directory_is_refused_by_name(moved, tmp_path, cmd):
    pack, _ = moved
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n", encoding="utf-8")
    extra = ["-p", "hi"] if cmd == "generate" else ["--prompts", str(prompts), "-o", str(tmp_path / "o.parquet")]
    r = CliRunner().invoke(engine_main, [cmd, str(pack), *extra, "--source-dir", str(tmp_path / "nowhere")])
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1] == f"error: --source-dir {tmp_path / 'nowhere'}: no such directory"


def test_verify_and_budget_with_a_wrong_source_dir_do_not_suggest_the_option_again(moved, tmp_path):
    """``--source-dir`` given but the shards are not there: the refusal says the option's directory is the one to fix,
    not "pass --source-dir" (a user found the hint repeated)."""
    from strata.budget.cli import main as budget_main
    from strata.packer.cli import main as pack_main

    pack, _now = moved
    wrong = tmp_path / "elsewhere"
    wrong.mkdir()
    r = CliRunner().invoke(pack_main, ["verify", str(pack), "--source-dir", str(wrong)])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == (
        f"error: {pack}: source shard m-00001-of-00002.gguf not found at {wrong}/m-00001-of-00002.gguf "
        "(--source-dir names the directory it is in now); nothing was compared"
    )
    r = CliRunner().invoke(
        budget_main, ["check", str(pack), "--card", "24G", "--ctx", "64", "--source-dir", str(wrong)]
    )
    flat = " ".join(r.output.split())
    assert r.exit_code == 2 and "(--source-dir names the directory it is in now)" in flat and "moved?" not in flat
