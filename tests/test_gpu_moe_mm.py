"""The grouped expert product of a GPU prompt chunk (strata.engine.gpu.moe_mm, cuda/moe_mm.cu).

On the host: the tile list and the pair index are exact arrays; the per-row f16 scale is the stated power of two and
keeps a row of 1e6 finite where plain f16 overflows; the chunk path takes the grouped product for block-type experts
and the f32 tiles under ``--kernel exact``. On CUDA (gpu-marked): every block type's kernel equals the NumPy reference
(f16 operands, float64 sums) within f32 summation; the scales equal the reference bit for bit; a pair's output does not
depend on the other experts of the launch nor on how the experts are split between launches (bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine.gpu import kernels as K
from strata.engine.gpu import moe_mm as MM
from strata.engine.kernel_src import assembly as A
from strata.packer import quants

GPU_OK, GPU_WHY = K.gpu_available()
skip_no_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")
BLOCK_TYPES = sorted(t for t in A.SUPPORTED_TYPES if MM.supports(t))


def test_tiles_and_pair_index_are_exact():
    assert MM.tiles_of(np.array([0, 65, 5, 64, 129])).tolist() == [
        [1, 0],
        [1, 64],
        [2, 0],
        [3, 0],
        [4, 0],
        [4, 64],
        [4, 128],
    ]
    assert MM.tiles_of(np.array([], dtype=np.int64)).shape == (0, 2)
    pi = MM.PairIndex.build(np.arange(10), np.array([0, 3, 3]), np.array([3, 0, 7]), [np.array([0, 2]), np.array([1])])
    # src [10] | round 0: tiles (0,0) (1,0), starts 0 3, counts 3 7 | round 1: no tiles, start 3, count 0
    assert pi.host.tolist() == list(range(10)) + [0, 0, 1, 0, 0, 3, 3, 7] + [3, 0]
    assert pi.rounds == ((10, 2, 14, 2), (18, 0, 18, 1))
    assert pi.host.dtype == np.int32
    with pytest.raises(ValueError, match="outside the 3 given"):
        MM.PairIndex.build(np.arange(10), np.array([0, 3, 3]), np.array([3, 0, 7]), [np.array([3])])
    with pytest.raises(ValueError, match="past the 10 pairs"):
        MM.PairIndex.build(np.arange(10), np.array([0, 3, 4]), np.array([3, 0, 7]), [np.array([0, 1, 2])])
    assert not MM.supports(quants.F32.id) and not MM.supports(quants.BF16.id) and MM.supports(quants.QTYPES[12].id)


def test_group_pairs_reference_is_the_host_sort_in_one_round():
    """The device grouping's layout (group_layout) and values (group_pairs_reference) for 3 rows x 2 experts of 4
    written out; on 300 rows x 8 of 128 skewed experts: src, starts, counts and tiles are those the host's
    ChunkRouting + PairIndex give for one round of every expert id, inv inverts the sort, padding tiles are (-1, 0)."""
    from strata.engine.chunk_routing import ChunkRouting

    ids = np.array([[3, 1], [1, 0], [3, 2]])
    got = MM.group_pairs_reference(ids, 4)
    # NT = min(6, (6 + 4 * 63) // 64) = 4: src | tiles (0,0) (1,0) (2,0) (3,0) | starts | counts | inv
    assert MM.group_layout(6, 4) == ((6, 4, 14, 4), 22)
    assert got.tolist() == [1, 0, 1, 2, 0, 2] + [0, 0, 1, 0, 2, 0, 3, 0] + [0, 1, 3, 4] + [1, 2, 1, 2] + [
        4,
        1,
        2,
        0,
        5,
        3,
    ]
    assert got.dtype == np.int32
    rng = np.random.default_rng(4)
    E, T, k = 128, 300, 8
    p = rng.dirichlet(np.full(E, 0.3))
    sel = np.stack([rng.choice(E, size=k, replace=False, p=p) for _ in range(T)])
    got = MM.group_pairs_reference(sel, E).astype(np.int64)
    (t0, nt, s0, G), inv0 = MM.group_layout(T * k, E)
    r = ChunkRouting.of(sel)
    starts, counts = np.zeros(E, np.int64), np.zeros(E, np.int64)
    starts[r.used], counts[r.used] = r.starts, r.counts
    starts[counts == 0] = (np.cumsum(counts) - counts)[counts == 0]
    pi = MM.PairIndex.build(r.perm // k, starts, counts, [np.arange(E)])
    n = pi.rounds[0][1]
    assert np.array_equal(got[: T * k], r.perm // k)
    assert np.array_equal(got[t0 : t0 + 2 * n], pi.host[t0 : t0 + 2 * n])
    assert np.all(got[t0 + 2 * n : s0].reshape(-1, 2) == [-1, 0]) and nt == MM.group_tiles(T * k, E) >= n
    assert np.array_equal(got[s0 : s0 + G], starts) and np.array_equal(got[s0 + G : inv0], counts)
    assert np.array_equal(got[inv0:][r.perm], np.arange(T * k))
    with pytest.raises(ValueError, match="outside 0..3"):
        MM.group_pairs_reference(np.array([[0, 4]]), 4)


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize(
    ("E", "T", "k"), [(128, 512, 8), (512, 700, 10), (4, 3, 2), (60, 1, 4), (1, 300, 1), (1024, 300, 8)]
)
def test_cuda_group_pairs_equals_the_reference(E, T, k):
    """rows_ops.group_pairs (one CTA: shared-memory counts, one warp placing the pairs in order) equals
    group_pairs_reference value for value - skewed routings, a pair count past the kernel's 2,048-id staging segment
    (7,000 pairs), few rows; weighted_rows reading the sorted outputs in place equals it on the gathered copy, bit for
    bit."""
    import cupy as cp

    from strata.engine.gpu import rows_ops as RO

    rng = np.random.default_rng(E + T)
    p = rng.dirichlet(np.full(E, 0.2))
    sel = np.stack([rng.choice(E, size=k, replace=False, p=p) for _ in range(T)])
    want = MM.group_pairs_reference(sel, E)
    (_t0, nt, _s0, _g), inv0 = MM.group_layout(T * k, E)
    got = cp.asnumpy(RO.group_pairs(cp.asarray(sel, dtype=cp.int32), E, MM.TILE_PAIRS, nt))
    assert np.array_equal(got, want)
    D = cp.asarray(rng.standard_normal((T * k, 96)).astype(np.float32))
    w = cp.asarray(rng.random((T, k)).astype(np.float32))
    at = cp.asarray(want[inv0:])
    assert np.array_equal(
        cp.asnumpy(RO.weighted_rows(D, w, at)), cp.asnumpy(RO.weighted_rows(D[at].reshape(T, k, 96), w))
    )
    with pytest.raises(ValueError, match="tiles for"):
        RO.group_pairs(cp.asarray(sel, dtype=cp.int32), E, MM.TILE_PAIRS, nt - 1)


def test_row_scales_are_the_stated_power_of_two():
    X = np.array(
        [[1.0, -0.5], [1e6, 2.0], [3e-5, 0.0], [0.0, 0.0], [np.inf, 1.0], [-16383.9, 1.0], [16384.0, 0.0], [np.nan, 2]],
        dtype=np.float32,
    )
    s = MM.row_f16_scales_reference(X)
    assert s.tolist() == [2.0**13, 2.0**-6, 2.0**29, 1.0, 1.0, 1.0, 2.0**-1, 1.0]
    m = np.abs(X).max(axis=1) * s
    assert all(2.0**13 <= v < 2.0**14 for v in m[[0, 1, 2, 5, 6]])


def test_reference_keeps_a_large_row_finite_where_plain_f16_overflows():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    X = np.vstack([rng.standard_normal(64), 1e6 * rng.standard_normal(64)]).astype(np.float32)
    out = np.zeros((2, 8), np.float32)
    MM.grouped_mm_reference([w], X, None, np.array([0]), np.array([2]), out)
    exact = X.astype(np.float64) @ w.astype(np.float64).T
    assert np.all(np.isfinite(out))
    bound = 2.0**-10 * (np.abs(X).astype(np.float64) @ np.abs(w).astype(np.float64).T)  # two f16 roundings
    assert np.all(np.abs(out - exact) <= bound)
    with np.errstate(over="ignore"):
        assert not np.all(np.isfinite(X.astype(np.float16)))  # what the scale is for


def _engine_form(type_id: int, rows: int, ne0: int, seed: int):
    from strata.engine import engine_form as EF
    from strata.testing import make_random_blocks

    raw = make_random_blocks(type_id, rows * ne0, np.random.default_rng(seed))
    ef = EF.to_engine_form(raw, type_id, type_id, (ne0, rows))
    w = EF.dequantize_engine_form(ef, type_id, type_id, (ne0, rows)).reshape(rows, ne0)
    return ef, w


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("type_id", BLOCK_TYPES, ids=lambda i: quants.qtype(i).name)
def test_cuda_grouped_mm_equals_the_reference(type_id):
    """Three experts of 200 x 512 (two rounds: experts 0 and 2, then 1), 41 / 0 / 75 pairs gathered from 30 rows:
    within f32 summation of the f16 reference; the same pairs in one round of the three, and expert 2 alone, give the
    same bits; the scales equal NumPy's bit for bit."""
    import cupy as cp

    rows, ne0 = 200, 512
    ws, bufs = _device_experts(type_id, 3, rows, ne0, 10 * type_id)
    rng = np.random.default_rng(type_id)
    X = rng.standard_normal((30, ne0)).astype(np.float32)
    X[3] *= 1e5  # a row f16 alone would overflow
    counts = np.array([41, 0, 75])
    starts = np.array([0, 41, 41])
    src = rng.integers(0, 30, size=116)
    ref = np.zeros((116, rows), np.float32)
    MM.grouped_mm_reference(ws, X, src, starts, counts, ref)
    Xd = cp.asarray(X)
    assert cp.asnumpy(MM.row_f16_scales(type_id, Xd)).tolist() == MM.row_f16_scales_reference(X).tolist()

    def run(rounds):
        pi = MM.PairIndex.build(src, starts, counts, [np.array(r) for r in rounds])
        idx = cp.asarray(pi.host)
        out = cp.full((116, rows), np.nan, dtype=cp.float32)
        for r, rnd in zip(rounds, pi.rounds):
            MM.grouped_mm(type_id, _addresses([bufs[g] for g in r]), rows, ne0, Xd, idx, rnd, out)
        return cp.asnumpy(out)

    two = run([[0, 2], [1]])
    bound = 1e-5 * (np.abs(X[src]).astype(np.float64) @ np.abs(np.stack(ws)).max(axis=0).astype(np.float64).T) + 1e-30
    assert np.all(np.isfinite(two))
    assert np.all(np.abs(two - ref) <= bound), float(np.max(np.abs(two - ref) / bound))
    assert np.array_equal(run([[0, 1, 2]]), two)
    alone = run([[2]])
    assert np.array_equal(alone[41:], two[41:]) and np.all(np.isnan(alone[:41]))


