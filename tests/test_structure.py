"""The floors of the house, checked on every run (docs/ARCHITECTURE.md, "Floors").

Imports go one way: the contracts (``manifests/``) at the bottom, then the pack format and builder
(``packer/``), what the engine allocates for a geometry (``layout/``), the budget (``budget/``), the engine
(``engine/``); the test-file generator (``testing/``) sits beside the product and may use the contracts
and the pack format only. Within that: no import cycle between modules, no module importing another
module's ``_private`` name, no module over 600 lines. Parsed with ``ast`` (every import, also inside
functions), no code run.

Inside the engine each device has its room (:data:`ENGINE_ROOMS`): ``engine/cpu/`` (the CPU device: its C
kernels, weights, experts), ``engine/gpu/`` (the GPU device) and ``engine/kernel_src/`` (the per-type kernel
sources both devices compile, and their assembly); the device-neutral modules (start-up, core, decoder, recipes,
models, ...) sit in ``engine/`` and may use any room. ``strata.engine.cpu`` never imports ``strata.engine.gpu``,
and ``strata.engine.kernel_src`` imports neither. The one arrow between the device rooms goes from the GPU to
the CPU: the GPU package may import the CPU's kernels where it computes on the host (the ``sim`` backend's q8
matvec, an embedding row read on the host; its expert misses run through :mod:`strata.engine.experts`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("manifests", "packer", "layout", "budget", "engine", "testing")
#: package -> the packages it may import from (besides itself)
ALLOWED = {
    "manifests": set(),
    "packer": {"manifests"},
    "layout": {"manifests", "packer"},
    "budget": {"manifests", "packer", "layout"},
    "engine": {"manifests", "packer", "layout", "budget"},
    "testing": {"manifests", "packer"},
}
#: engine room -> the engine packages it must not import (module docstring)
ENGINE_ROOMS = {
    "engine.cpu": {"engine.gpu"},
    "engine.kernel_src": {"engine.cpu", "engine.gpu"},
}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _imports(mod: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("strata."):
                    out.append((a.name[len("strata.") :], []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("strata."):
                target = node.module[len("strata.") :]
            else:
                continue
            out.append((target, [a.name for a in node.names]))
    return out


MODULES = _modules()


def _resolve(target: str, names: list[str]) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) pairs: ``from pkg import mod`` is an import of pkg.mod."""
    out = []
    for n in names or [None]:
        if n is not None and f"{target}.{n}" in MODULES:
            out.append((f"{target}.{n}", None))
        else:
            out.append((target, n))
    return out


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for target, names in _imports(mod, path):
            for t, _n in _resolve(target, names):
                if t in MODULES and t != mod:
                    g[mod].add(t)
    return g


def _inside(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _floor_violations(mod: str, target: str, names: list[str]) -> list[str]:
    """What is wrong with ``mod`` importing ``names`` from ``target`` (as :func:`_imports` gives them): a package
    importing one above it (:data:`ALLOWED`), or an engine room importing a room it must not
    (:data:`ENGINE_ROOMS`; ``from strata.engine import gpu`` is an import of ``engine.gpu``). Empty if none."""
    bad = []
    top, other = mod.split(".")[0], target.split(".")[0]
    if other in PACKAGES and other != top and other not in ALLOWED[top]:
        bad.append(f"{mod} imports {target} ({top} may import {sorted(ALLOWED[top]) or 'nothing of strata'})")
    for room, banned in ENGINE_ROOMS.items():
        if _inside(mod, room):
            for t, _n in _resolve(target, names):
                bad += [f"{mod} imports {t} ({room} must not import {b})" for b in sorted(banned) if _inside(t, b)]
    return bad


def test_imports_go_down_the_floors():
    bad = []
    for mod, path in MODULES.items():
        for target, names in _imports(mod, path):
            bad += _floor_violations(mod, target, names)
    assert bad == []


def test_no_import_cycle():
    g = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert cycles == []


def test_no_private_name_imported_across_modules():
    bad = []
    for mod, path in MODULES.items():
        for target, names in _imports(mod, path):
            for t, n in _resolve(target, names):
                if n is not None and n.startswith("_") and not n.startswith("__") and t != mod:
                    bad.append(f"{mod} imports {t}.{n}")
        # attribute access on an imported module: K._load_module
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{mod} uses {node.value.id}.{node.attr}")
    assert bad == []


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_module_size(mod):
    n = len(MODULES[mod].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[mod].relative_to(ROOT)} has {n} lines (> {MAX_LINES}): split it by what it does"


def test_the_check_can_fail(tmp_path):
    # the walker sees relative, absolute and in-function imports (a check that cannot fail is a defect)
    p = tmp_path / "m.py"
    p.write_text(
        "from . import x\nfrom ..engine import y\nimport strata.budget.plan\n"
        "def f():\n    from strata.engine.gpu import kernels as K\n    return K._private\n"
    )
    got = _imports("packer.sub.m", p)
    assert ("packer.sub.x" not in [t for t, _ in got]) and ("packer.sub", ["x"]) in got
    assert ("packer.engine", ["y"]) in got and ("budget.plan", []) in got and ("engine.gpu", ["kernels"]) in got


@pytest.mark.parametrize(
    "mod,src,want",
    [
        ("engine.cpu.m", "from ..gpu import kernels\n", "engine.cpu.m imports engine.gpu.kernels (engine.cpu must not"),
        ("engine.cpu.m", "from strata.engine import gpu\n", "engine.cpu.m imports engine.gpu (engine.cpu must not"),
        ("engine.cpu.m", "def f():\n    import strata.engine.gpu.fused\n", "engine.cpu.m imports engine.gpu.fused ("),
        ("engine.kernel_src.m", "from ..cpu import kernels\n", "engine.kernel_src.m imports engine.cpu.kernels ("),
        ("engine.kernel_src.m", "from strata.engine.gpu.kernels import cuda_file\n", "engine.kernel_src.m imports"),
        ("budget.m", "from strata.engine.startup import load_engine\n", "budget.m imports engine.startup (budget may"),
        ("budget.m", "from ..engine.cpu import kernels\n", "budget.m imports engine.cpu (budget may"),
    ],
)
def test_the_floors_refuse_an_upward_import(tmp_path, mod, src, want):
    # each rule reports a violating import (a floor that cannot fail is a defect)
    p = tmp_path / "m.py"
    p.write_text(src)
    bad = [b for target, names in _imports(mod, p) for b in _floor_violations(mod, target, names)]
    assert len(bad) == 1 and bad[0].startswith(want), bad


@pytest.mark.parametrize(
    "mod,src",
    [
        ("engine.gpu.m", "from ..cpu import kernels\nfrom ..kernel_src import assembly\n"),
        ("engine.cpu.m", "from ..kernel_src import assembly\nfrom .. import experts\n"),
        ("engine.m", "from .cpu import device\nfrom .gpu import device as gd\n"),
        ("budget.m", "from strata.packer import quants\n"),
    ],
)
def test_the_floors_let_a_downward_import_pass(tmp_path, mod, src):
    p = tmp_path / "m.py"
    p.write_text(src)
    assert [b for target, names in _imports(mod, p) for b in _floor_violations(mod, target, names)] == []
