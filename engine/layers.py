"""Shared layers of the forward passes, written against an array module ``xp`` (numpy or cupy).

Every function takes ``xp`` first and uses only operations both modules have; weights come
through a :class:`strata.engine.weights.Weights` object, so the same code runs on the CPU
reference path and the GPU path. No architecture branches here: a model file composes these.

Numerics follow llama.cpp (``ggml/src/ggml-cpu/ops.cpp``) in f32: RMS norm
``x / sqrt(mean(x^2) + eps) * w``, NEOX rope (rotate pairs ``(i, i + n_rot/2)``), attention
``softmax(scale * q.k) v`` over the cached positions (a sliding-window layer sees the last
``window`` positions, llama-hparams.h ``is_masked_swa``: masked iff ``p1 - p0 >= n_swa``, and
keeps only those in a ring buffer), K/V stored as f16 (default, like llama.cpp) or f32,
SwiGLU / GELU(tanh) MLPs, and MoE routing softmax -> top-k -> renormalise (llama-graph.cpp
``build_moe_ffn``: weights divided by their sum, clamped below at 6.103515625e-5).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.manifests.names import tensor_name

from . import rowpar


def chunk_op(w, name: str):
    """The device kernel ``name`` the weight store ``w``'s prompt-chunk path offers (the GPU's
    :class:`strata.engine.gpu.chunk.ChunkPath` on CUDA: ``attend_rows`` and ``route_rows`` - None for shapes they do
    not take -, ``rms_norm_rows``, ``rope_rows``, ``unit_lower_inverse``: each the array form's computation in one
    launch), or None (no chunk path, or one without device kernels: the simulated device)."""
    path = getattr(w, "chunk", None)
    return getattr(path, name, None) if getattr(path, "device_kernels", False) else None


def rms_norm(xp, x, w, eps: float):
    """``x / sqrt(mean(x^2, last axis) + eps) * w`` in f32 (ggml_rms_norm then ggml_mul)."""
    ms = xp.mean(x * x, axis=-1, keepdims=True, dtype=xp.float32)
    return (x * (xp.float32(1.0) / xp.sqrt(ms + xp.float32(eps)))) * w


def silu(xp, x):
    """``x / (1 + exp(-x))`` (ggml_silu). ``exp(-x)`` overflows to inf for ``x`` below about -88, and ``x / inf``
    is the -0 the formula tends to: NumPy's overflow warning is silenced (damaged weights are caught as non-finite
    logits, :class:`strata.engine.errors.NonFiniteLogits`, not as warnings)."""
    with np.errstate(over="ignore"):
        return x / (xp.float32(1.0) + xp.exp(-x))


def sigmoid(xp, x):
    """``1 / (1 + exp(-x))`` (ggml_sigmoid)."""
    return xp.float32(1.0) / (xp.float32(1.0) + xp.exp(-x))


#: sqrt(2 / pi), the constant of the tanh GELU (ggml's SQRT_2_OVER_PI; the fused act_mul kernel gets it too).
GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(xp, x):
    """GELU, tanh approximation (ggml_gelu): ``0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))``."""
    return (
        xp.float32(0.5)
        * x
        * (xp.float32(1.0) + xp.tanh(xp.float32(GELU_C) * x * (xp.float32(1.0) + xp.float32(0.044715) * x * x)))
    )


def gelu_f16_table(xp, x):
    """llama.cpp CPU's GELU (``GGML_GELU_FP16``): ``fp16(gelu_tanh(fp16(x)))`` for ``-10 < x < 10``,
    ``0`` at or below -10, ``x`` at or above 10 (:mod:`strata.engine.numerics`, item 4)."""
    y = gelu_tanh(xp, x.astype(xp.float16).astype(xp.float32)).astype(xp.float16).astype(xp.float32)
    return xp.where(x <= -10.0, xp.float32(0.0), xp.where(x >= 10.0, x, y))


def softmax(xp, x, axis: int = -1):
    m = x.max(axis=axis, keepdims=True)
    p = xp.exp(x - m)
    return p / p.sum(axis=axis, keepdims=True)


#: Rope pairings (llama.cpp ``llama_model_rope_type``): ``neox`` rotates ``(i, i + n_rot/2)``
#: (qwen2, qwen3, gemma3 ...), ``norm`` rotates adjacent pairs ``(2i, 2i + 1)`` (llama, Mistral, Mixtral).
ROPE_MODES = ("neox", "norm")


#: Positions a thread computes at a time when the rope tables are made (:func:`_rope_table`).
ROPE_CHUNK = 1 << 16


def _rope_table(n_ctx: int, inv: np.ndarray, freq_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of ``theta[p, i] = (freq_scale * p) * inv[i]`` (float64, then rounded to f32: numpy
    ``[n_ctx, inv.size]``), computed in chunks of :data:`ROPE_CHUNK` positions on the CPU's cores (NumPy's ufuncs
    release the GIL; elementwise, so the same bits as one call). Large angles make ``np.cos`` slow (its range
    reduction): one table of 1,000,000 positions x 128 took 42 s on one core of a 2-core VM - Gemma 3 has two."""
    h = int(inv.size)
    cos, sin = np.empty((n_ctx, h), np.float32), np.empty((n_ctx, h), np.float32)

    def fill(lo: int) -> None:
        hi = min(n_ctx, lo + ROPE_CHUNK)
        ang = (freq_scale * np.arange(lo, hi, dtype=np.float64))[:, None] * inv[None, :]
        cos[lo:hi], sin[lo:hi] = np.cos(ang), np.sin(ang)

    starts = range(0, n_ctx, ROPE_CHUNK)
    if len(starts) <= 1:
        for lo in starts:
            fill(lo)
    else:
        import os
        from concurrent.futures import ThreadPoolExecutor

        workers = min(len(starts), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            list(pool.map(fill, starts))
    return cos, sin


class Rope:
    """Rotary embedding with a precomputed table for positions ``0..n_ctx-1`` (ggml ``rope_f32``).

    ``theta_i(p) = freq_scale * p * base^(-2i/n_rot) / factors[i]`` for ``i < n_rot/2`` (``factors``:
    the ``rope_freqs.weight`` tensor of Llama 3.1+ files, ggml_rope_ext's ``freq_factors``; 1 without
    it; ``freq_scale``: linear rope scaling, 1 / ``rope.scaling.factor``: ggml ``rope_yarn`` with
    ``ext_factor`` 0 takes ``theta_interp = freq_scale * theta_extrap``); dims past ``n_rot`` pass through.
    ``mode`` picks the pairing (:data:`ROPE_MODES`). The table is allocated once per session (the token path
    allocates nothing of its own).

    Raises:
        ValueError: an unknown ``mode``, or ``factors`` whose length is not ``n_rot/2``.
    """

    def __init__(
        self, xp, n_rot: int, base: float, n_ctx: int, mode: str = "neox", factors=None, freq_scale: float = 1.0
    ):
        if mode not in ROPE_MODES:
            raise ValueError(f"rope mode {mode!r}: expected one of {ROPE_MODES}")
        inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        if factors is not None:
            f = np.asarray(factors, dtype=np.float64).reshape(-1)
            if f.size != n_rot // 2:
                raise ValueError(f"rope_freqs: {f.size} factors, the rope rotates {n_rot} dims (needs {n_rot // 2})")
            inv = inv / f
        self.n_rot, self.mode, self.freq_scale = n_rot, mode, float(freq_scale)
        cos, sin = _rope_table(n_ctx, inv, float(freq_scale))
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)

    def __call__(self, xp, x, pos: int):
        """Rotate ``x [n_head, head_dim]`` (numpy order) for position ``pos``."""
        h = self.n_rot // 2
        c, s = self.cos[pos], self.sin[pos]
        if self.mode == "norm":
            x0, x1 = x[:, 0 : self.n_rot : 2], x[:, 1 : self.n_rot : 2]
            r = xp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape[0], self.n_rot)
        else:
            x0, x1 = x[:, :h], x[:, h : self.n_rot]
            r = xp.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
        if self.n_rot < x.shape[-1]:
            r = xp.concatenate([r, x[:, self.n_rot :]], axis=-1)
        return r

    def rows(self, xp, x, pos0: int):
        """Rotate ``x [T, n_head, head_dim]`` (numpy order), row ``t`` for position ``pos0 + t`` (a prompt chunk):
        the arithmetic of :meth:`__call__` per row, so each row is bit-identical to it."""
        T, nh = x.shape[0], x.shape[1]
        h = self.n_rot // 2
        c, s = self.cos[pos0 : pos0 + T][:, None, :], self.sin[pos0 : pos0 + T][:, None, :]
        if self.mode == "norm":
            x0, x1 = x[..., 0 : self.n_rot : 2], x[..., 1 : self.n_rot : 2]
            r = xp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(T, nh, self.n_rot)
        else:
            x0, x1 = x[..., :h], x[..., h : self.n_rot]
            r = xp.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
        if self.n_rot < x.shape[-1]:
            r = xp.concatenate([r, x[..., self.n_rot :]], axis=-1)
        return r