def _device_experts(type_id: int, n: int, rows: int, ne0: int, seed: int):
    """``n`` random experts' parts of ``[rows, ne0]``: their dequantized f32 values and engine forms on the device."""
    import cupy as cp

    pairs = [_engine_form(type_id, rows, ne0, seed + g) for g in range(n)]
    return [w for _, w in pairs], [cp.asarray(ef) for ef, _ in pairs]


def _addresses(bufs):
    from strata.engine.gpu import gemm

    return gemm.addresses(bufs)


def test_chunk_path_takes_the_grouped_product_unless_exact(tmp_path):
    """The default kernels take the grouped f16 product for the block-type experts of the synthetic MoE; ``--kernel
    exact`` keeps the f32 tiles (plain f32 GEMMs)."""
    from strata import testing as synth
    from strata.engine.gpu.backend import SimBackend
    from strata.engine.startup import load_engine
    from strata.packer.build import build_pack

    paths = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec())
    build_pack(paths[0], tmp_path / "p", progress=False)
    on = load_engine(tmp_path / "p", device="cuda", backend=SimBackend(), n_ctx=32, ubatch=8)
    off = load_engine(tmp_path / "p", device="cuda", backend=SimBackend(), n_ctx=32, ubatch=8, cpu_kernel="exact")
    assert on.experts.chunk_path.mm is True and off.experts.chunk_path.mm is False


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("type_id", [t for t in BLOCK_TYPES if quants.qtype(t).block_elems == 32],
                         ids=lambda i: quants.qtype(i).name)  # fmt: skip
