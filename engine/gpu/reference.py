"""NumPy replicas of the GPU path's arithmetic, bit for bit: the CPU side of the hybrid engine.

The hit path is all or nothing and GPU and CPU must agree (docs/DESIGN.md "The hit path is all or nothing":
a 4.761e-04 disagreement between the two paths changed the generated tokens). Strata's GPU engine therefore
computes an expert that is a cache miss on the CPU with *the same IEEE f32 operations in the same order* as
the GPU kernels use for a hit:

- :func:`matvec` replays ``strata.engine.gpu.kernels``' matvec order exactly (per-chunk sequential
  ``s = s + w*x``, per-lane sequential chunk sums, xor butterfly 16/8/4/2/1): NumPy's float32
  ``cumsum`` is a sequential left-to-right sum, so it reproduces the kernel's rounding order.
- :func:`silu_mul` is ``silu(g) * u`` with a portable ``exp`` (range reduction + Horner
  polynomial + exact power-of-two scaling: only +, -, *, /, floor, min, max - each correctly
  rounded on both sides); the GPU kernel ``silu_mul`` runs the same sequence compiled with
  ``--fmad=false``. (``numpy.exp`` and CUDA's ``expf`` are different approximations.)

Dequantized weights are already bit-identical (``gguf.quants.dequantize`` == the GPU kernels), so
an expert's output is bit-identical on both sides and the tokens cannot depend on which experts
are resident. tests/test_gpu_kernels.py checks every replica against the device.
"""

from __future__ import annotations

import numpy as np

from strata.packer import quants

from ..kernel_src.assembly import EXP_CONSTANTS  # the one definition (the kernels embed its bits)

__all__ = ["matvec", "silu_mul", "exp_portable", "EXP_CONSTANTS", "expert_ffn"]

_F = np.float32


def exp_portable(t: np.ndarray) -> np.ndarray:
    """``exp(t)`` for float32 ``t`` clamped to [-80, 88] (~2 ulp), every step one rounded f32 op:

    ``n = floor(t*log2e + 0.5)``, ``r = (t - n*ln2_hi) - n*ln2_lo``, Horner degree 7 with separate
    multiply and add, times ``2**n`` built from bits (exact: the result stays normal)."""
    c = EXP_CONSTANTS
    t = np.minimum(np.maximum(np.asarray(t, dtype=_F), c["LO"]), c["HI"])
    n = np.floor(t * c["LOG2E"] + c["HALF"])
    r = (t - n * c["LN2_HI"]) - n * c["LN2_LO"]
    p = r * c["C7"]
    p = p + c["C6"]
    p = p * r
    p = p + c["C5"]
    p = p * r
    p = p + c["C4"]
    p = p * r
    p = p + c["C3"]
    p = p * r
    p = p + c["C2"]
    p = p * r
    p = p + c["ONE"]
    p = p * r
    p = p + c["ONE"]
    scale = ((n.astype(np.int32) + 127) << 23).astype(np.uint32).view(_F)
    return p * scale


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``(g / (1 + exp_portable(-g))) * u`` in float32: the expert FFN's activation, bit-identical
    to the GPU kernel ``silu_mul``."""
    g = np.asarray(g, dtype=_F)
    e = exp_portable(-g)
    return (g / (EXP_CONSTANTS["ONE"] + e)) * np.asarray(u, dtype=_F)


def _butterfly(acc: np.ndarray) -> np.ndarray:
    """Lane 0 of the warp's xor butterfly over ``acc[..., 32]`` (offsets 16, 8, 4, 2, 1)."""
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ o]
    return acc[..., 0]


def _seq_sum(a: np.ndarray, axis: int) -> np.ndarray:
    """``((0 + a[0]) + a[1]) + ...`` along ``axis`` in float32 (NumPy's cumsum is sequential)."""
    a = np.moveaxis(a, axis, -1)
    z = np.zeros(a.shape[:-1] + (1,), dtype=_F)
    return np.cumsum(np.concatenate([z, a], axis=-1), axis=-1, dtype=_F)[..., -1]


def matvec(type_id: int, W: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``W @ x`` (float32 ``W [rows, ne0]`` already dequantized, ``x [ne0]``) in the exact order of
    the GPU matvec kernel for weights of ggml type ``type_id``; bit-identical to it.

    Padding adds ``+0.0`` where a lane has no chunk: exact, because a sum that starts at +0.0
    never becomes -0.0 under round-to-nearest.
    """
    W = np.asarray(W, dtype=_F)
    x = np.asarray(x, dtype=_F)
    rows, ne0 = W.shape
    P = W * x[None, :]  # one rounded product per element
    t = quants.qtype(type_id)
    if t.block_elems == 1:
        it = -(-ne0 // 32)
        Q = np.zeros((rows, it * 32), dtype=_F)
        Q[:, :ne0] = P
        acc = _seq_sum(Q.reshape(rows, it, 32), axis=1)  # lane l: elements l, l+32, ...
        return _butterfly(acc)
    if ne0 % 32:
        raise ValueError(f"{t.name}: ne0={ne0} is not a multiple of 32")
    nch = ne0 // 32
    s = _seq_sum(P.reshape(rows, nch, 32), axis=2)  # chunk sums
    it = -(-nch // 32)
    S = np.zeros((rows, it * 32), dtype=_F)
    S[:, :nch] = s
    acc = _seq_sum(S.reshape(rows, it, 32), axis=1)  # lane l: chunks l, l+32, ...
    return _butterfly(acc)


def expert_ffn(
    types: tuple[int, int, int], gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray
) -> np.ndarray:
    """One routed expert ``down @ silu_mul(gate @ x, up @ x)`` on the CPU, bit-identical to the GPU
    hit path (:meth:`strata.engine.gpu.slots.SlotCache.ffn`). ``types`` = ggml types of
    gate, up, down; matrices f32 in numpy order ``[rows, row length]``."""
    g = matvec(types[0], gate, x)
    u = matvec(types[1], up, x)
    return matvec(types[2], down, silu_mul(g, u))
