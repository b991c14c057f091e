"""A GPU prompt chunk's causal attention in one launch (strata.engine.gpu.attn_rows, cuda/attn_rows.cu) against the
array form (strata.engine.layers.attend_rows): the same values within f32 summation order, with earlier positions in
the cache, a sliding window, grouped heads, head dims 64 / 128 / 256, with and without f16 operands (gpu-marked); on the
host, which shapes it takes and its tile shapes (exact)."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine import layers
from strata.engine.gpu import attn_rows as AR
from strata.engine.gpu import kernels as K

GPU_OK, GPU_WHY = K.gpu_available()
skip_no_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")


def test_supported_shapes_and_tiles():
    assert AR.supports(32, 4, 128, 128) and AR.supports(16, 2, 256, 256) and AR.supports(4, 1, 64, 64)
    assert not AR.supports(64, 1, 128, 128)  # 64 query heads a KV head: more than a CTA's 32 rows
    assert not AR.supports(8, 2, 96, 96) and not AR.supports(8, 2, 512, 512) and not AR.supports(6, 4, 64, 64)
    assert AR.shape(32, 4, 128, 128) == (32, 2, 4) and AR.shape(16, 2, 256, 256) == (16, 2, 4)
    assert AR.shape(28, 4, 128, 128) == (32, 2, 4) and AR.shape(4, 4, 64, 64) == (32, 16, 4)
    assert AR.shape(24, 1, 128, 128) == (32, 1, 8)  # 24 query heads a KV head: 8 rows a warp


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("heads", [(12, 3), (24, 1)], ids=["4-per-kv", "24-per-kv"])
def test_cuda_attend_rows_equals_the_array_form(hd, window, f16, heads):
    import cupy as cp

    rng = np.random.default_rng(hd + (window or 0) + f16)
    (n_head, n_kv), T, pos0, lo = heads, 45, 20, 3
    S = pos0 + T - lo
    q = cp.asarray(rng.standard_normal((T, n_head, hd)).astype(np.float32))
    K_ = cp.asarray(rng.standard_normal((S, n_kv, hd)).astype(np.float32))
    V = cp.asarray(rng.standard_normal((S, n_kv, hd)).astype(np.float32))
    scale = 1.0 / np.sqrt(hd)
    want = cp.asnumpy(layers.attend_rows(cp, q, K_, V, scale, pos0, lo, window, f16))
    got = cp.asnumpy(AR.attend_rows(q, K_, V, scale, pos0, lo, window, f16))
    assert got.shape == want.shape == (T, n_head * hd)
    tol = 2e-3 if f16 else 2e-5  # f16 probabilities: a rounding step apart when the sums' order moves p across one
    assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want)), float(np.max(np.abs(got - want)))


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("mode", ["neox", "norm"])
def test_cuda_row_ops_equal_the_array_forms(mode):
    """``rms_norm_rows``, ``rope_rows`` and ``weighted_rows`` (strata.engine.gpu.rows_ops) against layers.rms_norm,
    Rope.rows and the weighted sum of ExpertPath.combine: within f32 rounding (the squares summed in another order;
    CuPy may fuse products its own way), partial rotation included."""
    import cupy as cp

    from strata.engine.gpu import rows_ops as RO

    rng = np.random.default_rng(3)
    x = cp.asarray(rng.standard_normal((37, 5, 96)).astype(np.float32))
    w = cp.asarray(rng.standard_normal(96).astype(np.float32))
    want = cp.asnumpy(layers.rms_norm(cp, x, w, 1e-6))
    got = cp.asnumpy(RO.rms_norm_rows(x, w, 1e-6))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    rope = layers.Rope(cp, 64, 10000.0, 128, mode=mode)  # 64 of 96 dims rotated
    want = cp.asnumpy(rope.rows(cp, x, 50))
    got = cp.asnumpy(RO.rope_rows(x, rope.cos, rope.sin, rope.n_rot, 50, mode == "neox"))
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))
    assert np.array_equal(got[..., 64:], cp.asnumpy(x)[..., 64:])
    E = cp.asarray(rng.standard_normal((37, 8, 96)).astype(np.float32))
    wts = cp.asarray(rng.random((37, 8)).astype(np.float32))
    want = cp.asnumpy(sum((E[:, k] * wts[:, k : k + 1] for k in range(1, 8)), E[:, 0] * wts[:, 0:1]))
    got = cp.asnumpy(RO.weighted_rows(E, wts))
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("norm", [False, True])
def test_cuda_route_rows_equals_the_array_form(norm):
    """``route_rows`` against layers.route_topk_rows: the same experts in the same order (ties included: rows of equal
    logits pick the lowest ids), weights within f32 rounding; more experts than the kernel takes: None."""
    import cupy as cp

    from strata.engine.gpu import rows_ops as RO

    rng = np.random.default_rng(9)
    logits = rng.standard_normal((70, 128)).astype(np.float32)
    logits[5] = 0.25  # a row of ties
    logits[6, 10:20] = 9.0
    L = cp.asarray(logits)
    ids, w = RO.route_rows(L, 8, norm)
    want_ids, want_w = layers.route_topk_rows(np, logits, 8, norm)
    assert ids.dtype == np.int64 and ids.tolist() == want_ids.tolist()
    assert ids[5].tolist() == list(range(8)) and ids[6].tolist() == list(range(10, 18))
    assert np.max(np.abs(cp.asnumpy(w) - want_w)) <= 1e-6
    assert RO.route_rows(cp.zeros((2, 2048), dtype=cp.float32), 8, norm) is None
