"""The gated delta net on a prompt chunk (strata.engine.deltanet): the conv over the chunk is the one-position conv bit
for bit; the chunked delta rule (``delta_rule_rows``, llama.cpp's ``build_delta_net_chunking``) equals the recurrence
(``delta_rule`` position by position) within float rounding - outputs and the state the next chunk starts from - at
any sub-chunk size, at decays from none to total, and without an overflow."""

from __future__ import annotations

import types

import numpy as np
import pytest

from strata.engine.deltanet import (
    DeltaNetDims,
    conv_silu,
    conv_silu_rows,
    delta_rule,
    delta_rule_rows,
    unit_lower_inverse,
    unit_lower_solve,
)

# Qwen3-Next's head layout at a small width: 4 k heads, 8 v heads (2 per k head), d_state 16
DS, NK, NV = 16, 4, 8
DIMS = DeltaNetDims(
    d_conv=4,
    d_state=DS,
    n_group=NK,
    dt_rank=NV,
    eps=1e-6,
    key_dim=NK * DS,
    value_dim=NV * DS,
    conv_dim=2 * NK * DS + NV * DS,
)


def _inputs(T: int, rng, a_scale: float = 1.0):
    """Conv outputs H, gates z, [b | a] rows, dt bias, ssm_a = -exp(A_log) (``a_scale`` multiplies it: the decay),
    the norm weight and a start state."""
    H = rng.standard_normal((T, DIMS.conv_dim)).astype(np.float32)
    Z = rng.standard_normal((T, DIMS.value_dim)).astype(np.float32)
    BA = (rng.standard_normal((T, 2 * NV)) * 2).astype(np.float32)
    dt = rng.standard_normal(NV).astype(np.float32)
    ssm_a = (-np.exp(rng.uniform(-1.0, 2.5, NV)) * a_scale).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, DS).astype(np.float32)
    S0 = (rng.standard_normal((NV, DS, DS)) * 0.3).astype(np.float32)
    return H, Z, BA, dt, ssm_a, nw, S0


def _recurrence(H, Z, BA, S, dt, ssm_a, nw):
    return np.stack([delta_rule(np, H[t], Z[t], BA[t], S, dt, ssm_a, nw, DIMS) for t in range(H.shape[0])])


@pytest.mark.parametrize("T", [1, 2, 10])
def test_conv_over_a_chunk_is_the_one_position_conv_bit_for_bit(T):
    rng = np.random.default_rng(T)
    qkv = rng.standard_normal((T, DIMS.conv_dim)).astype(np.float32)
    cw = rng.standard_normal((DIMS.conv_dim, DIMS.d_conv)).astype(np.float32)
    cs0 = rng.standard_normal((DIMS.d_conv - 1, DIMS.conv_dim)).astype(np.float32)
    cs_a, cs_b = cs0.copy(), cs0.copy()
    want = np.stack([conv_silu(np, qkv[t], cs_a, cw) for t in range(T)])
    got = conv_silu_rows(np, qkv, cs_b, cw)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(cs_a.view(np.uint32), cs_b.view(np.uint32))


#: NumPy under another name: the array-module code paths a GPU takes (``xp is not np``) run on the host.
NP_AS_DEVICE = types.SimpleNamespace(**{n: getattr(np, n) for n in dir(np) if not n.startswith("__")})


@pytest.mark.parametrize("chunk", [64, 7, 1])
@pytest.mark.parametrize("a_scale", [1.0, 0.0, 60.0])
@pytest.mark.parametrize("xp", [np, NP_AS_DEVICE], ids=["cpu-substitution", "device-block-inverse"])
def test_chunked_delta_rule_is_the_recurrence_within_rounding(chunk, a_scale, xp):
    """150 positions (sub-chunks of 64: two whole, one partial); decay as drawn, none (ssm_a = 0: g = 0) and near
    total (g down to ~ -700 a position: every e^G underflows to 0, the state forgets in one step); the CPU's
    row-by-row substitution and the device's block inverse (NumPy standing in for CuPy)."""
    rng = np.random.default_rng(int(chunk * 10 + a_scale))
    H, Z, BA, dt, ssm_a, nw, S0 = _inputs(150, rng, a_scale)
    S_ref, S_got = S0.copy(), S0.copy()
    want = _recurrence(H, Z, BA, S_ref, dt, ssm_a, nw)
    got = delta_rule_rows(xp, H, Z, BA, S_got, dt, ssm_a, nw, DIMS, chunk=chunk)
    assert got.shape == want.shape == (150, DIMS.value_dim) and np.isfinite(got).all() and np.isfinite(S_got).all()
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))
    assert np.max(np.abs(S_got - S_ref)) <= 1e-4 * max(1.0, float(np.max(np.abs(S_ref))))
    if a_scale:  # the form is really taken (the recurrence's rounding differs)
        assert chunk == 1 or not np.array_equal(got, want)


