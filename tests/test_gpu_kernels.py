"""GPU kernels over engine form (strata.engine.gpu.kernels) against gguf-py, on a CUDA device.

- Dequantization: for every type with a kernel, random valid blocks
  (``strata.testing.make_random_blocks``) and "wild" blocks (random payload bytes, fp16
  scale fields with random sign and exponent, subnormals included) -> engine form -> GPU
  dequantize equals ``gguf.quants.dequantize`` BIT FOR BIT (uint32 views compared; output
  poisoned with NaN first so an unwritten element fails); for Q1_0 and Q2_0, which gguf-py lacks,
  the NumPy definition of the CPU engine (``strata.engine.dequant``, itself pinned to hand-computed
  blocks of ggml's C in tests/test_engine_dequant.py).
- Matrix-vector product: y = W x equals the NumPy replica of the kernel's order
  (``strata.engine.gpu.reference.matvec``, the CPU side of the hybrid path) BIT FOR BIT, and
  against a float64 reference from the same exact f32 weights every output is within the
  rigorous f32 summation bound ``depth * 2**-24 * sum_j |W[r, j] x[j]|``
  (``kernels.matvec_error_depth``); two runs give the same bits.
- Batched expert variant: each item equals the single matvec of its weight bit for bit.
- ``silu_mul`` (the expert activation) equals ``reference.silu_mul`` bit for bit.

CI has no GPU: every test here skips with the reason ``gpu_available()`` gives (CuPy missing /
no device). Run on a GPU machine with ``pytest -m gpu -rs tests/test_gpu_kernels.py``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from strata.engine import engine_form as EF
from strata.engine.dequant import OWN_DEQUANTIZERS, dequantize_blocks
from strata.engine.gpu import kernels as K
from strata.engine.gpu import reference as R
from strata.engine.kernel_src import assembly as A
from strata.packer import quants

GPU_OK, GPU_WHY = K.gpu_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")]

TYPES = sorted(A.SUPPORTED_TYPES, key=lambda i: quants.qtype(i).name)
IDS = [quants.qtype(i).name for i in TYPES]
U = 2.0**-24


def _random_blocks(type_id: int, n: int, rng: np.random.Generator) -> np.ndarray:
    try:
        from strata.testing import make_random_blocks
    except ImportError:  # synth needs pydantic; fall back to the same recipe
        make_random_blocks = None
    if make_random_blocks is not None:
        return make_random_blocks(type_id, n, rng)
    t = quants.qtype(type_id)
    if t.name == "F32":
        return (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint8)
    if t.name == "F16":
        return (rng.standard_normal(n) * 0.02).astype("<f2").view(np.uint8)
    if t.name == "BF16":
        return quants.f32_to_bf16_rne((rng.standard_normal(n, dtype=np.float32) * 0.02).view("<u4")).view(np.uint8)
    return _wild_blocks(type_id, n, rng)


def _wild_blocks(type_id: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes; every fp16 scale field a random finite fp16 with |d| < 1 (any sign, subnormals
    included) so that no product overflows: exercises sign and exponent paths synth does not."""
    t = quants.qtype(type_id)
    if t.block_elems == 1:
        if t.name == "F32":  # random finite f32 patterns of every magnitude
            u = rng.integers(0, 1 << 32, size=n, dtype=np.uint32)
            return np.where((u & 0x7F800000) == 0x7F800000, u & np.uint32(0x807FFFFF), u).astype("<u4").view(np.uint8)
        # random finite 16-bit patterns (exponent field not all ones): F16 subnormals, BF16 tiny/huge
        h = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
        if t.name == "F16":
            h = np.where((h & 0x7C00) == 0x7C00, h & np.uint16(0x83FF), h)
        else:
            h = np.where((h & 0x7F80) == 0x7F80, h & np.uint16(0x807F), h)
        return h.astype("<u2").view(np.uint8)
    nb = n // t.block_elems
    b = rng.integers(0, 256, size=(nb, t.block_bytes), dtype=np.uint8)
    for o in t.fp16_scale_offsets:
        h = rng.integers(0, 0x3C00, size=nb, dtype=np.uint16) | (rng.integers(0, 2, size=nb, dtype=np.uint16) << 15)
        b[:, o : o + 2] = h.astype("<u2").view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


def _pool_and_ref(type_id: int, raw: np.ndarray, ne: tuple[int, ...]):
    """(pool_type, src_type, pool bytes, reference f32 [rows, ne0]) for source bytes ``raw``: gguf-py's
    dequantization, or strata's NumPy definition for the types gguf-py lacks (Q1_0, Q2_0)."""
    t = quants.qtype(type_id)
    shape = tuple(reversed(ne))
    rows = raw.reshape(shape[0] if len(shape) > 1 else 1, -1)
    if type_id in OWN_DEQUANTIZERS:
        ref = dequantize_blocks(rows, type_id)
    else:
        ref = np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(type_id)), dtype=np.float32)
    if t.name == "BF16":  # the pack stores BF16 as F32 (bf16 << 16); the engine re-rounds it
        pool = quants.bf16_to_f32_bits(raw.view("<u2")).astype("<u4").view(np.uint8)
        return quants.F32.id, quants.BF16.id, pool, ref.reshape(shape)
    return type_id, type_id, raw, ref.reshape(shape)


