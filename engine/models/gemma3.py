"""gemma3 (llama.cpp ``src/models/gemma3.cpp``): sandwich norms, q/k RMS norms, GELU(tanh) MLP,
sliding-window attention on most layers, embeddings scaled by sqrt(n_embd), tied head.

    x = embd[token] * sqrt(n_embd)
    per layer:  a = attn(rms_norm(x) * attn_norm)            # Q scaled by attn_scale, kq_scale 1
                x += rms_norm(a) * post_attention_norm
                f = down(gelu(gate(h)) * up(h)),  h = rms_norm(x) * ffn_norm
                x += rms_norm(f) * post_ffw_norm
    logits = head(rms_norm(x) * output_norm), soft-capped when final_logit_softcapping is set

Norm weights are stored with the +1 already applied (converter), so they multiply as they are.
Sliding layers ('swa' kind in manifests/gemma3.toml) see the last ``sliding_window`` positions
and rope with ``rope_base_swa`` (10000); global layers see everything with ``rope_base`` (1e6).
``attn_scale`` is a derived value of the manifest (1/sqrt(head_dim), 1/sqrt(n_embd/n_head) for
the 27B), llama.cpp's ``f_attention_scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layers import Attention, gated_mlp, rms_norm
from .base import BaseModel, Hyper, State


@dataclass(frozen=True)
class Gemma3Hyper(Hyper):
    rope_base_swa: float = 10000.0
    logit_softcap: float | None = None


class Gemma3(BaseModel):
    arch = "gemma3"

    @classmethod
    def hyper(cls, g):
        cap = g.get("logit_softcap")
        return Gemma3Hyper.from_geometry(g, rope_base_swa=float(g["rope_base_swa"]),
                                         logit_softcap=float(cap) if cap else None)

    def __init__(self, g, w, experts=None, metadata=None):
        super().__init__(g, w, experts, metadata)
        h = self.hp
        self.kinds = list(g.layer_kinds)
        self.attn = [Attention(w, il, n_head=h.n_head, n_head_kv=h.n_head_kv, head_dim=h.head_dim,
                               head_dim_v=h.head_dim_v, scale=h.attn_scale, window=g.layer_window(il),
                               eps=h.rms_eps, qk_norm=True, scale_q=True, f16_operands=self.nx.attn_f16)
                     for il in range(h.n_layer)]
        self.embd_scale = self.xp.float32(math.sqrt(h.n_embd))
        self.gelu = "gelu_f16" if self.nx.gelu_f16_table else "gelu"

    def rope_bases(self) -> list[float]:
        return [self.hp.rope_base, self.hp.rope_base_swa]

    def step(self, token: int, pos: int, state: State, logits: bool = True):
        xp, w, h = self.xp, self.w, self.hp
        x = w.rows("token_embd.weight", [token])[0] * self.embd_scale
        for il in range(h.n_layer):
            p = f"blk.{il}."
            rope = state.ropes[h.rope_base_swa if self.kinds[il] == "swa" else h.rope_base]
            a = self.attn[il](xp, rms_norm(xp, x, w.get(p + "attn_norm.weight"), h.rms_eps), pos, state.cache, rope)
            x = x + rms_norm(xp, a, w.get(p + "post_attention_norm.weight"), h.rms_eps)
            f = gated_mlp(xp, w, il, rms_norm(xp, x, w.get(p + "ffn_norm.weight"), h.rms_eps), self.gelu)
            x = x + rms_norm(xp, f, w.get(p + "post_ffw_norm.weight"), h.rms_eps)
        if not logits:
            return None
        y = self.logits(x)
        if h.logit_softcap:
            # ggml_scale(1/cap) -> ggml_tanh -> ggml_scale(cap)
            y = xp.tanh(y * xp.float32(1.0 / h.logit_softcap)) * xp.float32(h.logit_softcap)
        return y
