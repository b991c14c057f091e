"""A prompt chunk's row-wise operations on CUDA in one launch each (``cuda/rows_ops.cu``): RMS norm and rotary
embedding over a chunk's rows, what :func:`strata.engine.layers.rms_norm` and :meth:`strata.engine.layers.Rope.rows`
compute with array operations (each a handful of launches, temporaries and host calls per use; a 30B-A3B chunk makes
~300 of them). The same formulas and f32 operations; the squares' sum in another order (rounding only). Shapes in
numpy order. The chunk path (:class:`strata.engine.gpu.chunk.ChunkPath`) offers them to the layers.
"""

from __future__ import annotations

import functools

import numpy as np

from . import kernels as K

#: Threads a CTA of the row kernels (``ROW_THREADS`` in the source).
ROW_THREADS = 256
KERNEL_NAMES = ("rms_norm_rows", "rope_rows", "weighted_rows", "route_rows", "group_pairs", "unit_lower_inverse")
#: Experts a layer may have for :func:`route_rows` (``ROUTE_MAX_E``: the probabilities sit in shared memory).
ROUTE_MAX_E = 1024
#: The largest matrix :func:`unit_lower_inverse` takes (``ULI_MAX_N``: A and X sit in shared memory, 32 KiB): the
#: delta rule's sub-chunk (:data:`strata.engine.deltanet.DELTA_CHUNK`).
ULI_MAX_N = 64


def source() -> str:
    """The module's CUDA source: the prelude's typedefs and ``cuda/rows_ops.cu``."""
    from ..kernel_src import assembly as A
    from ..layers import ROUTE_WEIGHT_SUM_MIN

    defs = f"#define ROW_THREADS {ROW_THREADS}\n#define ROUTE_MAX_E {ROUTE_MAX_E}\n#define ULI_MAX_N {ULI_MAX_N}\n"
    defs += f"#define ROUTE_SUM_MIN {float(np.float32(ROUTE_WEIGHT_SUM_MIN))!r}f\n"
    return A.source_file("prelude.cuh") + defs + K.cuda_file("rows_ops.cu")


@functools.cache
def _kernels() -> dict:
    return K.load_module(source(), KERNEL_NAMES)


def rms_norm_rows(x, w, eps: float):
    """``(x * (1 / sqrt(mean(x^2, last axis) + eps))) * w`` for ``x`` of any leading shape ``[..., n]`` and ``w [n]``
    (``cupy.float32``): the rows of ``x`` in one launch.

    Raises:
        ValueError: ``w`` not of ``x``'s last dimension.
    """
    import cupy as cp

    n = x.shape[-1]
    if w.size != n:
        raise ValueError(f"rms_norm_rows: weight of {w.size} values for rows of {n}")
    xc = cp.ascontiguousarray(x, dtype=cp.float32)
    out = cp.empty_like(xc)
    rows = xc.size // n if n else 0
    if rows:
        _kernels()["rms_norm_rows"](
            (rows,), (ROW_THREADS,), (xc, cp.ascontiguousarray(w, dtype=cp.float32), out, np.int32(n), np.float32(eps))
        )
    return out


