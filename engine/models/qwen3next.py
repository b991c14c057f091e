"""qwen3next (llama.cpp ``src/models/qwen3next.cpp``): a hybrid of gated-delta-net layers (linear
attention with a recurrent state) and full-attention layers (every ``full_attention_interval``-th),
a routed-expert FFN plus a gated shared expert on every layer.

    per layer:  x += mixer(rms_norm(x) * attn_norm)
                    recurrent layers:  the gated delta net (strata.engine.deltanet)
                    attention layers:  q/k RMS norms, partial NEOX rope (rope.dimension_count dims),
                                       GQA over the KV cache, output * sigmoid(gate) - the query
                                       projection carries the gate (per head [q | gate])
                h = rms_norm(x) * post_attention_norm
                x += sum_k w_k * expert_k(h) + sigmoid(ffn_gate_inp_shexp . h) * shared_expert(h)
    logits = head(rms_norm(x) * output_norm)

Routing: ``build_moe_ffn(..., LLM_FFN_SILU, norm_w = true, ..., SOFTMAX)``. The sparse-attention
indexer of the qwen3next reference model (``blk.N.indexer.*``) is audited and loaded but not computed: no public
implementation defines its maths for this architecture.
"""

from ..recipe import Attention, Block, DeltaNet, MoEFFN, Recipe

ARCH = "qwen3next"

_FFN = MoEFFN("silu", norm_weights=True, shared_expert=True, shared_gate=True)
RECIPE = Recipe(
    blocks={
        "recurrent": Block(DeltaNet(), _FFN, ffn_norm="post_attention_norm.weight"),
        "attention": Block(
            Attention(qk_norm=True, rope_dim="rope_dim", output_gate=True), _FFN, ffn_norm="post_attention_norm.weight"
        ),
    },
    unused={
        "indexer.": "the sparse-attention indexer (blk.N.indexer.*) is checked and loaded, but this forward "
        "pass does not use it: no public implementation defines its computation for qwen3next"
    },
)