@pytest.mark.parametrize("n", [1, 2, 3, 33, 64])
@pytest.mark.parametrize("lo,hi", [(0.0, 0.1), (-1.0, 1.0), (-1.0, -0.5)])
def test_block_inverse_is_as_accurate_as_substitution(n, lo, hi):
    """``unit_lower_inverse`` (the device's block doubling) against float64: within 2e-6 of the solution's scale and
    within 4x the row-by-row substitution's error, also where the solution grows to ~1e15 (entries near -1)."""
    rng = np.random.default_rng(n)
    A = np.tril(rng.uniform(lo, hi, (4, n, n)), -1).astype(np.float32)
    B = rng.standard_normal((4, n, 8)).astype(np.float32)
    ref = np.linalg.solve(np.eye(n) + A.astype(np.float64), B.astype(np.float64))
    scale = float(np.abs(ref).max())
    blk = float(np.abs(unit_lower_inverse(NP_AS_DEVICE, A) @ B - ref).max()) / scale
    sub = float(np.abs(unit_lower_solve(np, A, B) - ref).max()) / scale
    assert blk <= 2e-6 and blk <= 4 * sub + 1e-7, (blk, sub)
    inv = unit_lower_inverse(np, A)
    assert inv.shape == (4, n, n) and np.array_equal(np.triu(inv, 1), np.zeros_like(inv))
    assert np.array_equal(np.diagonal(inv, axis1=1, axis2=2), np.ones((4, n), np.float32))


@pytest.mark.parametrize("xp", [np, NP_AS_DEVICE], ids=["cpu-substitution", "device-batched"])
def test_chunks_continue_from_the_state_they_leave(xp):
    """Two calls of 40 and 30 positions leave the state one call of 70 leaves, and give its outputs (the prompt's
    chunks of -ub feed one another through the recurrent state)."""
    rng = np.random.default_rng(5)
    H, Z, BA, dt, ssm_a, nw, S0 = _inputs(70, rng)
    S_one, S_two = S0.copy(), S0.copy()
    one = delta_rule_rows(xp, H, Z, BA, S_one, dt, ssm_a, nw, DIMS)
    two = np.concatenate(
        [
            delta_rule_rows(xp, H[:40], Z[:40], BA[:40], S_two, dt, ssm_a, nw, DIMS),
            delta_rule_rows(xp, H[40:], Z[40:], BA[40:], S_two, dt, ssm_a, nw, DIMS),
        ]
    )
    assert np.max(np.abs(one - two)) <= 1e-4 * np.max(np.abs(one))
    assert np.max(np.abs(S_one - S_two)) <= 1e-5 * max(1.0, float(np.max(np.abs(S_one))))


@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (64, 64), (65, 64), (128, 64), (130, 16)])
def test_device_sub_chunks_batched_equal_substitution(T, chunk):
    """The device's form (every sub-chunk's state-free part at once, the last padded with zero rows) against the
    CPU's sub-chunk-by-sub-chunk substitution on the same inputs: outputs and the state left within 1e-5 of their
    scale, whatever the padding (none, 1 row, 63 rows, a chunk shorter than a sub-chunk)."""
    rng = np.random.default_rng(T + chunk)
    H, Z, BA, dt, ssm_a, nw, S0 = _inputs(T, rng)
    S_cpu, S_dev = S0.copy(), S0.copy()
    cpu = delta_rule_rows(np, H, Z, BA, S_cpu, dt, ssm_a, nw, DIMS, chunk=chunk)
    dev = delta_rule_rows(NP_AS_DEVICE, H, Z, BA, S_dev, dt, ssm_a, nw, DIMS, chunk=chunk)
    assert dev.shape == cpu.shape == (T, DIMS.value_dim)
    assert np.max(np.abs(dev - cpu)) <= 1e-5 * np.max(np.abs(cpu))
    assert np.max(np.abs(S_dev - S_cpu)) <= 1e-5 * max(1.0, float(np.max(np.abs(S_cpu))))


