"""qwen2moe (llama.cpp ``src/models/qwen2moe.cpp``): qwen2's attention (q/k/v biases, NEOX rope)
with routed experts whose weights are NOT renormalised (``norm_w = false``) plus a shared expert
scaled by ``sigmoid(ffn_gate_inp_shexp . h)``.

    per layer:  x += attn(rms_norm(x) * attn_norm)
                h = rms_norm(x) * ffn_norm
                p = softmax(router @ h); top n_expert_used (weights p, not renormalised)
                x += sum_k p_k * down_k(silu(gate_k(h)) * up_k(h))
                     + sigmoid(gate_inp_shexp . h) * down_s(silu(gate_s(h)) * up_s(h))
"""

from ..recipe import Attention, Block, MoEFFN, Recipe

ARCH = "qwen2moe"
RECIPE = Recipe(
    blocks={"attention": Block(Attention(), MoEFFN("silu", norm_weights=False, shared_expert=True, shared_gate=True))}
)
