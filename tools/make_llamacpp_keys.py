#!/usr/bin/env python
"""Record which GGUF metadata keys llama.cpp's model loader reads for each architecture strata has a
contract for: the fixture ``tests/fixtures/llamacpp_keys.json`` that ``tests/test_metadata_keys.py``
walks against every manifest's ``[keys]`` section (:mod:`strata.manifests.keys`: "Metadata keys:
honoured or refused, never ignored").

What is read, in the vendored llama.cpp source (llama-cpp-python 0.3.36, ``vendor/llama.cpp``):

- ``src/llama-arch.cpp`` ``LLM_KV_NAMES``: key enum -> GGUF key (``%s.`` = the architecture's
  prefix) and ``LLM_ARCH_NAMES``: arch enum -> ``general.architecture``;
- ``src/llama-model.cpp`` ``llama_model_base::load_hparams``: the generic keys. A block guarded by
  a condition made only of ``arch == LLM_ARCH_X`` / ``!=`` comparisons is kept only when the
  condition holds for the architecture (e.g. ``LLM_ARCH_WAVTOKENIZER_DEC``'s keys are not qwen2's);
  any other condition keeps its block (the read may happen);
- the architecture's model file ``src/models/<file>.cpp`` (the one defining
  ``llama_model_<arch enum, lower case>::load_arch_hparams``): every key it names, and the keys of
  the ``llama_model_base`` helpers it calls (``load_swa_pattern``).

Each key is recorded with how it is read (``get_key``, ``get_key_or_arr``: a scalar or one value per
layer, ``get_arr``, ``get_arr_n``: an array's length) and where (function name, file). Keys are
written as the manifests write them: relative to ``<arch>.`` (``rope.dimension_count``), or with a
leading ``/`` when absolute (``/general.name``). ``known_keys`` lists every key name of
``LLM_KV_NAMES`` in the same form, so the test can tell a key that llama.cpp does not read for an
architecture from a key that does not exist at all.

    python tools/make_llamacpp_keys.py --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp
    python tools/make_llamacpp_keys.py --check     # exit 1 when the fixture differs from the source
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "llamacpp_keys.json"
DEFAULT_SRC = os.environ.get("LLAMA_CPP_SRC", "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
#: The architectures with a manifest (``manifests/*.toml``), by ``general.architecture``.
ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "qwen3next", "gemma3", "deepseek2", "gpt-oss")
#: ``llama_model_base`` methods that are not helpers of ``load_arch_hparams``.
NOT_HELPERS = {"load_hparams", "load_vocab", "load_tensors", "load_stats"}

_PAIR = re.compile(r'\{\s*(LLM_(?:KV|ARCH)_\w+)\s*,\s*"([^"]*)"\s*\}')
_READ = re.compile(r"\bml\.(get_key_or_arr|get_key|get_arr_n|get_arr)\s*\(\s*(LLM_KV_\w+)\b")
_KV_TOKEN = re.compile(r"\bLLM_KV_\w+\b")
_ARCH_CMP = re.compile(r"\s*(?:arch|ml\.get_arch\(\))\s*(==|!=)\s*(LLM_ARCH_\w+)\s*")


def strip_comments(src: str) -> str:
    """C++ source without ``//`` and ``/* */`` comments (string literals left as they are)."""
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def name_tables(arch_cpp: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(LLM_KV_* -> "%s.key", LLM_ARCH_* -> "name")`` from llama-arch.cpp's two tables."""
    kv, arch = {}, {}
    for enum, s in _PAIR.findall(arch_cpp):
        (kv if enum.startswith("LLM_KV_") else arch).setdefault(enum, s)
    return kv, arch


def manifest_key(pattern: str) -> str:
    """``"%s.rope.dimension_count"`` -> ``rope.dimension_count``; ``"general.name"`` -> ``/general.name``."""
    return pattern[3:] if pattern.startswith("%s.") else "/" + pattern


def function_body(src: str, qualified: str) -> str:
    """The body (between the outer braces) of the definition of ``qualified`` (``cls::fn``) in ``src``.

    Raises:
        SystemExit: no such definition.
    """
    m = re.search(rf"\b{re.escape(qualified)}\s*\([^)]*\)\s*(?:const\s*)?\{{", src)
    if not m:
        sys.exit(f"make_llamacpp_keys: no definition of {qualified}")
    return src[m.end() : _matching_brace(src, m.end() - 1)]


def _matching_brace(src: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(src)):
        if src[i] == "{":
            depth += 1
        elif src[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    sys.exit("make_llamacpp_keys: unbalanced braces")


def arch_condition(cond: str, arch_enum: str) -> bool | None:
    """Evaluate an ``if`` condition made only of ``arch ==/!= LLM_ARCH_X`` joined by ``||`` / ``&&``
    for ``arch_enum``; None when the condition has anything else (then the block is kept)."""
    cond = cond.strip()
    while cond.startswith("(") and cond.endswith(")"):
        cond = cond[1:-1].strip()
    for op, join in (("||", any), ("&&", all)):
        if op in cond:
            parts = [arch_condition(p, arch_enum) for p in cond.split(op)]
            return None if None in parts else join(parts)
    m = _ARCH_CMP.fullmatch(cond)
    if not m:
        return None
    return (m.group(2) == arch_enum) == (m.group(1) == "==")


def drop_other_arch_blocks(body: str, arch_enum: str) -> tuple[str, list[str]]:
    """``body`` without the blocks guarded by an arch-only condition that is false for ``arch_enum``;
    also returns the conditions dropped (for the fixture's record)."""
    out, dropped, i = [], [], 0
    pat = re.compile(r"\bif\s*\(")
    while True:
        m = pat.search(body, i)
        if not m:
            out.append(body[i:])
            break
        depth, j = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(body[j], 0)
            j += 1
        cond = body[m.end() : j - 1]
        k = j
        while k < len(body) and body[k].isspace():
            k += 1
        if k < len(body) and body[k] == "{" and arch_condition(cond, arch_enum) is False:
            end = _matching_brace(body, k)
            out.append(body[i : m.start()])
            dropped.append(" ".join(cond.split()))
            i = end + 1
        else:
            out.append(body[i : m.end()])
            i = m.end()
    return "".join(out), dropped


def reads(body: str, kv_names: dict[str, str], where: str) -> dict[str, dict]:
    """Every key ``body`` reads: ``{manifest key: {"how", "required", "where"}}``.

    Raises:
        SystemExit: an ``LLM_KV_*`` token that is not the key argument of an ``ml.get_*`` call (the
            tool would have to learn that form of read).
    """
    found: dict[str, dict] = {}
    spans = []
    for m in _READ.finditer(body):
        how, enum = m.group(1), m.group(2)
        spans.append(m.start(2))
        depth, j = 1, m.end()
        while depth:  # the call's closing parenthesis: the last argument says whether the key is required
            depth += {"(": 1, ")": -1}.get(body[j], 0)
            j += 1
        last = body[m.start(2) : j - 1].split(",")[-1].strip()
        key = manifest_key(kv_names[enum])
        prev = found.get(key)
        found[key] = {
            "how": how if prev is None or prev["how"] == how else f"{prev['how']}+{how}",
            "required": last != "false" or bool(prev and prev["required"]),
            "where": where,
        }
    for m in _KV_TOKEN.finditer(body):
        if m.start() not in spans:
            sys.exit(f"make_llamacpp_keys: {where}: {m.group(0)} is used other than as ml.get_*(KEY, ...)")
    return found


def collect(src_dir: Path) -> dict:
    """The fixture's content for :data:`ARCHS` from the llama.cpp tree at ``src_dir``."""
    rd = lambda p: strip_comments((src_dir / p).read_text())  # noqa: E731
    kv_names, arch_names = name_tables(rd("src/llama-arch.cpp"))
    model_cpp = rd("src/llama-model.cpp")
    generic_body = function_body(model_cpp, "llama_model_base::load_hparams")
    helpers = {}
    for m in re.finditer(r"\bllama_model_base::(\w+)\s*\(\s*llama_model_loader\s*&", model_cpp):
        name = m.group(1)
        if name not in NOT_HELPERS:
            body = function_body(model_cpp, f"llama_model_base::{name}")
            if _KV_TOKEN.search(body):
                helpers[name] = reads(body, kv_names, f"src/llama-model.cpp llama_model_base::{name}")
    enum_of = {v: k for k, v in arch_names.items()}
    model_files = {p: rd(p.relative_to(src_dir)) for p in sorted((src_dir / "src" / "models").glob("*.cpp"))}
    archs = {}
    for arch in ARCHS:
        enum = enum_of[arch]
        cls = "llama_model_" + enum[len("LLM_ARCH_") :].lower()
        files = [p for p, s in model_files.items() if re.search(rf"\b{cls}::load_arch_hparams\b", s)]
        if len(files) != 1:
            sys.exit(f"make_llamacpp_keys: {cls}::load_arch_hparams defined in {len(files)} files")
        rel = str(files[0].relative_to(src_dir))
        body, dropped = drop_other_arch_blocks(generic_body, enum)
        keys = reads(body, kv_names, "src/llama-model.cpp llama_model_base::load_hparams")
        text = model_files[files[0]]
        keys.update(reads(text, kv_names, f"{rel} {cls}"))
        for name, hk in helpers.items():
            if re.search(rf"\b{name}\s*\(", text):
                keys.update(hk)
        archs[arch] = {
            "enum": enum,
            "class": cls,
            "file": rel,
            "skipped_conditions": dropped,
            "keys": dict(sorted(keys.items())),
        }
    return {
        "source": "llama.cpp vendored in llama-cpp-python 0.3.36 (src/llama-arch.cpp LLM_KV_NAMES, src/llama-model.cpp "
        "llama_model_base::load_hparams and helpers, src/models/<arch>.cpp); written by tools/make_llamacpp_keys.py",
        "known_keys": sorted({manifest_key(v) for v in kv_names.values()}),
        "archs": archs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-cpp", default=DEFAULT_SRC, help="llama.cpp source tree (vendor/llama.cpp of llama-cpp-python)"
    )
    ap.add_argument("-o", "--out", default=str(FIXTURE))
    ap.add_argument("--check", action="store_true", help="compare with the fixture instead of writing it")
    a = ap.parse_args(argv)
    data = collect(Path(a.llama_cpp))
    text = json.dumps(data, indent=1, sort_keys=False) + "\n"
    if a.check:
        same = Path(a.out).read_text() == text
        print("fixture matches the source" if same else f"{a.out} differs from {a.llama_cpp}")
        return 0 if same else 1
    Path(a.out).write_text(text)
    for arch, d in data["archs"].items():
        print(f"{arch:10s} {len(d['keys']):3d} keys  ({d['file']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
