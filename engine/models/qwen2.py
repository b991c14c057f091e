"""qwen2 (llama.cpp ``src/models/qwen2.cpp``): pre-norm attention with q/k/v biases (or a fused qkv
with bias), NEOX rope, SwiGLU MLP, untied or tied head with optional bias.

    x = embd[token]
    per layer:  x += attn(rms_norm(x) * attn_norm)          # kq_scale 1/sqrt(head_dim)
                x += down(silu(gate(h)) * up(h)),  h = rms_norm(x) * ffn_norm
    logits = head(rms_norm(x) * output_norm) (+ output.bias)

Biases and the fused qkv are optional tensors of the contract: the attention layer uses them when
the pack has them.
"""

from ..recipe import Attention, Block, DenseFFN, Recipe

ARCH = "qwen2"
RECIPE = Recipe(blocks={"attention": Block(Attention(), DenseFFN("silu"))})
