"""qwen2 (llama.cpp ``src/models/qwen2.cpp``): pre-norm attention with q/k/v biases, NEOX rope,
SwiGLU MLP, untied or tied head with optional bias.

    x = embd[token]
    per layer:  x += attn(rms_norm(x) * attn_norm)          # scale 1/sqrt(head_dim)
                x += down(silu(gate(h)) * up(h)),  h = rms_norm(x) * ffn_norm
    logits = head(rms_norm(x) * output_norm) (+ output.bias)
"""

from __future__ import annotations

from ..layers import Attention, gated_mlp, rms_norm
from .base import BaseModel, State


class Qwen2(BaseModel):
    arch = "qwen2"
    qk_norm = False

    def __init__(self, g, w, experts=None, metadata=None):
        super().__init__(g, w, experts, metadata)
        h = self.hp
        self.attn = [Attention(w, il, n_head=h.n_head, n_head_kv=h.n_head_kv, head_dim=h.head_dim,
                               head_dim_v=h.head_dim_v, scale=h.attn_scale, window=None, eps=h.rms_eps,
                               qk_norm=self.qk_norm, f16_operands=self.nx.attn_f16)
                     for il in range(h.n_layer)]

    def ffn(self, il: int, x):
        return gated_mlp(self.xp, self.w, il, x, "silu")

    def step(self, token: int, pos: int, state: State, logits: bool = True):
        xp, w, h = self.xp, self.w, self.hp
        rope = state.ropes[h.rope_base]
        x = w.rows("token_embd.weight", [token])[0]
        for il in range(h.n_layer):
            p = f"blk.{il}."
            x = x + self.attn[il](xp, rms_norm(xp, x, w.get(p + "attn_norm.weight"), h.rms_eps), pos, state.cache, rope)
            x = x + self.ffn(il, rms_norm(xp, x, w.get(p + "ffn_norm.weight"), h.rms_eps))
        return self.logits(x) if logits else None
