"""qwen3moe (llama.cpp ``src/models/qwen3moe.cpp``): qwen2's block with q/k RMS norms (no biases)
and a routed-expert FFN on every layer (no shared expert).

    per layer:  x += attn(rms_norm(x) * attn_norm)          # q, k: rms_norm per head, then rope
                h = rms_norm(x) * ffn_norm
                p = softmax(router @ h); top n_expert_used; weights renormalised
                x += sum_k w_k * down_k(silu(gate_k(h)) * up_k(h))   # experts from the shards

Routing is llama.cpp's ``build_moe_ffn(..., LLM_FFN_SILU, norm_w = true, w_scale = 0,
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX)``: qwen3moe always renormalises (no metadata switch).
"""

from ..recipe import Attention, Block, MoEFFN, Recipe

ARCH = "qwen3moe"
RECIPE = Recipe(blocks={"attention": Block(Attention(qk_norm=True), MoEFFN("silu", norm_weights=True))})
