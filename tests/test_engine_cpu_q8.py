"""The CPU path's llama.cpp-numerics kernel (``kernel="q8"``, engine/cpu/cpu_q8.c + cpu_q8_dots.c), checked
against NumPy definitions written here from the ggml sources, bit for bit where the order is ours:

- the activation quantizers (Q8_0, Q8_K) give exactly the values of the ``llamacpp`` numerics mode
  (:func:`strata.engine.numerics.quantize_activation`), with llama.cpp's rounding (half to even, fp16 d);
- a row's result equals a NumPy replay of the documented order bit for bit: the integer block sums
  (exact: computed here in int64 from gguf-py's own dequantizer with the block scale set to 1, so the
  weight layout is decoded by an independent implementation) and then the fixed f32 sequence;
- it is within a stated bound of the float64 dot of the mode's values (dequantized weights x
  quantized activation): ``(n_blocks + 8) * 4 * 2^-24 * sum |w x|`` (the roundings of d_w * d_x,
  float(S), the product and the accumulation per block, and the 8-lane tree);
- the AVX2 (+VNNI) build and the portable scalar build give the same bits;
- with llama-cpp-python present (``llama_cpp`` marker): ggml's own quantize_row_q8_0 / q8_K give our
  bytes exactly, and ggml's vec_dot agrees within the bound (it sums the same terms in other lanes, FMA).
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
from test_gpu_kernels import _wild_blocks

from strata.engine.cpu import kernels as CK
from strata.engine.dequant import dequantize_rows
from strata.engine.gpu import reference as R
from strata.engine.numerics import quantize_activation
from strata.packer import quants
from strata.testing import make_random_blocks

Q8 = sorted(CK.Q8_TYPES, key=lambda i: quants.qtype(i).name)
Q8_IDS = [quants.qtype(i).name for i in Q8]
U = 2.0**-24


def _x(rng, n: int) -> np.ndarray:
    """Activations with some structure: a spread of block magnitudes, a zero block, exact ties."""
    x = (rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-3, 2, n // 32), 32)).astype(np.float32)
    x[32:64] = 0.0
    return x


# ------------------------------------------------------------------ activation quantization


@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "scalar"])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])  # a Q8_0 and a Q8_K weight type
def test_activation_quantizer_gives_the_numerics_mode_values(name, scalar):
    t = quants.by_name(name)
    rng = np.random.default_rng(1)
    x = _x(rng, 256 * 12)
    q, d, s = CK.quantize_activation(t.id, x, scalar=scalar)
    blk = 32 if t.act_format == "q8_0" else 256
    want = quantize_activation(np, x, t.id)
    got = np.repeat(d, blk) * q.astype(np.float32)
    assert np.array_equal(got, want)  # values (a -0.0 of the numerics mode is +0.0 here: q is an integer)
    # q itself: round half to even of x * (127 / amax) (Q8_0) or of x * (-127 / max) (Q8_K), |q| <= 127
    b = x.reshape(-1, blk)
    if blk == 32:
        amax = np.abs(b).max(axis=1, keepdims=True)
        scale = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    else:
        mx = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
        scale = np.where(mx != 0, np.float32(-127) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
    assert np.array_equal(q.reshape(-1, blk), np.minimum(127, np.rint(b * scale)).astype(np.int8))
    assert np.array_equal(s, q.reshape(-1, 16).astype(np.int32).sum(axis=1))
    assert q.min() >= -127


def test_activation_rounding_rules():
    # Q8_0 block with amax 127: id = 1, so q = rint(x): ties to even
    x = np.zeros(32, np.float32)
    x[:6] = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5]
    q, d, _ = CK.quantize_activation(quants.by_name("Q8_0").id, x)
    assert q[:6].tolist() == [127, 2, -4, 0, 0, 2] and d[0] == 1.0
    # Q8_K block whose largest |x| is negative: iscale = -127 / max > 0; first of equal magnitudes wins
    x = np.zeros(256, np.float32)
    x[:4] = [-127.0, 127.0, 2.5, -3.5]
    q, d, _ = CK.quantize_activation(quants.by_name("Q4_K").id, x)
    assert q[:4].tolist() == [-127, 127, 2, -4] and d[0] == 1.0  # iscale = -127 / -127 = 1
    x[0] = 127.0  # now the positive 127 comes first: iscale = -1, d = -1
    q, d, _ = CK.quantize_activation(quants.by_name("Q4_K").id, x)
    assert q[:4].tolist() == [-127, -127, -2, 4] and d[0] == -1.0
    # an all-zero Q8_K block: d = 0, q = 0
    q, d, s = CK.quantize_activation(quants.by_name("Q6_K").id, np.zeros(256, np.float32))
    assert d[0] == 0.0 and not q.any() and not s.any()


@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "scalar"])
def test_fp16_rounding_of_the_scale_is_round_to_nearest_even(scalar):
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 1 << 32, size=200000, dtype=np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    # plus the edges: ties at every exponent of the half range, subnormal halves, overflow
    h = np.arange(0, 0x7C00, dtype=np.uint32)
    lo = h.astype(np.uint16).view(np.float16).astype(np.float32)
    ties = (lo.view(np.uint32) + (1 << 12)).view(np.float32)  # halfway between two normal halves
    edge = np.float32([65504, 65519.99, 65520, 65536, 1e-8, 2.0**-25, 2.0**-24 * 1.5, 2.0**-14, -0.0])
    x = np.concatenate([x, ties, -ties, edge]).astype(np.float32)
    out = np.empty_like(x)
    CK.library(quants.by_name("Q8_0").id, scalar).f16_round(x.ctypes.data, x.size, out.ctypes.data)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------ the dot: NumPy replay of the documented order


def _int_weights(t, raw: np.ndarray, rows: int, ne0: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Integer weight values (int64 [rows, ne0]) before the fp16 super-scale: gguf-py's dequantizer on
    the blocks with d = 1 (and dmin = 0); for the types with mins, also the mins per value (d = 0,
    dmin = 1, negated). Exact: small integers times 1.0."""
    blocks = raw.reshape(-1, t.block_bytes).copy()
    one, zero = np.float16([1]).view(np.uint8), np.float16([0]).view(np.uint8)
    offs = t.fp16_scale_offsets

    def deq(vals):
        b = blocks.copy()
        for o, v in zip(offs, vals):
            b[:, o : o + 2] = v
        y = gguf.quants.dequantize(b.reshape(rows, -1), gguf.GGMLQuantizationType(t.id)).astype(np.float64)
        assert np.array_equal(y, np.round(y))
        return y.astype(np.int64).reshape(rows, ne0)

    w = deq([one, zero])
    mins = -deq([zero, one]) if len(offs) == 2 else None
    return w, mins


