"""One exit-code contract for every command: the README's table is the code's
(:func:`strata.packer.exits.exit_table`), and every cell of it is produced here, per command:
0, 1 where the command has a negative answer, 2 for bad input, 130 for SIGINT and 143 for SIGTERM
(with no traceback, one ``error: interrupted by SIG...`` line and nothing half-written), 141 when
stdout is closed.

The signals are real: each command runs in its own process, with one of its own steps replaced by a
step that sends the signal to the process itself, so the signal lands mid-command every time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from strata import testing as synth
from strata.budget.cli import main as budget_main
from strata.engine.cli import main as engine_main
from strata.packer.build import build_pack
from strata.packer.cli import main as pack_main
from strata.packer.exits import COMMANDS, NEGATIVE, exit_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A dense and an MoE synthetic model with their packs, a prompts file, a fake fetch cache."""
    d = tmp_path_factory.mktemp("exits")
    dense = synth.write_model(d / "dense.gguf", synth.qwen2_spec())[0]
    moe = synth.write_model(d / "moe.gguf", synth.qwen3moe_spec())[0]
    build_pack(dense, d / "dense", progress=False)
    build_pack(moe, d / "moe", progress=False)
    (d / "prompts.txt").write_text("The capital of France is\nHello\n")
    (d / "empty").mkdir()
    return d


def test_readme_holds_the_exit_code_table():
    readme = (ROOT / "README.md").read_text()
    assert exit_table() in readme, "README.md's exit-code table differs from strata.packer.exits.exit_table()"
    assert set(NEGATIVE) <= set(COMMANDS)