#: ``--kv`` choice -> the dtype K and V are stored in (strata.layout.kv.ENGINE_KV_TYPES).
KV_DTYPES = {"f16": "float16", "f32": "float32"}


class KVCache:
    """Static per-layer K/V arrays ``[size, n_head_kv, head_dim]`` (gpt-fast style: allocated once,
    written in place), stored as ``kv`` (``f16``, llama.cpp's default cache type, or ``f32``) and
    read back as f32.

    ``sizes[il]`` positions per layer: ``n_ctx`` for a full-context layer; for a sliding-window layer
    :func:`strata.layout.kv.kv_tokens` (its window, at most ``n_ctx``) - a ring
    buffer: position ``p`` lives in slot ``p % size``, overwriting the position ``size`` before it,
    which the window no longer sees. :meth:`read` returns positions in chronological order, so the
    arithmetic over them is the same as over a full cache.

    Raises:
        ValueError: an unknown ``kv``.
    """

    def __init__(self, xp, sizes: list[int], n_head_kv: int, head_dim: int, head_dim_v: int, kv: str = "f16"):
        if kv not in KV_DTYPES:
            raise ValueError(f"--kv {kv!r}: strata's engine stores K/V as {' or '.join(KV_DTYPES)}")
        self.xp, self.kv = xp, kv
        self.sizes = [int(n) for n in sizes]
        dt = getattr(xp, KV_DTYPES[kv])
        self.k = [xp.zeros((n, n_head_kv, head_dim), dtype=dt) for n in self.sizes]
        self.v = [xp.zeros((n, n_head_kv, head_dim_v), dtype=dt) for n in self.sizes]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def write(self, il: int, pos: int, k, v) -> None:
        """Store position ``pos`` of layer ``il`` (rounded to the cache dtype)."""
        s = pos % self.sizes[il]
        self.k[il][s] = k
        self.v[il][s] = v

    def write_rows(self, il: int, pos0: int, k, v) -> None:
        """Store positions ``pos0 .. pos0 + T - 1`` of layer ``il`` (``k [T, n_head_kv, head_dim]``, ``v`` likewise;
        rounded to the cache dtype); a ring keeps the last ``size`` of them."""
        n, T = self.sizes[il], k.shape[0]
        lo = max(0, T - n)
        slots = (pos0 + lo + self.xp.arange(T - lo)) % n
        self.k[il][slots] = k[lo:]
        self.v[il][slots] = v[lo:]

    def read(self, il: int, lo: int, hi: int):
        """K and V of positions ``lo..hi`` (inclusive) of layer ``il`` as f32 ``[hi - lo + 1, n_head_kv, d]``,
        oldest first. The positions must all be resident: ``hi - lo < sizes[il]`` (a ring keeps the
        last ``size`` positions written)."""
        n = self.sizes[il]
        if hi - lo >= n or lo < 0:
            raise IndexError(f"layer {il}: positions {lo}..{hi} do not fit its {n}-position cache")
        a, b = lo % n, hi % n
        k, v = self.k[il], self.v[il]
        if a <= b:
            K, V = k[a : b + 1], v[a : b + 1]
        else:  # wrapped: the older part is at the end of the ring
            K, V = self.xp.concatenate((k[a:], k[: b + 1])), self.xp.concatenate((v[a:], v[: b + 1]))
        return K.astype(self.xp.float32), V.astype(self.xp.float32)


