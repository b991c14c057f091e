"""What the VRAM plan knows about a model (:class:`ModelFacts`, built by the audit from the metadata path
after checking it against the tensors): the inputs of :func:`strata.budget.plan.make_plan` and of
:mod:`strata.budget.engine_terms`, in a module of their own so both import them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from strata.layout.kv import KVLayer, RecurrentLayer


class DenseTensor(BaseModel):
    """One dense tensor as the plan needs it: name, pool and source ggml type ids, ne (ggml order)."""

    model_config = ConfigDict(frozen=True)
    name: str
    type: int
    src_type: int
    ne: tuple[int, ...]


class ExpertLayerFacts(BaseModel):
    """One MoE layer: expert types and one expert's bytes in source and engine form, and the bytes
    of a cache slot that holds it (engine form, parts aligned: :func:`strata.layout.experts.expert_slot_bytes`;
    None = the engine blob)."""

    layer: int
    gate_type: int
    up_type: int
    down_type: int
    blob_bytes: int
    blob_engine_bytes: int
    slot_bytes: int | None = None

    @property
    def slot(self) -> int:
        return self.blob_engine_bytes if self.slot_bytes is None else self.slot_bytes


class ModelFacts(BaseModel):
    """Everything the plan needs to know about a model (built by the audit from the metadata path,
    after checking it against the tensors; tests build it directly)."""

    arch: str
    n_ctx_train: int
    n_vocab: int
    dense: list[DenseTensor] = Field(default_factory=list)
    head: str | None = None  # tensor the output head multiplies with (token_embd.weight when tied)
    embeddings: str | None = None
    kv_layers: list[KVLayer] = Field(default_factory=list)
    recurrent_layers: list[RecurrentLayer] = Field(default_factory=list)
    act_per_token: int = 0
    logits_per_token: int = 0
    n_expert: int = 0
    expert_layers: list[ExpertLayerFacts] = Field(default_factory=list)
    # per-head K and V widths of the attention layers (key_length / value_length; 0: not known):
    # a block-quantized KV cache stores each head's row in whole blocks
    head_dim: int = 0
    head_dim_v: int = 0
    # what the engine-buffer term needs (0: not known, nothing charged)
    n_embd: int = 0
    n_ff_exp: int = 0
    rope_dim: int = 0
    rope_tables: int = 0
    # what strata's engine terms need (budget/engine_terms.py; 0: not known)
    n_layer: int = 0  # decoder layers the main pass runs (NextN draft blocks excepted)
    n_head: int = 0
    n_expert_used: int = 0
    draft_layers: list[int] = Field(default_factory=list)  # NextN / MTP draft blocks (the drafter)

    @property
    def tied(self) -> bool:
        return self.head is not None and self.head == self.embeddings

    @property
    def trunk_experts(self) -> list[ExpertLayerFacts]:
        """The MoE layers of the main pass: a draft block's experts are never routed, no slot serves them."""
        return [L for L in self.expert_layers if L.layer not in self.draft_layers]

    @property
    def max_blob_engine(self) -> int:
        return max((L.blob_engine_bytes for L in self.trunk_experts), default=0)

    @property
    def max_slot_bytes(self) -> int:
        """What one expert-cache slot holds: the largest engine-form blob, parts aligned."""
        return max((L.slot for L in self.trunk_experts), default=0)

    @property
    def max_blob_source(self) -> int:
        return max((L.blob_bytes for L in self.trunk_experts), default=0)

    @property
    def expert_pairs(self) -> int:
        return self.n_expert * len(self.trunk_experts)

    def is_draft(self, name: str) -> bool:
        """True for a tensor of a NextN draft block (``blk.N.`` with N a draft layer)."""
        parts = name.split(".", 2)
        return (
            bool(self.draft_layers) and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) in self.draft_layers
        )


__all__ = ["DenseTensor", "ExpertLayerFacts", "ModelFacts"]