def _run(main, *args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in r.output
    return r


# ------------------------------------------------------------------ 0 / 1 / 2 per command


def test_build(world, tmp_path):
    assert _run(pack_main, "build", world / "dense.gguf", "-o", tmp_path / "p").exit_code == 0
    (tmp_path / "x.gguf").write_text("not a model")
    r = _run(pack_main, "build", tmp_path / "x.gguf", "-o", tmp_path / "q")
    assert r.exit_code == 2 and r.stderr.startswith("error: ")


def test_verify(world, tmp_path):
    assert _run(pack_main, "verify", world / "dense").exit_code == 0
    # 2: not a pack directory, an empty directory, a GGUF file, a moved source (nothing compared)
    for p, msg in (
        (tmp_path / "nope", "not a pack directory"),
        (world / "empty", "not a strata pack (no index.txt)"),
        (
            world / "dense.gguf",
            "this is a GGUF file, not a pack directory: build a pack first with "
            f"strata-pack build {world / 'dense.gguf'} -o PACK",
        ),
    ):
        r = _run(pack_main, "verify", p)
        assert r.exit_code == 2 and r.stderr == f"error: {p}: {msg}\n", r.stderr
    src = tmp_path / "src"
    src.mkdir()
    os.link(world / "moe.gguf", src / "moe.gguf")
    build_pack(src / "moe.gguf", tmp_path / "moved", progress=False)
    (src / "moe.gguf").unlink()
    r = _run(pack_main, "verify", tmp_path / "moved")
    assert r.exit_code == 2 and f"source shard moe.gguf not found at {src / 'moe.gguf'}" in r.stderr
    # 1: a byte of a dense tensor changed
    build_pack(world / "dense.gguf", tmp_path / "bad", progress=False)
    with open(tmp_path / "bad" / "pool.bin", "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    r = _run(pack_main, "verify", tmp_path / "bad")
    assert r.exit_code == 1 and r.stderr.startswith("error: tensor token_embd.weight: pool byte 0 is ")


def test_inspect(world, tmp_path):
    assert _run(pack_main, "inspect", world / "dense").exit_code == 0
    assert _run(pack_main, "inspect", tmp_path / "nope").exit_code == 2


def test_fetch(monkeypatch, tmp_path):
    import strata.packer.fetch as fetch

    monkeypatch.setattr(fetch, "fetch_model", lambda name, cache_dir=None, progress=True: tmp_path / "m.gguf")
    assert _run(pack_main, "fetch", "gemma3-270m").exit_code == 0

    def fails(name, cache_dir=None, progress=True):
        raise fetch.ChecksumError("m.gguf", 1, 2, "a" * 64, "b" * 64)

    monkeypatch.setattr(fetch, "fetch_model", fails)
    r = _run(pack_main, "fetch", "gemma3-270m")
    assert r.exit_code == 1 and "failed verification" in r.stderr
    monkeypatch.undo()
    assert _run(pack_main, "fetch", "no-such-model").exit_code == 2


def test_budget_check(world):
    assert _run(budget_main, "check", world / "dense", "--card", "24G").exit_code == 0
    assert _run(budget_main, "check", world / "dense", "--card", "24GB").exit_code == 0  # the unit may be written
    assert _run(budget_main, "check", world / "dense", "--card-mib", 200).exit_code == 1
    r = _run(budget_main, "check", world / "dense.gguf", "--card", "24G")  # a plan before the pack (issue 21 item 7)
    assert r.exit_code == 0 and "planned from the GGUF header of" in " ".join(r.stdout.split())


def test_engine_generate(world):
    r = _run(engine_main, "generate", world / "dense", "-p", "Hello", "-n", "2")
    assert r.exit_code == 0 and r.stdout.startswith("Hello")
    r = _run(engine_main, "generate", world / "dense.gguf", "-p", "Hello")
    assert r.exit_code == 2 and "this is a GGUF file" in r.stderr


def test_engine_measure(world, monkeypatch):
    import strata.engine.measure as measure
    from strata.engine.measure import Measurement

    def fake(ok):
        def measure_pack(pack, **kw):
            m = Measurement(
                pack=str(pack), device="test", card_total_bytes=1 << 30, context_bytes=0, n_ctx=8, kv="f16", slots=0
            )
            if not ok:
                m.terms = [
                    measure.AuditTerm(term="KV cache", predicted_bytes=1, measured_bytes=2, measured_how="", exact=True)
                ]
            return m

        return measure_pack

    monkeypatch.setattr(measure, "print_measurement", lambda a: None)
    monkeypatch.setattr(measure, "measure_pack", fake(True))
    assert _run(engine_main, "measure", world / "dense").exit_code == 0
    monkeypatch.setattr(measure, "measure_pack", fake(False))
    assert _run(engine_main, "measure", world / "dense").exit_code == 1
    monkeypatch.undo()
    from strata.engine.gpu.kernels import gpu_available

    if not gpu_available()[0]:  # no GPU: refused, naming the command's need, not an option it lacks
        r = _run(engine_main, "measure", world / "dense")
        assert (
            r.exit_code == 2 and r.stderr.startswith("error: measure needs a CUDA GPU") and "--device" not in r.stderr
        )
    assert _run(engine_main, "measure", world / "nope").exit_code == 2


def test_engine_profile(world, tmp_path):
    out = tmp_path / "prof.parquet"
    assert (
        _run(engine_main, "profile", world / "moe", "--prompts", world / "prompts.txt", "-n", "2", "-o", out).exit_code
        == 0
    )
    assert out.is_file()
    assert _run(engine_main, "profile", world / "moe", "--prompts", tmp_path / "none.txt").exit_code == 2


@pytest.mark.parametrize(
    "tool, args, want",
    [
        (
            "engine",
            ["generate", "{dense}", "-p", "hi", "--threads", "0"],
            "Invalid value for '-t' / '--threads': 0 is not in the range 1<=x<=512.",
        ),
        (
            "engine",
            ["generate", "{dense}", "-p", "hi", "--kernel", "bogus"],
            "Invalid value for '--kernel' / '--cpu-kernel': 'bogus' is not one of 'q8', 'exact', 'f32'.",
        ),
        (
            "engine",
            ["generate", "{dense}", "-p", "hi", "--kv", "int8"],
            "Invalid value for '--kv': 'int8' is not one of 'f16', 'f32'.",
        ),
        (
            "engine",
            ["generate", "{dense}", "-p", "hi", "--resident", "bogus"],
            "Invalid value for '--resident': 'bogus': expected all, none, half or a fraction in [0, 1]",
        ),
        (
            "engine",
            ["generate", "{dense}"],
            "no prompt: give -p/--prompt TEXT or -f/--file FILE (- for standard input)",
        ),
        (
            "engine",
            ["profile", "{moe}", "--prompts", "{empty}"],
            "Invalid value for '--prompts': File '{empty}' is a directory.",
        ),
        ("engine", ["bogus"], "No such command 'bogus'."),
        (
            "budget",
            ["check", "{dense}", "--card", "24G", "--kv", "q4"],
            "Invalid value for '--kv': 'q4' is not one of ",
        ),
        ("pack", ["build"], "Missing argument 'SRC'."),
        ("pack", ["--bogus"], "No such option '--bogus'."),
    ],
)
def test_a_usage_error_is_one_error_line(world, tool, args, want):
    """An option value click refuses (out of range, not a choice), a missing or unknown option, argument or
    command: exit 2 and one ``error:`` line, as every other refusal - not click's three-line usage block
    (``Usage: ...`` / ``Try ...`` / ``Error: ...``)."""
    main = {"engine": engine_main, "budget": budget_main, "pack": pack_main}[tool]
    names = {"dense": world / "dense", "moe": world / "moe", "empty": world / "empty"}
    r = _run(main, *(a.format(**names) for a in args))
    want = want.format(**names)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: {want}") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == "" and "Usage:" not in r.output


def test_a_bare_group_still_prints_its_help(world):
    """``strata-engine`` alone: its help is the answer (click's no_args_is_help), not an error line."""
    r = _run(engine_main)
    assert r.output.startswith("Usage: ") and "Commands:" in r.output and not r.stderr.startswith("error:")


# ------------------------------------------------------------------ signals: 130 / 143, nothing half-written


# module of the step replaced, its attribute, the command line
def _cases(w: Path, out: Path) -> dict[str, tuple[str, str, list[str]]]:
    return {
        "strata-pack build": (
            "strata.packer.build",
            "write_pool",
            ["strata.packer.cli", "build", w / "dense.gguf", "-o", out / "p"],
        ),
        "strata-pack verify": ("strata.packer.verify", "open_model", ["strata.packer.cli", "verify", w / "dense"]),
        "strata-pack inspect": (
            "pyarrow.parquet",
            "write_table",
            ["strata.packer.cli", "inspect", w / "dense", "--parquet", out / "t.parquet"],
        ),
        "strata-pack fetch": (
            "strata.packer.fetch",
            "download_package",
            ["strata.packer.cli", "fetch", "gemma3-270m", "--cache-dir", out / "cache"],
        ),
        "strata-budget check": (
            "strata.budget.cli",
            "audit_pack",
            ["strata.budget.cli", "check", w / "dense", "--card", "24G"],
        ),
        "strata-engine generate": (
            "strata.engine.generate_cli",
            "generate",
            ["strata.engine.cli", "generate", w / "dense", "-p", "Hi"],
        ),
        "strata-engine measure": (
            "strata.engine.measure",
            "measure_pack",
            ["strata.engine.cli", "measure", w / "dense"],
        ),
        "strata-engine profile": (
            "pyarrow.parquet",
            "write_table",
            [
                "strata.engine.cli",
                "profile",
                w / "moe",
                "--prompts",
                w / "prompts.txt",
                "-n",
                "1",
                "-o",
                out / "prof.parquet",
            ],
        ),
    }


_DRIVER = textwrap.dedent("""
    import importlib, os, signal, sys, time
    mod, attr, sig, args = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    m = importlib.import_module(mod)
    real = getattr(m, attr)
    def step(*a, **k):
        if attr == "write_table":
            real(*a, **k)  # a file half-written under its temporary name, then the signal
        os.kill(os.getpid(), sig)
        time.sleep(30)
    setattr(m, attr, step)
    cli = importlib.import_module(args[0])
    cli.main(args[1:], prog_name=args[0])
""")


@pytest.fixture(scope="module")
def signalled(world, tmp_path_factory):
    """Every command of :data:`COMMANDS` interrupted by SIGINT and by SIGTERM, all at once (processes)."""
    runs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        for cmd, (mod, attr, argv) in _cases(world, Path("/")).items():
            out = tmp_path_factory.mktemp("sig")
            mod, attr, argv = _cases(world, out)[cmd]
            p = subprocess.Popen(
                [sys.executable, "-c", _DRIVER, mod, attr, str(int(sig)), *map(str, argv)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            runs[(cmd, sig)] = (p, out)
    done = {}
    for k, (p, out) in runs.items():
        so, se = p.communicate(timeout=120)
        done[k] = (p.returncode, so, se, out)
    return done


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("cmd", COMMANDS)
def test_signal_exits_128_plus_n_with_nothing_half_written(signalled, cmd, sig):
    code, out, err, d = signalled[(cmd, sig)]
    assert code == 128 + sig, (code, err)
    assert "Traceback" not in err and "Aborted!" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: interrupted by {signal.Signals(sig).name}"), err
    left = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert left == [], f"{cmd} left {left} after {signal.Signals(sig).name}"


def test_generate_streams_and_keeps_its_tokens_on_ctrl_c(world):
    """Text mode prints each token as it comes; Ctrl-C ends with 130 and what was printed stays."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "strata.engine.cli",
            "generate",
            str(world / "dense"),
            "-p",
            "Hello",
            "-n",
            "2000",
            "--ignore-eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = p.stdout.read(len("Hello") + 1)  # the prompt, then the first generated bytes: streamed, not at the end
    assert first.startswith(b"Hello") and len(first) == len("Hello") + 1
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    err = err.decode()
    assert p.returncode == 130 and "Traceback" not in err
    assert "error: interrupted by SIGINT; stopped after " in err and "generated token(s) (printed above)" in err
    assert len(first + rest) > len("Hello") + 1


def test_generate_json_interrupted_is_one_object_with_the_tokens(world, monkeypatch):
    import strata.engine.generate as G

    real = G.decode

    def decode(model, state, ids, n_new, pick, **kw):
        seen = []

        def pick2(row):
            t = pick(row)
            seen.append(t)
            if len(seen) == 3:
                raise KeyboardInterrupt
            return t

        return real(model, state, ids, n_new, pick2, **kw)

    monkeypatch.setattr(G, "decode", decode)
    r = CliRunner().invoke(
        engine_main, ["generate", str(world / "dense"), "-p", "Hello", "-n", "10", "--json", "--ignore-eos"]
    )
    assert r.exit_code == 130
    d = json.loads(r.stdout)  # one object
    assert d["ok"] is False and d["signal"] == "SIGINT" and d["exit_code"] == 130 and len(d["output_ids"]) == 2
    assert d["error"] == "interrupted by SIGINT; stopped after 2 generated token(s)"


def test_closed_stdout_exits_141_silently(world):
    """`| head`: the reader goes away; the writer stops with 141 and prints nothing more (click alone
    would exit 1, the code of a negative answer)."""
    r = subprocess.run(
        f"{sys.executable} -m strata.engine.cli generate {world / 'dense'} -p Hello -n 2000 "
        f'--ignore-eos | head -c 10; echo " ${{PIPESTATUS[0]}}"',
        shell=True,
        capture_output=True,
        text=True,
        executable="/bin/bash",
        timeout=120,
    )
    assert r.stderr == "", r.stderr
    assert r.stdout.startswith("Hello") and r.stdout.endswith(" 141\n"), r.stdout


@pytest.mark.parametrize("card, answer", [("24G", 0), ("--card-mib=200", 1)], ids=["fits", "does-not-fit"])
def test_budget_tables_into_a_closed_stdout_exit_141_not_1(world, card, answer):
    """`strata-budget check PACK --card 24G | head -1`: the tables are printed by rich, whose console exits 1 on a
    closed pipe - "does not fit" to a script, for a plan that fits. The reader went away: 141, silently, whatever
    the answer would have been (``answer``: the code with stdout open)."""
    cmd = [sys.executable, "-m", "strata.budget.cli", "check", str(world / "dense")]
    cmd += [card] if card.startswith("--") else ["--card", card]
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == answer
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the command has printed anything (it imports and audits first)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 141 and err == b"", err


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_the_tools_import_exits_quietly(sig, code):
    """The console scripts install quiet handlers before the heavy imports (strata.packer.entry): a signal
    in that window exits 128 + N with one line, no KeyboardInterrupt traceback from inside an import."""
    import subprocess
    import sys

    prog = (
        "from strata.packer.entry import early_signals; import os, signal; early_signals(); "
        f"os.kill(os.getpid(), signal.{sig}); import time; time.sleep(10)"
    )
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert r.returncode == code and r.stderr == f"error: interrupted by {sig} while starting; nothing was done\n"


def test_no_gpu_reason_says_what_insufficient_driver_means(monkeypatch):
    """CuPy installed on a machine without an NVIDIA driver reports cudaErrorInsufficientDriver, which reads like an
    old driver: gpu_available's reason says there may be no GPU or driver at all (what the refusals print)."""
    import sys
    import types

    class FakeError(Exception):
        pass

    def count():
        raise FakeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from strata.engine.gpu import kernels as K

    ok, why = K.gpu_available()
    assert not ok and why.startswith("no usable CUDA device (FakeError: cudaErrorInsufficientDriver")
    assert "no NVIDIA GPU or driver here, or a driver older than CuPy's CUDA runtime" in why


@pytest.mark.parametrize(
    "pkg,cmd", [("packer", "strata-pack"), ("budget", "strata-budget"), ("engine", "strata-engine")]
)
def test_python_dash_m_runs_each_command_line(pkg, cmd, tmp_path):
    """``python -m strata.<pkg>`` is ``<cmd>`` (the Makefile's demo calls it so: an environment whose scripts are not on
    PATH): its --help exits 0 naming the module, and bad input exits 2 as the script does."""
    r = subprocess.run([sys.executable, "-m", f"strata.{pkg}", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"python -m strata.{pkg}" in r.stdout, r.stderr
    sub = {"packer": ["verify"], "budget": ["check", "--card", "24G"], "engine": ["generate", "-p", "hi"]}[pkg]
    missing = tmp_path / "no-such-pack"
    args = [sys.executable, "-m", f"strata.{pkg}", sub[0], str(missing), *sub[1:]]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no-such-pack" in r.stderr, (cmd, r.returncode, r.stderr)