def attend(xp, q, K, V, scale: float, f16_operands: bool = False):
    """Attention of one query position over the keys ``K`` and values ``V`` it may see (GQA).

    ``q [n_head, hd]``, ``K [T, n_head_kv, hd]``, ``V [T, n_head_kv, hd_v]`` in f32, oldest first;
    query head ``h`` reads KV head ``h // (n_head / n_head_kv)``. Scores and the weighted sum are
    elementwise products and sums (no matmul: on the GPU path that would create a cuBLAS handle,
    ~68 MiB of VRAM outside every budget term). ``f16_operands``: q and the softmax probabilities
    rounded to f16 before their products, as llama.cpp's non-flash attention does with an F16
    cache (:mod:`strata.engine.numerics`, item 3); products accumulate in f32 either way.
    Returns ``[n_head * hd_v]``.
    """
    n_head, hd = q.shape
    n_kv = K.shape[1]
    if f16_operands:
        q = q.astype(xp.float16).astype(xp.float32)
    qg = q.reshape(n_kv, n_head // n_kv, 1, hd)
    Kt = K.transpose(1, 0, 2)[:, None]  # [g, 1, T, hd]
    s = (qg * Kt).sum(axis=-1) * xp.float32(scale)  # [g, r, T]
    p = softmax(xp, s)
    if f16_operands:
        p = p.astype(xp.float16).astype(xp.float32)
    Vt = V.transpose(1, 0, 2)[:, None]  # [g, 1, T, hd_v]
    o = (p[..., None] * Vt).sum(axis=2)  # [g, r, hd_v]
    return o.reshape(n_head * V.shape[2])


#: Keys from which one position's attention on the CPU takes matrix products (:func:`attend_rows` of one query, NumPy's
#: BLAS) instead of :func:`attend`'s elementwise products and sums: those make ``[heads, keys, hd]`` temporaries, and
#: at 4,000 keys a Qwen2.5-0.5B layer took 18 ms against 2.5 ms for the products (docs/DESIGN.md "Long contexts on the
#: CPU"). Below it the elementwise form stays (the short contexts of the llama.cpp fixtures keep their numerics).
ATTEND_MM_MIN_KEYS = 256

#: Score elements one block of :func:`attend_rows` may hold (f32: 64 MiB): longer prompts are split in query blocks.
ATTEND_BLOCK_ELEMS = 1 << 24
#: Query rows of one block of :func:`attend_rows` on the CPU: blocks are what its threads share
#: (:mod:`strata.engine.rowpar`), and a block reads only the keys its queries may see, so short blocks skip most of
#: the causal mask's upper triangle.
ATTEND_CPU_ROWS = 64


def attend_rows(xp, q, K, V, scale: float, pos0: int, lo: int, window: int | None, f16_operands: bool = False):
    """Causal attention of a prompt chunk: query row ``t`` (position ``pos0 + t``) over the keys of positions
    ``lo .. pos0 + t`` it may see (``K [S, n_head_kv, hd]``, ``V [S, n_head_kv, hd_v]`` f32 for positions
    ``lo .. lo + S - 1``, oldest first), inside its ``window`` when one is given (llama.cpp ``is_masked_swa``:
    masked iff ``p_q - p_k >= window``). ``q [T, n_head, hd]``; returns ``[T, n_head * hd_v]`` (numpy order).

    The scores and the weighted sum are matrix products (:func:`attend` sums elementwise products for one
    query: the two differ by float rounding only); masked keys get ``-inf`` before the softmax (weight 0).
    ``f16_operands`` rounds q and the probabilities to f16 as :func:`attend` does. Queries are taken in blocks
    of at most :data:`ATTEND_BLOCK_ELEMS` scores (on the CPU at most :data:`ATTEND_CPU_ROWS` rows, the blocks
    shared by the chunk's threads: :func:`strata.engine.rowpar.run`); a block reads only the keys from the first
    one its first query sees (window) to the last its last query sees (causal)."""
    T, n_head, hd = q.shape
    S, n_kv = K.shape[0], K.shape[1]
    r = n_head // n_kv
    if f16_operands:
        q = q.astype(xp.float16).astype(xp.float32)
    Kt_all = K.transpose(1, 2, 0)[:, None]  # [g, 1, hd, S]
    Vt_all = V.transpose(1, 0, 2)[:, None]  # [g, 1, S, hd_v]
    out = xp.empty((T, n_head * V.shape[2]), dtype=xp.float32)
    step = max(1, ATTEND_BLOCK_ELEMS // max(1, n_head * S))
    if xp is np:
        step = min(step, ATTEND_CPU_ROWS)

    def block(a: int, b: int) -> None:
        k0 = 0 if window is None else max(0, pos0 + a + 1 - window - lo)
        k1 = min(S, pos0 + b - lo)
        Kt, Vt = Kt_all[..., k0:k1], Vt_all[:, :, k0:k1]
        kp = lo + xp.arange(k0, k1)
        qg = q[a:b].reshape(b - a, n_kv, r, hd).transpose(1, 2, 0, 3)  # [g, r, t, hd]
        s = (qg @ Kt) * xp.float32(scale)  # [g, r, t, k1 - k0]
        qp = pos0 + xp.arange(a, b)
        seen = kp[None, :] <= qp[:, None]
        if window is not None:
            seen = seen & (qp[:, None] - kp[None, :] < window)
        s = xp.where(seen, s, xp.float32(-xp.inf))
        p = softmax(xp, s)
        if f16_operands:
            p = p.astype(xp.float16).astype(xp.float32)
        o = p @ Vt  # [g, r, t, hd_v]
        out[a:b] = o.transpose(2, 0, 1, 3).reshape(b - a, -1)

    rowpar.run([(a, min(T, a + step)) for a in range(0, T, step)], block)
    return out


@dataclass
class AttentionNames:
    """Tensor names of one attention layer (resolved once; fused qkv and biases optional)."""

    qkv: str | None
    q: str
    k: str
    v: str
    q_bias: str | None
    k_bias: str | None
    v_bias: str | None
    qkv_bias: str | None
    out: str
    out_bias: str | None
    q_norm: str | None
    k_norm: str | None

    @classmethod
    def of(cls, w, il: int, qk_norm: bool) -> AttentionNames:
        def n(role: str) -> str:
            return tensor_name(role, il)

        def opt(role: str) -> str | None:
            return n(role) if w.has(n(role)) else None

        return cls(
            qkv=opt("attn_qkv.weight"),
            q=n("attn_q.weight"),
            k=n("attn_k.weight"),
            v=n("attn_v.weight"),
            q_bias=opt("attn_q.bias"),
            k_bias=opt("attn_k.bias"),
            v_bias=opt("attn_v.bias"),
            qkv_bias=opt("attn_qkv.bias"),
            out=n("attn_output.weight"),
            out_bias=opt("attn_output.bias"),
            q_norm=n("attn_q_norm.weight") if qk_norm else None,
            k_norm=n("attn_k_norm.weight") if qk_norm else None,
        )


class Attention:
    """Self-attention of one layer: projections (+ biases), optional q/k RMS norms, rope, cache
    write, GQA attention with optional sliding window, output projection.

    ``scale_q``: multiply Q by ``scale`` before attention and use a kq scale of 1 (gemma3's
    ``ggml_scale(Qcur, f_attention_scale)``) instead of scaling q.k (qwen's ``kq_scale``); the
    two differ only once q is rounded to f16. ``output_gate``: the query projection holds
    ``[q_h | gate_h]`` for every head h (``2 * head_dim`` rows per head) and the attention output is
    multiplied by ``sigmoid(gate)`` before the output projection (llama.cpp ``src/models/qwen3next.cpp``
    ``build_layer_attn``: Qcur_full reshaped to ``[2 * head_dim, n_head]``, viewed as query and gate).
    """

    def __init__(
        self,
        w,
        il: int,
        *,
        n_head: int,
        n_head_kv: int,
        head_dim: int,
        head_dim_v: int,
        scale: float,
        window: int | None,
        eps: float,
        qk_norm: bool,
        scale_q: bool = False,
        f16_operands: bool = False,
        output_gate: bool = False,
    ):
        self.w, self.il = w, il
        self.names = AttentionNames.of(w, il, qk_norm)
        self.n_head, self.n_head_kv, self.hd, self.hd_v = n_head, n_head_kv, head_dim, head_dim_v
        self.scale, self.window, self.eps = scale, window, eps
        self.scale_q, self.f16_operands, self.output_gate = scale_q, f16_operands, output_gate

    def project(self, xp, x):
        """The projections of ``x`` (``[n_embd]``, or a chunk's rows ``[T, n_embd]``, numpy order): ``(q, k, v,
        gate)`` as ``[..., n_head, hd]``, ``[..., n_head_kv, hd]``, ``[..., n_head_kv, hd_v]`` and the output gate
        ``[..., n_head * hd]`` (None without one), biases added and q/k normed; before rope."""
        w, n = self.w, self.names
        lead = x.shape[:-1]
        nq, nk = self.n_head * self.hd, self.n_head_kv * self.hd
        if n.qkv is not None:
            qkv = w.matmul(n.qkv, x)
            if n.qkv_bias is not None:
                qkv = qkv + w.get(n.qkv_bias)
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]
        else:
            q, k, v = w.matmul(n.q, x), w.matmul(n.k, x), w.matmul(n.v, x)
        gate = None
        if self.output_gate:
            qg = q.reshape(*lead, self.n_head, 2 * self.hd)
            q, gate = qg[..., : self.hd].reshape(*lead, -1), qg[..., self.hd :].reshape(*lead, -1)
        if n.q_bias is not None:
            q = q + w.get(n.q_bias)
        if n.k_bias is not None:
            k = k + w.get(n.k_bias)
        if n.v_bias is not None:
            v = v + w.get(n.v_bias)
        q = q.reshape(*lead, self.n_head, self.hd)
        k = k.reshape(*lead, self.n_head_kv, self.hd)
        v = v.reshape(*lead, self.n_head_kv, self.hd_v)
        if n.q_norm is not None:
            fast = chunk_op(w, "rms_norm_rows") if q.ndim == 3 else None
            norm = rms_norm if fast is None else (lambda _xp, a, nw, eps: fast(a, nw, eps))
            q = norm(xp, q, w.get(n.q_norm), self.eps)
            k = norm(xp, k, w.get(n.k_norm), self.eps)
        return q, k, v, gate

    def output(self, xp, o, gate):
        """The attention output ``o`` (``[..., n_head * hd_v]``) times ``sigmoid(gate)`` when the layer has an output
        gate, through ``attn_output`` (+ its bias)."""
        w, n = self.w, self.names
        if gate is not None:
            o = o * sigmoid(xp, gate)
        y = w.matmul(n.out, o)
        return y + w.get(n.out_bias) if n.out_bias is not None else y

    def __call__(self, xp, x, pos: int, cache: KVCache, rope: Rope):
        q, k, v, gate = self.project(xp, x)
        q = rope(xp, q, pos)
        k = rope(xp, k, pos)
        cache.write(self.il, pos, k, v)
        if self.scale_q:
            q, kq_scale = q * xp.float32(self.scale), 1.0
        else:
            kq_scale = self.scale
        # a sliding window sees positions pos - window + 1 .. pos (llama.cpp is_masked_swa: masked iff
        # pos - p >= window); a full layer 0 .. pos
        lo = 0 if self.window is None else max(0, pos + 1 - self.window)
        K, V = cache.read(self.il, lo, pos)
        if xp is np and K.shape[0] >= ATTEND_MM_MIN_KEYS:
            o = attend_rows(xp, q[None], K, V, kq_scale, pos, lo, None, self.f16_operands)[0]
        else:
            o = attend(xp, q, K, V, kq_scale, self.f16_operands)
        return self.output(xp, o, gate)

    def chunk(self, xp, X, pos0: int, cache: KVCache, rope: Rope):
        """The layer on a prompt chunk: ``X [T, n_embd]`` (numpy order) for positions ``pos0 .. pos0 + T - 1``,
        returns ``[T, n_embd]``. The projections take the whole chunk (``w.matmul`` on rows: bit-identical per row
        to the one-position products); the keys and values are rounded to the cache's dtype as one position's
        are, the earlier positions read from the cache before the chunk's are written (a ring may hold only the
        window), and the attention is :func:`attend_rows` (or the weight store's chunk path's ``attend_rows``, the same
        computation in one device kernel: :mod:`strata.engine.gpu.attn_rows`)."""
        q, k, v, gate = self.project(xp, X)
        fast_rope = chunk_op(self.w, "rope_rows")
        if fast_rope is not None:
            q, k = fast_rope(rope, q, pos0), fast_rope(rope, k, pos0)
        else:
            q, k = rope.rows(xp, q, pos0), rope.rows(xp, k, pos0)
        dt = cache.k[self.il].dtype
        kc, vc = k.astype(dt), v.astype(dt)
        lo = 0 if self.window is None else max(0, pos0 + 1 - self.window)
        if pos0 > lo:
            K0, V0 = cache.read(self.il, lo, pos0 - 1)
            K = xp.concatenate([K0, kc.astype(xp.float32)])
            V = xp.concatenate([V0, vc.astype(xp.float32)])
        else:
            K, V = kc.astype(xp.float32), vc.astype(xp.float32)
        cache.write_rows(self.il, pos0, kc, vc)
        if self.scale_q:
            q, kq_scale = q * xp.float32(self.scale), 1.0
        else:
            kq_scale = self.scale
        # the device's own kernel when the weight store offers one (the GPU's chunk path: one launch), else the arrays
        fast = chunk_op(self.w, "attend_rows")
        o = None if fast is None else fast(q, K, V, kq_scale, pos0, lo, self.window, self.f16_operands)
        if o is None:
            o = attend_rows(xp, q, K, V, kq_scale, pos0, lo, self.window, self.f16_operands)
        return self.output(xp, o, gate)


def gated_mlp(xp, w, il: int, x, act: str):
    """``down @ (act(gate @ x + gate_b) * (up @ x + up_b)) + down_b`` (llama.cpp ``build_ffn``
    LLM_FFN_PAR; each bias only when the pack has it: llama's optional MLP biases); ``act`` is
    ``silu``, ``gelu`` (exact tanh form) or ``gelu_f16`` (llama.cpp CPU's table)."""

    def mm(role, v):
        y = w.matmul(tensor_name(role + ".weight", il), v)
        b = tensor_name(role + ".bias", il)
        return y + w.get(b) if w.has(b) else y

    g, u = mm("ffn_gate", x), mm("ffn_up", x)
    fn = silu if act == "silu" else gelu_tanh if act == "gelu" else gelu_f16_table
    if xp is np and g.ndim == 2 and rowpar.threads() > 1:  # a CPU prompt chunk: rows over the threads, same bits
        h = np.empty_like(g)

        def part(a0: int, b0: int) -> None:
            h[a0:b0] = fn(xp, g[a0:b0]) * u[a0:b0]

        rowpar.run(rowpar.ranges(g.shape[0]), part)
    else:
        h = fn(xp, g) * u
    return mm("ffn_down", h)


def expert_ffn(xp, gate, up, down, x, types: tuple[int, int, int] | None = None):
    """One routed expert: ``down @ (silu(gate @ x) * (up @ x))`` from f32 matrices (numpy order
    ``[rows, row length]``). ``types`` (ggml types of gate, up, down) switches on llama.cpp's
    activation quantization for each product (:func:`strata.engine.numerics.quantize_activation`).
    The hit and the miss path both call this, on identical weights and types."""
    if types is None:
        return down @ (silu(xp, gate @ x) * (up @ x))
    from .numerics import quantize_activation as qa

    h = silu(xp, gate @ qa(xp, x, types[0])) * (up @ qa(xp, x, types[1]))
    return down @ qa(xp, h, types[2])


def route_topk(xp, logits, k: int, norm: bool = True) -> tuple[list[int], Any]:
    """Softmax over all experts, the ``k`` most probable (ties: lower id first), their
    probabilities renormalised to sum 1 (sum clamped below at 6.103515625e-5, as llama.cpp)."""
    probs = softmax(xp, logits)
    order = xp.argsort(-probs, kind="stable") if xp is np else xp.argsort(-probs)
    top = order[:k]
    ids = [int(i) for i in to_host(top).tolist()]  # the host decides hit or miss per expert
    wts = probs[top]
    if norm:
        wts = wts / xp.maximum(wts.sum(), xp.float32(ROUTE_WEIGHT_SUM_MIN))
    return ids, wts


#: The floor of a routed row's weight sum before the division (llama.cpp ``build_moe_ffn``: ``ggml_clamp(weights_sum,
#: 6.103515625e-5, INFINITY)``, 2^-14): every routing implementation takes it from here.
ROUTE_WEIGHT_SUM_MIN = 6.103515625e-5


def route_topk_rows(xp, logits, k: int, norm: bool = True) -> tuple[np.ndarray, Any]:
    """:func:`route_topk` of every row of ``logits [T, n_expert]`` (a prompt chunk): ``(ids, weights)`` with
    ``ids[t]`` the row's ``k`` experts (a host ``int64 [T, k]`` array, most probable first, ties: lower id first) and
    ``weights [T, k]``; each row's values are :func:`route_topk`'s on that row."""
    probs = softmax(xp, logits)
    order = xp.argsort(-probs, axis=-1, kind="stable") if xp is np else xp.argsort(-probs, axis=-1)
    top = order[:, :k]
    wts = xp.take_along_axis(probs, top, axis=-1)
    if norm:
        wts = wts / xp.maximum(wts.sum(axis=-1, keepdims=True), xp.float32(ROUTE_WEIGHT_SUM_MIN))
    return to_host(top).astype(np.int64, copy=False), wts


class HostWait:
    """Host wall milliseconds spent blocked in device->host copies (:func:`to_host`): each copy
    waits for every kernel queued before it, so this is the time the host waited for the device
    (``--stats`` "wait"). Process-wide; read and reset with :meth:`take`."""

    ms = 0.0

    @classmethod
    def take(cls) -> float:
        v, cls.ms = cls.ms, 0.0
        return v


def to_host(x) -> np.ndarray:
    """A device array as a numpy array (identity for numpy); device copies count in :class:`HostWait`."""
    if isinstance(x, np.ndarray):
        return x
    if not hasattr(x, "get"):
        return np.asarray(x)
    t0 = time.perf_counter()
    h = x.get()
    HostWait.ms += (time.perf_counter() - t0) * 1000
    return h
