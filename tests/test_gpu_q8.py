"""The GPU q8 kernels (strata.engine.gpu.kernels: ``quantize_q8``, ``matvec_q8`` and its batched / grouped forms)
against the CPU's ``"q8"`` kernel (engine/cpu/cpu_q8.c, cpu_q8_dots.c), on a CUDA device: BIT FOR BIT.

That equality is what lets the GPU path run llama.cpp's numerics while an expert computed on the CPU (a cache
miss) still equals a hit: tokens that do not depend on the cache. Checked for every type with a q8 kernel, on
valid (``make_random_blocks``) and wild blocks (random bytes, random fp16 scales of any sign and exponent), rows
of 1..many blocks, inputs with zero blocks, ties of the largest magnitude, and NaN / inf blocks (a non-finite
input block gives NaN outputs on both devices, at the same rows).

CI has no GPU: every test skips with ``gpu_available()``'s reason. The host-compiled check of the same source
(tests/test_gpu_q8_source.py) runs in CI.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_kernels import _random_blocks, _wild_blocks

from strata.engine import engine_form as EF
from strata.engine.cpu import kernels as cpukernels
from strata.engine.gpu import kernels as K
from strata.layout.step import q8_act_bytes
from strata.packer import quants

GPU_OK, GPU_WHY = K.gpu_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")]

Q8 = sorted(K.Q8_GPU_TYPES, key=lambda i: quants.qtype(i).name)
Q8_IDS = [quants.qtype(i).name for i in Q8]


def _x(ne0: int, rng, kind: str) -> np.ndarray:
    x = (rng.standard_normal(ne0) * rng.choice([1e-3, 1.0, 30.0], ne0)).astype(np.float32)
    if kind == "zeros":  # an all-zero block (d = 0) and a block of +-0
        x[:256] = 0.0
        x[256:512] = np.where(np.arange(256) % 2, 0.0, -0.0)
    elif kind == "ties":  # the largest |x| twice, with both signs (Q8_K takes the first)
        x[3], x[9] = -7.5, 7.5
        x[256 + 5], x[256 + 6] = 2.0, -2.0
    elif kind == "nonfinite":
        x[40] = np.nan
        x[300] = np.inf
    return x


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bits, NaN at the same places (payloads may differ: the device's canonical NaN)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb) and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32)))


@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
@pytest.mark.parametrize("kind", ["plain", "zeros", "ties", "nonfinite"])
def test_quantize_equals_the_cpu_bit_for_bit(type_id, kind):
    import cupy as cp

    rng = np.random.default_rng(7 + type_id)
    n = 2048
    x = _x(n, rng, kind)
    q, d, s = cpukernels.quantize_activation(type_id, x)
    fmt = K.q8_act_format(type_id)
    buf = cp.asnumpy(K.quantize_q8(cp.asarray(x), fmt))
    assert buf.size == q8_act_bytes(n)
    qg = buf[:n].view(np.int8)
    doff = (n + 63) // 64 * 64
    soff = doff + (n // 32 * 4 + 63) // 64 * 64
    dg = buf[doff : doff + 4 * d.size].view(np.float32)
    sg = buf[soff : soff + 2 * s.size].view(np.int16)
    assert np.array_equal(qg, q)
    assert _same(dg, d)
    assert np.array_equal(sg, s)


@pytest.mark.parametrize("fmt", [1, 2])
def test_quantize_with_silu_equals_silu_mul_then_quantize(fmt):
    """``quantize_q8`` with its silu pre-op (the fused MoE step's experts' down input, fused_moe): the rows it makes
    equal ``silu_mul``'s (and reference.silu_mul's) bit for bit, and their q8 form equals quantizing those rows in a
    second launch - on 3 rows of 768 values with a gap between rows (stride 800), values past n left alone."""
    import cupy as cp

    from strata.engine.gpu import reference as R

    rng = np.random.default_rng(11 + fmt)
    rows, n, stride = 3, 768, 800
    g = (rng.standard_normal(rows * stride) * 4).astype(np.float32)
    u = rng.standard_normal(rows * stride).astype(np.float32)
    g[5], g[900] = 90.0, -95.0  # exp's clamps
    ob = q8_act_bytes(n)
    H = cp.full(rows * stride, 7.0, dtype=cp.float32)
    got = cp.zeros(rows * ob, dtype=cp.uint8)
    K.quantize_kernel()(
        K.quantize_grid(n, fmt, rows),
        (256,),
        (H, np.int32(n), np.int64(stride), np.int32(fmt), got, np.int64(ob), cp.asarray(g), cp.asarray(u)),
    )
    h = cp.asnumpy(H).reshape(rows, stride)
    want_h = np.stack([R.silu_mul(g[r * stride : r * stride + n], u[r * stride : r * stride + n]) for r in range(rows)])
    assert _same(h[:, :n], want_h)
    assert (h[:, n:] == 7.0).all()
    dev = cp.asnumpy(K.silu_mul(cp.asarray(g), cp.asarray(u))).reshape(rows, stride)[:, :n]
    assert _same(dev, want_h)
    want_q = K.quantize_q8(cp.asarray(want_h.reshape(-1)), fmt, n=n, rows=rows, x_stride=n, out_stride=ob)
    assert np.array_equal(cp.asnumpy(got), cp.asnumpy(want_q))


def _case(type_id: int, rows: int, ne0: int, kind: str, rng):
    import cupy as cp

    n = rows * ne0
    raw = _random_blocks(type_id, n, rng) if kind == "synth" else _wild_blocks(type_id, n, rng)
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    ef = EF.to_engine_form(raw, type_id, type_id, (ne0, rows))
    return raw, cp.asarray(ef)


def _shapes(type_id: int) -> list[tuple[int, int]]:
    qk = 256 if K.q8_act_format(type_id) == 2 else 32
    if qk == 256:  # 1, 3, 8, 14 and 74 super-blocks per row (the 30B-A3B / 7B widths among them)
        return [(5, 256), (37, 768), (9, 2048), (33, 3584), (3, 18944)]
    return [(5, 32), (7, 224), (37, 640), (9, 3584), (3, 18944)]


@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
@pytest.mark.parametrize("kind", ["synth", "wild"])
def test_matvec_q8_equals_the_cpu_q8_kernel_bit_for_bit(type_id, kind):
    import cupy as cp

    rng = np.random.default_rng(100 + type_id)
    for rows, ne0 in _shapes(type_id):
        raw, buf = _case(type_id, rows, ne0, kind, rng)
        for xk in ("plain", "zeros", "ties", "nonfinite") if ne0 >= 512 else ("plain",):
            x = _x(ne0, rng, xk)
            want = cpukernels.matvec(type_id, raw, rows, ne0, x, kernel="q8", threads=2)
            got = cp.asnumpy(K.matvec_q8(type_id, buf, rows, ne0, cp.asarray(x)))
            assert _same(got, want), (
                quants.qtype(type_id).name,
                rows,
                ne0,
                xk,
                np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))[:8],
            )
            if xk == "nonfinite":
                assert np.isnan(got).all()


@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
def test_matvec_q8_gives_the_same_bits_with_every_split(type_id):
    """The warps a row is split over (1, 2, 4: ``kernels.q8_launch``) change where a block's terms are made, never
    the order they are added in: the CPU q8 kernel's bits at every split, for a row of 14 / 112 blocks (4 warp
    steps: every warp of a split of 4 has work) and a row of 3 / 7 blocks (fewer steps than warps)."""
    import cupy as cp

    rng = np.random.default_rng(300 + type_id)
    shapes = [(33, 3584), (6, 768 if K.q8_act_format(type_id) == 2 else 224)]
    for rows, ne0 in shapes:
        raw, buf = _case(type_id, rows, ne0, "wild", rng)
        x = _x(ne0, rng, "plain")
        want = cpukernels.matvec(type_id, raw, rows, ne0, x, kernel="q8", threads=1)
        for split in (1, 2, 4):
            got = cp.asnumpy(K.matvec_q8(type_id, buf, rows, ne0, cp.asarray(x), split=split))
            assert _same(got, want), (quants.qtype(type_id).name, rows, ne0, split)


@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
def test_batched_and_group_q8_equal_the_single_product(type_id):
    """``matvec_q8_batched`` (per-item activations, a skipped 0 address) and ``matvec_q8_group`` give each
    weight's single product bit for bit (the fused step's expert and q/k/v launches)."""
    import cupy as cp

    rng = np.random.default_rng(5 + type_id)
    fmt = K.q8_act_format(type_id)
    rows, ne0 = 11, 768 if fmt == 2 else 96
    k8 = K.q8_kernels_for(type_id)
    cases = [_case(type_id, rows, ne0, "wild", rng) for _ in range(3)]
    xs = [_x(ne0, rng, "plain") for _ in range(3)]
    want = [cpukernels.matvec(type_id, raw, rows, ne0, x, kernel="q8", threads=1) for (raw, _b), x in zip(cases, xs)]
    stride = q8_act_bytes(ne0)
    X = cp.asarray(np.concatenate(xs))
    xq = K.quantize_q8(X, fmt, n=ne0, rows=3, x_stride=ne0, out_stride=stride)
    bases = cp.asarray(np.array([b.data.ptr for _r, b in cases[:2]] + [0], dtype=np.uint64))
    Y = cp.full((3, rows), -1.0, dtype=cp.float32)
    gx, nt, shmem, split = K.q8_launch(k8, rows, ne0)
    args8 = (bases, np.int64(rows), np.int32(ne0), xq, np.int64(stride), Y, np.int32(split))
    k8.matvec_batched((gx, 3), (nt,), args8, shared_mem=shmem)
    Y = cp.asnumpy(Y)
    assert _same(Y[0], want[0]) and _same(Y[1], want[1])
    assert (Y[2] == -1.0).all()  # a miss's rows are left for the host
    # bit 0 of an address (fused.cu moe_route's host-tier tag): the same weight read word by word, the same bits
    tagged = cp.asarray(np.array([b.data.ptr | 1 for _r, b in cases[:2]] + [0], dtype=np.uint64))
    Yt = cp.full((3, rows), -1.0, dtype=cp.float32)
    k8.matvec_batched((gx, 3), (nt,), (tagged, *args8[1:5], Yt, args8[6]), shared_mem=shmem)
    Yt = cp.asnumpy(Yt)
    assert _same(Yt[0], want[0]) and _same(Yt[1], want[1]) and (Yt[2] == -1.0).all()
    # group: three weights on ONE activation (xs[0])
    want0 = [cpukernels.matvec(type_id, raw, rows, ne0, xs[0], kernel="q8", threads=1) for raw, _b in cases]
    outs = [cp.zeros(rows, dtype=cp.float32) for _ in range(3)]
    xq0 = K.quantize_q8(cp.asarray(xs[0]), fmt)
    args = (
        [np.uint64(b.data.ptr) for _r, b in cases]
        + [np.uint64(cases[0][1].data.ptr)]
        + [np.int64(rows)] * 4
        + [np.int32(ne0), xq0]
        + [np.uint64(o.data.ptr) for o in outs]
        + [np.uint64(outs[0].data.ptr)]
        + [np.int32(split)]
    )
    k8.matvec_group((gx, 3), (nt,), tuple(args), shared_mem=shmem)
    for o, w in zip(outs, want0):
        assert _same(cp.asnumpy(o), w)
