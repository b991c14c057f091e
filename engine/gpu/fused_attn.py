"""Attention layers inside the fused decode step (:mod:`strata.engine.gpu.fused`): per layer the q/k/v
matvecs (one ``matvec_group`` launch when they share a type, or the fused ``attn_qkv``), ``qk_prep`` (biases,
q/k norms, rope, the K/V cache write), ``attn``, the output gate (qwen3next), the output projection, and the
residual add fused with the FFN's norm.
"""

from __future__ import annotations

from .fused_ops import AttnIO


def build_attention_layer(dec, il: int, b, add, mv, mv_group, opt, norm_of, norm) -> None:
    """Add layer ``il``'s attention launches (q/k/v, ``qk_prep``, ``attn``, the output gate when the query
    projection carries one, the output projection) and the residual add fused with the FFN norm to ``dec``'s
    list (``b``: the layer's recipe block; ``add``, ``mv``, ``mv_group``, ``opt``, ``norm_of``, ``norm``: the
    list builder's helpers, :meth:`strata.engine.gpu.fused.FusedDecoder._build`)."""
    m, ops, st = dec.model, dec._ops, dec.state
    A = m.attn[il]
    n = A.names
    sa = f"L{il} attn"
    nq, nk = A.n_head * A.hd, A.n_head_kv * A.hd
    if n.qkv is not None:
        qkv = mv(n.qkv, dec.xn, sa)
        q, k, v = qkv[:nq], qkv[nq : nq + nk], qkv[nq + nk :]
        bqkv = opt(n.qkv_bias)
        qb, kb, vb = (None, None, None) if bqkv is None else (bqkv[:nq], bqkv[nq : nq + nk], bqkv[nq + nk :])
    else:
        q, k, v = mv_group([n.q, n.k, n.v], dec.xn, sa)
        qb, kb, vb = opt(n.q_bias), opt(n.k_bias), opt(n.v_bias)
    rope = st.ropes[m.rope_key_of(il)]
    L = AttnIO(
        il=il,
        q=q,
        k=k,
        v=v,
        qb=qb,
        kb=kb,
        vb=vb,
        qnw=opt(n.q_norm),
        knw=opt(n.k_norm),
        rope=rope,
        cache=st.cache,
        n_head=A.n_head,
        n_kv=A.n_head_kv,
        hd=A.hd,
        hd_v=A.hd_v,
        window=A.window,
        eps=A.eps,
        scale=A.scale,
        scale_q=A.scale_q,
        params=dec.params_dev,
        qo=dec.qo,
        ao=dec.ao,
        scores=dec.scores,
        q_stride=2 * A.hd if A.output_gate else A.hd,
    )
    add(f"qk_prep L{il}", sa, ops.qk_prep(L))
    add(f"attn L{il}", sa, ops.attn(L))
    if A.output_gate:  # qwen3next: the query projection's second half of every head gates the output
        add(f"gate_mul L{il}", sa, ops.gate_mul(dec.ao, q, A.n_head, A.hd))
    o = mv(n.out, dec.ao, sa)
    post = norm_of(b.mixer_post_norm, il) if b.mixer_post_norm else None
    norm(
        f"resid_norm L{il} +attn{' post-norm' if post is not None else ''}, ffn norm",
        sa,
        o,
        opt(n.out_bias),
        post,
        norm_of(b.ffn_norm, il),
        1.0,
        2 if post is not None else 1,
    )


__all__ = ["build_attention_layer"]
