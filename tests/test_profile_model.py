"""An expert profile records the model it was recorded on (``strata-engine profile``), and a profile of another
model is refused by name by ``strata-budget check`` and ``strata-engine generate``: its counts would fill the
cache with another model's hot experts (before, only the index ranges were checked)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from strata import testing as synth
from strata.budget.cli import main as budget_main
from strata.budget.profile import model_identity, read_profile, read_profile_model
from strata.engine.cli import main as engine_main
from strata.packer.build import build_pack
from strata.packer.pack import open_pack


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two MoE packs of the same shape from different weights (seeds), and a profile recorded on the first."""
    root = tmp_path_factory.mktemp("two")
    packs = []
    for name, seed in (("a", 1), ("b", 2)):
        (root / name).mkdir()
        paths = synth.write_model(root / name / "m.gguf", synth.qwen3moe_spec(seed=seed, tensor_types={}))
        build_pack(paths[0], root / f"{name}-pack", progress=False)
        packs.append(root / f"{name}-pack")
    prompts = root / "prompts.txt"
    prompts.write_text("hello world\nthe capital of\n", encoding="utf-8")
    prof = root / "a.parquet"
    r = CliRunner().invoke(
        engine_main, ["profile", str(packs[0]), "--prompts", str(prompts), "-o", str(prof), "-n", "2", "--ctx", "64"]
    )
    assert r.exit_code == 0, r.output
    return packs[0], packs[1], prof


def test_profile_records_its_model(two):
    a, b, prof = two
    ident, name = model_identity(open_pack(a))
    assert read_profile_model(prof) == (ident, name) and len(ident) == 16
    assert name.startswith("qwen3moe ")
    assert model_identity(open_pack(b))[0] != ident  # other router weights: another identity


def test_foreign_profile_refused_by_budget_and_engine_own_one_accepted(two):
    a, b, prof = two
    want = model_identity(open_pack(b))
    got = model_identity(open_pack(a))
    msg = (
        f"error: --expert-profile {prof}: recorded on another model ({got[1]}, model {got[0]}); this pack is "
        f"{want[1]}, model {want[0]} - record a profile of this pack with strata-engine profile"
    )
    r = CliRunner().invoke(
        budget_main, ["check", str(b), "--card", "24G", "--ctx", "256", "--expert-profile", str(prof)]
    )
    assert r.exit_code == 2 and msg in r.output
    r = CliRunner().invoke(
        engine_main, ["generate", str(b), "-p", "hi", "-n", "2", "--ctx", "64", "--expert-profile", str(prof)]
    )
    assert r.exit_code == 2 and msg in r.output
    r = CliRunner().invoke(
        budget_main, ["check", str(a), "--card", "24G", "--ctx", "256", "--expert-profile", str(prof)]
    )
    assert r.exit_code == 0, r.output


def test_profile_without_a_model_record_is_accepted_on_its_ranges(two, tmp_path):
    _, b, prof = two
    rows = read_profile(prof)
    old = tmp_path / "old.parquet"
    pq.write_table(pa.table({k: [r[i] for r in rows] for i, k in enumerate(("layer", "expert", "count"))}), old)
    assert read_profile_model(old) is None
    r = CliRunner().invoke(
        budget_main, ["check", str(b), "--card", "24G", "--ctx", "256", "--expert-profile", str(old)]
    )
    assert r.exit_code == 0, r.output
