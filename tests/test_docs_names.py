"""The docs name only what exists: every dotted ``strata.<package>...`` name in README.md, docs/*.md and the
sources of the product packages resolves to a module or an attribute, and every ``docs/DESIGN.md
"<heading>"`` citation names a heading of docs/DESIGN.md.

A name resolves when its longest importable module prefix imports and the rest is found attribute by
attribute from there (a class's methods and class attributes by ``getattr``; its dataclass and pydantic
fields and the attributes its methods assign to ``self`` too). The product sources are read as text, so
docstrings, comments and strings are all covered.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The product packages whose sources are searched (the tests, bench/ and tools/ are not product).
PRODUCT_DIRS = ("packer", "budget", "engine", "manifests", "testing")
SOURCE_SUFFIXES = (".py", ".toml", ".c", ".h", ".cu", ".cuh")
NAME = re.compile(r"(?<![\w.])strata\.[a-z_]+(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
#: ``docs/DESIGN.md "<heading>"``, a line break (and a comment's ``#`` / ``#:``) allowed inside the quotes,
#: and a second heading after ``and`` or a comma.
CITATION = re.compile(r'docs/DESIGN\.md\s+"([^"]+)"(?:(?:,| and)\s+"([^"]+)")?')


def _documents() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for d in PRODUCT_DIRS:
        files += sorted(p for p in (ROOT / d).rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file())
    return files


def _import_longest(parts: list[str]):
    """(module, number of parts it covers) for the longest importable prefix of ``parts``; (None, 0) if none."""
    for n in range(len(parts), 1, -1):
        name = ".".join(parts[:n])
        try:
            return importlib.import_module(name), n
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # no such module: try a shorter prefix
            raise  # the module exists but one of ITS imports is missing: that is not the docs' fault
    return None, 0


def _member(obj, attr: str):
    """``obj.attr``, or for a class also a dataclass / pydantic field or an attribute a method assigns to
    ``self`` (not a class attribute, so ``getattr`` on the class cannot see it). Raises AttributeError."""
    if hasattr(obj, attr):
        return getattr(obj, attr)
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            fields = {
                **getattr(klass, "__dataclass_fields__", {}),
                **(klass.__dict__.get("model_fields") or {}),
                **klass.__dict__.get("__annotations__", {}),
            }
            if attr in fields:
                return fields[attr]
            try:
                src = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            if re.search(rf"\bself\.{re.escape(attr)}\s*(?::[^=\n]+)?=[^=]", src):
                return attr
    raise AttributeError(f"{getattr(obj, '__name__', obj)!s} has no attribute {attr!r}")


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` names a module or an attribute reachable from one, else why it does not."""
    parts = dotted.split(".")
    mod, n = _import_longest(parts)
    if mod is None:
        return f"no module {'.'.join(parts[:2])}"
    obj = mod
    for i, attr in enumerate(parts[n:], start=n):
        try:
            obj = _member(obj, attr)
        except AttributeError:
            return f"{'.'.join(parts[:i])} has no {attr!r}"
    return None


def _names() -> dict[str, list[str]]:
    """Every dotted strata name -> where it is written (``file:line``)."""
    out: dict[str, list[str]] = {}
    for path in _documents():
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for m in NAME.finditer(line):
                out.setdefault(m.group(0), []).append(f"{path.relative_to(ROOT)}:{no}")
    return out


def test_the_resolver_finds_real_names_and_refuses_made_up_ones():
    assert resolve("strata.packer.quants") is None  # a module
    assert resolve("strata.packer.quants.QuantType.act_format") is None  # a field of a class
    assert resolve("strata.engine.startup.load_engine") is None
    assert resolve("strata.testing.blocks.make_random_blocks") is None
    assert resolve("strata.packer.synth.make_random_blocks") == "strata.packer has no 'synth'"
    assert resolve("strata.packer.packfmt.open_pack") == "strata.packer.packfmt has no 'open_pack'"
    assert resolve("strata.engine.startup.load_engine.no_such_thing") is not None
    assert resolve("strata.nosuchpackage.x") == "no module strata.nosuchpackage"
    assert NAME.findall("see :func:`strata.packer.pack.open_pack`. And strata.testing alone.") == [
        "strata.packer.pack.open_pack"
    ]


def test_every_dotted_strata_name_in_the_docs_and_sources_resolves():
    names = _names()
    assert len(names) > 50  # the search finds the names (a broken pattern would pass vacuously)
    bad = {name: (why, where) for name, where in names.items() if (why := resolve(name)) is not None}
    assert not bad, "names that do not resolve:\n" + "\n".join(
        f"  {name}: {why} ({', '.join(where[:3])}{' ...' if len(where) > 3 else ''})"
        for name, (why, where) in sorted(bad.items())
    )


def _design_headings() -> set[str]:
    return {
        ln.lstrip("#").strip()
        for ln in (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8").splitlines()
        if ln.startswith("#")
    }


def _citations() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    files = _documents() + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    for path in files:
        text = path.read_text(encoding="utf-8")
        flat = re.sub(r"\n[ \t]*(?:#:?|//)?[ \t]*", " ", text)  # a citation wrapped over lines reads as one
        for m in CITATION.finditer(flat):
            for heading in (h for h in m.groups() if h and h != "<heading>"):  # "<heading>": the convention
                out.setdefault(heading, []).append(str(path.relative_to(ROOT)))
    return out


def test_every_cited_design_heading_exists():
    headings = _design_headings()
    cited = _citations()
    assert "Start-up order" in cited  # the search finds the citations
    missing = {h: sorted(set(w)) for h, w in cited.items() if h not in headings}
    assert not missing, f"docs/DESIGN.md has no such heading: {missing}"


@pytest.mark.parametrize("old", ["Round 194", "Incident 1", "Incident 2", "Incident 3", "The documents' model"])
def test_design_headings_say_what_the_lesson_is(old):
    assert not any(h.startswith(old) for h in _design_headings())
