"""The gated delta net (linear attention) layer and its per-sequence recurrent state, written
against an array module ``xp`` (NumPy on the CPU path, CuPy on the GPU's generic path).

As llama.cpp computes it for one token (``src/models/qwen3next.cpp``
``build_layer_attn_linear``, ``build_qkvz``; ``src/models/delta-net-base.cpp`` ``build_conv_state``,
``build_delta_net_autoregressive``; ``src/models/models.h`` ``build_gdn_l2_norm``):

1. ``qkv = attn_qkv @ x`` (``conv_dim`` = 2 key_dim + value_dim), ``z = attn_gate @ x`` (value_dim);
   a legacy ``ssm_in`` instead holds, per k head, ``[q | k | v | z]`` (rows regrouped here);
2. ``ba = ssm_ba @ x``: per k-head group ``[b (nv/nk) | a (nv/nk)]``; ``beta = sigmoid(b)``,
   ``g = softplus(a + ssm_dt.bias) * ssm_a`` (``ssm_a`` stores ``-exp(A_log)``; ggml's softplus is
   ``x`` above 20, ``log(1 + exp(x))`` below: ``ggml-impl.h`` ``ggml_compute_softplus_f32``);
3. causal depthwise conv1d over the last ``d_conv`` positions: ``window = [conv_state | qkv]``
   (``d_conv - 1`` past inputs per channel), ``out[c] = sum_k window[k, c] * w[c, k]``
   (``ggml_ssm_conv``), then the new conv state is the last ``d_conv - 1`` inputs; SiLU;
4. split into q (``n_group`` heads), k (``n_group``), v (``dt_rank`` heads) of ``d_state`` each;
   q and k L2-normalised (``x / sqrt(sum(x^2) + eps)``, as ``rms_norm(x, eps / n) / sqrt(n)``) and
   repeated to the v heads (v head ``i`` reads k head ``i // (nv / nk)``); q scaled by
   ``1 / sqrt(d_state)``;
5. per v head, the delta rule on the state ``S [d_state (v), d_state (k)]`` (llama.cpp's
   ``[S_v, S_v]`` in ne order, so ``S[j, i]`` here is its ``s[i, j]``)::

       S = S * exp(g);  d = (v - S @ k) * beta;  S = S + outer(d, k);  o = S @ q

6. ``o`` RMS-normed per head with ``ssm_norm``, times ``silu(z)`` (the gated norm), then ``ssm_out``.

The state is f32 and its size is exactly the budget's recurrent-state term
(:func:`strata.layout.kv.recurrent_state_bytes_per_seq`): ``(d_conv - 1) x conv_dim`` conv
values and ``d_state x d_inner`` delta values per recurrent layer per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from strata.manifests.names import tensor_name

from .layers import chunk_op, rms_norm, sigmoid, silu


@dataclass(frozen=True)
class DeltaNetDims:
    """Dimensions of one gated-delta-net layer (counts): ``d_conv`` conv kernel, ``d_state`` head dim
    of q, k and v, ``n_group`` k heads, ``dt_rank`` v heads; ``eps`` of the norms; the widths ``key_dim``
    (q and k), ``value_dim`` (v, z and the output) and ``conv_dim`` (the conv's channels: q, k and v) as the
    geometry derives them (manifests/qwen3next.toml ``[derived]``: the one definition; :meth:`of`)."""

    d_conv: int
    d_state: int
    n_group: int
    dt_rank: int
    eps: float
    key_dim: int
    value_dim: int
    conv_dim: int

    @classmethod
    def of(cls, g, eps: float) -> DeltaNetDims:
        """The dims of a resolved geometry ``g`` (:class:`strata.manifests.contract.Geometry`: its params
        ``d_conv``, ``d_state``, ``n_group``, ``dt_rank`` and derived ``key_dim``, ``value_dim``, ``conv_dim``).

        Raises:
            KeyError: ``g`` has no delta-net params (not a qwen3next geometry).
        """
        n = ("d_conv", "d_state", "n_group", "dt_rank")
        return cls(*(int(g[k]) for k in n), eps, *(int(g[k]) for k in ("key_dim", "value_dim", "conv_dim")))


class RecurrentState:
    """Per recurrent layer, the conv state ``[d_conv - 1, conv_dim]`` and the delta state
    ``[dt_rank, d_state, d_state]`` (f32, zeros at the start of a sequence), allocated once.

    ``nbytes`` is :func:`strata.layout.kv.recurrent_state_bytes_per_seq` of these layers. Every
    layer's two arrays are views of ONE allocation (``arena``, layers in order, conv then delta state),
    so the device allocator rounds one size, not two per layer."""

    def __init__(self, xp, layers: list[int], dims: DeltaNetDims):
        self.xp, self.dims = xp, dims
        conv_shape = (dims.d_conv - 1, dims.conv_dim)
        ssm_shape = (dims.dt_rank, dims.d_state, dims.d_state)
        nc, ns = math.prod(conv_shape), math.prod(ssm_shape)
        self.arena = xp.zeros(len(layers) * (nc + ns), dtype=xp.float32)
        self.conv, self.ssm = {}, {}
        for k, il in enumerate(layers):
            base = k * (nc + ns)
            self.conv[il] = self.arena[base : base + nc].reshape(conv_shape)
            self.ssm[il] = self.arena[base + nc : base + nc + ns].reshape(ssm_shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv.values()) + sum(a.nbytes for a in self.ssm.values())

    def reset(self) -> None:
        """Zero every layer's state (a new sequence)."""
        for a in (*self.conv.values(), *self.ssm.values()):
            a[...] = 0


def l2_norm(xp, x, eps: float):
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, as llama.cpp's ``build_gdn_l2_norm``
    computes it: ``rms_norm(x, eps / n) * (1 / sqrt(n))`` (``src/models/models.h``)."""
    n = x.shape[-1]
    ms = xp.mean(x * x, axis=-1, keepdims=True, dtype=xp.float32)
    y = x * (xp.float32(1.0) / xp.sqrt(ms + xp.float32(eps / n)))
    return y * xp.float32(1.0 / n**0.5)


def softplus(xp, x):
    """``x`` where ``x > 20``, else ``log(1 + exp(x))`` (ggml ``ggml_compute_softplus_f32``)."""
    return xp.where(x > xp.float32(20.0), x, xp.log(xp.float32(1.0) + xp.exp(xp.minimum(x, xp.float32(20.0)))))


class GatedDeltaNet:
    """One gated-delta-net layer (module docstring); ``__call__(xp, x, state) -> [n_embd]``."""

    def __init__(self, w, il: int, dims: DeltaNetDims):
        self.w, self.il, self.dims = w, il, dims

        def n(role: str) -> str:
            return tensor_name(role, il)

        self.qkv = n("attn_qkv.weight") if w.has(n("attn_qkv.weight")) else None
        self.gate = n("attn_gate.weight") if self.qkv is not None else None
        self.ssm_in = n("ssm_in.weight") if self.qkv is None else None
        self.conv_w, self.dt_bias, self.a = n("ssm_conv1d.weight"), n("ssm_dt.bias"), n("ssm_a")
        self.ba, self.norm, self.out = n("ssm_ba.weight"), n("ssm_norm.weight"), n("ssm_out.weight")

    def _qkvz(self, xp, x):
        """``(qkv [conv_dim], z [value_dim])`` from the pair of projections or the legacy ``ssm_in``
        (per k head ``[q (d) | k (d) | v (d nv/nk) | z (d nv/nk)]``, regrouped to ``[q all | k all | v all]``:
        llama.cpp ``build_qkvz``'s legacy path)."""
        w, d = self.w, self.dims
        if self.qkv is not None:
            return w.matmul(self.qkv, x), w.matmul(self.gate, x)
        m = w.matmul(self.ssm_in, x)
        r = d.dt_rank // d.n_group
        lead = m.shape[:-1]  # () for one position, (T,) for a prompt chunk
        per = m.reshape(*lead, d.n_group, 2 * d.d_state + 2 * d.d_state * r)
        s = d.d_state
        q, k = per[..., :s], per[..., s : 2 * s]
        v, z = per[..., 2 * s : 2 * s + s * r], per[..., 2 * s + s * r :]
        flat = [a.reshape(*lead, -1) for a in (q, k, v)]
        return xp.concatenate(flat, axis=-1), z.reshape(*lead, -1)

    def __call__(self, xp, x, state: RecurrentState):
        w, d = self.w, self.dims
        qkv, z = self._qkvz(xp, x)
        ba = w.matmul(self.ba, x)
        cw = w.get(self.conv_w).reshape(d.conv_dim, d.d_conv)  # numpy order of ne [d_conv, conv_dim]
        h = conv_silu(xp, qkv, state.conv[self.il], cw)
        o = delta_rule(xp, h, z, ba, state.ssm[self.il], w.get(self.dt_bias), w.get(self.a), w.get(self.norm), d)
        return w.matmul(self.out, o)

    def chunk(self, xp, X, state: RecurrentState):
        """The layer on a prompt chunk ``X [T, n_embd]`` (numpy order): ``[T, n_embd]``. The projections take the
        whole chunk (bit-identical per row), the conv too (:func:`conv_silu_rows`: the one-position values bit for
        bit); the delta rule in its chunked form (:func:`delta_rule_rows`: matrix products over sub-chunks of
        :data:`DELTA_CHUNK` positions, llama.cpp's ``build_delta_net_chunking``; within float rounding of the
        recurrence)."""
        w, d = self.w, self.dims
        qkv, z = self._qkvz(xp, X)
        ba = w.matmul(self.ba, X)
        cw = w.get(self.conv_w).reshape(d.conv_dim, d.d_conv)
        h = conv_silu_rows(xp, qkv, state.conv[self.il], cw)
        args = (state.ssm[self.il], w.get(self.dt_bias), w.get(self.a), w.get(self.norm), d)
        o = delta_rule_rows(xp, h, z, ba, *args, inverse=chunk_op(w, "unit_lower_inverse"))
        return w.matmul(self.out, o)


def conv_silu(xp, qkv, cs, cw):
    """Steps 3 of the module docstring: the causal depthwise conv of ``qkv [conv_dim]`` over
    ``[cs | qkv]`` (``cs [d_conv - 1, conv_dim]``, the previous inputs; updated in place to the last
    ``d_conv - 1``) with ``cw [conv_dim, d_conv]`` (numpy order), summed sequentially over the kernel
    (``ggml_ssm_conv``), then SiLU. Returns ``[conv_dim]`` f32."""
    win = xp.concatenate([cs, qkv[None, :]], axis=0)  # [d_conv, conv_dim]
    acc = win[0] * cw[:, 0]
    for k in range(1, cw.shape[1]):
        acc = acc + win[k] * cw[:, k]
    cs[...] = win[1:]
    return silu(xp, acc)


def conv_silu_rows(xp, qkv, cs, cw):
    """:func:`conv_silu` of ``T`` consecutive positions at once: ``qkv [T, conv_dim]``, ``cs`` updated in place to
    the last ``d_conv - 1`` inputs. Position ``t``'s window is rows ``t .. t + d_conv - 1`` of ``[cs | qkv]``, summed
    over the kernel in the same order: each row is :func:`conv_silu`'s bit for bit. Returns ``[T, conv_dim]`` f32."""
    T = qkv.shape[0]
    win = xp.concatenate([cs, qkv], axis=0)  # [T + d_conv - 1, conv_dim]
    acc = win[0:T] * cw[:, 0]
    for k in range(1, cw.shape[1]):
        acc = acc + win[k : k + T] * cw[:, k]
    cs[...] = win[T:]
    return silu(xp, acc)


#: Positions per sub-chunk of :func:`delta_rule_rows` (llama.cpp's ``build_delta_net_chunking`` takes 64).
DELTA_CHUNK = 64


def _gates_heads(xp, H, BA, dt_bias, ssm_a, d: DeltaNetDims):
    """Steps 2 and 4 of the module docstring for rows ``H [T, conv_dim]``, ``BA [T, 2 dt_rank]``: ``(beta, g, q, k,
    v)`` with ``beta``, ``g`` ``[T, dt_rank]`` and ``q`` (scaled), ``k``, ``v`` ``[T, dt_rank, d_state]`` - the
    per-position values of :func:`delta_rule` (the same elementwise operations, row by row)."""
    f32 = xp.float32
    T, r, kd = H.shape[0], d.dt_rank // d.n_group, d.key_dim
    ba = BA.reshape(T, d.n_group, 2, r)
    beta = sigmoid(xp, ba[:, :, 0, :].reshape(T, -1))
    g = softplus(xp, ba[:, :, 1, :].reshape(T, -1) + dt_bias) * ssm_a
    q = l2_norm(xp, H[:, :kd].reshape(T, d.n_group, d.d_state), d.eps)
    k = l2_norm(xp, H[:, kd : 2 * kd].reshape(T, d.n_group, d.d_state), d.eps)
    v = H[:, 2 * kd :].reshape(T, d.dt_rank, d.d_state)
    q = xp.repeat(q, r, axis=1) * f32(1.0 / d.d_state**0.5)
    k = xp.repeat(k, r, axis=1)
    return beta, g, q, k, v


def unit_lower_solve(xp, A, B):
    """``(I + A)^-1 B`` for strictly lower-triangular ``A [h, n, n]`` and ``B [h, n, m]`` by forward substitution (row
    ``t`` = ``B_t - A[t, :t] D[:t]``): stable where the series ``sum (-A)^k`` is not (its terms grow like binomial
    coefficients when A's entries are near 1), and no LAPACK / cuSOLVER call (cuSOLVER's first use would hold device
    memory no budget term has; the products run on cuBLAS, which the chunk path already uses)."""
    D = xp.empty_like(B)
    D[:, 0] = B[:, 0]
    for t in range(1, B.shape[1]):
        D[:, t] = B[:, t] - (A[:, t : t + 1, :t] @ D[:, :t])[:, 0]
    return D


def unit_lower_inverse(xp, A):
    """``(I + A)^-1`` for strictly lower-triangular ``A [h, n, n]`` (numpy order, any ``n``) by block doubling: the
    inverses of the diagonal blocks of size 1, 2, 4, ... combined level by level, ``[[X11, 0], [X21, X22]]`` with
    ``X21 = -X22 L21 X11`` (the standard recursive triangular inversion, e.g. Higham, *Accuracy and Stability of
    Numerical Algorithms*, sec. 14.2), every block of a level in one batched product: ``ceil(log2 n)`` levels of a few
    array operations instead of :func:`unit_lower_solve`'s ``n`` steps - what a GPU needs (each step there is several
    kernel launches from Python; a 512-position chunk of a qwen3next layer made ~2,000 of them). ``n`` is padded to a
    power of two with an identity block. No LAPACK / cuSOLVER call."""
    h, n, _ = A.shape
    N = 1 << max(0, int(n - 1).bit_length())
    L = xp.zeros((h, N, N), dtype=A.dtype)
    L[:, :n, :n] = A
    L += xp.eye(N, dtype=A.dtype)
    inv = xp.ones((h, N, 1, 1), dtype=A.dtype)  # the 1 x 1 diagonal blocks' inverses
    b = 1
    while b < N:
        P = N // (2 * b)
        # the diagonal 2b x 2b blocks, [h, P, 2b, 2b] (block row p = block column p)
        blocks = xp.diagonal(L.reshape(h, P, 2 * b, P, 2 * b), axis1=1, axis2=3).transpose(0, 3, 1, 2)
        x11, x22 = inv[:, 0::2], inv[:, 1::2]
        x21 = -(x22 @ blocks[:, :, b:, :b] @ x11)
        nxt = xp.zeros((h, P, 2 * b, 2 * b), dtype=A.dtype)
        nxt[:, :, :b, :b] = x11
        nxt[:, :, b:, b:] = x22
        nxt[:, :, b:, :b] = x21
        inv, b = nxt, 2 * b
    return inv.reshape(h, N, N)[:, :n, :n]


def _sub_chunks_substituted(xp, beta, g, q, k, v, S, chunk: int):
    """The chunked delta rule of :func:`delta_rule_rows` one sub-chunk of ``chunk`` positions after another, each
    solved by row-by-row substitution (:func:`unit_lower_solve`): ``beta``, ``g`` ``[T, heads]``, ``q``, ``k``, ``v``
    ``[T, heads, d_state]`` (numpy order); ``S`` ``[heads, d_state (v), d_state (k)]`` updated in place. Returns ``[T,
    heads, d_state]`` f32 before the gated norm."""
    f32 = xp.float32
    T = g.shape[0]
    out = xp.empty(v.shape, dtype=f32)
    for c0 in range(0, T, chunk):
        n = min(chunk, T - c0)
        sl = slice(c0, c0 + n)
        qc, kc, vc = (a[sl].transpose(1, 0, 2) for a in (q, k, v))  # [heads, n, d_state]
        bc = beta[sl].T  # [heads, n]
        G = xp.cumsum(g[sl].T, axis=1)  # [heads, n]
        lower = xp.tril(xp.ones((n, n), dtype=bool))
        decay = xp.exp(xp.where(lower, G[:, :, None] - G[:, None, :], f32(-xp.inf)))  # e^(G_t - G_j), 0 above
        eG = xp.exp(G)
        St = S.transpose(0, 2, 1)  # S^T: x @ St = (S x) per row
        kk = kc @ kc.transpose(0, 2, 1)
        A = bc[:, :, None] * (kk * decay) * xp.tril(xp.ones((n, n), dtype=f32), -1)
        B = bc[:, :, None] * (vc - eG[:, :, None] * (kc @ St))
        D = unit_lower_solve(xp, A, B)
        oc = eG[:, :, None] * (qc @ St) + ((qc @ kc.transpose(0, 2, 1)) * decay) @ D
        wl = xp.exp(G[:, -1:] - G)  # e^(G_C - G_j)
        S[...] = eG[:, -1, None, None] * S + (D * wl[:, :, None]).transpose(0, 2, 1) @ kc
        out[sl] = oc.transpose(1, 0, 2)
    return out


def _sub_chunks_batched(xp, beta, g, q, k, v, S, chunk: int, inverse=None):
    """:func:`_sub_chunks_substituted`'s result with every sub-chunk's state-free part computed at once - what a GPU
    needs (a 512-position chunk of the 80B-A3B geometry spent 1.3 s in 288 sub-chunks' ~40 small launches each from
    Python: bench/results/h200-2026-12-02t-pp_profile.log). With ``St = S_0^T`` the sub-chunk's first state, ``Inv =
    (I + A)^-1`` (batched over heads and sub-chunks: ``inverse(A)`` when given - the device's one-launch kernel,
    :meth:`strata.engine.gpu.chunk.ChunkPath.unit_lower_inverse` - else :func:`unit_lower_inverse`) and ``M = (q k^T)
    o decay``, the solution ``D = Inv B`` of :func:`delta_rule_rows` splits as ``D = W - U St`` with ``W = Inv (beta
    v)``, ``U = Inv (beta e^G k)``, so (``wk`` = the rows ``e^(G_C - G_j) k_j``)::

        o       = M W + (e^G q - M U) St               = [e^G q - M U | M W] [St; I]
        St_next = (e^G_C I - wk^T U) St + wk^T W       = [e^G_C I - wk^T U | wk^T W] [St; I]

    Both are one product with the same right operand ``Z = [St; I]`` (``[d_k + d_v, d_v]``): the left operands
    ``[M; wk^T] [U | W]``, signs and the ``e^G q`` / ``e^G_C I`` blocks added, depend only on the sub-chunk's own rows
    and are computed for all sub-chunks together; the sequential part is one product and one copy per sub-chunk. The
    last sub-chunk is padded with zero rows (``beta = g = 0``, ``q = k = v = 0``: they add nothing to ``A``, ``U``,
    ``W``, ``wk``, and leave ``G`` as it is), their outputs dropped. Same shapes and in-place update of ``S`` as
    :func:`_sub_chunks_substituted`; equal to the recurrence within float rounding (tests/test_engine_deltanet.py runs
    this form on NumPy)."""
    f32 = xp.float32
    T, h = g.shape
    n = chunk
    C = -(-T // n)
    pad = C * n - T
    dk, dv = k.shape[2], v.shape[2]

    def blocks(a):  # [T, h, x] -> [C, h, n, x], zero rows appended to fill the last sub-chunk
        if pad:
            a = xp.concatenate([a, xp.zeros((pad, *a.shape[1:]), dtype=a.dtype)])
        return a.reshape(C, n, h, a.shape[2]).transpose(0, 2, 1, 3)

    qc, kc, vc = blocks(q), blocks(k), blocks(v)  # [C, h, n, d_state]: sub-chunk first, so the products below come
    bc = blocks(beta[:, :, None])[..., 0]  # [C, h, n]                   out in the order the sequence reads them
    G = xp.cumsum(blocks(g[:, :, None])[..., 0], axis=2)  # [C, h, n]
    lower = xp.tril(xp.ones((n, n), dtype=bool))
    decay = xp.exp(xp.where(lower, G[..., :, None] - G[..., None, :], f32(-xp.inf)))  # e^(G_t - G_j), 0 above
    eG = xp.exp(G)
    kT = kc.transpose(0, 1, 3, 2)
    A = (bc[..., None] * ((kc @ kT) * decay) * xp.tril(xp.ones((n, n), dtype=f32), -1)).reshape(C * h, n, n)
    Inv = inverse(A) if inverse is not None else None
    if Inv is None:
        Inv = unit_lower_inverse(xp, A)
    UW = Inv.reshape(C, h, n, n) @ xp.concatenate([(bc * eG)[..., None] * kc, bc[..., None] * vc], axis=3)
    wkT = (xp.exp(G[..., -1:] - G)[..., None] * kc).transpose(0, 1, 3, 2)  # [C, h, d_k, n]
    # [M; wk^T] [U | W] with the U columns negated, then e^G q and e^G_C I added in the U columns: [C, h, n + d_k, .]
    Lm = xp.concatenate([(qc @ kT) * decay, wkT], axis=2) @ UW
    Lm[..., :dk] *= f32(-1.0)
    Lm[..., :n, :dk] += eG[..., None] * qc
    Lm[..., n:, :dk] += eG[..., -1, None, None] * xp.eye(dk, dtype=f32)
    Z = xp.zeros((h, dk + dv, dv), dtype=f32)
    Z[:, :dk] = S.transpose(0, 2, 1)
    Z[:, dk:] = xp.eye(dv, dtype=f32)
    Y = xp.empty((C, h, n + dk, dv), dtype=f32)
    for c in range(C):
        xp.matmul(Lm[c], Z, out=Y[c])
        Z[:, :dk] = Y[c, :, n:]
    S[...] = Z[:, :dk].transpose(0, 2, 1)
    return Y[:, :, :n].transpose(0, 2, 1, 3).reshape(C * n, h, dv)[:T]


def delta_rule_rows(xp, H, Z, BA, S, dt_bias, ssm_a, norm_w, d: DeltaNetDims, chunk: int = DELTA_CHUNK, inverse=None):
    """:func:`delta_rule` of ``T`` consecutive positions (``H [T, conv_dim]``, ``Z [T, value_dim]``, ``BA``) in the
    chunked form: the recurrence ``S_t = e^g_t S_{t-1} + beta_t (v_t - e^g_t S_{t-1} k_t) k_t^T`` unrolled over a
    sub-chunk of ``chunk`` positions from its first state ``S_0`` (per v head; ``G_t`` = the sum of ``g`` over the
    sub-chunk up to ``t``)::

        S_t   = e^G_t S_0 + sum_{j<=t} e^(G_t - G_j) D_j k_j^T
        D     = (I + A)^-1 B,  A[t, j] = beta_t e^(G_t - G_j) (k_t . k_j)  (j < t),  B_t = beta_t (v_t - e^G_t S_0 k_t)
        o_t   = e^G_t S_0 q_t + sum_{j<=t} e^(G_t - G_j) (q_t . k_j) D_j

    (the WY form of the Gated DeltaNet paper, Yang et al. 2024, and of llama.cpp ``src/models/delta-net-base.cpp``
    ``build_delta_net_chunking``). Only ``G_t - G_j <= 0`` (``j <= t``) and ``G_t <= 0`` are exponentiated (``g <= 0``):
    no overflow at any decay. Matrix products and one unit-lower-triangular solve per sub-chunk instead of a step per
    position: on the CPU by substitution, sub-chunk after sub-chunk (:func:`_sub_chunks_substituted`), on a device
    every sub-chunk's state-free part at once (:func:`_sub_chunks_batched`, with ``inverse`` - a one-launch ``(I +
    A)^-1`` of a batch, or None for :func:`unit_lower_inverse`); the values equal the recurrence's within float
    rounding (tests/test_engine_deltanet.py), ``S`` ``[dt_rank, d_state, d_state]`` is updated in place to the last
    position's. Returns ``[T, value_dim]`` f32 (the gated norm applied: step 6)."""
    T = H.shape[0]
    if T == 0:
        return xp.zeros((0, d.value_dim), dtype=xp.float32)
    beta, g, q, k, v = _gates_heads(xp, H, BA, dt_bias, ssm_a, d)
    # the CPU substitutes row by row, sub-chunk after sub-chunk (its values checked against llama.cpp's fixtures); a
    # device takes every sub-chunk's state-free part at once (_sub_chunks_batched)
    if xp is np:
        out = _sub_chunks_substituted(xp, beta, g, q, k, v, S, min(chunk, T))
    else:
        out = _sub_chunks_batched(xp, beta, g, q, k, v, S, min(chunk, T), inverse)
    o = rms_norm(xp, out, norm_w, d.eps) * silu(xp, Z.reshape(T, d.dt_rank, d.d_state))
    return o.reshape(T, -1)


def delta_rule(xp, h, z, ba, S, dt_bias, ssm_a, norm_w, d: DeltaNetDims):
    """Steps 2, 4-6 of the module docstring for one token: gates from ``ba`` (per k-head group
    ``[b | a]``, ``dt_rank / n_group`` each), q/k/v heads from the conv output ``h [conv_dim]``, the
    delta rule on ``S [dt_rank, d_state, d_state]`` (updated in place), the gated RMS norm with
    ``norm_w [d_state]`` and ``silu(z)``. Returns ``[value_dim]`` f32 (the input of ``ssm_out``)."""
    f32 = xp.float32
    r = d.dt_rank // d.n_group
    ba = ba.reshape(d.n_group, 2, r)
    beta = sigmoid(xp, ba[:, 0, :].reshape(-1))
    g = softplus(xp, ba[:, 1, :].reshape(-1) + dt_bias) * ssm_a
    kd = d.key_dim
    q = l2_norm(xp, h[:kd].reshape(d.n_group, d.d_state), d.eps)
    k = l2_norm(xp, h[kd : 2 * kd].reshape(d.n_group, d.d_state), d.eps)
    v = h[2 * kd :].reshape(d.dt_rank, d.d_state)
    q = xp.repeat(q, r, axis=0) * f32(1.0 / d.d_state**0.5)  # v head i reads k head i // r
    k = xp.repeat(k, r, axis=0)
    S *= xp.exp(g)[:, None, None]
    sk = (S * k[:, None, :]).sum(axis=-1)
    dlt = (v - sk) * beta[:, None]
    S += dlt[:, :, None] * k[:, None, :]
    o = (S * q[:, None, :]).sum(axis=-1)  # [dt_rank, d_state]
    o = rms_norm(xp, o, norm_w, d.eps) * silu(xp, z.reshape(d.dt_rank, d.d_state))
    return o.reshape(-1)


__all__ = [
    "DELTA_CHUNK",
    "unit_lower_inverse",
    "unit_lower_solve",
    "DeltaNetDims",
    "GatedDeltaNet",
    "RecurrentState",
    "conv_silu",
    "conv_silu_rows",
    "delta_rule",
    "delta_rule_rows",
    "l2_norm",
    "softplus",
]
