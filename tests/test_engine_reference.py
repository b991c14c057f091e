"""strata-engine's CPU path against llama.cpp (llama-cpp-python 0.3.36) reference fixtures.

Fixtures (tests/fixtures/reference/): greedy runs of llama.cpp, 24 steps per prompt, the top-5
``[id, logit]`` per step including the last prompt position (tools/make_reference.py; the
synthetic ones via tools/make_synthetic_reference.py, which stores the generator spec so the
GGUF is rebuilt here byte for byte - its sha256 is checked).

How a model is compared (one loop, :func:`strata.engine.generate.decode`): the prompt ids and
then the *reference's* tokens are fed (teacher forcing), and at every step our logits are
compared with the reference's:

- prompt ids from our tokenizer == llama.cpp's;
- step 0 (last prompt position): our top-5 contains the reference top-1;
- every logit of the reference top-5, every step: ``|ours - llama.cpp| <= TOL_LOGIT``, and the
  mean of those differences ``<= TOL_MEAN``;
- greedy agreement: our argmax == the reference token at every step whose reference top-1/top-2
  margin exceeds ``TOL_MARGIN`` (the error on a *difference* of two logits, where common shifts
  cancel; measured below), and at least ``MIN_CHECKED`` of the steps are checked.

Tolerances, in logits. llama.cpp quantizes activations to 8 bits inside every quantized matmul
(Q8_0 / Q8_K), keeps K/V in f16 and uses an fp16 GELU table; the default ``f32`` path keeps K/V in
f16 too (``--kv f16``, the engine's default, like llama.cpp's) but does none of the rest
(strata.engine.numerics). Measured maxima over all fixture steps (f32 profile unless noted), with
the f16 KV cache and, in brackets, with ``--kv f32``, and the tolerance used (~1.25-2x the maximum).
The f16 cache moves no figure by more than 0.004 and no tolerance had to change:

==================  ===============  =========  ===============  ==========  ========================
fixture             max |d|          TOL_LOGIT  max d(margin)    TOL_MARGIN  note
==================  ===============  =========  ===============  ==========  ========================
gemma3-270m         1.198 (1.194)    1.5        0.397 (0.400)    0.5         Gemma amplifies 8-bit
qwen2.5-0.5b        0.240 (0.241)    0.35       0.225 (0.222)    0.3         activation rounding
synth qwen3moe lcpp 0.027            0.05       0.022            0.03        routing is discontinuous
synth qwen3moe f32  0.802 (0.802)    1.2        0.427 (0.428)    0.6         (top-k flips), see below
synthetic qwen2     0.0094 (0.0093)  0.02       0.012 (0.012)    0.02
synthetic gemma3    0.0073 (0.0071)  0.015      0.0079 (0.0079)  0.015       130-token prompt > window
synth qwen3next lc  0.011            0.05       (71 steps)       0.03        delta net + gated attn
synth q3n split lc  0.0091           0.05       (76 steps)       0.03        3 shards, fused gate_up
synth qwen3next f32 0.450            0.7        -                0.6         routing flips, bounds only
synth q3n split f32 0.468            0.7        -                0.6
==================  ===============  =========  ===============  ==========  ========================

(means: gemma3-270m 0.207 (0.207), qwen2.5-0.5b 0.057 (0.057). The llamacpp profile assumes llama.cpp's
f16 cache: with ``--kv f32`` the synthetic MoE drifts to 0.85, routing flips.)

CPU kernels: each row names one (``cpu_kernel``). The figures above were measured with the ``f32`` dot;
the CPU engine's default is now ``q8`` (llama.cpp's own arithmetic: Q8_0/Q8_K activations, integer block
dots; strata.engine.cpu.kernels), whose figures are beside TOLERANCES - the same level, with the f32-profile
MoE rows closer (routing follows llama.cpp's more often) and the real models' f32-profile rows a little
further (their activations are now quantized while attention stays f32).

A one-token Gemma forward pass with the ``llamacpp`` numerics mode matches llama.cpp to 2e-5; longer
runs do not get closer than the f32 path for the real models (see strata.engine.numerics), but
the synthetic MoE does (expert selection follows llama.cpp's), so it is checked with both.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from strata.engine.generate import decode, generate
from strata.engine.startup import load_engine

FIXTURES = Path(__file__).parent / "fixtures" / "reference"

#: (fixture, numerics, CPU kernel) -> (TOL_LOGIT, TOL_MEAN, TOL_MARGIN, MIN_CHECKED steps of all prompts).
#: Kernel "q8" is the CPU engine's default (llama.cpp's integer dots, strata.engine.cpu.kernels); "f32" rows are
#: the f32 dot the figures of the module docstring were measured with (the default before the q8 kernel).
TOLERANCES = {
    ("gemma3-270m", "f32", "f32"): (1.5, 0.3, 0.5, 48),
    ("qwen2.5-0.5b", "f32", "f32"): (0.35, 0.1, 0.3, 60),
    ("synthetic-qwen3moe", "llamacpp", "f32"): (0.05, 0.01, 0.03, 40),
    # f32 on the MoE: no step's margin is above the error a routing flip causes; the greedy check of
    # this fixture is the llamacpp row above, this one bounds the logits only
    ("synthetic-qwen3moe", "f32", "f32"): (1.2, 0.08, 0.6, 0),
    ("synthetic-qwen2", "f32", "f32"): (0.02, 0.005, 0.02, 40),
    ("synthetic-gemma3", "f32", "f32"): (0.015, 0.004, 0.015, 60),
    # qwen3next: gated delta net + gated attention + shared expert. With llama.cpp's activation
    # roundings (llamacpp profile) the first steps agree to < 1e-4, later ones to ~0.02 (measured below)
    ("synthetic-qwen3next", "llamacpp", "f32"): (0.05, 0.01, 0.03, 40),
    ("synthetic-qwen3next", "f32", "f32"): (0.7, 0.03, 0.6, 0),  # like qwen3moe f32: routing flips; bounds only
    ("synthetic-qwen3next-split-fused", "llamacpp", "f32"): (0.05, 0.01, 0.03, 40),
    ("synthetic-qwen3next-split-fused", "f32", "f32"): (0.7, 0.03, 0.6, 0),
    # issue 13 (measured 2026-11-30, max / mean |d logit|): llama NORM rope + rope_freqs factors
    # (llamacpp 0.013 / 0.0025, f32 0.026 / 0.0044; without the factors or with NEOX pairs the argmax
    # check fails at step 1), Mixtral-style llama experts (llamacpp 0.010 / 0.0010), qwen3 (llamacpp
    # 0.014 / 0.0015, f32 0.014 / 0.0040), qwen2moe (llamacpp 0.012 / 0.0003). The MoE f32 rows flip
    # routing like qwen3moe's: bounds only
    ("synthetic-llama", "llamacpp", "f32"): (0.03, 0.005, 0.03, 40),
    ("synthetic-llama", "f32", "f32"): (0.05, 0.008, 0.03, 40),
    ("synthetic-llama_moe", "llamacpp", "f32"): (0.03, 0.005, 0.03, 40),
    ("synthetic-llama_moe", "f32", "f32"): (0.8, 0.02, 0.6, 0),
    ("synthetic-qwen3", "llamacpp", "f32"): (0.03, 0.005, 0.03, 40),
    ("synthetic-qwen3", "f32", "f32"): (0.03, 0.008, 0.03, 40),
    ("synthetic-qwen2moe", "llamacpp", "f32"): (0.03, 0.005, 0.03, 40),
    ("synthetic-qwen2moe", "f32", "f32"): (0.3, 0.01, 0.6, 0),
}
# The q8 kernel (issue 9, measured 2026-11-30; max / mean |d logit| with q8, f32 dot in brackets): the same
# tolerances wherever its figures stay inside them - qwen2 0.0094 / 0.0026, gemma3 0.0069 / 0.0021, llama
# 0.016 / 0.0044 (f32) and 0.013 / 0.0016 (llamacpp), qwen3 0.020 / 0.0036 and 0.0099 / 0.0020, qwen3next
# 0.449 / 0.012 and 0.011 / 0.0014, llama_moe 0.080 / 0.0045 (0.392 / 0.0073) and 0.010 / 0.0013, qwen2moe
# 0.017 / 0.0036 (0.130 / 0.0043) and 0.012 / 0.0010, qwen3next-split-fused 0.401 / 0.0097 (0.468 / 0.015) and
# 0.0095 / 0.0015, qwen3moe f32 0.682 / 0.020 (0.802 / 0.044): with Q8
# activations in the experts the f32-profile MoE rows route like llama.cpp more often. Own rows where not:
TOLERANCES.update({(f, nx, "q8"): tol for (f, nx, k), tol in list(TOLERANCES.items())})
TOLERANCES.update(
    {
        # one routing flip in 67 steps (llamacpp exact: the same 0.144; the f32 dot happens to miss it: 0.027)
        ("synthetic-qwen3moe", "llamacpp", "q8"): (0.2, 0.01, 0.03, 40),
        # Gemma amplifies 8-bit activation rounding (strata.engine.numerics): f32 profile + q8 1.397 / 0.244,
        # llamacpp + q8 1.173 / 0.230 (llamacpp + f32 dot 1.095 / 0.229)
        ("gemma3-270m", "f32", "q8"): (1.8, 0.35, 0.5, 48),
        ("gemma3-270m", "llamacpp", "q8"): (1.5, 0.3, 0.5, 48),
        # f32 profile + q8 0.349 / 0.068, llamacpp + q8 0.294 / 0.068 (llamacpp + f32 dot 0.282 / 0.060)
        ("qwen2.5-0.5b", "f32", "q8"): (0.45, 0.1, 0.3, 60),
        ("qwen2.5-0.5b", "llamacpp", "q8"): (0.4, 0.1, 0.3, 60),
    }
)


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))


def synthetic_pack(tmp_path_factory, name: str) -> Path:
    """Rebuild the synthetic GGUF of fixture ``name`` from its stored spec (sha256-checked) and pack it."""
    from strata import testing as synth
    from strata.packer.build import build_pack

    ref = load_fixture(name)
    spec = synth.ModelSpec.model_validate(ref["synthetic"]["spec"])
    d = tmp_path_factory.mktemp(name)
    paths = synth.write_model(d / ref["model"]["file"], spec)
    want = ref["synthetic"].get("shards_sha256", [ref["model"]["sha256"]])
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert digests == want, (
        f"{name}: strata.testing no longer writes the file(s) the reference was recorded on "
        "(regenerate with tools/make_synthetic_reference.py)"
    )
    build_pack(paths[ref["synthetic"].get("pack_from_shard", 0)], d / "pack", progress=False)
    return d / "pack"


def teacher_forced(engine, prompt_ids: list[int], ref_ids: list[int]) -> list[np.ndarray]:
    """Our logits at every step while feeding the reference's tokens (one decode loop)."""
    rows: list[np.ndarray] = []

    def pick(row: np.ndarray) -> int:
        rows.append(row.copy())
        return ref_ids[len(rows) - 1]

    decode(engine.model, engine.state, prompt_ids, len(ref_ids), pick)
    return rows


