"""A prompt chunk's causal attention on CUDA in one launch (``cuda/attn_rows.cu``): what
:func:`strata.engine.layers.attend_rows` computes with array operations (scores, mask, softmax, weighted values: a
dozen launches and ``[heads, T, S]`` temporaries per layer), here each query row's two passes over the keys it may see,
the keys and values staged a tile at a time in shared memory. The same f32 values within the sums' order (the f16
rounding of q and of the probabilities with ``f16_operands`` included). Shapes in numpy order.

The chunk path (:class:`strata.engine.gpu.chunk.ChunkPath`) offers it to the layers as ``attend_rows``
(:meth:`strata.engine.layers.Attention.chunk` takes it when the weight store has a chunk path that supports the
shapes; otherwise the array form).
"""

from __future__ import annotations

import functools

import numpy as np

from . import kernels as K

#: Warps per CTA (``ATT_WARPS``) and rows a warp takes at most (``RPW``: 4, or 8 when a KV head has more than 16
#: query heads): a CTA takes ``ATT_WARPS * RPW`` (query, head) rows of one KV head. Fewer rows a warp: fewer registers
#: (168 at 8 rows for head dim 128), more CTAs resident and in the grid.
WARPS, ROWS_PER_WARP = 4, 8
MAX_HEAD_DIM = 256


def supports(n_head: int, n_kv: int, hd: int, hd_v: int) -> bool:
    """Whether :func:`attend_rows` takes these shapes: head dims multiples of 64 up to :data:`MAX_HEAD_DIM`, and a KV
    head's query heads within one CTA's rows."""
    return (
        n_kv > 0
        and n_head % n_kv == 0
        and n_head // n_kv <= WARPS * ROWS_PER_WARP
        and all(d % 64 == 0 and 0 < d <= MAX_HEAD_DIM for d in (hd, hd_v))
    )


def shape(n_head: int, n_kv: int, hd: int, hd_v: int) -> tuple[int, int, int]:
    """``(KT, BQ, RPW)``: keys a shared-memory tile holds (32, or 16 for head dims over 128: 32 KiB of K and V rows),
    queries a CTA takes (as many as fill its rows) and rows a warp takes at most."""
    kt = 32 if max(hd, hd_v) <= 128 else 16
    r = n_head // n_kv
    rpw = 4 if r <= 4 * WARPS else ROWS_PER_WARP
    return kt, max(1, (WARPS * rpw) // r), rpw


def source(hd: int, hd_v: int, kt: int, bq: int, f16ops: bool, rpw: int = ROWS_PER_WARP) -> str:
    """The module's CUDA source: the prelude's typedefs, the shape's defines, ``cuda/attn_rows.cu``."""
    from ..kernel_src import assembly as A

    defs = f"#define HD {hd}\n#define HDV {hd_v}\n#define KT {kt}\n#define BQ {bq}\n#define F16OPS {int(f16ops)}\n"
    defs += f"#define RPW {rpw}\n"
    return A.source_file("prelude.cuh") + defs + K.cuda_file("attn_rows.cu")


@functools.cache
def _kernel(hd: int, hd_v: int, kt: int, bq: int, f16ops: bool, rpw: int):
    return K.load_module(source(hd, hd_v, kt, bq, f16ops, rpw), ("attn_rows",))["attn_rows"]


def attend_rows(q, K_, V, scale: float, pos0: int, lo: int, window: int | None, f16_operands: bool = False):
    """:func:`strata.engine.layers.attend_rows` on CUDA: ``q [T, n_head, hd]``, ``K_ [S, n_kv, hd]``, ``V [S, n_kv,
    hd_v]`` (``cupy.float32``, positions ``lo .. lo + S - 1``) -> ``[T, n_head * hd_v]``; None when
    :func:`supports` refuses the shapes (the caller takes the array form).

    Raises:
        ValueError: the arrays' shapes disagree.
    """
    import cupy as cp

    T, n_head, hd = q.shape
    S, n_kv, hd_v = V.shape
    if K_.shape != (S, n_kv, hd):
        raise ValueError(f"attend_rows: K {K_.shape} and V {V.shape} disagree with q {q.shape}")
    if not supports(n_head, n_kv, hd, hd_v):
        return None
    kt, bq, rpw = shape(n_head, n_kv, hd, hd_v)
    out = cp.empty((T, n_head * hd_v), dtype=cp.float32)
    if T == 0:
        return out
    c = lambda a: cp.ascontiguousarray(a, dtype=cp.float32)  # noqa: E731
    _kernel(hd, hd_v, kt, bq, bool(f16_operands), rpw)(
        ((T + bq - 1) // bq, n_kv),
        (32 * WARPS,),
        (c(q), c(K_), c(V), out, np.int32(T), np.int32(S), np.int32(n_head), np.int32(n_kv), np.int64(pos0),
         np.int64(lo), np.int64(window or 0), np.float32(scale)),
    )  # fmt: skip
    return out


def sources() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Modules of every kind the engine's shapes compile, ``label -> (source, kernel names)``
    (tests/test_gpu_cuda_compile.py): head dims 64, 128, 256 in both f16 modes, 8 query heads a KV head (4 rows a
    warp) and 24 (8 rows a warp), and a value head dim other than the key's (192 / 128: 16-key tiles, 2-float loads)."""
    out = {}
    for (hd, hd_v), heads in [((64, 64), (16, 2)), ((128, 128), (16, 2)), ((256, 256), (16, 2)), ((128, 128), (24, 1)),
                              ((192, 128), (16, 2))]:  # fmt: skip
        for f16 in (False, True):
            kt, bq, rpw = shape(*heads, hd, hd_v)
            label = f"attn_rows hd{hd}x{hd_v} rpw{rpw} f16ops{int(f16)}"
            out[label] = (source(hd, hd_v, kt, bq, f16, rpw), ("attn_rows",))
    return out


__all__ = ["MAX_HEAD_DIM", "attend_rows", "shape", "source", "sources", "supports"]
