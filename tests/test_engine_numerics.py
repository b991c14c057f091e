"""The ``llamacpp`` numerics mode: llama.cpp CPU's activation roundings (strata.engine.numerics)."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine import numerics as N
from strata.engine.layers import gelu_f16_table, gelu_tanh
from strata.packer import quants


def test_activation_format_follows_ggml_cpu_vec_dot_types():
    t = quants.by_name
    assert N.activation_format(t("Q8_0").id) == "q8_0"
    assert N.activation_format(t("Q5_0").id) == "q8_0"
    assert N.activation_format(t("IQ4_NL").id) == "q8_0"
    assert N.activation_format(t("Q4_K").id) == "q8_K"
    assert N.activation_format(t("Q6_K").id) == "q8_K"
    assert N.activation_format(t("IQ2_XS").id) == "q8_K"
    assert N.activation_format(t("F16").id) == "f16"
    assert N.activation_format(t("F32").id) == "f32"


def test_q8_0_quantizer():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(32 * 64) * rng.uniform(0.01, 100, 32 * 64)).astype(np.float32)
    x[:32] = 0.0  # an all-zero block stays zero
    y = N.quantize_q8_0(np, x)
    b, yb = x.reshape(-1, 32), y.reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    q = np.where(d[:, None] > 0, yb / np.where(d > 0, d, 1)[:, None], 0)
    assert np.array_equal(q, np.rint(q)) and np.abs(q).max() <= 127  # y = fp16(d) * integer
    assert np.all(yb[0] == 0)
    assert np.all(np.abs(yb - b) <= 0.5 * amax[:, None] / 127 * 1.01 + np.abs(b) * 2e-3)


def test_q8_K_quantizer():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(256 * 8).astype(np.float32)
    x[5] = -9.0  # the largest magnitude of block 0, negative
    y = N.quantize_q8_K(np, x)
    b, yb = x.reshape(-1, 256), y.reshape(-1, 256)
    d0 = np.float32(1) / (np.float32(-127) / np.float32(-9.0))
    assert yb[0, 5] == np.float32(-127) * d0 or abs(yb[0, 5] + 9.0) < 1e-5
    for blk, yy in zip(b, yb):
        mx = blk[np.abs(blk).argmax()]
        d = np.float32(1) / (np.float32(-127) / mx)
        q = yy / d
        assert np.allclose(q, np.rint(q), atol=1e-3) and q.max() <= 127.001 and q.min() >= -128.001


def test_gelu_table_is_fp16_valued_and_saturates():
    x = np.linspace(-12, 12, 10001, dtype=np.float32)
    y = gelu_f16_table(np, x)
    mid = (x > -10) & (x < 10)
    assert np.array_equal(y[mid], y[mid].astype(np.float16).astype(np.float32))
    assert np.all(y[x <= -10] == 0) and np.array_equal(y[x >= 10], x[x >= 10])
    assert np.max(np.abs(y - gelu_tanh(np, x))[mid]) < 0.01


def test_numerics_modes():
    assert N.numerics("f32").act_quant is False and N.numerics("llamacpp").attn_f16 is True
    assert not hasattr(N.numerics("llamacpp"), "kv_f16")  # the KV type is the engine's --kv option now
    assert N.DEFAULT_NUMERICS == "f32"
    with pytest.raises(ValueError, match="unknown numerics mode 'fp8'; known: f32, llamacpp"):
        N.numerics("fp8")


@pytest.mark.real
@pytest.mark.llama_cpp
def test_one_token_gemma_forward_matches_llama_cpp_with_llamacpp_numerics(gemma_pack, gemma_gguf, llama_cpp):
    """The measurement behind strata.engine.numerics: one token through Gemma's 18 layers agrees with
    llama.cpp's CPU backend to ~1e-5 in every logit with the four roundings emulated (3.6 without)."""
    from strata.engine.generate import decode
    from strata.engine.startup import load_engine

    llm = llama_cpp.Llama(model_path=str(gemma_gguf), n_ctx=64, logits_all=True, n_threads=2, verbose=False)
    llm.eval([818])
    want = np.asarray(llm.scores[0], dtype=np.float32)
    eng = load_engine(gemma_pack, n_ctx=8, numerics="llamacpp")
    rows = []
    decode(eng.model, eng.state, [818], 1, lambda r: rows.append(r.copy()) or 0)
    assert np.abs(rows[0] - want).max() < 1e-3
