"""A prompt chunk's routed experts on CUDA in one launch per expert part: the grouped f16 tensor-core product of
``cuda/moe_mm.cu`` (docs/DESIGN.md "Prompts in chunks on the GPU").

The chunk's (row, expert) pairs are sorted by expert; expert ``g``'s pairs are output rows ``starts[g] ..
starts[g] + counts[g] - 1``. One launch per part (gate, up, down) takes every expert of the call: a CTA computes
64 pairs of one expert times 128 weight rows, dequantizing the weight's blocks straight from engine form (the type's
``deq_chunk``: the type's arithmetic, with FMA contraction) to f16 in shared memory - no f32 tile in device memory, no
padding of experts to a common row count, no per-group launches. Operands are f16 (as llama.cpp's cuBLAS path,
``ggml-cuda.cu`` ``ggml_cuda_op_mul_mat_cublas``; for quantized experts on cards with int8 tensor cores llama.cpp
takes its MMQ kernels instead: integer products, no f16 rounding), each input row first scaled
by a power of two (:func:`row_f16_scales`) so f16 cannot overflow; products accumulate in f32 (PTX ``mma.sync
m16n8k16``). Block types only (``deq_chunk``); the plain types (F32 / F16 / BF16 experts) and ``--kernel exact``
take :func:`strata.engine.gpu.gemm.grouped_product`.

Each output element is computed by one CTA from the expert's own bytes and rows in a fixed order, whatever the other
experts of the launch are: **a chunk's result does not depend on which experts are resident** (nor on how the
experts are split between launches). Shapes are numpy order; the weight of ggml ``ne = (ne0, rows)`` is ``[rows,
ne0]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..kernel_src import assembly as A
from . import kernels as K

#: Pairs x weight rows of one CTA's tile and the K step (``BM``, ``BN``, ``BK`` in cuda/moe_mm.cu).
TILE_PAIRS, TILE_ROWS, TILE_K = 64, 128, 64
#: Threads per CTA (``32 * MM_WARPS``).
THREADS = 128
MM_KERNEL_NAMES = ("mm_grouped", "row_f16_scale")


def mm_source(type_id: int) -> str:
    """The CUDA source of ``type_id``'s grouped-product module: the type's device code
    (:func:`strata.engine.kernel_src.assembly.type_source`) and ``cuda/moe_mm.cu``.

    Raises:
        ValueError: a plain type (no blocks: F32, F16, BF16).
        NotImplementedError: a type without GPU code.
    """
    if not supports(type_id):
        raise ValueError(f"the grouped expert product takes block types only, not type {type_id}")
    defs = f"#define BM {TILE_PAIRS}\n#define BN {TILE_ROWS}\n#define BK {TILE_K}\n#define MM_WARPS {THREADS // 32}\n"
    return A.type_source(type_id) + defs + K.cuda_file("moe_mm.cu")


def supports(type_id: int) -> bool:
    """Whether ``type_id``'s experts can take :func:`grouped_mm` (a block type with GPU code:
    :func:`strata.layout.chunk.grouped_types`)."""
    from strata.layout.chunk import grouped_types

    return grouped_types([type_id])


def mm_sources() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every grouped-product module, ``label -> (source, kernel names)`` (tests/test_gpu_cuda_compile.py)."""
    from strata.packer import quants

    return {f"{quants.qtype(t).name} moe_mm": (mm_source(t), MM_KERNEL_NAMES) for t in sorted(A.SUPPORTED_TYPES)
            if supports(t)}  # fmt: skip


@functools.cache
def kernels(type_id: int) -> dict:
    """Compile (once per process) ``type_id``'s grouped-product module: its kernels by name
    (:data:`MM_KERNEL_NAMES`)."""
    return K.load_module(mm_source(type_id), MM_KERNEL_NAMES, fmad=True)  # f16 results: FMAs in the dequantization


