"""bench/cpu_moe_layers.py's refusals (a benchmark script, not a test of speed): bad input is refused before anything
is timed, naming the path and the numbers, and nothing is written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _main():
    spec = importlib.util.spec_from_file_location("cpu_moe_layers", ROOT / "bench" / "cpu_moe_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        _main()(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_refusals_name_the_path_and_the_numbers(qwen3moe_pack, tmp_path, capsys):
    out = tmp_path / "no-such-dir" / "x.json"
    err = _refused(capsys, [str(qwen3moe_pack), "--json", str(out), "--passes", "1"])
    assert f"--json {out}: {out.parent} is not a writable directory" in err and not out.parent.exists()
    err = _refused(capsys, [str(qwen3moe_pack), "--used", "9"])
    assert "--used 9: the model has 8 experts per layer" in err
    err = _refused(capsys, [str(qwen3moe_pack), "--threads", "0"])
    assert "--threads 0: must be at least 1" in err
    gguf = sorted(qwen3moe_pack.parent.glob("*.gguf"))[0]
    err = _refused(capsys, [str(gguf)])
    assert err.count(str(gguf)) == 2 and "this is a GGUF file, not a pack directory" in err  # named once, and the fix


def test_default_used_is_the_models_and_the_json_holds_every_row(qwen3moe_pack, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert _main()([str(qwen3moe_pack), "--kernel", "q8", "--threads", "1", "--passes", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["kernel"], r["populate"], r["used"], r["layers"]) for r in rows] == [
        ("q8", False, 2, 3),
        ("q8", True, 2, 3),
    ]
