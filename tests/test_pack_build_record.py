"""The pack's build record is ``build.json`` (issue 8: "manifest" names the architecture contracts);
packs built before the rename keep ``manifest.json``, which is still read (verify's source mtimes,
``build --force``'s is-this-a-pack check)."""

from __future__ import annotations

import json

import pytest

from strata import testing as synth
from strata.packer.build import BuildError, build_pack
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
