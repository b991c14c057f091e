"""qwen3moe (llama.cpp ``src/models/qwen3moe.cpp``): qwen2's block with q/k RMS norms (no biases)
and a routed-expert FFN on every layer (no shared expert).

    per layer:  x += attn(rms_norm(x) * attn_norm)          # q, k: rms_norm per head, then rope
                h = rms_norm(x) * ffn_norm
                p = softmax(router @ h); top n_expert_used; weights renormalised
                x += sum_k w_k * down_k(silu(gate_k(h)) * up_k(h))   # experts from the shards

Routing is llama.cpp's ``build_moe_ffn(..., LLM_FFN_SILU, norm_w = true, w_scale = 0,
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX)``: qwen3moe always renormalises (no metadata switch).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import route_topk
from .base import Hyper
from .qwen2 import Qwen2


@dataclass(frozen=True)
class MoEHyper(Hyper):
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0


class Qwen3MoE(Qwen2):
    arch = "qwen3moe"
    qk_norm = True

    @classmethod
    def hyper(cls, g):
        return MoEHyper.from_geometry(g, n_expert=int(g["n_expert"]), n_expert_used=int(g["n_expert_used"]),
                                      n_ff_exp=int(g["n_ff_exp"]))

    def __init__(self, g, w, experts=None, metadata=None):
        super().__init__(g, w, experts, metadata)
        if experts is None:
            raise ValueError("qwen3moe needs an ExpertPath (routed experts)")

    def ffn(self, il: int, x):
        logits = self.w.matmul(f"blk.{il}.ffn_gate_inp.weight", x)
        ids, wts = route_topk(self.xp, logits, self.hp.n_expert_used, norm=True)
        return self.experts(il, x, ids, wts)
