"""The KV cache: its type (``--kv f16|f32``) and the sliding-window ring buffers, against the budget.

- K/V are stored rounded to the cache type and read back as f32 (f16 is llama.cpp's default
  cache type and strata's); the bytes the engine allocates are exactly what
  ``strata.layout.kv.kv_cache_bytes`` (and so ``strata-budget check --kv``) charges.
- A sliding-window layer holds ``kv_tokens(n_ctx, window, 1)`` positions (its window) in a ring
  buffer; a full-context layer ``n_ctx``. The ring gives IDENTICAL logits (bit for bit) to the
  full-cache implementation (``sliding="full"``): the synthetic gemma3 fixture's window is 128
  and its third prompt 130 tokens, so the ring wraps; on the real Gemma 3 270M the window is
  shrunk to 16 on both engines so that a short run wraps it too.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_reference import load_fixture, synthetic_pack, teacher_forced

from strata.budget.audit import audit_pack
from strata.budget.cards import card_from_mib
from strata.budget.plan import PlanOptions, make_plan
from strata.engine.errors import GenerateError
from strata.engine.generate import generate
from strata.engine.layers import KVCache
from strata.engine.startup import load_engine
from strata.layout import kv as LK


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    return {n: synthetic_pack(tmp_path_factory, f"synthetic-{n}") for n in ("gemma3", "qwen2")}


def _bits_equal(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))


# ------------------------------------------------------------------ the ring buffer itself


def test_ring_write_read_order_and_wrap():
    c = KVCache(np, [4, 10], n_head_kv=1, head_dim=2, head_dim_v=2, kv="f32")
    for p in range(10):
        c.write(0, p, np.full((1, 2), p, np.float32), np.full((1, 2), -p, np.float32))
    assert [int(r[0, 0]) for r in c.k[0]] == [8, 9, 6, 7]  # slot p % 4 holds position p
    K, V = c.read(0, 6, 9)  # wrapped: slots 2, 3, 0, 1, oldest first
    assert K[:, 0, 0].tolist() == [6, 7, 8, 9] and V[:, 0, 0].tolist() == [-6, -7, -8, -9]
    K, _ = c.read(0, 8, 9)
    assert K[:, 0, 0].tolist() == [8, 9]
    with pytest.raises(IndexError, match="positions 5..9 do not fit its 4-position cache"):
        c.read(0, 5, 9)  # position 5 was overwritten by 9


def test_kv_types_store_rounded_and_read_f32():
    x = np.array([[1.0 + 2**-12, 3.14159265]], np.float32)  # not f16 values
    for kv, dt in (("f16", np.float16), ("f32", np.float32)):
        c = KVCache(np, [3], 1, 2, 2, kv=kv)
        c.write(0, 0, x, x)
        K, V = c.read(0, 0, 0)
        assert c.k[0].dtype == dt and K.dtype == np.float32
        assert np.array_equal(K[0], x.astype(dt).astype(np.float32))
        assert c.nbytes == 2 * 3 * 2 * np.dtype(dt).itemsize
    with pytest.raises(ValueError, match="stores K/V as f16 or f32"):
        KVCache(np, [3], 1, 2, 2, kv="int8")


# ------------------------------------------------------------------ engine vs budget


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("name,n_ctx", [("gemma3", 64), ("gemma3", 128), ("gemma3", 300), ("qwen2", 77)])
def test_engine_kv_bytes_are_the_budget_kv_term(syn, name, n_ctx, kv):
    eng = load_engine(syn[name], n_ctx=n_ctx, kv=kv)
    facts = audit_pack(syn[name]).facts
    want = LK.kv_cache_bytes(facts.kv_layers, n_ctx, LK.ENGINE_PREFILL_CHUNK, kv, 1)
    assert eng.state.cache.nbytes == want
    # strata-budget check --kv, at the engine's one-position prompt path (--prefill 0 or 1)
    for chunk in (0, 1):
        p = make_plan(facts, card_from_mib(4096), PlanOptions(n_ctx=n_ctx, kv=kv, prefill=chunk))
        assert p.term("KV cache") == want
    if name == "gemma3":  # layer 0 slides (window 128), layer 1 is global
        assert eng.state.cache.sizes == [min(n_ctx, 128), n_ctx]


def test_engine_refuses_kv_types_it_does_not_implement(syn):
    with pytest.raises(GenerateError, match="--kv int8: strata's engine stores K/V as f16 or f32"):
        load_engine(syn["qwen2"], n_ctx=16, kv="int8")


def test_f16_kv_is_what_the_cache_holds(syn):
    """The default cache holds the f32 K of the step rounded to f16 (read back exactly)."""
    e16 = load_engine(syn["qwen2"], n_ctx=16)
    e32 = load_engine(syn["qwen2"], n_ctx=16, kv="f32")
    assert e16.kv == "f16" and e16.state.cache.k[0].dtype == np.float16
    for e in (e16, e32):
        e.model.step(7, 0, e.state, logits=False)
    k32 = e32.state.cache.k[0][0]
    assert np.array_equal(e16.state.cache.k[0][0], k32.astype(np.float16))  # layer 0 sees the same input


# ------------------------------------------------------------------ ring == full cache


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_ring_equals_full_cache_on_the_synthetic_gemma3_fixture(syn, kv):
    ref = load_fixture("synthetic-gemma3")
    ring = load_engine(syn["gemma3"], n_ctx=256, kv=kv, sliding="ring")
    full = load_engine(syn["gemma3"], n_ctx=256, kv=kv, sliding="full")
    window = ring.geometry["sliding_window"]
    assert window == 128 and ring.state.cache.sizes == [128, 256] and full.state.cache.sizes == [256, 256]
    long = [p for p in ref["prompts"] if len(p["prompt_ids"]) > window]
    assert long and len(long[0]["prompt_ids"]) == 130  # positions 128.. overwrite the ring's oldest slots
    for p in ref["prompts"]:
        a = teacher_forced(ring, p["prompt_ids"], p["output_ids"])
        b = teacher_forced(full, p["prompt_ids"], p["output_ids"])
        assert _bits_equal(a, b), p["prompt"][:40]
    assert ring.state.cache.nbytes < full.state.cache.nbytes


def _shrink_windows(eng, w):
    for a in eng.model.attn:
        if a.window is not None:
            a.window = w


@pytest.mark.real
@pytest.mark.slow
def test_ring_equals_full_cache_on_real_gemma(gemma_pack):
    """Gemma 3 270M (15 sliding layers, 3 global): windows shrunk to 16 on both engines, a 6-token
    prompt and 24 generated tokens (30 positions: every sliding ring wraps) - identical logits."""
    ring = load_engine(gemma_pack, n_ctx=40, sliding="ring")
    full = load_engine(gemma_pack, n_ctx=40, sliding="full")
    for e in (ring, full):
        _shrink_windows(e, 16)
    ring.state = ring.model.new_state(40, sliding="ring")
    assert sorted(set(ring.state.cache.sizes)) == [16, 40] and set(full.state.cache.sizes) == {40}
    a = generate(ring, "The capital of France is", 24, ignore_eos=True)
    b = generate(full, "The capital of France is", 24, ignore_eos=True)
    assert a.output_ids == b.output_ids
    assert a.top == b.top  # floats compared exactly