def _upload(type_id: int, raw: np.ndarray, ne: tuple[int, ...]):
    import cupy as cp

    pool_t, src_t, pool, ref = _pool_and_ref(type_id, raw, ne)
    ef = EF.to_engine_form(pool, pool_t, src_t, ne)
    assert ef.size == quants.engine_nbytes(pool_t, src_t, ne)
    return cp.asarray(ef), ref


@pytest.mark.parametrize("type_id", TYPES, ids=IDS)
@pytest.mark.parametrize("kind", ["synth", "wild"])
def test_dequant_bit_exact(type_id, kind):
    import cupy as cp

    t = quants.qtype(type_id)
    rng = np.random.default_rng([type_id, 7 if kind == "synth" else 8])
    n = 256 * 2048
    raw = (_random_blocks if kind == "synth" else _wild_blocks)(type_id, n, rng)
    buf, ref = _upload(type_id, raw, (n,))
    out = cp.full(n, np.nan, dtype=cp.float32)
    K.dequantize(type_id, buf, n, out=out)
    got = cp.asnumpy(out)
    ref = ref.reshape(-1)
    diff = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
    assert diff.size == 0, (
        f"{t.name}/{kind}: {diff.size} of {n} values differ from the reference; first at "
        f"{diff[:4].tolist()}: gpu {got[diff[:4]].tolist()} ref {ref[diff[:4]].tolist()}"
    )
    print(
        f"\n[gpu-dequant] {t.name:8s} {kind:5s} n={n} bit-exact vs gguf.quants.dequantize or strata.engine.dequant "
        f"(max|x|={np.abs(ref).max():.3g})"
    )


def _shape_for(t) -> tuple[int, int]:
    """(rows, ne0): odd row count (partial last CTA), chunk counts not multiples of 32."""
    if t.block_elems == 1:
        return 301, 1000  # ne0 not a multiple of 32: plain kernels take any ne0
    if t.block_elems == 32:
        return 301, 32 * 45
    return 301, 256 * 9


@pytest.mark.parametrize("type_id", TYPES, ids=IDS)
def test_matvec_within_bound_and_deterministic(type_id):
    import cupy as cp

    t = quants.qtype(type_id)
    rows, ne0 = _shape_for(t)
    rng = np.random.default_rng([type_id, 11])
    raw = _random_blocks(type_id, rows * ne0, rng)
    buf, W = _upload(type_id, raw, (ne0, rows))
    x = rng.standard_normal(ne0).astype(np.float32)
    xd = cp.asarray(x)
    y = cp.full(rows, np.nan, dtype=cp.float32)
    K.matvec(type_id, buf, rows, ne0, xd, out=y)
    y1 = cp.asnumpy(y)
    y2 = cp.asnumpy(K.matvec(type_id, buf, rows, ne0, xd))
    assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32)), f"{t.name}: matvec not deterministic"
    rep = R.matvec(type_id, W, x)
    nd = np.flatnonzero(rep.view(np.uint32) != y1.view(np.uint32))
    assert nd.size == 0, f"{t.name}: {nd.size} rows differ from reference.matvec, first {nd[:4].tolist()}"
    Wd = W.astype(np.float64)
    ref = Wd @ x.astype(np.float64)
    mag = np.abs(Wd) @ np.abs(x.astype(np.float64))
    depth = K.matvec_error_depth(type_id, ne0)
    bound = depth * U * mag * (1 + depth * U * 2) + 1e-37
    err = np.abs(y1.astype(np.float64) - ref)
    worst = int(np.argmax(err / bound))
    assert np.all(err <= bound), (
        f"{t.name}: row {worst} |y-ref|={err[worst]:.3e} > bound {bound[worst]:.3e} (depth {depth})"
    )
    rel = np.linalg.norm(y1 - ref) / np.linalg.norm(ref)
    print(
        f"\n[gpu-matvec] {t.name:8s} [{rows}x{ne0}] == reference.matvec bit-exact; vs f64: ||y-ref||/||ref||={rel:.2e} "
        f"max|err|/(u*sum|wx|)={np.max(err / (U * mag)):.2f} (bound {depth})"
    )


