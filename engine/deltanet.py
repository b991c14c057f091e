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

from strata.manifests.names import tensor_name

from .layers import rms_norm, sigmoid, silu


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
        whole chunk (bit-identical per row); the conv and the delta rule run position by position on the state
        (the recurrence; llama.cpp's chunked delta rule, ``build_delta_net_chunking``, is not done here)."""
        w, d = self.w, self.dims
        qkv, z = self._qkvz(xp, X)
        ba = w.matmul(self.ba, X)
        cw = w.get(self.conv_w).reshape(d.conv_dim, d.d_conv)
        args = (state.ssm[self.il], w.get(self.dt_bias), w.get(self.a), w.get(self.norm), d)
        o = xp.stack(
            [delta_rule(xp, conv_silu(xp, qkv[t], state.conv[self.il], cw), z[t], ba[t], *args) for t in range(len(X))]
        )
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


__all__ = ["DeltaNetDims", "GatedDeltaNet", "RecurrentState", "conv_silu", "delta_rule", "l2_norm", "softplus"]
