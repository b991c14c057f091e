"""The VRAM plan: what a card holds when the engine has started, term by term, and how many expert
slots are left - a model of what the engine allocates, built only from :mod:`.formulas`.

Terms, in the engine's start-up order (BRIEF.md "Start-up order and the memory plan"): CUDA
context; the CUDA runtime's first-use memory (kernel modules: a measured constant, cards.toml);
memory already in use (``--card measure`` only); dense weights in engine form; the output
head (before the cache: incident 1); token embeddings (unless kept on the host or tied to the
head); KV cache (attention layers only, sliding-window layers capped at their window); recurrent
state (per sequence x batch); engine buffers (the f32 vectors strata's engine preallocates: GEMV
outputs, f32 copies of non-F32 vectors, rope tables, the embedding row, the expert hit path);
prefill / activation buffers; then the expert cache gets
``floor((free - reserve) / max_blob)`` slots (incident 2), or the ``--expert-cache N`` asked, which
is refused with both numbers when it does not fit. The reserve is never allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from strata.packer import quants

from . import formulas as F
from .cards import Card
from .formulas import MIB, KVLayer, RecurrentLayer

DEFAULT_RESERVE_MIB = 700  # the documents' engine default (--vram-reserve-mib)
DEFAULT_PREFILL_CHUNK = 256  # the documents' prompt path chunk (BRIEF.md incident 3)
LOW_MIB = 256  # the documents' serve check calls less than this free LOW (incident 3)


class PlanInputError(ValueError):
    """Options or a profile that cannot be planned (bad profile rows, impossible option values)."""


class DenseTensor(BaseModel):
    """One dense tensor as the plan needs it: name, pool and source ggml type ids, ne (ggml order)."""

    model_config = ConfigDict(frozen=True)
    name: str
    type: int
    src_type: int
    ne: tuple[int, ...]


class ExpertLayerFacts(BaseModel):
    """One MoE layer: expert types and one expert's bytes in source and engine form, and the bytes
    of a cache slot that holds it (engine form, parts aligned: :func:`formulas.expert_slot_bytes`;
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
    # what the engine-buffer term needs (0: not known, nothing charged)
    n_embd: int = 0
    n_ff_exp: int = 0
    rope_dim: int = 0
    rope_tables: int = 0

    @property
    def tied(self) -> bool:
        return self.head is not None and self.head == self.embeddings

    @property
    def max_blob_engine(self) -> int:
        return max((L.blob_engine_bytes for L in self.expert_layers), default=0)

    @property
    def max_slot_bytes(self) -> int:
        """What one expert-cache slot holds: the largest engine-form blob, parts aligned."""
        return max((L.slot for L in self.expert_layers), default=0)

    @property
    def max_blob_source(self) -> int:
        return max((L.blob_bytes for L in self.expert_layers), default=0)

    @property
    def expert_pairs(self) -> int:
        return self.n_expert * len(self.expert_layers)


class PlanOptions(BaseModel):
    """The knobs of ``strata-budget check`` (None = the default described on each)."""

    model_config = ConfigDict(extra="forbid")
    max_context: int | None = None  # None: the model's n_ctx_train, flagged
    kv_resident: int | None = None
    kv: Literal["f16", "int8", "f32"] = "f16"
    batch: int = 1
    prefill: int = DEFAULT_PREFILL_CHUNK
    logits_all: bool = False
    prefill_model: Literal["geometry", "documents"] = "geometry"
    embeddings_on_host: bool = False
    vram_reserve_mib: int = DEFAULT_RESERVE_MIB
    expert_cache: int | None = None  # None: automatic
    profile_pairs: list[tuple[int, int, int]] | None = None  # (layer, expert, count)


class Term(BaseModel):
    name: str
    bytes: int
    detail: str = ""


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


class Suggestion(BaseModel):
    option: str
    value: str
    saves_bytes: int
    fits_alone: bool
    text: str


class ProfileReport(BaseModel):
    pairs: int
    slots: int
    filled: int
    expected_hit_rate: float
    layers: list[dict]


class Plan(BaseModel):
    """A VRAM plan for one card (bytes; ``fits`` decides exit code 0 or 1)."""

    card: Card
    options: PlanOptions
    n_ctx: int
    terms: list[Term]
    free_bytes: int  # what cudaMemGetInfo would say when the expert cache is opened
    reserve_bytes: int
    max_blob: int  # engine form: what one slot holds
    max_blob_source: int
    slots: int
    slots_fit: int  # the most slots that fit (= slots when automatic)
    slots_cap: int | None
    expert_cache_bytes: int
    used_bytes: int  # sum of the terms, expert cache included
    left_bytes: int  # card - used (>= reserve when the plan fits)
    fits: bool
    refused: str | None = None
    kv_bytes_per_token: int  # full-context layers, one sequence
    kv_bytes_per_token_window_layers: int
    recurrent_state_bytes_per_seq: int
    widened_scale_bytes: int
    bf16_saved_bytes: int
    types: list[TypeRow]
    profile: ProfileReport | None = None
    warnings: list[str] = Field(default_factory=list)
    suggestions: list[Suggestion] = Field(default_factory=list)

    def term(self, name: str) -> int:
        return next(t.bytes for t in self.terms if t.name == name)


def dense_types(facts: ModelFacts) -> list[TypeRow]:
    """Per pool type: pack bytes, engine bytes (payload + f32 scales), widened extra, BF16 saving."""
    rows: dict[str, TypeRow] = {}
    for t in facts.dense:
        f = F.engine_form(t.type, t.src_type, t.ne)
        label = quants.qtype(t.type).name + (" (from BF16)" if t.src_type == quants.BF16.id else "")
        r = rows.setdefault(label, TypeRow(type=label, tensors=0, pack_bytes=0, engine_bytes=0, payload_bytes=0,
                                           scales_f32_bytes=0, widened_extra_bytes=0, bf16_saved_bytes=0))
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
    of :mod:`.formulas`, the ones the engine's allocator calls): one GEMV output per matrix it
    multiplies, an f32 copy of every vector whose engine form is not F32, one rope table per rope
    base for ``n_ctx`` positions, the row an untied embedding is looked up into, and the expert hit
    path's vectors. Untied token embeddings are read by rows only (no GEMV output)."""
    rows_only = {facts.embeddings} if facts.embeddings and not facts.tied else set()
    total = 0
    for t in facts.dense:
        if t.name in rows_only:
            continue
        if quants.n_elements(t.ne) == int(t.ne[0]):  # one row: a vector
            total += F.vector_f32_bytes(t.type, t.src_type, t.ne)
        else:
            total += F.matvec_out_bytes(t.ne)
    if rows_only and facts.n_embd:
        total += F.embedding_row_bytes(facts.n_embd)
    total += facts.rope_tables * F.rope_table_bytes(n_ctx, facts.rope_dim)
    if facts.expert_layers and facts.n_embd:
        total += F.expert_hit_buffer_bytes(facts.n_embd, facts.n_ff_exp)
    return total


def _engine(facts: ModelFacts, name: str | None) -> int:
    for t in facts.dense:
        if t.name == name:
            return F.engine_form(t.type, t.src_type, t.ne).engine
    return 0


def _terms(facts: ModelFacts, card: Card, o: PlanOptions, n_ctx: int) -> list[Term]:
    head = _engine(facts, facts.head)
    embd = 0 if facts.tied or o.embeddings_on_host else _engine(facts, facts.embeddings)
    special = {facts.head, facts.embeddings}
    dense = sum(F.engine_form(t.type, t.src_type, t.ne).engine for t in facts.dense if t.name not in special)
    kv = F.kv_cache_bytes(facts.kv_layers, n_ctx, o.prefill, o.kv, o.batch, o.kv_resident)
    rec = F.recurrent_state_bytes(facts.recurrent_layers, o.batch)
    if o.prefill_model == "documents":
        act = F.documents_prefill_bytes(o.prefill)
        act_detail = f"documents' engine: 160 + {o.prefill} x 680 / 1024 MiB (generate.cpp:2941-2960)"
    else:
        act = F.activation_bytes(o.prefill, facts.act_per_token, facts.logits_per_token, o.logits_all, o.batch)
        rows = max(o.prefill, o.batch, 1)
        act_detail = (f"{rows} rows x {facts.act_per_token} f32 activations + "
                      f"{rows if o.logits_all else o.batch} x {facts.logits_per_token} f32 logits")
    n_full = sum(1 for L in facts.kv_layers if L.window is None)
    n_win = len(facts.kv_layers) - n_full
    terms = [Term(name="CUDA context", bytes=card.cuda_context_bytes, detail=card.cuda_context_source),
             Term(name="CUDA runtime", bytes=card.cuda_runtime_bytes, detail=card.cuda_runtime_source)]
    if card.in_use_bytes is not None:
        terms.append(Term(name="in use before start", bytes=card.in_use_bytes, detail="measured"))
    terms += [
        Term(name="dense weights", bytes=dense, detail=f"engine form, {len(facts.dense) - len(special - {None})} tensors"),
        Term(name="output head", bytes=head, detail=(f"{facts.head} (tied to the embeddings)" if facts.tied else str(facts.head))),
        Term(name="token embeddings", bytes=embd, detail=("shared with the output head" if facts.tied else
                                                          "kept on the host" if o.embeddings_on_host else str(facts.embeddings))),
        Term(name="KV cache", bytes=kv, detail=(f"{o.kv}, {n_full} full-context + {n_win} sliding-window layers, "
                                                f"{n_ctx} tokens x {o.batch} seq"
                                                + (f", {o.kv_resident} resident" if o.kv_resident else ""))),
        Term(name="recurrent state", bytes=rec, detail=f"{len(facts.recurrent_layers)} layers, f32, x {o.batch} seq"),
        Term(name="engine buffers", bytes=engine_buffer_bytes(facts, n_ctx),
             detail=f"f32 GEMV outputs, non-F32 vectors as f32, {facts.rope_tables} rope table(s) of {n_ctx} x "
                    f"{facts.rope_dim}, embedding row, expert hit path"),
        Term(name="prefill/activations", bytes=act, detail=act_detail),
    ]
    return terms


def make_plan(facts: ModelFacts, card: Card, options: PlanOptions, *, suggest: bool = True) -> Plan:
    """Plan ``facts`` on ``card`` with ``options``.

    Raises:
        PlanInputError: a non-positive batch or context, a negative reserve / chunk / cache, or a
            profile naming a layer without experts or an expert id out of range.
    """
    o = options
    for name, v, lo in (("--batch", o.batch, 1), ("--prefill", o.prefill, 0), ("--vram-reserve-mib", o.vram_reserve_mib, 0),
                        ("--max-context", o.max_context, 1), ("--kv-resident", o.kv_resident, 1),
                        ("--expert-cache", o.expert_cache, 0)):
        if v is not None and v < lo:
            raise PlanInputError(f"{name} {v}: must be at least {lo}")
    n_ctx = o.max_context if o.max_context is not None else facts.n_ctx_train
    terms = _terms(facts, card, o, n_ctx)
    before = sum(t.bytes for t in terms)
    free = card.total_bytes - before
    reserve = o.vram_reserve_mib * MIB
    blob = facts.max_slot_bytes
    profile = None
    cap = facts.expert_pairs if facts.expert_layers else None
    if o.profile_pairs is not None and facts.expert_layers:
        _check_profile(facts, o.profile_pairs)
        cap = len(o.profile_pairs)
    slots_fit = F.expert_slots(free, reserve, blob, cap)
    warnings: list[str] = []
    refused = None
    if o.expert_cache is not None:
        slots = o.expert_cache
        if not facts.expert_layers and slots:
            raise PlanInputError(f"--expert-cache {slots}: this {facts.arch} model has no routed experts")
        if cap is not None and slots > cap:
            warnings.append(f"--expert-cache {slots} is more than the {cap} (layer, expert) pairs that can fill it")
        most = F.expert_slots(free, reserve, blob)
        if slots * blob > free - reserve:
            refused = (f"--expert-cache {slots} refused: {slots} slots x {blob} B = {slots * blob} B "
                       f"({F.mib(slots * blob):.1f} MiB) asked, at most {most} slots fit "
                       f"({F.mib(max(free - reserve, 0)):.1f} MiB free after the {o.vram_reserve_mib} MiB reserve)")
    else:
        slots = slots_fit
    if o.profile_pairs is not None and facts.expert_layers:
        fill = F.fill_profile(o.profile_pairs, slots)
        profile = ProfileReport(pairs=fill.pairs, slots=slots, filled=fill.used, expected_hit_rate=fill.hit_rate,
                                layers=[dict(layer=L.layer, range=L.range, filled=L.filled, hit_count=L.hit_count,
                                             total_count=L.total_count) for L in fill.layers])
    cache = slots * blob
    terms.append(Term(name="expert cache", bytes=cache,
                      detail=(f"{slots} slots x {blob} B (largest expert, engine form)" if facts.expert_layers else "no routed experts")))
    used = before + cache
    fits = free - reserve >= 0 and refused is None
    if o.max_context is None:
        warnings.append(f"--max-context not given: budgeted at the model's maximum context, {facts.n_ctx_train} tokens")
    elif n_ctx > facts.n_ctx_train:
        warnings.append(f"--max-context {n_ctx} is beyond the model's trained context {facts.n_ctx_train}")
    if o.vram_reserve_mib < LOW_MIB:
        warnings.append(f"--vram-reserve-mib {o.vram_reserve_mib} leaves less than the {LOW_MIB} MiB the documents' "
                        f"serve check calls LOW (BRIEF.md incident 3)")
    full = [L for L in facts.kv_layers if L.window is None]
    plan = Plan(
        card=card, options=o, n_ctx=n_ctx, terms=terms, free_bytes=free, reserve_bytes=reserve, max_blob=blob,
        max_blob_source=facts.max_blob_source, slots=slots, slots_fit=slots_fit, slots_cap=cap,
        expert_cache_bytes=cache, used_bytes=used, left_bytes=card.total_bytes - used, fits=fits, refused=refused,
        kv_bytes_per_token=sum(F.kv_bytes_per_token(L, o.kv) for L in full),
        kv_bytes_per_token_window_layers=sum(F.kv_bytes_per_token(L, o.kv) for L in facts.kv_layers if L.window is not None),
        recurrent_state_bytes_per_seq=F.recurrent_state_bytes_per_seq(facts.recurrent_layers),
        widened_scale_bytes=sum(r.widened_extra_bytes for r in dense_types(facts)),
        bf16_saved_bytes=sum(r.bf16_saved_bytes for r in dense_types(facts)),
        types=dense_types(facts), profile=profile, warnings=warnings,
    )
    if suggest and not fits:
        plan.suggestions = suggestions(facts, card, o, plan)
    return plan


def _check_profile(facts: ModelFacts, pairs: list[tuple[int, int, int]]) -> None:
    moe = {L.layer for L in facts.expert_layers}
    for layer, expert, count in pairs:
        if layer not in moe:
            raise PlanInputError(f"expert profile: layer {layer} has no routed experts (MoE layers: {min(moe)}..{max(moe)})")
        if not 0 <= expert < facts.n_expert:
            raise PlanInputError(f"expert profile: layer {layer} expert {expert} is outside 0..{facts.n_expert - 1}")
        if count < 0:
            raise PlanInputError(f"expert profile: layer {layer} expert {expert} has negative count {count}")


def read_profile(path: str | Path) -> list[tuple[int, int, int]]:
    """Read an expert profile: Parquet with integer columns ``layer``, ``expert``, ``count``.

    Raises:
        PlanInputError: unreadable file, missing columns (naming them) or null values.
    """
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise PlanInputError(f"{path}: not a readable Parquet file ({e})") from None
    missing = [c for c in ("layer", "expert", "count") if c not in table.column_names]
    if missing:
        raise PlanInputError(f"{path}: expert profile lacks column(s) {missing}; it has {table.column_names}")
    cols = []
    for c in ("layer", "expert", "count"):
        col = table.column(c)
        if col.null_count:
            raise PlanInputError(f"{path}: column {c} has {col.null_count} null value(s)")
        cols.append([int(x) for x in col.to_pylist()])
    return list(zip(*cols))


# ----------------------------------------------------------------------------- shrinking

def _margin(facts: ModelFacts, card: Card, o: PlanOptions) -> int:
    """Bytes left after the terms, the reserve and an asked expert cache (>= 0: fits)."""
    p = make_plan(facts, card, o, suggest=False)
    need = p.expert_cache_bytes if o.expert_cache is not None else 0
    return p.free_bytes - p.reserve_bytes - need


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Largest v in [lo, hi] with ok(v), for ok monotone (true then false); None if ok(lo) is false."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def suggestions(facts: ModelFacts, card: Card, o: PlanOptions, plan: Plan) -> list[Suggestion]:
    """Which terms to shrink, and by how much, for a plan that does not fit: for each knob the
    least change that fits on its own (found with the plan itself, so it is exact), or what the
    knob saves at most when it alone cannot make the plan fit."""
    base = _margin(facts, card, o)
    deficit = -base
    out: list[Suggestion] = []

    def with_(**kw) -> PlanOptions:
        return o.model_copy(update=kw)

    def add(option: str, value, new_o: PlanOptions, text: str) -> None:
        m = _margin(facts, card, new_o)
        out.append(Suggestion(option=option, value=str(value), saves_bytes=m - base, fits_alone=m >= 0, text=text))

    if o.expert_cache is not None and o.expert_cache > 0:
        add("--expert-cache", plan.slots_fit if facts.expert_layers else 0, with_(expert_cache=None),
            f"at most {plan.slots_fit} slots fit; ask for that many (or leave it automatic)")
    kv_layers = bool(facts.kv_layers)
    if kv_layers and plan.n_ctx > 1:
        best = _largest(1, plan.n_ctx - 1, lambda c: _margin(facts, card, with_(max_context=c)) >= 0)
        if best is not None:
            add("--max-context", best, with_(max_context=best), f"the largest context that fits is {best} tokens")
        else:
            add("--max-context", 1, with_(max_context=1), "even a 1-token context does not fit on its own")
    if kv_layers and o.kv == "f16":
        add("--kv", "int8", with_(kv="int8"), "int8 (Q8_0) KV cache: 34 B per 32 values instead of 64")
    if any(L.window is None for L in facts.kv_layers):
        top = min(o.kv_resident or plan.n_ctx, plan.n_ctx)
        if top > 1:
            best = _largest(1, top - 1, lambda r: _margin(facts, card, with_(kv_resident=r)) >= 0)
            if best is not None:
                add("--kv-resident", best, with_(kv_resident=best),
                    f"keep {best} tokens of KV resident, stream the rest from the host")
    if o.batch > 1:
        best = _largest(1, o.batch - 1, lambda b: _margin(facts, card, with_(batch=b)) >= 0)
        if best is not None:
            add("--batch", best, with_(batch=best), f"the largest batch that fits is {best}")
    if o.prefill > 0:
        best = _largest(0, o.prefill - 1, lambda c: _margin(facts, card, with_(prefill=c)) >= 0)
        if best is not None:
            add("--prefill", best, with_(prefill=best), f"the largest prompt chunk that fits is {best}")
    if not o.embeddings_on_host and not facts.tied and facts.embeddings:
        add("--embeddings-on-host", "", with_(embeddings_on_host=True), "look token embeddings up on the host")
    if o.vram_reserve_mib > 0 and deficit > 0:
        new = o.vram_reserve_mib - (deficit + MIB - 1) // MIB
        if new >= 0:
            add("--vram-reserve-mib", new, with_(vram_reserve_mib=new),
                f"a {new} MiB reserve fits, at the risk the reserve exists for (BRIEF.md incidents 1 and 3)")
    return out