def _replay(t, raw: np.ndarray, rows: int, ne0: int, x: np.ndarray) -> np.ndarray:
    """engine/cpu/cpu_q8.c's item 3 in NumPy float32, from exact int64 block sums."""
    f = np.float32
    q, d, s = CK.quantize_activation(t.id, x)
    w, mins = _int_weights(t, raw, rows, ne0)
    blk = t.block_elems
    nb = ne0 // blk
    S = (w * q.astype(np.int64)).reshape(rows, nb, blk).sum(axis=2)
    fields = raw.reshape(rows, nb, t.block_bytes)
    dw = fields[:, :, t.fp16_scale_offsets[0] : t.fp16_scale_offsets[0] + 2].copy().view("<f2")[..., 0].astype(f)
    if blk == 32:
        acc = np.zeros((rows, 8), f)
        for b in range(nb):
            acc[:, b % 8] = acc[:, b % 8] + (dw[:, b] * d[b]) * S[:, b].astype(f)
        return ((acc[:, 0] + acc[:, 4]) + (acc[:, 2] + acc[:, 6])) + ((acc[:, 1] + acc[:, 5]) + (acc[:, 3] + acc[:, 7]))
    sa, sm = np.zeros(rows, f), np.zeros(rows, f)
    if mins is not None:
        o = t.fp16_scale_offsets[1]
        dm = fields[:, :, o : o + 2].copy().view("<f2")[..., 0].astype(f)
        M = (mins * q.astype(np.int64)).reshape(rows, nb, blk).sum(axis=2)
    for b in range(nb):
        sa = sa + (d[b] * dw[:, b]) * S[:, b].astype(f)
        if mins is not None:
            sm = sm + (d[b] * dm[:, b]) * M[:, b].astype(f)
    return sa - sm


