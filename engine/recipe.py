"""The block recipe: how an architecture's layers are put together, as data.

An architecture is one manifest (``manifests/<arch>.toml``: names, shapes, metadata keys) plus one
model file (``engine/models/<arch>.py``) that declares a :class:`Recipe` over the vocabulary below.
Both executors are built from the recipe - the NumPy/CuPy step (:class:`strata.engine.decoder.Decoder`)
and the GPU's fused launch list (:mod:`strata.engine.gpu.fused`) - so there is no second
hand-written forward pass and no ``arch ==`` branch outside the model file.

The vocabulary follows llama.cpp's graph builders (``src/models/*.cpp``, ``src/llama-graph.cpp``):

- a layer is ``x += post(mixer(norm(x)))`` then ``x += post(ffn(norm(x)))``: :class:`Block` names
  the norm tensors (``mixer_norm``, optional ``mixer_post_norm`` applied to the branch before the
  residual add - gemma's sandwich norms -, ``ffn_norm``, optional ``ffn_post_norm``);
- the mixer is softmax attention (:class:`Attention`: q/k RMS norms, where the scale applies, rope
  base and rotary dims as geometry params, an output gate carried by the query projection) or the
  gated delta net (:class:`DeltaNet`, a recurrent state instead of a KV cache); rope base, rotated dims
  and frequency scale are geometry params (the metadata keys of ``manifests/<arch>.toml`` ``[keys]``);
- the FFN is dense (:class:`DenseFFN`: gated, SiLU or GELU) or routed experts (:class:`MoEFFN`:
  gating function, weight normalisation, optional shared expert and its sigmoid gate);
- the model: embeddings optionally scaled by ``sqrt(n_embd)``, final RMS norm, head, optional logit
  soft-capping (a geometry param).

Which block a layer uses comes from its *kind* (``manifests/<arch>.toml`` ``[layers] kind``, e.g.
``swa`` / ``global`` for gemma3): ``Recipe.blocks`` maps kinds to blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Act = Literal["silu", "gelu"]


@dataclass(frozen=True)
class Attention:
    """Softmax attention with a KV cache (llama.cpp ``build_attn``).

    Attributes:
        qk_norm: RMS-norm every q and k head with ``attn_q_norm`` / ``attn_k_norm`` before rope.
        scale_q: multiply q by ``attn_scale`` and use a kq scale of 1 (gemma3's ``ggml_scale(Qcur,
            f_attention_scale)``), instead of scaling q.k (``kq_scale``).
        rope_base: geometry param holding this layer kind's rope base (``rope_base``, ``rope_base_swa``).
        rope_dim: geometry param holding the rotated dims per head (``rope.dimension_count``: the first
            ``rope_dim`` dims rotate, the rest pass through, as ggml_rope_ext with ``n_dims < ne0``);
            None: head_dim.
        rope_scale: geometry param holding this layer kind's rope frequency scale (``rope_freq_scale`` =
            1 / ``rope.scaling.factor``, linear scaling; gemma3's sliding layers ``rope_freq_scale_swa`` = 1:
            llama.cpp ``llama_model::get_rope_freq_scale``).
        output_gate: the query projection holds ``[q | gate]`` per head and the attention output is
            multiplied by ``sigmoid(gate)`` (qwen3next ``build_layer_attn``).
        rope: the pairing, ``neox`` or ``norm`` (:data:`strata.engine.layers.ROPE_MODES`; llama.cpp
            ``llama_model_rope_type``: LLAMA_ROPE_TYPE_NEOX / LLAMA_ROPE_TYPE_NORM).
    """

    rope: Literal["neox", "norm"] = "neox"
    qk_norm: bool = False
    scale_q: bool = False
    rope_base: str = "rope_base"
    rope_dim: str | None = "rope_dim"
    rope_scale: str = "rope_freq_scale"
    output_gate: bool = False


@dataclass(frozen=True)
class DeltaNet:
    """The gated delta net (linear attention with a recurrent state; llama.cpp ``src/models/qwen3next.cpp``
    ``build_layer_attn_linear``): its dimensions are the geometry params ``d_conv``, ``d_state``,
    ``n_group`` (k heads) and ``dt_rank`` (v heads) (:mod:`strata.engine.deltanet`)."""


@dataclass(frozen=True)
class DenseFFN:
    """``down @ (act(gate @ x) * (up @ x))`` (llama.cpp ``build_ffn`` LLM_FFN_PAR)."""

    act: Act = "silu"


@dataclass(frozen=True)
class MoEFFN:
    """Routed experts (llama.cpp ``build_moe_ffn``): router logits, gating (``softmax`` over all
    experts), the ``n_expert_used`` best, weights renormalised when ``norm_weights``; each expert a
    gated FFN of ``act``. ``shared_expert``: plus ``ffn_{gate,up,down}_shexp`` scaled by
    ``sigmoid(ffn_gate_inp_shexp . x)`` when ``shared_gate`` (qwen3next)."""

    act: Act = "silu"
    gating: Literal["softmax"] = "softmax"
    norm_weights: bool = True
    shared_expert: bool = False
    shared_gate: bool = False


Mixer = Attention | DeltaNet
FFN = DenseFFN | MoEFFN


@dataclass(frozen=True)
class Block:
    """One layer kind's block: mixer and FFN with their norm tensors (roles, ``manifests/names``)."""

    mixer: Mixer
    ffn: FFN
    mixer_norm: str = "attn_norm.weight"
    mixer_post_norm: str | None = None
    ffn_norm: str = "ffn_norm.weight"
    ffn_post_norm: str | None = None


@dataclass(frozen=True)
class Recipe:
    """A whole architecture (see the module docstring).

    Attributes:
        blocks: layer kind -> block.
        embed_scale: embeddings multiplied by ``sqrt(n_embd)`` (gemma).
        logit_softcap: geometry param of the final logit soft-cap (``tanh(y / c) * c``), None: none.
        unused: tensor roles the contract allows but this forward pass does not read, each with the one
            line the engine says at start-up when a pack holds them (e.g. a sparse-attention indexer
            whose computation no public implementation defines), instead of guessing their maths.
    """

    blocks: dict[str, Block]
    embed_scale: bool = False
    logit_softcap: str | None = None
    unused: dict[str, str] = field(default_factory=dict)

    def block(self, kind: str) -> Block:
        """The block of layer kind ``kind``. Raises KeyError naming the kinds the recipe has."""
        try:
            return self.blocks[kind]
        except KeyError:
            raise KeyError(
                f"layer kind {kind!r} has no block in the recipe (kinds: {', '.join(self.blocks)})"
            ) from None

    @property
    def moe(self) -> bool:
        """True when some block has routed experts."""
        return any(isinstance(b.ffn, MoEFFN) for b in self.blocks.values())


__all__ = ["Act", "Attention", "Block", "DeltaNet", "DenseFFN", "FFN", "Mixer", "MoEFFN", "Recipe"]
