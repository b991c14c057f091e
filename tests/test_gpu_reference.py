"""The CPU replicas of the GPU arithmetic (strata.engine.gpu.reference), checked without a GPU:
accuracy against float64, and the documented order. Their bit-equality with the device is in
tests/test_gpu_kernels.py (gpu-marked)."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine.gpu import kernels as K
from strata.engine.gpu import reference as R
from strata.packer import quants

U = 2.0**-24


def test_exp_portable_accuracy():
    x = np.linspace(-80, 88, 400001, dtype=np.float32)
    e = R.exp_portable(x)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(e - ref) / ref) < 3 * U  # measured ~1.6 ulp
    assert np.all(np.isfinite(R.exp_portable(np.array([-1e30, 1e30, -200, 200], np.float32))))


def test_silu_mul_matches_float64():
    g = np.linspace(-30, 30, 10001, dtype=np.float32)
    u = np.ones_like(g)
    want = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
    assert np.max(np.abs(R.silu_mul(g, u) - want)) < 4e-6


@pytest.mark.parametrize("name,ne0", [("Q4_K", 2304), ("Q8_0", 1440), ("F32", 1000), ("BF16", 33), ("Q6_K", 256)])
def test_replica_matvec_within_bound(name, ne0):
    t = quants.by_name(name)
    rng = np.random.default_rng(ne0)
    W = rng.standard_normal((37, ne0)).astype(np.float32)
    x = rng.standard_normal(ne0).astype(np.float32)
    y = R.matvec(t.id, W, x)
    Wd, xd = W.astype(np.float64), x.astype(np.float64)
    err = np.abs(y - Wd @ xd)
    bound = K.matvec_error_depth(t.id, ne0) * U * (np.abs(Wd) @ np.abs(xd)) * 1.001
    assert np.all(err <= bound)


def test_replica_order_is_the_documented_one():
    """Block types: lane l sums chunks l, l+32, ... sequentially, then the xor butterfly."""
    rng = np.random.default_rng(9)
    ne0 = 32 * 70  # 70 chunks: lanes 0..5 get 3 chunks, the others 2
    W = rng.standard_normal((3, ne0)).astype(np.float32)
    x = rng.standard_normal(ne0).astype(np.float32)
    P = W * x
    out = np.empty(3, np.float32)
    for r in range(3):
        lanes = []
        for lane in range(32):
            acc = np.float32(0)
            for c in range(lane, 70, 32):
                s = np.float32(0)
                for i in range(32):
                    s = np.float32(s + P[r, 32 * c + i])
                acc = np.float32(acc + s)
            lanes.append(acc)
        a = np.array(lanes, np.float32)
        for o in (16, 8, 4, 2, 1):
            a = (a + a[np.arange(32) ^ o]).astype(np.float32)
        out[r] = a[0]
    assert np.array_equal(R.matvec(quants.by_name("Q4_K").id, W, x).view(np.uint32), out.view(np.uint32))