def _case(t, rng, wild: bool):
    ne0 = 256 * 7 if t.block_elems == 256 else 32 * 45  # 45 blocks: 5 groups of 8 and a tail of 5
    rows = 23
    raw = (_wild_blocks if wild else make_random_blocks)(t.id, rows * ne0, rng).view(np.uint8).reshape(-1)
    return raw, rows, ne0, _x(rng, ne0)


@pytest.mark.parametrize("wild", [False, True], ids=["valid", "wild"])
@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
def test_q8_row_equals_the_replay_of_the_documented_order(type_id, wild):
    t = quants.qtype(type_id)
    raw, rows, ne0, x = _case(t, np.random.default_rng(type_id + 100 * wild), wild)
    y = CK.matvec(type_id, raw, rows, ne0, x, kernel="q8", threads=2)
    assert np.array_equal(y.view(np.uint32), _replay(t, raw, rows, ne0, x).view(np.uint32))


@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
def test_q8_is_the_numerics_mode_dot_within_the_stated_bound(type_id):
    t = quants.qtype(type_id)
    raw, rows, ne0, x = _case(t, np.random.default_rng(type_id), False)
    y = CK.matvec(type_id, raw, rows, ne0, x, kernel="q8").astype(np.float64)
    W = dequantize_rows(raw.reshape(rows, -1), type_id, ne0).astype(np.float64)
    xq = quantize_activation(np, x, type_id).astype(np.float64)
    nb = ne0 // t.block_elems
    bound = (nb + 8) * 4 * U * (np.abs(W) @ np.abs(xq))
    err = np.abs(y - W @ xq)
    assert np.all(err <= bound), float(np.max(err / bound))
    # and the f32 kernels with the mode's activation give the same values to the same order of error
    yf = CK.matvec(type_id, raw, rows, ne0, quantize_activation(np, x, type_id), kernel="f32").astype(np.float64)
    assert np.all(np.abs(yf - W @ xq) <= 2 * ne0 * U * (np.abs(W) @ np.abs(xq)))