@pytest.mark.parametrize("type_id", TYPES, ids=IDS)
def test_matvec_batched_equals_single(type_id):
    import cupy as cp

    t = quants.qtype(type_id)
    rows, ne0 = (64, 512) if t.block_elems > 1 else (64, 500)
    rng = np.random.default_rng([type_id, 13])
    experts = [_upload(type_id, _random_blocks(type_id, rows * ne0, rng), (ne0, rows))[0] for _ in range(5)]
    items = [2, 0, 4, 2, 1, 3]
    bases = cp.asarray(np.array([experts[e].data.ptr for e in items], dtype=np.uint64))
    X = cp.asarray(rng.standard_normal((len(items), ne0)).astype(np.float32))
    Y = cp.full((len(items), rows), np.nan, dtype=cp.float32)
    K.matvec_batched(type_id, bases, rows, ne0, X, out=Y)
    Y0 = K.matvec_batched(type_id, bases, rows, ne0, X[1], x_stride=0)  # one x for all items
    for i, e in enumerate(items):
        want = K.matvec(type_id, experts[e], rows, ne0, X[i])
        assert cp.array_equal(Y[i].view(cp.uint32), want.view(cp.uint32)), f"{t.name}: item {i} (expert {e})"
        want0 = K.matvec(type_id, experts[e], rows, ne0, X[1])
        assert cp.array_equal(Y0[i].view(cp.uint32), want0.view(cp.uint32)), f"{t.name}: x_stride=0 item {i}"
    # bit 0 set (fused.cu moe_route's host-tier tag) is cleared: the same products
    tagged = cp.asarray(np.array([experts[e].data.ptr | 1 for e in items], dtype=np.uint64))
    Yt = K.matvec_batched(type_id, tagged, rows, ne0, X)
    assert cp.array_equal(Yt.view(cp.uint32), Y.view(cp.uint32)), f"{t.name}: tagged addresses"


@pytest.mark.parametrize("type_id", TYPES, ids=IDS)
def test_matvec_group_equals_single(type_id):
    """The fused step's q/k/v (gate/up) launch: weights of one type and row length but different row
    counts (a partial CTA in each), one x, each output bit for bit the weight's own matvec."""
    import cupy as cp

    from strata.engine.gpu.fused_ops import CudaOps

    t = quants.qtype(type_id)
    _, ne0 = _shape_for(t)
    rng = np.random.default_rng([type_id, 17])
    parts = []
    for rows in (301, 64, 17):
        buf, _ = _upload(type_id, _random_blocks(type_id, rows * ne0, rng), (ne0, rows))
        parts.append((buf, rows, cp.full(rows, np.nan, dtype=cp.float32)))
    x = cp.asarray(rng.standard_normal(ne0).astype(np.float32))
    stream = cp.cuda.Stream()
    CudaOps(stream).matvec_group(type_id, parts, ne0, x)()
    stream.synchronize()
    for i, (buf, rows, out) in enumerate(parts):
        want = K.matvec(type_id, buf, rows, ne0, x)
        assert cp.array_equal(out.view(cp.uint32), want.view(cp.uint32)), f"{t.name}: part {i} ({rows} rows)"


def test_engine_buffer_size_is_checked():
    import cupy as cp

    n = 256
    buf = cp.zeros(quants.engine_nbytes(2, 2, (n,)) - 4, dtype=cp.uint8)
    with pytest.raises(ValueError, match="engine-form buffer"):
        K.dequantize(2, buf, n)


def _ieee_or_skip():
    K.kernels_for(quants.F32.id)
    if K.COMPILE_MODE != "nvrtc":
        pytest.skip(f"kernels compiled as {K.COMPILE_MODE}: subnormal results flush on the device")


def test_silu_mul_bit_exact():
    import cupy as cp

    _ieee_or_skip()
    print(f"\n[gpu-compile] {K.COMPILE_MODE} options {K.NVRTC_OPTIONS}")

    rng = np.random.default_rng(5)
    g = np.concatenate(
        [
            rng.standard_normal(1 << 16).astype(np.float32) * 8,
            np.linspace(-100, 100, 4001, dtype=np.float32),
            np.array([0.0, -0.0], np.float32),
        ]
    )
    u = rng.standard_normal(g.size).astype(np.float32)
    got = cp.asnumpy(K.silu_mul(cp.asarray(g), cp.asarray(u)))
    want = R.silu_mul(g, u)
    nd = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert nd.size == 0, f"{nd.size} of {g.size} differ, first g={g[nd[:4]].tolist()}"


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "F32"])
def test_matvec_subnormal_products_bit_exact(name):
    """Products and partial sums below 2**-126 (x scaled to ~1e-37): IEEE on both sides."""
    import cupy as cp

    _ieee_or_skip()
    t = quants.by_name(name)
    rows, ne0 = 64, 512
    rng = np.random.default_rng(21)
    buf, W = _upload(t.id, _random_blocks(t.id, rows * ne0, rng), (ne0, rows))
    x = (rng.standard_normal(ne0) * 1e-37).astype(np.float32)
    assert np.any(np.abs(W.reshape(rows, ne0) * x) < np.finfo(np.float32).tiny)
    got = cp.asnumpy(K.matvec(t.id, buf, rows, ne0, cp.asarray(x)))
    want = R.matvec(t.id, W.reshape(rows, ne0), x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
