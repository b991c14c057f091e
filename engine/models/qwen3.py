"""qwen3 (llama.cpp ``src/models/qwen3.cpp``): qwen3moe's attention (q/k RMS norms per head before
the NEOX rope, no biases, kq_scale 1/sqrt(head_dim)) with a dense SwiGLU MLP.

    per layer:  x += attn(rms_norm(x) * attn_norm)
                x += down(silu(gate(h)) * up(h)),  h = rms_norm(x) * ffn_norm
"""

from ..recipe import Attention, Block, DenseFFN, Recipe

ARCH = "qwen3"
RECIPE = Recipe(blocks={"attention": Block(Attention(qk_norm=True), DenseFFN("silu"))})
