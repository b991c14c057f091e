"""bench/trace_host_point.py's refusals (a benchmark script, not a test of speed): bad input is refused before any
pack is loaded, naming the path or the numbers once, exit 2; a dense pack has no host point to trace."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _refused(capsys, argv) -> str:
    spec = importlib.util.spec_from_file_location("trace_host_point", ROOT / "bench" / "trace_host_point.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_refusals_name_the_path_and_the_numbers(tmp_path, capsys):
    missing = tmp_path / "no-pack"
    err = _refused(capsys, [str(missing), "--device", "sim"])
    assert err.count(str(missing)) == 1 and "not a pack directory" in err
    for argv, want in (
        (["--tokens", "0"], "--tokens 0 / --expert-cache 0: at least 1 / 0"),
        (["--expert-cache", "-1"], "--tokens 32 / --expert-cache -1: at least 1 / 0"),
    ):
        assert want in _refused(capsys, [str(missing), "--device", "sim", *argv])  # before the pack is opened


def test_a_step_without_a_cpu_miss_is_refused(qwen3moe_pack, capsys):
    """Every miss read from the host tier (--miss-tier pcie): one graph, no host point: refused, not zeros."""
    err = _refused(capsys, [str(qwen3moe_pack), "--device", "sim", "--miss-tier", "pcie"])
    assert "the step is one graph (no CPU miss): no host point to trace" in err