def compare(engine, ref: dict, tol: tuple[float, float, float, int]) -> dict:
    """Run every prompt of ``ref`` and assert the comparison of the module docstring."""
    tol_logit, tol_mean, tol_margin, min_checked = tol
    diffs, checked, worst = [], 0, (0.0, None)
    assert len(ref["prompts"]) >= 3 and ref["n_steps"] >= 16
    for p in ref["prompts"]:
        assert engine.tokenizer.encode(p["prompt"]) == p["prompt_ids"], p["prompt"]
        rows = teacher_forced(engine, p["prompt_ids"], p["output_ids"])
        assert len(rows) == len(p["steps"]) >= 16
        top0 = np.argsort(-rows[0], kind="stable")[:5].tolist()
        assert p["steps"][0]["top"][0][0] in top0, (p["prompt"], top0, p["steps"][0]["top"])
        for s, (row, rec) in enumerate(zip(rows, p["steps"])):
            for i, v in rec["top"]:
                d = abs(float(row[i]) - v)
                diffs.append(d)
                if d > worst[0]:
                    worst = (d, (p["prompt"][:30], s, i))
            if rec["margin"] > tol_margin:
                checked += 1
                assert int(np.argmax(row)) == p["output_ids"][s], (
                    f"{p['prompt'][:30]!r} step {s}: argmax {int(np.argmax(row))} != llama.cpp {p['output_ids'][s]} "
                    f"(reference margin {rec['margin']:.4f} > {tol_margin})"
                )
    assert worst[0] <= tol_logit, f"max |logit - llama.cpp| = {worst[0]:.4f} > {tol_logit} at {worst[1]}"
    mean = float(np.mean(diffs))
    assert mean <= tol_mean, f"mean |logit - llama.cpp| = {mean:.4f} > {tol_mean}"
    assert checked >= min_checked, f"only {checked} steps had a margin above {tol_margin}"
    return {"max": worst[0], "mean": mean, "checked": checked}


