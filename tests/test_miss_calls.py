"""The hybrid step's CPU misses (engine/cpu/miss_calls.py LayerMisses): the same bits as ShardExperts.ffn_many with the
GPU's activation, on every MoE layer of the synthetic qwen3moe fixture (down types Q8_0, IQ4_NL, Q5_0: the two-call
fast path where the down type has a q8 kernel, ffn_many itself otherwise), written packed into the output."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_reference import synthetic_pack

from strata.engine.cpu import kernels as CK
from strata.engine.cpu.miss_calls import LayerMisses
from strata.engine.gpu import reference as R
from strata.engine.startup import load_engine


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return load_engine(synthetic_pack(tmp_path_factory, "synthetic-qwen3moe"), n_ctx=32).experts.source


@pytest.mark.parametrize("kernel", ["q8", "q8-exact", "exact"])
def test_layer_misses_equal_ffn_many_bit_for_bit(src, kernel):
    fast = 0
    for il in src.layers:
        n_embd, E = src.shapes[il].gate[0], 8
        x = np.zeros(n_embd, np.float32)  # the step's pinned input: filled in place before each call
        lm = LayerMisses(src, il, E, x, kernel=kernel, threads=3, max_ids=E, silu_mul=R.silu_mul)
        fast += lm.fast
        out = np.full(E * n_embd, np.nan, np.float32)
        for seed, ids in enumerate(([6, 1, 1, 4], [2], [7, 6, 5, 4, 3, 2, 1, 0])):
            x[...] = np.random.default_rng(seed + 10 * il).standard_normal(n_embd).astype(np.float32) * 3
            lm.run(np.array(ids, np.int32), out)
            want = src.ffn_many(il, ids, x.copy(), kernel=kernel, silu_mul=R.silu_mul, threads=2)
            got = out[: len(ids) * n_embd].reshape(len(ids), n_embd)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (il, ids, lm.fast)
    # the q8 down types (Q8_0, Q5_0) take the two C calls; "exact" never does (no fused activation there)
    assert fast == (sum(CK.kernel_for(src.types(il)[2], kernel) == "q8" for il in src.layers))
    assert fast >= (2 if kernel != "exact" else 0)


def test_layer_misses_refuse_an_input_they_cannot_read_in_place_and_too_many_ids(src):
    il = src.layers[0]
    with pytest.raises(ValueError, match=f"blk.{il} CPU misses: x must be C-contiguous f32"):
        LayerMisses(
            src,
            il,
            8,
            np.zeros(src.shapes[il].gate[0], np.float64),
            kernel="q8",
            threads=1,
            max_ids=2,
            silu_mul=R.silu_mul,
        )
    lm = LayerMisses(
        src, il, 8, np.zeros(src.shapes[il].gate[0], np.float32), kernel="q8", threads=1, max_ids=2, silu_mul=R.silu_mul
    )
    out = np.zeros(3 * src.shapes[il].down[1], np.float32)
    for ids in ([1, 2, 3], []):  # the buffers hold max_ids experts: more is refused, not written past
        with pytest.raises(ValueError, match=rf"blk.{il} CPU misses: {len(ids)} experts asked, 1..2 per call"):
            lm.run(np.array(ids, np.int32), out)


def test_layer_misses_with_another_activation_take_ffn_many_with_it(src):
    """The C activation is the GPU's silu_mul1 only (strata.engine.experts.activation_in_c, ffn_many's rule): given
    another activation, LayerMisses does not take its fast path (which would make silu_mul1 regardless) but hands
    that activation to ffn_many - the rows are ffn_many's with it, bit for bit."""

    def other(g, u):  # not the GPU's: a plain silu(g) * u
        return (g / (1 + np.exp(-g))) * u

    for il in src.layers:
        n_embd = src.shapes[il].gate[0]
        x = np.random.default_rng(il).standard_normal(n_embd).astype(np.float32)
        lm = LayerMisses(src, il, 8, x, kernel="q8", threads=2, max_ids=4, silu_mul=other)
        assert not lm.fast
        out = np.zeros(4 * n_embd, np.float32)
        lm.run(np.array([3, 1], np.int32), out)
        want = src.ffn_many(il, [3, 1], x, kernel="q8", silu_mul=other, threads=2)
        assert np.array_equal(out[: 2 * n_embd].view(np.uint32), want.reshape(-1).view(np.uint32))
