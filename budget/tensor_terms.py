"""Two of the VRAM plan's terms, tensor by tensor (:func:`strata.budget.plan.make_plan` sums them): the dense
weights per pool type in pack and engine form (:func:`dense_types`, the "dense weights" table) and the f32
buffers strata's engine preallocates for its dense tensors (:func:`engine_buffer_bytes`, "engine buffers").
Sizes are bytes, from :mod:`strata.layout` (the functions the engine allocates with).
"""

from __future__ import annotations

from pydantic import BaseModel

from strata.layout import buffers as LB
from strata.layout import engine_form as LE
from strata.layout import experts as LX
from strata.packer import quants

from .plan_model import ModelFacts


class TypeRow(BaseModel):
    """Dense weights of one pool type (bytes): pack form, engine form and its parts."""

    type: str
    tensors: int
    pack_bytes: int
    engine_bytes: int
    payload_bytes: int
    scales_f32_bytes: int
    widened_extra_bytes: int
    bf16_saved_bytes: int


def dense_types(facts: ModelFacts) -> list[TypeRow]:
    """Per pool type: pack bytes, engine bytes (payload + f32 scales), widened extra, BF16 saving."""
    rows: dict[str, TypeRow] = {}
    for t in facts.dense:
        f = LE.engine_form(t.type, t.src_type, t.ne)
        label = quants.qtype(t.type).name + (" (from BF16)" if t.src_type == quants.BF16.id else "")
        r = rows.setdefault(
            label,
            TypeRow(
                type=label,
                tensors=0,
                pack_bytes=0,
                engine_bytes=0,
                payload_bytes=0,
                scales_f32_bytes=0,
                widened_extra_bytes=0,
                bf16_saved_bytes=0,
            ),
        )
        r.tensors += 1
        r.pack_bytes += f.pack
        r.engine_bytes += f.engine
        r.payload_bytes += f.payload
        r.scales_f32_bytes += f.scales_f32
        r.widened_extra_bytes += f.widened_extra
        r.bf16_saved_bytes += f.bf16_saved
    return sorted(rows.values(), key=lambda r: -r.engine_bytes)


def engine_buffer_bytes(facts: ModelFacts, n_ctx: int) -> int:
    """The f32 buffers strata's engine preallocates before the first token (each from one function
    of :mod:`strata.layout.buffers`, the ones the engine's allocator calls): one GEMV output per matrix it
    multiplies, an f32 copy of every vector whose engine form is not F32, one rope table per rope
    base for ``n_ctx`` positions, the row an untied embedding is looked up into, and the expert hit
    path's vectors. Untied token embeddings are read by rows only (no GEMV output)."""
    rows_only = {facts.embeddings} if facts.embeddings and not facts.tied else set()
    total = 0
    for t in facts.dense:
        if t.name in rows_only or facts.is_draft(t.name):  # the draft head's buffers: its bind term
            continue
        if quants.n_elements(t.ne) == int(t.ne[0]):  # one row: a vector
            total += LB.vector_f32_bytes(t.type, t.src_type, t.ne)
        else:
            total += LB.matvec_out_bytes(t.ne)
    if rows_only and facts.n_embd:
        total += LB.embedding_row_bytes(facts.n_embd)
    total += facts.rope_tables * LB.rope_table_bytes(n_ctx, facts.rope_dim)
    if facts.expert_layers and facts.n_embd:
        total += LX.expert_hit_buffer_bytes(facts.n_embd, facts.n_ff_exp)
    return total