# ------------------------------------------------------------------ synthetic (CI, seconds)


@pytest.fixture(scope="module")
def syn_packs(tmp_path_factory):
    return {
        n: synthetic_pack(tmp_path_factory, f"synthetic-{n}")
        for n in (
            "qwen3moe",
            "qwen2",
            "gemma3",
            "qwen3next",
            "qwen3next-split-fused",
            "llama",
            "llama_moe",
            "qwen3",
            "qwen2moe",
        )
    }


SYNTHETIC = [
    ("qwen3moe", "llamacpp"),
    ("qwen3moe", "f32"),
    ("qwen2", "f32"),
    ("gemma3", "f32"),
    ("qwen3next", "llamacpp"),
    ("qwen3next", "f32"),
    ("qwen3next-split-fused", "llamacpp"),
    ("qwen3next-split-fused", "f32"),
    ("llama", "llamacpp"),
    ("llama", "f32"),
    ("llama_moe", "llamacpp"),
    ("llama_moe", "f32"),
    ("qwen3", "llamacpp"),
    ("qwen3", "f32"),
    ("qwen2moe", "llamacpp"),
    ("qwen2moe", "f32"),
]


@pytest.mark.parametrize(
    "name,numerics,kernel",
    [(n, nx, "q8") for n, nx in SYNTHETIC]
    + [("qwen3moe", "llamacpp", "f32"), ("qwen2", "f32", "f32"), ("llama_moe", "f32", "f32")],
)
def test_synthetic_matches_llama_cpp(syn_packs, name, numerics, kernel):
    ref = load_fixture(f"synthetic-{name}")
    eng = load_engine(syn_packs[name], n_ctx=256, numerics=numerics, cpu_kernel=kernel)
    r = compare(eng, ref, TOLERANCES[(f"synthetic-{name}", numerics, kernel)])
    print(f"{name} {numerics} {kernel}: {r}")


