"""The matrix products of a prompt chunk on CUDA: engine-form weights dequantized into an f32 tile, multiplied
with cuBLAS (docs/DESIGN.md "Prompts in chunks on the GPU").

A chunk of ``T`` positions meets each weight ``T`` times, so the weight is dequantized once (the type's
``dequant_many`` kernel, :mod:`strata.engine.gpu.kernels`: every value equals the decode kernels' dequantization
bit for bit) into a preallocated f32 tile, and the product is one cuBLAS GEMM. llama.cpp's CUDA back end does that
(``ggml-cuda.cu`` ``ggml_cuda_op_mul_mat_cublas``: both operands converted to f16) only where it does not take its
MMQ kernels (``ggml_cuda_should_use_mmq``: on cards with int8 tensor cores, every quantized type at every batch
size). strata keeps both operands f32 and asks cuBLAS for
``CUBLAS_COMPUTE_32F_FAST_TF32`` (``tf32=True``: tensor cores, operands rounded to TF32's 10-bit mantissa, f32
range and accumulation) or ``CUBLAS_COMPUTE_32F_PEDANTIC`` (``tf32=False``: plain f32, the ``--kernel exact``
mode). Shapes are numpy order ([rows, columns], row-major) throughout; the weight of ggml ``ne = (ne0, rows)``
is numpy ``[rows, ne0]``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from . import kernels as K

#: cuBLAS constants (cublas_api.h, library_types.h): the values are part of the C API.
_OP_N, _OP_T = 0, 1
_R_32F = 0
_COMPUTE_32F_PEDANTIC = 69
_COMPUTE_32F_FAST_TF32 = 77
_GEMM_DEFAULT = -1

_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


def _cublas():
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy
        from cupy.cuda import cublas
    return cublas


#: Whether this thread has a cuBLAS handle from this module (:func:`cublas_used`; CuPy keeps one per thread).
_USED = threading.local()


def cublas_used() -> bool:
    """True once a prompt chunk's GEMM has taken CuPy's cuBLAS handle in this thread: its first use (handle,
    workspace, kernels: the budget's cuBLAS share of "CUDA runtime") is then paid. Other CuPy code that used cuBLAS
    (``cupy.matmul``) is not seen; the engine itself uses none elsewhere."""
    return getattr(_USED, "yes", False)


def _handle():
    import cupy as cp

    cublas = _cublas()
    h = cp.cuda.device.get_cublas_handle()
    _USED.yes = True
    cublas.setStream(h, cp.cuda.get_current_stream().ptr)
    return cublas, h


def dequant_many(type_id: int, bases, rows_total: int, ne0: int, row0: int, nrows: int, out, out_stride: int) -> None:
    """Rows ``row0 .. row0 + nrows - 1`` of ``n`` engine-form weights of one type and shape (``bases``:
    ``cupy.uint64[n]`` device addresses, each a ``[rows_total, ne0]`` weight) as f32 into ``out`` (flat
    ``cupy.float32``; weight ``i``'s rows at element ``i * out_stride``, row-major ``[nrows, ne0]``). Each value
    equals :func:`strata.engine.gpu.kernels.dequantize`'s.

    Raises:
        ValueError: ``ne0`` not a multiple of the type's block, a row range outside the weight, ``out`` too small.
    """
    k = K.kernels_for(type_id)
    K.check_matvec(k, rows_total, ne0)
    n = int(bases.size)
    if not (0 <= row0 and nrows >= 0 and row0 + nrows <= rows_total):
        raise ValueError(f"rows {row0}..{row0 + nrows - 1} outside a weight of {rows_total} rows")
    if n == 0 or nrows == 0:
        return
    if (n - 1) * out_stride + nrows * ne0 > out.size:
        raise ValueError(f"dequant_many: {n} x {nrows} x {ne0} values do not fit an output of {out.size}")
    if k.plain:
        cnt = nrows * ne0
        k.dequant_many(
            ((cnt + 255) // 256, n),
            (256,),
            (bases, np.int64(rows_total * ne0), np.int64(row0 * ne0), np.int64(cnt), out, np.int64(out_stride)),
        )
        return
    per_row = ne0 // k.block_elems
    nblk = nrows * per_row
    n_work, per_cta = nblk * (k.block_elems // 32), 32 * K.WARPS_PER_CTA
    k.dequant_many(
        ((n_work + per_cta - 1) // per_cta, n),
        (32 * K.WARPS_PER_CTA,),
        (bases, np.int64(rows_total * per_row), np.int64(row0 * per_row), np.int64(nblk), out, np.int64(out_stride)),
    )


def gemm_nt(X, W, out, *, col0: int = 0, tf32: bool = True) -> None:
    """``out[:, col0 : col0 + rows] = X @ W.T`` for ``X: cupy.float32[T, k]``, ``W: [rows, k]`` (both C-contiguous),
    ``out: cupy.float32[T, N]`` (C-contiguous, ``N >= col0 + rows``); cuBLAS ``gemmEx`` (module docstring)."""
    T, kk = X.shape
    rows = W.shape[0]
    if W.shape[1] != kk or out.shape[0] != T or col0 + rows > out.shape[1]:
        raise ValueError(f"gemm_nt: X {X.shape}, W {W.shape}, out {out.shape}, col0 {col0}")
    if T == 0 or rows == 0:
        return
    cublas, h = _handle()
    # column-major: C (rows x T, ldc = N) = op_T(W: k x rows) * op_N(X: k x T)
    cublas.gemmEx(
        h, _OP_T, _OP_N, rows, T, kk,
        _ONE.ctypes.data, W.data.ptr, _R_32F, kk,
        X.data.ptr, _R_32F, kk,
        _ZERO.ctypes.data, out.data.ptr + 4 * col0, _R_32F, out.shape[1],
        _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F_PEDANTIC, _GEMM_DEFAULT,
    )  # fmt: skip


def gemm_nt_batched(X, W, out, *, tf32: bool = True) -> None:
    """``out[g] = X[g] @ W[g].T`` for ``X: cupy.float32[G, M, k]``, ``W: [G, rows, k]``, ``out: [G, M, rows]``
    (all C-contiguous); one cuBLAS ``gemmStridedBatchedEx``."""
    G, M, kk = X.shape
    rows = W.shape[1]
    if W.shape[0] < G or W.shape[2] != kk or out.shape != (G, M, rows):
        raise ValueError(f"gemm_nt_batched: X {X.shape}, W {W.shape}, out {out.shape}")
    if G == 0 or M == 0 or rows == 0:
        return
    cublas, h = _handle()
    cublas.gemmStridedBatchedEx(
        h, _OP_T, _OP_N, rows, M, kk,
        _ONE.ctypes.data, W.data.ptr, _R_32F, kk, rows * kk,
        X.data.ptr, _R_32F, kk, M * kk,
        _ZERO.ctypes.data, out.data.ptr, _R_32F, rows, M * rows,
        G, _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F_PEDANTIC, _GEMM_DEFAULT,
    )  # fmt: skip


def addresses(bufs: list[Any]):
    """``cupy.uint64[n]``: the device addresses of ``bufs`` (CuPy arrays, or ints that are addresses already)."""
    import cupy as cp

    return cp.asarray(np.array([b if isinstance(b, int) else b.data.ptr for b in bufs], dtype=np.uint64))


#: device address -> a ``cupy.uint64[1]`` holding it: a weight's address goes to the device once, not per product (an
#: upload from pageable memory waits for the queued kernels; the value is the key, so a reused address stays right)
_ONE_ADDRESS: dict[int, Any] = {}


def one_address(buf):
    """``cupy.uint64[1]`` holding ``buf``'s device address, uploaded once per address."""
    ptr = int(buf.data.ptr)
    a = _ONE_ADDRESS.get(ptr)
    if a is None:
        a = _ONE_ADDRESS[ptr] = addresses([ptr])
    return a


def rows_product(type_id: int, buf, rows: int, ne0: int, X, tile, *, tf32: bool = True, out=None):
    """``X @ W.T`` for one engine-form weight ``W`` (``[rows, ne0]``) and a chunk's inputs ``X: cupy.float32[T,
    ne0]``: ``cupy.float32[T, rows]``. ``W`` is dequantized into ``tile`` (``cupy.float32``, preallocated) as
    many rows at a time as fit, each row block multiplied with one GEMM.

    Raises:
        ValueError: ``tile`` smaller than one row of ``W``.
    """
    import cupy as cp

    T = X.shape[0]
    if out is None:
        out = cp.empty((T, rows), dtype=cp.float32)
    per = int(tile.size) // ne0
    if per < 1:
        raise ValueError(f"a chunk tile of {tile.size} f32 cannot hold one row of {ne0} values")
    bases = one_address(buf)
    Xc = cp.ascontiguousarray(X, dtype=cp.float32)
    for r0 in range(0, rows, per):
        n = min(per, rows - r0)
        dequant_many(type_id, bases, rows, ne0, r0, n, tile, 0)
        gemm_nt(Xc, tile[: n * ne0].reshape(n, ne0), out, col0=r0, tf32=tf32)
    return out


def grouped_product(type_id: int, bufs, rows: int, ne0: int, Xg, tile, *, tf32: bool = True):
    """``out[g] = Xg[g] @ W_g.T`` for ``G = len(bufs)`` engine-form weights of one type and shape ``[rows, ne0]``
    (a list of CuPy uint8 arrays or device addresses - a routed expert's part in a slot, the host tier or staging -
    or their addresses already on the device, ``cupy.uint64[G]``) and
    ``Xg: cupy.float32[G, M, ne0]``: ``cupy.float32[G, M, rows]``. All ``G`` weights are dequantized into ``tile``
    by one launch and multiplied by one batched GEMM.

    Raises:
        ValueError: ``tile`` smaller than ``G`` weights.
    """
    import cupy as cp

    G, M, _ = Xg.shape
    if G * rows * ne0 > tile.size:
        raise ValueError(f"{G} weights of {rows} x {ne0} f32 do not fit a chunk tile of {tile.size} f32")
    bases = bufs if isinstance(bufs, cp.ndarray) else addresses(bufs)
    dequant_many(type_id, bases, rows, ne0, 0, rows, tile, rows * ne0)
    out = cp.empty((G, M, rows), dtype=cp.float32)
    gemm_nt_batched(
        Xg if Xg.flags.c_contiguous else cp.ascontiguousarray(Xg),
        tile[: G * rows * ne0].reshape(G, rows, ne0),
        out,
        tf32=tf32,
    )
    return out


__all__ = ["addresses", "one_address", "dequant_many", "gemm_nt", "gemm_nt_batched", "grouped_product", "rows_product"]
