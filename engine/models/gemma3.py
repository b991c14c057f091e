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
and rope with ``rope_base_swa`` (10000) unscaled; global layers see everything with ``rope_base`` (1e6)
and the linear scaling of ``rope.scaling.factor`` (Gemma 3 4B and up: 8). Both rotate the first
``rope.dimension_count`` dims of each head (ggml_rope_ext ``n_rot``; default the head size).
``attn_scale`` is a derived value of the manifest (1/sqrt(head_dim), 1/sqrt(n_embd/n_head) for
the 27B), llama.cpp's ``f_attention_scale``.
"""

from ..recipe import Attention, Block, DenseFFN, Recipe

ARCH = "gemma3"


def _block(rope_base: str, rope_scale: str) -> Block:
    return Block(
        Attention(qk_norm=True, scale_q=True, rope_base=rope_base, rope_scale=rope_scale),
        DenseFFN("gelu"),
        mixer_post_norm="post_attention_norm.weight",
        ffn_post_norm="post_ffw_norm.weight",
    )


RECIPE = Recipe(
    blocks={"swa": _block("rope_base_swa", "rope_freq_scale_swa"), "global": _block("rope_base", "rope_freq_scale")},
    embed_scale=True,
    logit_softcap="logit_softcap",
)
