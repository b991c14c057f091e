"""Every command's ``--help`` speaks about the product, not the project's history: no "documents" (the
reference C++ engine is ``cpp``, its model the qwen3next reference model), no "round 194", no incident or
issue numbers (docs/DESIGN.md keeps the history)."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from strata.budget.cli import main as budget_main
from strata.engine.cli import main as engine_main
from strata.packer.cli import main as pack_main

TOOLS = {"strata-pack": pack_main, "strata-budget": budget_main, "strata-engine": engine_main}
#: What no help text may contain (case-insensitive).
HISTORY = re.compile(r"documents|round 194|incident|issue #?\d+", re.IGNORECASE)


def _commands() -> list[tuple[str, click.Command, list[str]]]:
    """(tool, its main group, the argument path) for every group and command, hidden ones too."""
    out = []

    def walk(tool, root, cmd, path):
        out.append((tool, root, path))
        if isinstance(cmd, click.Group):
            for name, sub in sorted(cmd.commands.items()):
                walk(tool, root, sub, [*path, name])

    for tool, root in TOOLS.items():
        walk(tool, root, root, [])
    return out


COMMANDS = _commands()


def test_every_command_is_covered():
    paths = {(tool, " ".join(path)) for tool, _root, path in COMMANDS}
    for want in (
        ("strata-pack", ""),
        ("strata-pack", "build"),
        ("strata-pack", "verify"),
        ("strata-pack", "inspect"),
        ("strata-pack", "fetch"),
        ("strata-budget", ""),
        ("strata-budget", "check"),
        ("strata-engine", ""),
        ("strata-engine", "generate"),
        ("strata-engine", "measure"),
        ("strata-engine", "profile"),
    ):
        assert want in paths


@pytest.mark.parametrize(
    "root, path", [(root, path) for _tool, root, path in COMMANDS], ids=[f"{t} {' '.join(p)}" for t, _r, p in COMMANDS]
)
def test_help_speaks_without_the_projects_history(root, path):
    r = CliRunner().invoke(root, [*path, "--help"], terminal_width=120)
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.output
    found = sorted({m.group(0) for m in HISTORY.finditer(r.output)})
    assert not found, f"{' '.join(path) or 'main'} --help says {found}:\n{r.output}"


def test_the_pattern_catches_what_it_should():
    for text in ("the documents' engine", "Round 194", "incident 1", "issue 12", "issue #9"):
        assert HISTORY.search(text), text
    for text in ("--engine cpp", "an issue", "rounded to f16"):
        assert not HISTORY.search(text), text