def test_cuda_grouped_mm_own_rows_and_a_partial_k_step(type_id):
    """Pairs reading their own rows (``src=False``: the down product's input) and a row of 96 values (the last K step
    half empty): within f32 summation of the reference, on two experts of 70 x 96 with 3 and 66 pairs."""
    import cupy as cp

    rows, ne0 = 70, 96
    ws, bufs = _device_experts(type_id, 2, rows, ne0, 7 * type_id)
    X = np.random.default_rng(type_id).standard_normal((69, ne0)).astype(np.float32)
    starts, counts = np.array([0, 3]), np.array([3, 66])
    ref = np.zeros((69, rows), np.float32)
    MM.grouped_mm_reference(ws, X, None, starts, counts, ref)
    pi = MM.PairIndex.build(np.arange(69), starts, counts, [np.array([0, 1])])
    out = cp.full((69, rows), np.nan, dtype=cp.float32)
    idx = cp.asarray(pi.host)
    MM.grouped_mm(type_id, _addresses(bufs), rows, ne0, cp.asarray(X), idx, pi.rounds[0], out, src=False)
    got = cp.asnumpy(out)
    bound = 1e-5 * (np.abs(X).astype(np.float64) @ np.abs(np.stack(ws)).max(axis=0).astype(np.float64).T) + 1e-30
    assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) / bound))