@pytest.mark.parametrize("xp", [np, NP_AS_DEVICE], ids=["cpu-substitution", "device-batched"])
def test_an_empty_chunk_leaves_the_state(xp):
    rng = np.random.default_rng(1)
    H, Z, BA, dt, ssm_a, nw, S0 = _inputs(0, rng)
    S = S0.copy()
    out = delta_rule_rows(xp, H, Z, BA, S, dt, ssm_a, nw, DIMS)
    assert out.shape == (0, DIMS.value_dim) and np.array_equal(S, S0)


def test_device_form_takes_the_inverse_it_is_given():
    """``delta_rule_rows(..., inverse=f)`` builds the device form on ``f(A)`` (the GPU's one-launch kernel there): with
    ``f`` = row-by-row substitution of ``(A, I)`` the result equals the block inverse's within 1e-5; an ``f`` that
    returns None (a matrix larger than the kernel takes) falls back to the block inverse, bit for bit; and the form
    really uses ``f``: a wrong inverse gives a wrong result."""
    rng = np.random.default_rng(11)
    H, Z, BA, dt, ssm_a, nw, S0 = _inputs(100, rng)
    seen = []

    def substituted(A):
        seen.append(A.shape)
        return unit_lower_solve(np, A, np.broadcast_to(np.eye(A.shape[1], dtype=np.float32), A.shape).copy())

    runs = {}
    for name, inv in [("block", None), ("subst", substituted), ("none", lambda A: None), ("wrong", np.zeros_like)]:
        S = S0.copy()
        runs[name] = (delta_rule_rows(NP_AS_DEVICE, H, Z, BA, S, dt, ssm_a, nw, DIMS, inverse=inv), S)
    assert seen == [(DIMS.dt_rank * 2, 64, 64)]  # heads x 2 sub-chunks (the second padded), one call
    block, subst = runs["block"], runs["subst"]
    assert np.max(np.abs(subst[0] - block[0])) <= 1e-5 * np.max(np.abs(block[0]))
    assert np.max(np.abs(subst[1] - block[1])) <= 1e-5 * max(1.0, float(np.max(np.abs(block[1]))))
    assert np.array_equal(runs["none"][0], block[0]) and np.array_equal(runs["none"][1], block[1])
    assert np.max(np.abs(runs["wrong"][0] - block[0])) > 1e-2 * np.max(np.abs(block[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 33, 64])
@pytest.mark.parametrize("lo,hi", [(0.0, 0.1), (-1.0, 1.0), (-1.0, -0.5)])
def test_cuda_unit_lower_inverse_is_as_accurate_as_substitution(n, lo, hi):
    """rows_ops.unit_lower_inverse (one CTA per matrix, forward substitution by column) against float64: the solution
    ``X B`` within 2e-6 of its scale and within 4x the host's row-by-row substitution's error, also where it grows to
    ~1e15; exactly unit lower triangular; None above ULI_MAX_N (the array form then); a non-square batch refused."""
    from strata.engine.gpu.kernels import gpu_available

    ok, why = gpu_available()
    if not ok:
        pytest.skip(f"needs CuPy and a CUDA GPU: {why}")
    import cupy as cp

    from strata.engine.gpu import rows_ops as RO

    rng = np.random.default_rng(n)
    A = np.tril(rng.uniform(lo, hi, (40, n, n)), -1).astype(np.float32)
    A += np.triu(rng.uniform(-9, 9, (40, n, n)), 0).astype(np.float32)  # not read
    B = rng.standard_normal((40, n, 8)).astype(np.float32)
    L = np.tril(A, -1)
    ref = np.linalg.solve(np.eye(n) + L.astype(np.float64), B.astype(np.float64))
    scale = float(np.abs(ref).max())
    inv = cp.asnumpy(RO.unit_lower_inverse(cp.asarray(A)))
    got = float(np.abs(inv @ B - ref).max()) / scale
    sub = float(np.abs(unit_lower_solve(np, L, B) - ref).max()) / scale
    assert got <= 2e-6 and got <= 4 * sub + 1e-7, (got, sub)
    assert inv.shape == (40, n, n) and np.array_equal(np.triu(inv, 1), np.zeros_like(inv))
    assert np.array_equal(np.diagonal(inv, axis1=1, axis2=2), np.ones((40, n), np.float32))
    assert RO.unit_lower_inverse(cp.zeros((2, RO.ULI_MAX_N + 1, RO.ULI_MAX_N + 1), cp.float32)) is None
    with pytest.raises(ValueError, match="square"):
        RO.unit_lower_inverse(cp.zeros((2, 4, 5), cp.float32))
