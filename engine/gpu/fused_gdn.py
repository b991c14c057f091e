"""Gated-delta-net layers (qwen3next) inside the fused decode step (:mod:`strata.engine.gpu.fused`).

Per recurrent layer the step runs (:mod:`strata.engine.deltanet` is the arithmetic, llama.cpp
``src/models/qwen3next.cpp`` ``build_layer_attn_linear``):

1. ``attn_qkv``, ``attn_gate`` (z) and ``ssm_ba`` on the normed input - one ``matvec_group``
   launch when they share a type;
2. ``gdn_conv``: the causal depthwise conv over the conv state (updated in place) and SiLU;
3. ``gdn_step``: one CTA per v head: l2-normed q and k, the gates, the delta rule on the head's
   state, the gated RMS norm with ``silu(z)``;
4. ``ssm_out``.

Both states live in the session's :class:`strata.engine.deltanet.RecurrentState` (device arrays,
allocated once, the budget's recurrent-state term); at position 0 the kernels read them as zeros (a
new sequence), so nothing on the host resets them between steps and the step stays one graph. The
conv kernel's weights are kept as an f32 copy made at start-up (``conv_dim x d_conv`` floats per
layer, counted in the step's buffers).
"""

from __future__ import annotations

from typing import Any

from strata.layout import step as LS

from .fused_ops import GdnIO


def gdn_unsupported(model) -> str | None:
    """Why the fused step cannot build ``model``'s delta-net layers (None if it can): the legacy
    fused ``ssm_in`` projection, or a head dim the per-head kernel cannot take (a multiple of 32 in
    32..1024: lanes over columns, 16 warps over rows; cuda/fused.cu ``gdn_step``)."""
    dims = model.delta_dims
    if dims is None:
        return None
    if any(g is not None and g.ssm_in is not None for g in model.delta):
        return f"{model.arch}: the legacy ssm_in projection (the fused step builds attn_qkv + attn_gate)"
    if dims.d_state % 32 or not 32 <= dims.d_state <= 1024:
        return f"{model.arch}: delta-net head dim {dims.d_state} is not a multiple of 32 in 32..1024"
    return None


class GdnBuffers:
    """The fused step's delta-net buffers: conv output ``h [conv_dim]``, gated-normed output
    ``o [value_dim]`` (shared by the layers) and each layer's f32 conv weights; ``nbytes`` counts them."""

    def __init__(self, model, backend):
        d = model.delta_dims
        self.h, self.o = backend.empty_f32(d.conv_dim), backend.empty_f32(d.value_dim)
        self.cw: dict[int, Any] = {}
        n_conv = 0
        for il, g in enumerate(model.delta):
            if g is None:
                continue
            host = model.w.host_f32(g.conv_w).reshape(-1)
            buf = backend.empty_f32(host.size)
            backend.copy_into(buf, host)
            self.cw[il] = buf
            n_conv += host.size
        self.nbytes = LS.gdn_step_bytes(d.conv_dim, d.value_dim, n_conv)  # the layout's definition
        assert self.nbytes == 4 * (self.h.size + self.o.size + n_conv)


def build_delta_layer(dec, il: int, add, mv, mv_group, stage: str):
    """Add layer ``il``'s delta-net launches (module docstring) to ``dec``'s list; returns the device
    vector holding the mixer's output (``ssm_out``'s)."""
    m, ops, w = dec.model, dec._ops, dec.model.w
    g, d, bufs, rec = m.delta[il], m.delta_dims, dec.gdn, dec.state.recurrent
    qkv, z, ba = mv_group([g.qkv, g.gate, g.ba], dec.xn, stage)
    G = GdnIO(
        il=il,
        qkv=qkv,
        z=z,
        ba=ba,
        cs=rec.conv[il],
        S=rec.ssm[il],
        cw=bufs.cw[il],
        dt_bias=w.get(g.dt_bias),
        ssm_a=w.get(g.a),
        norm_w=w.get(g.norm),
        h=bufs.h,
        o=bufs.o,
        params=dec.params_dev,
        dims=d,
    )
    add(f"gdn_conv L{il}", stage, ops.gdn_conv(G))
    add(f"gdn_step L{il}", stage, ops.gdn_step(G))
    return mv(g.out, bufs.o, stage)


__all__ = ["GdnBuffers", "build_delta_layer", "gdn_unsupported"]
