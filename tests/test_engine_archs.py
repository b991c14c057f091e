"""The engine's architectures beyond the first four: llama (dense and Mixtral-style),
qwen3, qwen2moe run; deepseek2 and gpt-oss are refused by name at load. The forward passes are
checked against llama.cpp in tests/test_engine_reference.py (fixtures synthetic-llama, -llama_moe,
-qwen3, -qwen2moe); this file covers what those fixtures do not: the rope pairing itself, llama's
optional MLP biases, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine.generate import generate
from strata.engine.gpu.backend import SimBackend
from strata.engine.layers import Rope
from strata.engine.models import UnsupportedModel, recipes
from strata.engine.startup import load_engine


def _pack(tmp_path, spec, name):
    from strata import testing as synth
    from strata.packer.build import build_pack

    paths = synth.write_model(tmp_path / f"{name}.gguf", spec)
    build_pack(paths[0], tmp_path / f"{name}-pack", progress=False)
    return tmp_path / f"{name}-pack"


def test_rope_norm_rotates_adjacent_pairs_and_applies_freq_factors():
    """ggml rope_f32, LLAMA_ROPE_TYPE_NORM: (x[2i], x[2i+1]) rotated by pos * base^(-2i/n_rot) / f[i];
    dims past n_rot pass through. Checked against complex multiplication, position 5."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 12)).astype(np.float32)
    f = np.array([1.0, 2.0, 4.0, 0.5], dtype=np.float32)
    r = Rope(np, 8, 10000.0, 16, mode="norm", factors=f)(np, x, 5)
    theta = 5 * 10000.0 ** (-np.arange(0, 8, 2) / 8) / f
    z = (x[:, 0:8:2] + 1j * x[:, 1:8:2]) * np.exp(1j * theta)
    want = np.stack([z.real, z.imag], axis=-1).reshape(3, 8)
    np.testing.assert_allclose(r[:, :8], want, rtol=0, atol=2e-6)
    assert np.array_equal(r[:, 8:], x[:, 8:])
    neox = Rope(np, 8, 10000.0, 16)(np, x, 5)
    zn = (x[:, 0:4] + 1j * x[:, 4:8]) * np.exp(1j * 5 * 10000.0 ** (-np.arange(0, 8, 2) / 8))
    np.testing.assert_allclose(neox[:, :8], np.concatenate([zn.real, zn.imag], axis=-1), rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="3 factors, the rope rotates 8 dims"):
        Rope(np, 8, 10000.0, 16, mode="norm", factors=f[:3])
    with pytest.raises(ValueError, match="rope mode 'gptj'"):
        Rope(np, 8, 10000.0, 16, mode="gptj")


def test_engine_architectures_are_the_model_files():
    assert {"llama", "qwen3", "qwen2moe", "qwen3moe", "qwen3next", "qwen2", "gemma3"} <= set(recipes())


def test_llama_mlp_biases_used_on_cpu_and_generic_gpu_and_fused_step_steps_aside(tmp_path):
    """llama's optional ffn_{gate,up,down}.bias (llama.cpp build_ffn adds them): the CPU and the generic GPU
    path apply them (the tokens change against the same weights without them); the fused step, whose
    act_mul takes no bias, says so and leaves the model to the generic path."""
    from strata import testing as synth

    spec = synth.llama_spec(
        seed=3, optional_tensors=("rope_freqs.weight", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")
    )
    pk = _pack(tmp_path, spec, "llama-bias")
    cpu_eng = load_engine(pk, n_ctx=64)
    assert cpu_eng.model.w.has("blk.0.ffn_down.bias")
    cpu = generate(cpu_eng, prompt_ids=[1, 2, 3, 4], n_tokens=6, ignore_eos=True)
    sim_eng = load_engine(pk, device="cuda", ubatch=1, n_ctx=64, backend=SimBackend())
    assert sim_eng.decoder is None and "MLP biases" in sim_eng.gpu.decode_path
    sim = generate(sim_eng, prompt_ids=[1, 2, 3, 4], n_tokens=6, ignore_eos=True)
    assert sim.output_ids == cpu.output_ids
    # the biases matter: the same step with them zeroed gives other logits
    import strata.engine.layers as L

    x = np.ones(256, dtype=np.float32)
    with_b = L.gated_mlp(np, cpu_eng.model.w, 0, x, "silu")

    class NoBias:
        def __init__(self, w):
            self.w = w

        def has(self, name):
            return not name.endswith(".bias") and self.w.has(name)

        def __getattr__(self, k):
            return getattr(self.w, k)

    without = L.gated_mlp(np, NoBias(cpu_eng.model.w), 0, x, "silu")
    assert float(np.abs(with_b - without).max()) > 1e-3


@pytest.mark.parametrize("preset,arch", [("deepseek2", "deepseek2"), ("gpt_oss", "gpt-oss")])
def test_engine_refuses_unimplemented_architectures_by_name(tmp_path, preset, arch):
    """deepseek2 (MLA) and gpt-oss (sinks, MXFP4, biased experts) pack and audit, but the engine has no
    forward pass for them: refused at load naming the architecture and those it runs."""
    from strata import testing as synth

    pk = _pack(tmp_path, synth.PRESETS[preset](), preset)
    with pytest.raises(
        UnsupportedModel,
        match=rf"architecture '{arch}' has no forward pass in strata's engine; "
        r"supported: .*llama.*qwen3",
    ):
        load_engine(pk, n_ctx=32)


@pytest.mark.parametrize("n_ctx", [1, 40, 41, 97])
def test_rope_table_in_chunks_on_threads_is_the_one_call_bit_for_bit(monkeypatch, n_ctx):
    """The rope tables are made in chunks of ROPE_CHUNK positions on a thread pool (a 1,000,000-position table took
    42 s in one call): cos / sin of theta = (freq_scale * p) * inv[i] in float64 rounded to f32, the same bits as one
    NumPy call over every position, across chunk edges (chunks of 8 here: 41 = 5 x 8 + 1) and with a scale."""

    from strata.engine import layers as L

    monkeypatch.setattr(L, "ROPE_CHUNK", 8)
    inv = 1e6 ** (-np.arange(0, 64, 2, dtype=np.float64) / 64) / np.linspace(1, 4, 32)
    for scale in (1.0, 0.25):
        ang = (scale * np.arange(n_ctx, dtype=np.float64))[:, None] * inv[None, :]
        c, s = L._rope_table(n_ctx, inv, scale)
        assert c.dtype == s.dtype == np.float32 and c.shape == (n_ctx, 32)
        assert np.array_equal(c.view(np.uint32), np.cos(ang).astype(np.float32).view(np.uint32))
        assert np.array_equal(s.view(np.uint32), np.sin(ang).astype(np.float32).view(np.uint32))