def tiles_of(counts: np.ndarray) -> np.ndarray:
    """The CTA tiles of experts with ``counts`` pairs each: int32 ``[n_tiles, 2]`` rows ``(g, first pair)``, every
    expert's pairs in steps of :data:`TILE_PAIRS` (an expert with no pairs has none)."""
    counts = np.asarray(counts, dtype=np.int64)
    nt = (counts + TILE_PAIRS - 1) // TILE_PAIRS
    g = np.repeat(np.arange(counts.size, dtype=np.int64), nt)
    first = np.arange(int(nt.sum()), dtype=np.int64) - np.repeat(np.cumsum(nt) - nt, nt)
    return np.stack([g, first * TILE_PAIRS], axis=1).astype(np.int32)


def row_f16_scales(type_id: int, X):
    """``cupy.float32[R]``: per row of ``X`` (``cupy.float32 [R, K]``, C-contiguous) the power of two that puts its
    largest magnitude in ``[2^13, 2^14)`` (1 for a row of zeros or with a NaN or an infinity; at most ``2^100``): the
    kernel of ``type_id``'s module (it does not depend on the type). :func:`row_f16_scales_reference` in NumPy.

    Raises:
        ValueError: ``X`` not a C-contiguous float32 matrix.
    """
    import cupy as cp

    if X.ndim != 2 or X.dtype != cp.float32 or not X.flags.c_contiguous:
        raise ValueError(f"row_f16_scales: X {X.shape} {X.dtype} must be a C-contiguous float32 matrix")
    R, Kd = X.shape
    out = cp.empty(R, dtype=cp.float32)
    if R:
        kernels(type_id)["row_f16_scale"]((R,), (THREADS,), (X, np.int64(Kd), np.int32(Kd), out))
    return out


def row_f16_scales_reference(X: np.ndarray) -> np.ndarray:
    """:func:`row_f16_scales` in NumPy (``float32[R]``; ``X [R, K]``)."""
    a = np.abs(np.asarray(X, dtype=np.float32))
    with np.errstate(invalid="ignore"):
        bad = ~(a <= np.float32(3.0e38)).all(axis=1)  # a NaN or an infinity in the row
    m = np.where(np.isnan(a), 0, a).max(axis=1, initial=0.0)
    ok = (m > 0) & ~bad
    _, e = np.frexp(np.where(ok, m, 1.0))
    return np.where(ok, np.ldexp(np.float32(1.0), np.minimum(14 - e, 100)), 1.0).astype(np.float32)


def grouped_mm_reference(weights: list[np.ndarray], X: np.ndarray, src, starts, counts, out: np.ndarray) -> None:
    """:func:`grouped_mm` in NumPy for the simulated device and the tests: ``weights[g]`` expert ``g``'s dequantized
    weight ``float32 [rows, ne0]`` (None for an expert without pairs); ``src`` the pairs' X rows (None: pair ``p``
    reads row ``p``); ``starts`` / ``counts`` per expert. The same f16 operands (each X row scaled by
    :func:`row_f16_scales_reference`), summed in float64 and rounded to f32 (the tensor cores' f32 sums differ from
    it by rounding only)."""
    X = np.asarray(X, dtype=np.float32)
    scale = row_f16_scales_reference(X)
    for g, w in enumerate(weights):
        p = np.arange(int(starts[g]), int(starts[g]) + int(counts[g]))
        if p.size == 0:
            continue
        r = p if src is None else np.asarray(src)[p]
        s = scale[r][:, None].astype(np.float64)
        x16 = (X[r] * scale[r][:, None]).astype(np.float16).astype(np.float64)
        w16 = np.asarray(w, dtype=np.float32).astype(np.float16).astype(np.float64)
        out[p] = ((x16 @ w16.T) / s).astype(np.float32)