def test_synthetic_gemma3_prompt_outruns_the_sliding_window(syn_packs):
    ref = load_fixture("synthetic-gemma3")
    eng = load_engine(syn_packs["gemma3"], n_ctx=256)
    window = eng.geometry["sliding_window"]
    assert max(len(p["prompt_ids"]) for p in ref["prompts"]) > window  # the window is exercised
    assert eng.model.attn[0].window == window and eng.model.attn[1].window is None  # pattern 2: swa, global


def test_synthetic_greedy_generation_reproduces_llama_cpp_tokens(syn_packs):
    # free-running greedy through the CLI's function (not teacher-forced): the tokens equal
    # llama.cpp's up to the first step whose reference margin is within the tolerance
    ref = load_fixture("synthetic-gemma3")
    tol_margin = TOLERANCES[("synthetic-gemma3", "f32", "q8")][2]
    eng = load_engine(syn_packs["gemma3"], n_ctx=256)
    compared = 0
    for p in ref["prompts"]:
        r = generate(eng, p["prompt"], ref["n_steps"], ignore_eos=True)
        assert r.prompt_ids == p["prompt_ids"]
        first_low = next((s for s, rec in enumerate(p["steps"]) if rec["margin"] <= tol_margin), len(p["steps"]))
        assert r.output_ids[:first_low] == p["output_ids"][:first_low]
        compared += first_low
    assert compared >= 16


# ------------------------------------------------------------------ real models (fetched, cached)

REAL = [("f32", "q8"), ("llamacpp", "q8"), ("f32", "f32")]


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("numerics,kernel", REAL)
def test_gemma3_270m_matches_llama_cpp(gemma_pack, numerics, kernel):
    ref = load_fixture("gemma3-270m")
    eng = load_engine(gemma_pack, n_ctx=128, numerics=numerics, cpu_kernel=kernel)
    compare(eng, ref, TOLERANCES[("gemma3-270m", numerics, kernel)])


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("numerics,kernel", REAL)
def test_qwen25_05b_matches_llama_cpp(qwen05_pack, numerics, kernel):
    ref = load_fixture("qwen2.5-0.5b")
    eng = load_engine(qwen05_pack, n_ctx=128, numerics=numerics, cpu_kernel=kernel)
    compare(eng, ref, TOLERANCES[("qwen2.5-0.5b", numerics, kernel)])