def rope_rows(x, cos_t, sin_t, n_rot: int, pos0: int, neox: bool):
    """:meth:`strata.engine.layers.Rope.rows` in one launch: ``x [T, n_head, head_dim]`` (``cupy.float32``), row
    ``t`` rotated for position ``pos0 + t`` with the tables ``cos_t`` / ``sin_t [n_ctx, n_rot / 2]`` (f32).

    Raises:
        ValueError: positions past the tables, tables of another shape, or ``n_rot`` odd or above the head dim.
    """
    import cupy as cp

    T, nh, hd = x.shape
    if n_rot % 2 or n_rot > hd or pos0 + T > cos_t.shape[0]:
        raise ValueError(f"rope_rows: n_rot {n_rot}, head dim {hd}, positions {pos0}..{pos0 + T - 1}")
    if cos_t.shape != sin_t.shape or cos_t.shape[1] != n_rot // 2:
        raise ValueError(f"rope_rows: tables {cos_t.shape} / {sin_t.shape} for {n_rot} rotated dims")
    cos_t = cp.ascontiguousarray(cos_t, dtype=cp.float32)
    sin_t = cp.ascontiguousarray(sin_t, dtype=cp.float32)
    xc = cp.ascontiguousarray(x, dtype=cp.float32)
    out = cp.empty_like(xc)
    n = T * nh * (n_rot // 2 + hd - n_rot)
    if n:
        _kernels()["rope_rows"](
            ((n + 255) // 256,),
            (256,),
            (xc, cos_t, sin_t, out, np.int32(T), np.int32(nh), np.int32(hd), np.int32(n_rot), np.int64(pos0),
             np.int32(bool(neox))),
        )  # fmt: skip
    return out


def weighted_rows(E, w, at=None):
    """``y[t] = sum_k w[t, k] * E[t, k]`` in ``k`` order (a chunk row's routed experts weighted and summed as
    :meth:`strata.engine.experts.ExpertPath.chunk` sums them): ``E [T, K, n]``, ``w [T, K]`` -> ``[T, n]``
    (``cupy.float32``), one launch. With ``at`` (int32 ``[T * K]``), ``E`` is ``[rows, n]`` and pair ``t * K + k``'s
    output is its row ``at[t * K + k]`` (the outputs sorted by expert, :func:`group_pairs`): the same sums, no
    gathered copy.

    Raises:
        ValueError: ``w`` not ``[T, K]`` of ``E``, or ``at`` not ``T * K`` int32 places.
    """
    import cupy as cp

    if at is None:
        T, Kk, n = E.shape
        if w.shape != (T, Kk):
            raise ValueError(f"weighted_rows: weights {w.shape} for outputs {E.shape}")
    else:
        (T, Kk), n = w.shape, E.shape[-1]
        if at.dtype != cp.int32 or at.size != T * Kk:
            raise ValueError(f"weighted_rows: {at.size} places ({at.dtype}) for weights {w.shape}")
    out = cp.empty((T, n), dtype=cp.float32)
    if T and n and Kk:
        _kernels()["weighted_rows"](
            ((n + 255) // 256, T),
            (256,),
            (cp.ascontiguousarray(E, dtype=cp.float32), cp.ascontiguousarray(w, dtype=cp.float32), out, np.int32(Kk),
             np.int32(n), np.uint64(0) if at is None else cp.ascontiguousarray(at)),
        )  # fmt: skip
    return out


def group_pairs(ids, n_expert: int, tile_pairs: int, n_tiles: int):
    """A chunk's (row, expert) pairs sorted by expert on the device, in one launch (``cuda/rows_ops.cu``
    ``group_pairs``): ``ids`` ``cupy.int32 [T, k]`` (every id in ``[0, n_expert)``: what :func:`route_rows` gives) ->
    ``cupy.int32 [2 P + 2 n_tiles + 2 n_expert]`` (``P = T k``): the layout
    :func:`strata.engine.gpu.moe_mm.group_layout` describes, the values of
    :func:`strata.engine.gpu.moe_mm.group_pairs_reference` (the same stable sort, tiles of ``tile_pairs``).

    Raises:
        ValueError: ``n_expert`` above :data:`ROUTE_MAX_E`, ``ids`` not int32 ``[T, k]``, ``n_tiles`` below the tiles
            the pairs may need.
    """
    import cupy as cp

    if ids.ndim != 2 or ids.dtype != cp.int32:
        raise ValueError(f"group_pairs: ids {ids.shape} {ids.dtype} must be int32 [T, k]")
    P = int(ids.size)
    if not 0 < n_expert <= ROUTE_MAX_E or tile_pairs < 1:
        raise ValueError(f"group_pairs: {n_expert} experts (at most {ROUTE_MAX_E}), tiles of {tile_pairs} pairs")
    if n_tiles < min(P, (P + n_expert * (tile_pairs - 1)) // tile_pairs):
        raise ValueError(f"group_pairs: {n_tiles} tiles for {P} pairs of {n_expert} experts")
    index = cp.empty(2 * P + 2 * n_tiles + 2 * n_expert, dtype=cp.int32)
    _kernels()["group_pairs"](
        (1,), (ROW_THREADS,), (cp.ascontiguousarray(ids), np.int32(P), np.int32(ids.shape[1]), np.int32(n_expert),
                               np.int32(tile_pairs), np.int32(n_tiles), index)
    )  # fmt: skip
    return index


def route_rows(logits, k: int, norm: bool, host: bool = True):
    """:func:`strata.engine.layers.route_topk_rows` in one launch: ``logits [T, n_expert]`` (``cupy.float32``) ->
    ``(ids, weights)``, ``ids`` a host ``int64 [T, k]`` array (one copy to the host), or with ``host=False`` the
    device's ``cupy.int32 [T, k]`` (no copy: :func:`group_pairs` groups them there), ``weights`` ``cupy.float32
    [T, k]``; None when ``n_expert`` is above :data:`ROUTE_MAX_E` or below ``k`` (the caller takes the array
    form). The same softmax formula and ties (lower id first); the sums in another order (rounding only). A row
    with NaN logits routes to valid experts (0..k-1 where nothing ranks) with weights 0 or NaN, as the array form
    gives NaN weights: the logits then say so."""
    import cupy as cp

    T, E = logits.shape
    if E > ROUTE_MAX_E or k > E or k < 1:
        return None
    ids = cp.tile(cp.arange(k, dtype=cp.int32), (T, 1))  # a NaN row's unranked slots stay valid experts
    w = cp.zeros((T, k), dtype=cp.float32)
    if T:
        _kernels()["route_rows"](
            (T,), (ROW_THREADS,), (cp.ascontiguousarray(logits, dtype=cp.float32), ids, w, np.int32(E), np.int32(k),
                                   np.int32(bool(norm)))
        )  # fmt: skip
    return (cp.asnumpy(ids).astype(np.int64) if host else ids), w


def unit_lower_inverse(A):
    """``(I + A)^-1`` for strictly lower-triangular ``A [batch, n, n]`` (``cupy.float32``, numpy order; the diagonal
    and the upper part are not read) in one launch (``cuda/rows_ops.cu`` ``unit_lower_inverse``: a CTA per matrix,
    forward substitution column by column: the substitution of :func:`strata.engine.deltanet.unit_lower_solve` of
    ``(A, I)``, each sum in ascending ``j``). What :func:`strata.engine.deltanet.unit_lower_inverse` computes by block
    doubling in ~50 array launches; within float rounding of it. Returns ``cupy.float32 [batch, n, n]``, or None
    for ``n`` above :data:`ULI_MAX_N` (the caller takes the array form).

    Raises:
        ValueError: ``A`` not ``[batch, n, n]``.
    """
    import cupy as cp

    if A.ndim != 3 or A.shape[1] != A.shape[2]:
        raise ValueError(f"unit_lower_inverse: {A.shape} is not a batch of square matrices")
    b, n = A.shape[0], A.shape[1]
    if n > ULI_MAX_N:
        return None
    Ac = cp.ascontiguousarray(A, dtype=cp.float32)
    X = cp.empty_like(Ac)
    if b and n:
        _kernels()["unit_lower_inverse"]((b,), (ULI_MAX_N,), (Ac, X, np.int32(n)))
    return X


__all__ = [
    "KERNEL_NAMES",
    "ROUTE_MAX_E",
    "ULI_MAX_N",
    "group_pairs",
    "rms_norm_rows",
    "route_rows",
    "rope_rows",
    "source",
    "unit_lower_inverse",
    "weighted_rows",
]
