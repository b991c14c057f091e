"""The default-settings reference rows fail on realistic geometry errors.

Every architecture's *default row* of tests/test_engine_reference.py - ``TOLERANCES[(fixture, *DEFAULT)]``,
the numerics and CPU kernel ``strata-engine generate`` runs when neither is named - is run here on a copy of
the fixture's pack with one realistic error put in, and the same :func:`compare` against the same llama.cpp
fixture must fail. The unmutated copy must pass (``test_the_unmutated_copy_passes``), so the copy is not
what fails. The errors (:data:`EDITS`):

- a ``key value`` of the copy's ``geometry.txt`` edited: rope base x0.01 or x100 (``rope_base``, gemma3's
  ``rope_base_swa``), RMS eps x100, one routed expert fewer per token (``n_expert_used``), a partial rope lost
  (``rope_dim`` = the head size), the linear rope scaling lost, gemma3's sliding window off (0: every layer
  global) or its layer pattern off (``swa_pattern`` 3);
- a flag of the architecture's block recipe (``engine/models/<arch>.py``; geometry.txt has no norm placement):
  gemma3's sandwich norms dropped, the q/k norms dropped, the rope pairing flipped (NORM <-> NEOX), the MoE
  weight renormalisation flipped, qwen3next's / qwen2moe's sigmoid gate of the shared expert dropped.

Every one of them keeps each tensor's shape, so the pack loads and the numerics row is what catches it.
:data:`MUTATIONS` says, for each (row, mutation), which check of :func:`compare` fires first (measured,
and asserted): ``argmax`` - a greedy step whose reference margin is clear picks another token; ``logit`` -
the max |d logit| bound of the strictly checked steps; ``top`` - llama.cpp's top-1 is not in our top 5 at
the last prompt position. Errors that change a shape are refused at load instead
(``test_shape_changing_geometry_is_refused_at_load``). An edit of geometry.txt alone is refused at load before
either (geometry.txt disagrees with metadata.txt: :mod:`strata.packer.pack_geometry`); each test asserts that refusal,
then sets the comparison aside, standing for an error both files carry (a converter's or a builder's bug).

Measured 2026-12-01, max |d logit| of the strictly checked steps, unmutated -> mutated, for the errors
nearest a bound (the others move the logits by 0.1-2 or change a clear greedy token): qwen2 rope x100
0.009 -> 0.020 (TOL 0.015), rms eps x100 -> 0.064; gemma3-rope rope x0.01 0.007 -> 0.103, x100 -> 0.049, eps
-> 0.061 (TOL 0.015); llama rope x100 0.016 -> 0.076, pairs flipped -> 0.061 (TOL 0.03); llama-rope-linear
rope x0.01 0.018 -> 0.030 (TOL 0.025), scaling lost -> 0.071, pairs -> 0.072; qwen3 eps 0.020 -> 0.069 (TOL
0.03); llama_moe rope x0.01 0.017 -> 0.120, pairs -> 0.121 (TOL 0.03); qwen3next rope x0.01 0.022 -> 0.034,
partial rope lost -> 0.036, q/k norms -> 0.045 (TOL 0.03); qwen3next-split-fused partial rope lost 0.024 ->
0.048, q/k norms -> 0.040 (TOL 0.03).

Not caught, or by too little to assert (measured; the error moves the logits less than the numerics' own
distance from llama.cpp there): qwen3next rope x100 (0.0303 at TOL 0.03) and qwen3next-split-fused's rope
base either way (0.027 / 0.023 against 0.024 unmutated) - their one attention layer in four rotates 16 of
64 dims, so the rope base hardly reaches the logits of these synthetic weights; llama-rope-linear rope x100
(0.027 at TOL 0.025: its positions are scaled by 1/8); RMS eps x10 on qwen3moe (0.049 against 0.047);
gemma3's soft-cap set to 30 (synthetic logits ~1: tanh(1/30) * 30 moves them by 4e-4).

The real models' default rows (marked ``real``, ``slow``) take the errors that are realistic for them: the
rope base of either layer kind, the eps, gemma's sandwich norms, qwen2's rope pairing.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from test_engine_reference import DEFAULT, TOLERANCES, compare, load_fixture, synthetic_pack

from strata.engine import startup
from strata.engine.loader import LoadError
from strata.engine.models import recipe_for
from strata.engine.recipe import Attention, Block, MoEFFN, Recipe
from strata.engine.startup import load_engine
from strata.packer.pack_geometry import PackGeometry

# ------------------------------------------------------------------ the mutations

Edit = dict[str, Callable[[str], str]] | Callable[[Recipe], Recipe]


def scale(f: float) -> Callable[[str], str]:
    """A geometry value (a float's text) times ``f``."""
    return lambda v: repr(float(v) * f)


def to(value: str) -> Callable[[str], str]:
    """A geometry value replaced by ``value``."""
    return lambda v: value


def add(n: int) -> Callable[[str], str]:
    """A geometry value (an int's text) plus ``n``."""
    return lambda v: str(int(v) + n)


def each_block(fn: Callable[[Block], Block]) -> Callable[[Recipe], Recipe]:
    """A recipe edit: ``fn`` applied to every layer kind's block."""
    return lambda r: dataclasses.replace(r, blocks={k: fn(b) for k, b in r.blocks.items()})


def attention(fn: Callable[[Attention], Attention]) -> Callable[[Recipe], Recipe]:
    """A recipe edit of every softmax-attention mixer (a delta-net layer is left as it is)."""
    return each_block(lambda b: dataclasses.replace(b, mixer=fn(b.mixer)) if isinstance(b.mixer, Attention) else b)


def experts(fn: Callable[[MoEFFN], MoEFFN]) -> Callable[[Recipe], Recipe]:
    """A recipe edit of every routed-experts FFN (a dense FFN is left as it is)."""
    return each_block(lambda b: dataclasses.replace(b, ffn=fn(b.ffn)) if isinstance(b.ffn, MoEFFN) else b)


#: mutation -> geometry.txt edits (key -> new value from the old text) or a recipe edit
EDITS: dict[str, Edit] = {
    "rope_base/100": {"rope_base": scale(0.01)},
    "rope_base*100": {"rope_base": scale(100.0)},
    "rope_base_swa/100": {"rope_base_swa": scale(0.01)},
    "rms_eps*100": {"rms_eps": scale(100.0)},
    "n_expert_used-1": {"n_expert_used": add(-1)},
    "partial rope lost": {"rope_dim": to("64")},  # every fixture with a partial rope has head_dim 64
    "rope scaling lost": {"rope_scaling_factor": to("none")},
    "no sliding window": {"sliding_window": to("0")},
    "swa_pattern 3": {"swa_pattern": to("3")},
    "no sandwich norms": each_block(lambda b: dataclasses.replace(b, mixer_post_norm=None, ffn_post_norm=None)),
    "no q/k norms": attention(lambda m: dataclasses.replace(m, qk_norm=False)),
    "rope pairs flipped": attention(lambda m: dataclasses.replace(m, rope="neox" if m.rope == "norm" else "norm")),
    "renormalisation flipped": experts(lambda f: dataclasses.replace(f, norm_weights=not f.norm_weights)),
    "no shared-expert gate": experts(lambda f: dataclasses.replace(f, shared_gate=False)),
}

#: the message of each check of :func:`compare`
CHECKS = {
    "argmax": r"step \d+: argmax \d+ != llama\.cpp \d+",
    "logit": r"^max \|logit - llama\.cpp\| = ",
    "top": r"step 0: llama\.cpp's top-1 \d+ not in our top 5",
}

#: fixture (synthetic-<name>) -> mutation -> the check of its default row that fails first (measured)
MUTATIONS: dict[str, dict[str, str]] = {
    "qwen2": {
        "rope_base/100": "argmax",
        "rope_base*100": "logit",
        "rms_eps*100": "logit",
        "rope pairs flipped": "argmax",
    },
    "gemma3": {
        "rope_base/100": "logit",
        "rope_base*100": "argmax",
        "rope_base_swa/100": "top",
        "rms_eps*100": "argmax",
        "no sliding window": "top",
        "swa_pattern 3": "argmax",
        "no sandwich norms": "top",
        "no q/k norms": "top",
    },
    "gemma3-rope": {
        "rope_base/100": "logit",
        "rope_base*100": "logit",
        "rope_base_swa/100": "argmax",
        "rms_eps*100": "logit",
        "partial rope lost": "top",
        "rope scaling lost": "argmax",
        "no sandwich norms": "top",
    },
    "llama": {
        "rope_base/100": "argmax",
        "rope_base*100": "logit",
        "rms_eps*100": "argmax",
        "rope pairs flipped": "logit",
    },
    "llama-rope-linear": {
        "rope_base/100": "logit",
        "rms_eps*100": "argmax",
        "rope scaling lost": "logit",
        "rope pairs flipped": "logit",
    },
    "qwen3": {
        "rope_base/100": "argmax",
        "rope_base*100": "argmax",
        "rms_eps*100": "logit",
        "no q/k norms": "argmax",
        "rope pairs flipped": "top",
    },
    "qwen2moe": {
        "rope_base/100": "argmax",
        "rope_base*100": "argmax",
        "rms_eps*100": "argmax",
        "n_expert_used-1": "argmax",
        "rope pairs flipped": "argmax",
        "renormalisation flipped": "argmax",
        "no shared-expert gate": "argmax",
    },
    "qwen3moe": {
        "rope_base/100": "argmax",
        "rope_base*100": "argmax",
        "rms_eps*100": "argmax",
        "n_expert_used-1": "top",
        "no q/k norms": "argmax",
        "renormalisation flipped": "top",
    },
    "llama_moe": {
        "rope_base/100": "argmax",
        "rope_base*100": "argmax",
        "rms_eps*100": "argmax",
        "n_expert_used-1": "top",
        "rope pairs flipped": "argmax",
        "renormalisation flipped": "top",
    },
    "qwen3next": {
        "rope_base/100": "logit",
        "rms_eps*100": "argmax",
        "n_expert_used-1": "argmax",
        "partial rope lost": "logit",
        "no q/k norms": "logit",
        "renormalisation flipped": "argmax",
        "no shared-expert gate": "argmax",
    },
    "qwen3next-split-fused": {
        "rms_eps*100": "top",
        "n_expert_used-1": "top",
        "partial rope lost": "logit",
        "no q/k norms": "logit",
    },
}


def mutated_copy(src: Path, dst: Path, edit: Edit | None) -> Path:
    """A copy of pack ``src`` at ``dst`` (``pool.bin`` linked, the rest copied) with ``edit``'s geometry.txt
    changes made. Raises AssertionError for an edited key the pack's geometry.txt does not have."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "pool.bin":  # read only, and hundreds of MB for the real models
            (dst / f.name).symlink_to(f.resolve())
        else:
            shutil.copy2(f, dst / f.name)
    if isinstance(edit, dict):
        g = dst / "geometry.txt"
        lines = g.read_text(encoding="utf-8").splitlines()
        keys = {ln.partition(" ")[0] for ln in lines}
        assert set(edit) <= keys, f"{src}: geometry.txt has no {sorted(set(edit) - keys)}"
        out = []
        for ln in lines:
            k, _, v = ln.partition(" ")
            out.append(f"{k} {edit[k](v)}" if k in edit else ln)
        g.write_text("\n".join(out) + "\n", encoding="utf-8")
    return dst


def load_mutated(monkeypatch, pack: Path, edit: Edit | None, n_ctx: int):
    """The engine of ``pack`` with the default settings, built from the edited recipe where ``edit`` is one. A
    geometry.txt edit is first refused at load as it is (geometry.txt disagrees with metadata.txt:
    strata.packer.pack_geometry, the rule the budget applies, names the param); the engine is then loaded with that
    comparison set aside, standing for a geometry error that both files carry (a converter's or a builder's bug),
    which only the numerics row can catch."""
    if callable(edit):
        monkeypatch.setattr(startup, "recipe_for", lambda arch: edit(recipe_for(arch)))
    elif edit:
        said = "|".join(f"geometry.txt param {k} disagrees with the metadata" for k in edit)
        with pytest.raises(LoadError, match=said):
            load_engine(pack, n_ctx=n_ctx)
        monkeypatch.setattr(startup, "pack_geometry", lambda _pack: PackGeometry(None, None))
    return load_engine(pack, n_ctx=n_ctx)


# ------------------------------------------------------------------ synthetic rows (CI)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """name -> the pack of fixture synthetic-<name>, rebuilt once for the module (the copies are made per test)."""
    return {n: synthetic_pack(tmp_path_factory, f"synthetic-{n}") for n in MUTATIONS}


def test_every_default_row_is_mutated():
    synthetic = {f.removeprefix("synthetic-") for f, _, _ in TOLERANCES if f.startswith("synthetic-")}
    assert set(MUTATIONS) == synthetic
    assert all(m in EDITS and how in CHECKS for ms in MUTATIONS.values() for m, how in ms.items())
    # every row fails on a geometry.txt error, not only on a recipe flag
    assert all(any(isinstance(EDITS[m], dict) for m in ms) for ms in MUTATIONS.values())


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_unmutated_copy_passes(packs, tmp_path, monkeypatch, name):
    eng = load_mutated(monkeypatch, mutated_copy(packs[name], tmp_path / "pack", None), None, 256)
    compare(eng, load_fixture(f"synthetic-{name}"), TOLERANCES[(f"synthetic-{name}", *DEFAULT)])


@pytest.mark.parametrize("name,mutation", [(n, m) for n, ms in sorted(MUTATIONS.items()) for m in ms])
def test_a_realistic_error_fails_the_default_row(packs, tmp_path, monkeypatch, name, mutation):
    edit = EDITS[mutation]
    eng = load_mutated(monkeypatch, mutated_copy(packs[name], tmp_path / "pack", edit), edit, 256)
    with pytest.raises(AssertionError, match=CHECKS[MUTATIONS[name][mutation]]):
        compare(eng, load_fixture(f"synthetic-{name}"), TOLERANCES[(f"synthetic-{name}", *DEFAULT)])


@pytest.mark.parametrize(
    "name,key,value,message",
    [
        # qwen3next: which layers are attention comes from full_attention_interval; 2 makes layer 1 one
        ("qwen3next", "full_attention_interval", "2", "tensor blk.1.attn_qkv.weight is not in the qwen3next contract"),
        ("qwen3moe", "n_expert", "7", "tensor blk.0.ffn_gate_inp.weight has shape [256, 8], the qwen3moe contract"),
        ("gemma3", "n_head_kv", "2", "tensor blk.0.attn_k.weight has shape [256, 64], the gemma3 contract requires"),
    ],
)
def test_shape_changing_geometry_is_refused_at_load(packs, tmp_path, monkeypatch, name, key, value, message):
    """Refused first because geometry.txt disagrees with metadata.txt; with that comparison set aside (an error both
    files carry), by the shape it makes wrong."""
    pack = mutated_copy(packs[name], tmp_path / "pack", {key: to(value)})
    with pytest.raises(LoadError, match=re.escape(f"geometry.txt param {key} disagrees with the metadata")):
        load_engine(pack, n_ctx=256)
    monkeypatch.setattr(startup, "pack_geometry", lambda _pack: PackGeometry(None, None))
    with pytest.raises(LoadError, match=re.escape(message)):
        load_engine(pack, n_ctx=256)


# ------------------------------------------------------------------ real models (fetched, cached)

#: real model -> mutation -> the check that fails first (measured)
REAL_MUTATIONS: dict[str, dict[str, str]] = {
    "gemma3-270m": {
        "rope_base/100": "argmax",
        "rope_base_swa/100": "argmax",
        "rms_eps*100": "argmax",
        "no sandwich norms": "top",
        "no q/k norms": "top",
    },
    "qwen2.5-0.5b": {
        "rope_base/100": "argmax",
        "rope_base*100": "logit",
        "rms_eps*100": "logit",
        "rope pairs flipped": "argmax",
    },
}


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("name,mutation", [(n, m) for n, ms in REAL_MUTATIONS.items() for m in ms])
def test_a_realistic_error_fails_the_real_default_row(request, tmp_path, monkeypatch, name, mutation):
    src = request.getfixturevalue("gemma_pack" if name == "gemma3-270m" else "qwen05_pack")
    edit = EDITS[mutation]
    eng = load_mutated(monkeypatch, mutated_copy(src, tmp_path / "pack", edit), edit, 128)
    with pytest.raises(AssertionError, match=CHECKS[REAL_MUTATIONS[name][mutation]]):
        compare(eng, load_fixture(name), TOLERANCES[(name, *DEFAULT)])