@dataclass(frozen=True)
class PairIndex:
    """A chunk layer's pair index in one int32 array (one copy to the device): the pairs' X rows ``src [P]``, then
    per round (a launch of some of the experts) its tiles (:func:`tiles_of`, flattened), and its experts' first
    output row and pair count. ``rounds[r] = (tiles offset, n_tiles, starts offset, G)`` (offsets in elements)."""

    host: np.ndarray
    rounds: tuple[tuple[int, int, int, int], ...]

    @staticmethod
    def build(src: np.ndarray, starts: np.ndarray, counts: np.ndarray, rounds: list[np.ndarray]) -> PairIndex:
        """``src`` (int ``[P]``): pair ``p``'s X row; ``starts`` / ``counts`` (int ``[G]``): every expert's first pair
        and pair count (pairs sorted by expert); ``rounds``: the experts (int arrays of indices into ``starts``) of each
        launch. Every value must fit int32 (the kernel's index type); the outputs :func:`grouped_mm` writes have ``P``
        rows.

        Raises:
            ValueError: a value outside int32, a round naming an expert outside ``starts``, pairs past ``P``.
        """
        parts = [np.asarray(src, dtype=np.int64)]
        n = np.size(starts)
        if any(np.size(r) and (np.min(r) < 0 or np.max(r) >= n) for r in rounds):
            raise ValueError(f"PairIndex: a round names an expert outside the {n} given")
        if n and int(np.max(np.asarray(starts) + np.asarray(counts))) > parts[0].size:
            raise ValueError(f"PairIndex: experts' pairs past the {parts[0].size} pairs (rows of the outputs)")
        off = int(parts[0].size)
        info = []
        for r in rounds:
            c = np.asarray(counts, dtype=np.int64)[r]
            t = tiles_of(c).reshape(-1)
            parts += [t, np.asarray(starts, dtype=np.int64)[r], c]
            info.append((off, t.size // 2, off + t.size, int(np.size(r))))
            off += t.size + 2 * np.size(r)
        host = np.concatenate(parts)
        if host.size and (host.min() < 0 or host.max() > np.iinfo(np.int32).max):
            raise ValueError(f"PairIndex: values {host.min()}..{host.max()} outside int32")
        return PairIndex(host.astype(np.int32), tuple(info))


def group_tiles(P: int, n_expert: int) -> int:
    """The most CTA tiles (:func:`tiles_of`) ``P`` pairs spread over ``n_expert`` experts can need:
    ``min(P, (P + n_expert (TILE_PAIRS - 1)) // TILE_PAIRS)`` (each expert's pairs in steps of :data:`TILE_PAIRS`,
    every tile at least one pair). A grid sized by it covers any routing; :func:`group_pairs_reference` marks the
    tiles past the last ``(-1, 0)``."""
    return min(int(P), (int(P) + int(n_expert) * (TILE_PAIRS - 1)) // TILE_PAIRS)


def group_layout(P: int, n_expert: int) -> tuple[tuple[int, int, int, int], int]:
    """Where :func:`group_pairs_reference` (and ``rows_ops.group_pairs`` on the device) put things in their int32
    index of ``2 P + 2 NT + 2 n_expert`` values (``NT`` = :func:`group_tiles`): ``(rnd, inv offset)``, ``rnd`` the
    one round of every expert in :class:`PairIndex`'s ``rounds`` form (tiles at ``P``, ``NT`` of them, starts at
    ``P + 2 NT``, ``n_expert`` experts: expert ``g`` is expert id ``g``), ``inv`` (pair ``q``'s place) the last
    ``P``."""
    nt = group_tiles(P, n_expert)
    return (int(P), nt, int(P) + 2 * nt, int(n_expert)), int(P) + 2 * nt + 2 * int(n_expert)


def group_pairs_reference(ids, n_expert: int) -> np.ndarray:
    """A chunk's pairs sorted by expert as one int32 index (layout :func:`group_layout`): ``ids`` int ``[T, k]``
    (numpy order; pair ``q = t k + kk``) -> ``src`` (the X row of each sorted pair: pairs by expert, ``q`` ascending
    within one), the tiles of every expert id ``0 .. n_expert - 1`` (:func:`tiles_of` of all ids' counts, then ``(-1,
    0)`` up to :func:`group_tiles`), ``starts``, ``counts`` (per expert id), ``inv`` (pair ``q``'s place). What the
    device's ``rows_ops.group_pairs`` computes; the same sort as :class:`strata.engine.chunk_routing.ChunkRouting`.

    Raises:
        ValueError: an id outside ``[0, n_expert)``.
    """
    sel = np.asarray(ids, dtype=np.int64)
    flat = sel.reshape(-1)
    P, k = flat.size, (sel.shape[1] if sel.ndim == 2 else 1)
    if P and (flat.min() < 0 or flat.max() >= n_expert):
        raise ValueError(f"group_pairs_reference: expert ids {flat.min()}..{flat.max()} outside 0..{n_expert - 1}")
    perm = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=n_expert).astype(np.int64)
    starts = np.cumsum(counts) - counts
    nt = group_tiles(P, n_expert)
    tiles = np.tile(np.array([-1, 0], dtype=np.int64), nt)
    t = tiles_of(counts).reshape(-1)
    tiles[: t.size] = t
    inv = np.empty(P, dtype=np.int64)
    inv[perm] = np.arange(P)
    return np.concatenate([perm // max(k, 1), tiles, starts, counts, inv]).astype(np.int32)


def grouped_mm(type_id: int, bases, rows: int, ne0: int, X, index, rnd, out, *, src: bool = True, xscale=None):
    """The grouped product (module docstring) of one round: for its ``G`` experts (``bases``: ``cupy.uint64[G]``,
    each an engine-form weight ``[rows, ne0]`` of ``type_id``), ``out[p] = X[src[p]] @ W_g.T`` for expert ``g``'s
    pairs ``p`` (f16 operands, f32 sums); ``index``: a :class:`PairIndex`'s ``host`` on the device, ``rnd`` one of
    its ``rounds``; without ``src`` pair ``p`` reads row ``p`` of ``X``. ``X``: ``cupy.float32 [R, ne0]``
    C-contiguous; ``out``: ``cupy.float32 [P, rows]`` C-contiguous (the rows of other pairs untouched); ``xscale``:
    :func:`row_f16_scales` of ``X`` (computed when None). Returns ``out``.

    Raises:
        ValueError: a shape that does not match, ``ne0`` not a whole number of the type's blocks, X not aligned.
    """
    from strata.packer import quants

    qk = quants.qtype(type_id).block_elems
    t0, nt, s0, G = rnd
    if int(bases.size) != G:
        raise ValueError(f"grouped_mm: {int(bases.size)} weights for a round of {G} experts")
    if ne0 % qk or ne0 % 32:
        raise ValueError(f"grouped_mm: ne0 {ne0} is not a whole number of {qk}-value blocks")
    if X.ndim != 2 or X.shape[1] != ne0 or not X.flags.c_contiguous or X.data.ptr % 16 or X.dtype != np.float32:
        raise ValueError(f"grouped_mm: X {X.shape} {X.dtype} must be C-contiguous float32 [R, {ne0}], 16-byte aligned")
    if out.ndim != 2 or out.shape[1] != rows or not out.flags.c_contiguous or out.dtype != np.float32:
        raise ValueError(f"grouped_mm: out {out.shape} {out.dtype} must be C-contiguous float32 [P, {rows}]")
    if nt == 0:
        return out
    if xscale is None:
        xscale = row_f16_scales(type_id, X)
    kernels(type_id)["mm_grouped"](
        ((rows + TILE_ROWS - 1) // TILE_ROWS, nt),
        (THREADS,),
        (
            bases,
            index[t0 : t0 + 2 * nt],
            index[s0 : s0 + G],
            index[s0 + G : s0 + 2 * G],
            index if src else np.uint64(0),
            X,
            np.int64(ne0),
            xscale,
            np.int32(rows),
            np.int32(ne0),
            out,
        ),
    )
    return out


__all__ = [
    "MM_KERNEL_NAMES",
    "PairIndex",
    "group_layout",
    "group_pairs_reference",
    "group_tiles",
    "grouped_mm",
    "grouped_mm_reference",
    "kernels",
    "mm_source",
    "mm_sources",
    "row_f16_scales",
    "row_f16_scales_reference",
    "supports",
    "tiles_of",
]
