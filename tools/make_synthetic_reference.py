#!/usr/bin/env python
"""Write llama.cpp reference fixtures for strata's synthetic models (the MoE coverage).

No small real MoE GGUF exists on the registry, so the qwen3moe forward pass is checked against
llama.cpp on a synthetic file (docs/DESIGN.md "Real models and the reference engine"):
this script writes the file with :func:`strata.testing.write_model` from a preset spec and a
seed, runs ``tools/make_reference.py``'s greedy recorder on it (llama-cpp-python), and stores the
full spec beside the reference, so ``tests/test_engine_reference.py`` rebuilds the byte-identical
GGUF (its sha256 is checked) without llama.cpp or any download.

    python tools/make_synthetic_reference.py                      # all presets below
    python tools/make_synthetic_reference.py qwen3moe --steps 24

Fixtures: ``tests/fixtures/reference/synthetic-<preset>.json`` (format of make_reference.py plus a
``synthetic`` object: ``preset``, ``spec`` = ``ModelSpec.model_dump(mode="json")``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "reference"

_WORDS = (
    "The capital of France is Paris. The capital of Germany is Berlin. A mixture of experts model "
    "routes every token to a few experts out of many; the router picks the top experts and the layer "
    "adds their outputs weighted by the router's probabilities. "
)

_MOE_PROMPTS = [
    "The capital of France is",
    "A mixture of experts model routes every token",
    "def forward(self, x): return",
    "1 2 3 4 5 6 7 8 9 10",
]

#: fixture name -> (generator preset, spec overrides, prompts). Prompts use the synthetic tokenizer's
#: corpus words; the gemma3 preset's sliding window is 128 tokens, so its last prompt is longer than the
#: window. qwen3next-split-fused: a 3-shard split with the fused ffn_gate_up_exps that llama.cpp's
#: qwen3next loader accepts, and expert types that differ per layer (IQ2_XXS gate/up with Q2_0 down).
PRESETS: dict[str, tuple[str, dict, list[str]]] = {
    "qwen3moe": ("qwen3moe", {"seed": 7}, _MOE_PROMPTS),
    "qwen2": (
        "qwen2",
        {"seed": 7},
        ["The capital of France is", "The quick brown fox jumps over the lazy dog", "Numbers like 0 1 2 3"],
    ),
    "gemma3": (
        "gemma3",
        {"seed": 7},
        ["The capital of France is", "hello world, model layer token expert", _WORDS * 2],
    ),
    "qwen3next": ("qwen3next", {"seed": 7}, _MOE_PROMPTS),
    "qwen3next-split-fused": (
        "qwen3next",
        {
            "seed": 11,
            "n_shards": 3,
            "fused_gate_up": True,
            "expert_types": [("IQ2_XS", "IQ4_NL"), ("IQ2_XXS", "Q2_0"), ("Q4_K", "Q5_0"), ("Q3_K", "Q6_K")],
        },
        _MOE_PROMPTS[:3] + [_WORDS],
    ),
    # the engine architectures: llama (NORM rope with Llama 3.1 rope_freqs factors), Mixtral-style
    # llama experts, qwen3 (q/k norms, q width != n_embd), qwen2moe (shared expert, no renormalisation)
    "llama": (
        "llama",
        {"seed": 7},
        ["The capital of France is", "The quick brown fox jumps over the lazy dog", _WORDS],
    ),
    "llama_moe": ("llama_moe", {"seed": 7}, _MOE_PROMPTS),
    "qwen3": ("qwen3", {"seed": 7}, ["The capital of France is", "Numbers like 0 1 2 3", _WORDS]),
    "qwen2moe": ("qwen2moe", {"seed": 7}, _MOE_PROMPTS),
    # honoured metadata keys (strata.manifests.keys): gemma3 rotating 32 of its 64 head dims
    # (rope.dimension_count, ggml_rope_ext n_dims < ne0) with its global layers scaled linearly by 1/4 (the
    # sliding ones never are); llama (NORM rope with rope_freqs factors) scaled linearly by 1/8
    "gemma3-rope": (
        "gemma3",
        {"seed": 7, "dims": {"rope_dim": 32}, "extra_kv": {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}},
        ["The capital of France is", "hello world, model layer token expert", _WORDS * 2],
    ),
    "llama-rope-linear": (
        "llama",
        {"seed": 7, "extra_kv": {"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}},
        ["The capital of France is", "The quick brown fox jumps over the lazy dog", _WORDS],
    ),
}


def _make_reference_module():
    spec = importlib.util.spec_from_file_location("make_reference", ROOT / "tools" / "make_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_spec(name: str, overrides: dict | None = None):
    """The :class:`~strata.testing.ModelSpec` of fixture ``name`` with this script's overrides."""
    from strata import testing as synth

    gen, over, _ = PRESETS[name]
    return getattr(synth, f"{gen}_spec")(**{**over, **(overrides or {})})


def make_fixture(preset: str, steps: int, out: Path) -> dict:
    from strata import testing as synth

    mr = _make_reference_module()
    spec = build_spec(preset)
    gen, _, prompts = PRESETS[preset]
    with tempfile.TemporaryDirectory() as d:
        paths = synth.write_model(Path(d) / f"synthetic-{preset}.gguf", spec)
        ref = mr.make_reference(paths[0], prompts, steps=steps)
        shards = [mr.sha256_file(p) for p in paths]
    ref["synthetic"] = {
        "preset": preset,
        "generator": f"strata.testing.{gen}_spec",
        "spec": spec.model_dump(mode="json"),
    }
    if len(paths) > 1:  # every shard's sha256; the test packs from the second (any shard finds the others)
        ref["synthetic"].update(shards_sha256=shards, pack_from_shard=1)
    text = json.dumps(ref, indent=1, ensure_ascii=False) + "\n"
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return ref


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "presets", nargs="*", default=sorted(PRESETS), help=f"presets (default: {' '.join(sorted(PRESETS))})"
    )
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)
    for p in args.presets:
        if p not in PRESETS:
            ap.error(f"unknown preset {p!r}; known: {', '.join(sorted(PRESETS))}")
        out = FIXTURES / f"synthetic-{p}.json"
        make_fixture(p, args.steps, out)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
