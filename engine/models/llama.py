"""llama (llama.cpp ``src/models/llama.cpp``): Llama 2/3, Mistral's files, and Mixtral (the same
architecture name with routed experts: layer kind ``moe`` when ``expert_count`` > 0, from the
manifest). Pre-norm attention with optional biases, NORM rope (adjacent pairs; llama.cpp
``llama_model_rope_type``: LLAMA_ROPE_TYPE_NORM) with the optional ``rope_freqs.weight`` factors of
Llama 3.1+, kq_scale 1/sqrt(head_dim); SwiGLU MLP with optional biases, or routed experts.

    per layer:  x += attn(rms_norm(x) * attn_norm)
                h = rms_norm(x) * ffn_norm
                dense: x += down(silu(gate(h) + gate_b) * (up(h) + up_b)) + down_b
                moe:   p = softmax(router @ h); top n_expert_used; weights renormalised (norm_w = true)
                       x += sum_k w_k * down_k(silu(gate_k(h)) * up_k(h))

Routing is ``build_moe_ffn(..., LLM_FFN_SILU, norm_w = true, expert_weights_scale,
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX)``.
"""

from ..recipe import Attention, Block, DenseFFN, MoEFFN, Recipe

ARCH = "llama"
RECIPE = Recipe(
    blocks={
        "dense": Block(Attention(rope="norm"), DenseFFN("silu")),
        "moe": Block(Attention(rope="norm"), MoEFFN("silu", norm_weights=True)),
    }
)