@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
def test_simd_and_scalar_builds_give_the_same_bits(type_id):
    t = quants.qtype(type_id)
    for wild in (False, True):
        raw, rows, ne0, x = _case(t, np.random.default_rng(7 + type_id), wild)
        y = CK.matvec(type_id, raw, rows, ne0, x, kernel="q8", threads=3)
        lib = CK.library(type_id, True)
        assert lib.q8_simd() == 0
        y2 = np.empty(rows, np.float32)
        sc = np.zeros(int(lib.act_nbytes(ne0)) + 64, np.uint8)
        lib.matvec_q8(
            raw.ctypes.data,
            rows,
            ne0,
            quants.row_nbytes(type_id, ne0),
            x.ctypes.data,
            y2.ctypes.data,
            1,
            sc.ctypes.data,
        )
        assert np.array_equal(y.view(np.uint32), y2.view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_exact_kernel_simd_block_dots_equal_the_scalar_build_and_the_gpu_replica(name):
    """engine/cpu/cpu_exact_simd.c (the exact kernel's AVX2 block dots for Q4_K / Q6_K: value i of a block's 8 chunks
    cut from transposed quant bytes) gives the scalar build's bits and the GPU replica's
    (strata.engine.gpu.reference.matvec), on valid blocks and on wild ones (any bytes: extreme scales, the
    non-finite results compared as NaN / inf where both are). Rows of 1, 3, 4, 5 and 7 blocks: every position
    of a block among the 4 lane groups of the accumulator."""
    t = quants.by_name(name)
    for wild in (False, True):
        for nb in (1, 3, 4, 5, 7):
            rng = np.random.default_rng(nb + 10 * wild)
            ne0, rows = 256 * nb, 19
            raw = (_wild_blocks if wild else make_random_blocks)(t.id, rows * ne0, rng).view(np.uint8).reshape(-1)
            x = _x(rng, ne0)
            y = CK.matvec(t.id, raw, rows, ne0, x, kernel="exact", threads=2)
            lib = CK.library(t.id, True)
            y2 = np.empty(rows, np.float32)
            sc = np.zeros(4 * ne0 + 64, np.uint8)
            lib.matvec_exact(
                raw.ctypes.data,
                rows,
                ne0,
                quants.row_nbytes(t.id, ne0),
                x.ctypes.data,
                y2.ctypes.data,
                1,
                (sc.ctypes.data + 63) // 64 * 64,
            )
            fin = np.isfinite(y)
            assert np.array_equal(fin, np.isfinite(y2)) and np.array_equal(np.isnan(y), np.isnan(y2))
            assert np.array_equal(y[fin].view(np.uint32), y2[fin].view(np.uint32)), (wild, nb)
            assert np.array_equal(y[np.isinf(y)], y2[np.isinf(y2)])
            if not wild:
                assert fin.all()
                W = dequantize_rows(raw.reshape(rows, -1), t.id, ne0)
                assert np.array_equal(y.view(np.uint32), R.matvec(t.id, W, x).view(np.uint32))


def test_q8_types_are_the_registry_rows_with_q8_activations():
    for type_id in Q8:
        fmt = CK.library(type_id).q8_act_format()
        assert {1: "q8_0", 2: "q8_K"}[fmt] == quants.qtype(type_id).act_format
    assert CK.kernel_for(quants.by_name("IQ2_XS").id, "q8") == "f32"  # no integer kernel: the f32 dot
    assert CK.kernel_for(quants.by_name("Q4_K").id, "q8") == "q8"
    with pytest.raises(ValueError, match="expected one of exact, f32, q8"):
        CK.kernel_for(0, "int8")


# ------------------------------------------------------------------ many matrices in one call


@pytest.mark.parametrize("kernel", CK.KERNELS)
def test_matvec_many_is_each_matvec_bit_for_bit(kernel):
    t = quants.by_name("Q4_K")
    rng = np.random.default_rng(3)
    ne0, rows = 512, 37
    raws = [make_random_blocks(t.id, rows * ne0, rng).view(np.uint8).reshape(-1) for _ in range(5)]
    x = _x(rng, ne0)
    x2 = _x(rng, ne0)
    xs = [x, x, x2, x, x2]
    Y = CK.matvec_many(t.id, raws, rows, ne0, xs, kernel=kernel, threads=2)
    for m in range(5):
        y = CK.matvec(t.id, raws[m], rows, ne0, xs[m], kernel=kernel, threads=1)
        assert np.array_equal(Y[m].view(np.uint32), y.view(np.uint32))
    if kernel == "exact":  # and the exact kernel is the GPU replica
        W = dequantize_rows(raws[2].reshape(rows, -1), t.id, ne0)
        assert np.array_equal(Y[2].view(np.uint32), R.matvec(t.id, W, x2).view(np.uint32))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
def test_a_vnni_host_builds_the_panels(type_id):
    """The panel path is compiled where the host has AVX-512 F, VL and VNNI (-march=native) and only there, and never
    in the scalar build: so the bit-for-bit matmat test below exercises the panels on such a host, not only the
    fallback (16 rows a panel)."""
    flags = _cpu_flags()
    vnni = {"avx512f", "avx512vl", "avx512_vnni"} <= flags
    assert CK.library(type_id).q8_panel_rows() == (16 if vnni else 0)
    assert CK.library(type_id, True).q8_panel_rows() == 0


@pytest.mark.parametrize("kernel", CK.KERNELS)
@pytest.mark.parametrize("type_id", [*Q8, quants.F16.id], ids=[*Q8_IDS, "F16"])
def test_matmat_rows_are_the_matvec_bit_for_bit(type_id, kernel):
    """The prompt chunk's product (call_matmat: tiles of 16 weight rows x 32 activations in the q8 kernel) gives
    every (input row, weight row) exactly the matvec's bits; row counts off the tile sizes (37 rows, 45 / 1 / 33
    inputs), a repeated input (quantized once), an input of no rows before another, matrices repeated in a call."""
    t = quants.qtype(type_id)
    rng = np.random.default_rng(type_id)
    ne0 = 256 * 3 if t.block_elems == 256 else 32 * 13
    rows = 37
    raws = [make_random_blocks(t.id, rows * ne0, rng).view(np.uint8).reshape(-1) for _ in range(3)]
    X1 = np.stack([_x(rng, ne0) for _ in range(45)])
    X2 = np.stack([_x(rng, ne0) for _ in range(33)])
    X3 = X2[:1].copy()
    Z = np.zeros((0, ne0), np.float32)  # an input of no rows (the next input is still its own)
    xs = [X1, X1, Z, X2, X3]
    mats = (raws[0], raws[1], raws[2], raws[2], raws[0])
    bases = np.array([r.__array_interface__["data"][0] for r in mats], np.uint64)
    ys = CK.call_matmat(type_id, kernel, bases, rows, ne0, quants.row_nbytes(type_id, ne0), xs, threads=2)
    for m, raw in enumerate(mats):
        assert ys[m].shape == (xs[m].shape[0], rows)
        for i in range(xs[m].shape[0]):
            y = CK.matvec(type_id, raw, rows, ne0, xs[m][i], kernel=kernel, threads=1)
            assert np.array_equal(ys[m][i].view(np.uint32), y.view(np.uint32)), (m, i)


# ------------------------------------------------------------------ llama.cpp itself (llama-cpp-python's libggml-cpu)


def _ggml(g):
    """``g``: the conftest's ``ggml_cpu`` (llama-cpp-python's libggml-cpu, initialised)."""
    for f in (g.quantize_row_q8_0, g.quantize_row_q8_K):
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return g


_VEC_DOT = {
    "Q4_0": "q4_0_q8_0",
    "Q5_0": "q5_0_q8_0",
    "Q8_0": "q8_0_q8_0",
    "IQ4_NL": "iq4_nl_q8_0",
    "Q2_K": "q2_K_q8_K",
    "Q3_K": "q3_K_q8_K",
    "Q4_K": "q4_K_q8_K",
    "Q5_K": "q5_K_q8_K",
    "Q6_K": "q6_K_q8_K",
}


@pytest.mark.llama_cpp
@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
def test_against_ggml_vec_dot(type_id, ggml_cpu):
    g = _ggml(ggml_cpu)
    t = quants.qtype(type_id)
    raw, rows, ne0, x = _case(t, np.random.default_rng(11 + type_id), False)
    q, d, s = CK.quantize_activation(type_id, x)
    # ggml's quantize_row_q8_0 / q8_K (the functions its matmul calls) give our bytes exactly
    if t.act_format == "q8_0":
        act = np.zeros((ne0 // 32, 34), np.uint8)
        g.quantize_row_q8_0(x.ctypes.data, act.ctypes.data, ne0)
        assert np.array_equal(act[:, 2:].view(np.int8).reshape(-1), q)
        assert np.array_equal(act[:, :2].copy().view("<f2")[:, 0].astype(np.float32), d)
    else:
        act = np.zeros((ne0 // 256, 4 + 256 + 32), np.uint8)  # block_q8_K: f32 d, int8 qs[256], int16 bsums[16]
        g.quantize_row_q8_K(x.ctypes.data, act.ctypes.data, ne0)
        assert np.array_equal(act[:, :4].copy().view("<f4")[:, 0], d)
        assert np.array_equal(act[:, 4:260].view(np.int8).reshape(-1), q)
        assert np.array_equal(act[:, 260:].copy().view("<i2").reshape(-1), s)
    fn = getattr(g, f"ggml_vec_dot_{_VEC_DOT[t.name]}")
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
    ]
    fn.restype = None
    rb = quants.row_nbytes(type_id, ne0)
    ours = CK.matvec(type_id, raw, rows, ne0, x, kernel="q8")
    W = dequantize_rows(raw.reshape(rows, -1), type_id, ne0).astype(np.float64)
    mag = np.abs(W) @ np.abs(quantize_activation(np, x, type_id).astype(np.float64))
    out = np.zeros(1, np.float32)
    for r in range(rows):
        fn(ne0, out.ctypes.data, 0, raw.ctypes.data + r * rb, 0, act.ctypes.data, 0, 1)
        assert abs(float(out[0]) - float(ours[r])) <= (ne0 // t.block_elems + 8) * 8 * U * mag[r]


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_q8_keeps_a_non_finite_activation_visible(name, bad):
    """A NaN or infinite activation makes every output row NaN (its block's scale is NaN), where a max over
    |x| would drop a NaN and quantize the block as zeros - finite garbage the engine's non-finite-logits check
    could not see. Finite inputs are untouched (the bit-exact tests above)."""
    from strata.engine.cpu import kernels as C
    from strata.packer import quants
    from strata.testing import make_random_blocks

    rng = np.random.default_rng(0)
    t = quants.by_name(name)
    w = np.asarray(make_random_blocks(t.id, 4 * 256, rng)).reshape(-1)
    x = rng.standard_normal(256).astype(np.float32)
    assert np.isfinite(C.matvec(t.id, w, 4, 256, x, kernel="q8")).all()
    x[5] = bad
    assert np.isnan(C.matvec(t.id, w, 4, 256, x, kernel="q8")).all()


@pytest.mark.parametrize("scalar", [False, True])
def test_c_silu_mul_is_the_gpu_activation_bit_for_bit(scalar):
    """The experts' activation in C (cpu_q8.c silu_mul_row: AVX2 lanes, or the scalar silu_mul1 of silu.cuh) equals
    strata.engine.gpu.reference.silu_mul - the GPU kernel's bits - on wide random values, the clamps' edges, zeros,
    subnormals, infinities and NaN (NaN where the reference has NaN)."""
    from strata.engine.gpu import reference as R

    rng = np.random.default_rng(3)
    edges = [0.0, -0.0, 1e-40, -1e-40, 80.0, -80.0, 88.0, -88.0, 88.5, -89.0, 1e30, -1e30, np.inf, -np.inf, np.nan]
    g = np.concatenate([(rng.standard_normal(20011) * 25).astype(np.float32), np.array(edges, np.float32)])
    u = rng.standard_normal(g.size).astype(np.float32)
    lib = CK.library(sorted(CK.Q8_TYPES)[0], scalar=scalar)
    out = np.empty_like(g)
    lib.silu_mul_f32(g.ctypes.data, u.ctypes.data, out.ctypes.data, g.size)
    with np.errstate(invalid="ignore", over="ignore"):
        want = R.silu_mul(g, u)
    same = (out.view(np.uint32) == want.view(np.uint32)) | (np.isnan(out) & np.isnan(want))
    assert same.all(), (g[~same][:4], out[~same][:4], want[~same][:4])
    if not scalar:
        assert np.array_equal(CK.silu_mul(g[:100], u[:100]).view(np.uint32), out[:100].view(np.uint32))
