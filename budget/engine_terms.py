"""The budget terms of strata's own engine (``strata-budget check --engine strata``, the default, and
``strata-engine measure``): what its GPU path really allocates and loads, derived from the pack.

The model's own terms (weights, KV cache, recurrent state, engine buffers) are the same for every
engine (:mod:`strata.layout`, :mod:`.formulas`); these are the ones that depend on how strata's engine runs the model:

- the decode path it takes (:func:`strata.budget.formulas_gpu.strata_decode_path`: the fused step, or
  the generic per-layer path for a delta-net model);
- "prefill/activations": the fused step's device buffers, exactly
  (:func:`strata.layout.step.fused_step_bytes`, the engine's ``GpuInfo.fused_buffer_bytes``), or the
  generic path's warm-up temporaries (:func:`strata.layout.step.generic_step_bytes`, an
  estimate); one position per step (generated tokens; a prompt chunk's buffers are "prompt chunk",
  :func:`chunk_term`);
- "CUDA runtime": the kernel modules of the types it loads, the CUDA graphs it captures, CuPy's kernels
  on the generic path, and the driver's rounding of each of its large allocations
  (:func:`strata.budget.formulas_gpu.cuda_runtime_bytes` over :func:`allocations`);
- the drafter: a NextN draft head's weights in engine form, loaded before the cache, and its bind
  buffers (:func:`strata.layout.buffers.draft_bind_bytes`), reserved when the cache is sized and
  allocated after it (docs/DESIGN.md "The automatic slot count").
"""

from __future__ import annotations

from strata.layout import buffers as LB
from strata.layout import chunk as LC
from strata.layout import engine_form as LE
from strata.layout import kv as LK
from strata.layout import step as LS
from strata.packer import quants

from . import formulas_gpu as FG
from .cards import Card, runtime_model
from .plan_model import ModelFacts


def _is_vector(ne) -> bool:
    return quants.n_elements(ne) == int(ne[0])


def _engine_type(t) -> int:
    return quants.BF16.id if t.type == quants.F32.id and t.src_type == quants.BF16.id else t.type


def _role(t) -> str:
    return t.name.split(".", 2)[-1]


def gdn_facts(facts: ModelFacts) -> tuple[bool, int, int, int]:
    """The delta-net layers as the fused step sees them, from the tensors: ``(fusable, conv_dim,
    value_dim, conv weight elements)`` - fusable unless a layer has the legacy ``ssm_in`` or the head
    dim (``ssm_norm``'s length) is not a multiple of 32 in 32..1024; ``(True, 0, 0, 0)`` without them."""
    trunk = [t for t in facts.dense if not facts.is_draft(t.name)]
    conv = [t for t in trunk if _role(t) == "ssm_conv1d.weight"]
    if not conv:
        return True, 0, 0, 0
    d_state = next((int(t.ne[0]) for t in trunk if _role(t) == "ssm_norm.weight"), 0)
    value_dim = next((int(t.ne[0]) for t in trunk if _role(t) == "ssm_out.weight"), 0)
    fusable = (not any(_role(t) == "ssm_in.weight" for t in trunk)) and d_state % 32 == 0 and 32 <= d_state <= 1024
    return fusable, int(conv[0].ne[1]), value_dim, sum(quants.n_elements(t.ne) for t in conv)


def decode_path(facts: ModelFacts) -> str:
    """``"fused"`` or ``"generic"``: the GPU decode step strata's engine runs this model with."""
    biases = any(_role(t) in ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias") for t in facts.dense)
    return FG.strata_decode_path(
        len(facts.recurrent_layers),
        biases,
        facts.n_expert_used if facts.expert_layers else 0,
        recurrent_fusable=gdn_facts(facts)[0],
    )


def kv_positions(facts: ModelFacts, n_ctx: int) -> int:
    """The longest KV cache of any attention layer at one position per step (``strata.layout.kv.kv_tokens``)."""
    return max((LK.kv_tokens(n_ctx, L.window, LK.ENGINE_PREFILL_CHUNK) for L in facts.kv_layers), default=0)


def _n_ff_max(facts: ModelFacts) -> int:
    widths = [
        int(t.ne[1])
        for t in facts.dense
        if not facts.is_draft(t.name) and t.name.split(".", 2)[-1] in ("ffn_gate.weight", "ffn_gate_shexp.weight")
    ]
    return max(widths, default=1)


def activation_term(facts: ModelFacts, n_ctx: int) -> tuple[int, str, bool]:
    """(bytes, detail, exact) of "prefill/activations" for strata's engine at ``n_ctx``."""
    pos = kv_positions(facts, n_ctx)
    if decode_path(facts) == "fused":
        moe = facts.trunk_experts
        _fusable, conv_dim, value_dim, conv_el = gdn_facts(facts)
        nb = LS.fused_step_bytes(
            facts.n_embd,
            facts.n_head,
            facts.head_dim,
            facts.head_dim_v or facts.head_dim,
            _n_ff_max(facts),
            pos,
            n_layer=facts.n_layer if moe else 0,
            n_expert=facts.n_expert if moe else 0,
            n_expert_used=facts.n_expert_used if moe else 0,
            n_ff_exp=facts.n_ff_exp if moe else 0,
            value_dim=value_dim,
            slot_bytes=facts.max_slot_bytes if moe else 0,
        )
        nb += LS.gdn_step_bytes(conv_dim, value_dim, conv_el)
        detail = f"fused decode step's device buffers (exact; scores over {pos} positions)"
        n_stage = LS.prefetch_entries(facts.max_slot_bytes) if moe else 0
        if n_stage:  # the expert prefetch's staging slots: a figure of their own, first (the table cuts details)
            detail = (
                f"fused decode step's buffers with the expert prefetch's {n_stage} staging slots "
                f"({n_stage * facts.max_slot_bytes} B) (exact; scores over {pos} positions)"
            )
        return nb, detail, True
    kv_el = max((L.k + L.v for L in facts.kv_layers), default=0)
    ssm = max((L.ssm for L in facts.recurrent_layers), default=0)
    nb = LS.generic_step_bytes(facts.act_per_token, facts.logits_per_token, pos, kv_el, facts.n_head, ssm)
    return (
        nb,
        (
            f"generic per-layer path: warm-up temporaries at position {max(pos - 1, 0)} (estimate: f32 K/V of "
            f"{pos} positions, scores, delta-net state temporaries)"
        ),
        False,
    )


def chunk_term(facts: ModelFacts, ubatch: int, n_ctx: int | None = None) -> tuple[int, str]:
    """(bytes, detail) of "prompt chunk" for strata's engine at ``-ub ubatch``: the GPU chunk path's f32 tile, staging
    slots and (block-type experts) the grouped product's outputs (:func:`strata.layout.chunk.chunk_buffer_bytes`,
    what ``strata.engine.gpu.chunk.ChunkPath`` allocates: the engine's ``GpuInfo.chunk_bytes``); 0 at ``-ub 1`` (one
    position at a time). A chunk holds at most ``n_ctx`` positions (:func:`strata.layout.chunk.chunk_positions`)."""
    if ubatch <= 1:
        return 0, "-ub 1: the prompt one position at a time, no chunk buffers"
    pos = LC.chunk_positions(ubatch, ubatch, n_ctx if n_ctx is not None else ubatch)
    w, h, _d = _split(facts)
    mats = [t for t in w + h if not _is_vector(t.ne)]
    ne0_max = max((int(t.ne[0]) for t in mats), default=1)
    dense_max = max((quants.n_elements(t.ne) for t in mats), default=1)
    moe = bool(facts.trunk_experts)
    part = facts.n_embd * facts.n_ff_exp if moe else 0
    n_expert = facts.n_expert if moe else 0
    slot = facts.max_slot_bytes if moe else 0
    types = {t for L in facts.trunk_experts for t in (L.gate_type, L.up_type, L.down_type)}
    grouped = moe and LC.grouped_types(types)
    pairs = LC.chunk_pair_bytes(pos, facts.n_expert_used, facts.n_embd, facts.n_ff_exp) if grouped else 0
    nb = LC.chunk_buffer_bytes(ne0_max, dense_max, part, n_expert, slot, pairs)
    tile = LC.chunk_tile_elements(ne0_max, dense_max, part, n_expert)
    group = min(LC.chunk_group_experts(tile, part), n_expert)
    return nb, (
        f"a chunk of {pos} positions (the least of -ub, -b and the context): f32 weight tile of {tile} values "
        f"({4 * tile} B)"
        + (f" + {group} staging slots of {slot} B (a chunk's missed experts)" if moe else "")
        + (f" + {pairs} B of grouped-product outputs ({pos} x {facts.n_expert_used} pairs)" if grouped else "")
    )


def _split(facts: ModelFacts) -> tuple[list, list, list]:
    """Dense tensors by the engine's stage arena: weights, head, draft head (untied embeddings: on the host)."""
    head = {facts.head, "output.bias"}
    rows_only = {facts.embeddings} if facts.embeddings and not facts.tied else set()
    w, h, d = [], [], []
    for t in facts.dense:
        if t.name in rows_only:
            continue
        (d if facts.is_draft(t.name) else h if t.name in head else w).append(t)
    return w, h, d


def _arenas(tensors) -> list[int]:
    """The three allocations of one upload (:func:`strata.layout.buffers.arena_layout`): tensors, GEMV outputs,
    f32 vector copies."""
    sizes = [quants.engine_nbytes(t.type, t.src_type, t.ne) for t in tensors]
    outs = [LB.matvec_out_bytes(t.ne) for t in tensors if not _is_vector(t.ne)]
    vecs = [LB.vector_f32_bytes(t.type, t.src_type, t.ne) for t in tensors if _is_vector(t.ne)]
    return [n for n in (LB.arena_layout(x)[1] for x in (sizes, outs, vecs)) if n]


def draft_weights_bytes(facts: ModelFacts) -> int:
    """The draft head's dense tensors in engine form (bytes; 0 without one)."""
    return sum(LE.engine_form(t.type, t.src_type, t.ne).engine for t in facts.dense if facts.is_draft(t.name))


def draft_bind(facts: ModelFacts, n_ctx: int, kv: str) -> int:
    """The draft head's bind buffers at ``n_ctx`` positions (:func:`strata.layout.buffers.draft_bind_bytes`;
    0 without a draft head): its attention blocks' K/V rows are the decoder's (``n_head_kv x head_dim``)."""
    if not facts.draft_layers:
        return 0
    k = facts.kv_layers[0].k if facts.kv_layers else 0
    v = facts.kv_layers[0].v if facts.kv_layers else 0
    per_token = sum(LK.kv_bytes_per_token(LK.KVLayer(il, k, v), kv) for il in facts.draft_layers)
    tensors = [(t.type, t.src_type, t.ne) for t in facts.dense if facts.is_draft(t.name)]
    return LB.draft_bind_bytes(tensors, per_token, n_ctx, facts.n_embd)


def allocations(facts: ModelFacts, n_ctx: int, kv: str) -> list[int]:
    """The engine's device allocations larger than a few KiB before the expert cache (bytes): each stage's
    arenas, every attention layer's K and V arrays and indexer key store, the rope tables, the recurrent
    state, the draft head's arena and bind buffers, the expert prefetch's staging slots (the cache's own allocation
    is not known before the slots are; its rounding is inside the reserve)."""
    w, h, d = _split(facts)
    out = _arenas(w) + _arenas(h)
    if d:
        out.append(LB.arena_layout([quants.engine_nbytes(t.type, t.src_type, t.ne) for t in d])[1])
        out.append(draft_bind(facts, n_ctx, kv))
    for L in facts.kv_layers:
        n = LK.kv_tokens(n_ctx, L.window, LK.ENGINE_PREFILL_CHUNK)
        out += [n * LK.kv_row_bytes(x, kv) for x in (L.k, L.v, L.indexer_k) if x]
    if facts.rope_tables and facts.rope_dim:
        out += [n_ctx * (facts.rope_dim // 2) * LB.F32_BYTES] * (2 * facts.rope_tables)
    if facts.recurrent_layers:
        out.append(LK.recurrent_state_bytes(facts.recurrent_layers, 1))
    if decode_path(facts) == "fused" and facts.trunk_experts:  # the expert prefetch's staging slots (one allocation)
        out.append(LS.prefetch_entries(facts.max_slot_bytes) * facts.max_slot_bytes)
    return out


def kernel_types(facts: ModelFacts) -> set[int]:
    """The ggml types the engine compiles a kernel module for: every uploaded dense tensor's and every
    trunk expert part's (the draft head is loaded, not run; untied embeddings stay on the host)."""
    w, h, _ = _split(facts)
    types = {_engine_type(t) for t in w + h}
    for L in facts.trunk_experts:
        types |= {L.gate_type, L.up_type, L.down_type}
    return types


def runtime_term(facts: ModelFacts, card: Card, n_ctx: int, kv: str, cublas: bool = False) -> tuple[int, str]:
    """(bytes, detail) of "CUDA runtime" for strata's engine (module docstring); ``card.cuda_runtime_fixed``
    (``--cuda-runtime-mib``): the card's constant. ``cublas``: the engine runs prompts in chunks on the GPU
    (``-ub`` > 1), whose GEMMs use cuBLAS: its first use in the process (handle, workspace, kernels) is added,
    cards.toml ``cuda_cublas_kib`` (measured, an estimate)."""
    if card.cuda_runtime_fixed:
        return card.cuda_runtime_bytes, card.cuda_runtime_source
    c, src = (card.runtime_model, "card") if card.runtime_model else runtime_model()
    path = decode_path(facts)
    types = kernel_types(facts)
    n_mod = len(types) + 1 + (1 if path == "fused" else 0)  # + the expert activation, + the fused step
    q8 = [t for t in types if quants.qtype(t).q8_kernel]
    if path == "fused" and q8:  # the default q8 numerics: the q8 modules of those types and the quantizer
        n_mod += len(q8) + 1
    # the prefetch's graphs: a MoE layer after the first, experts small enough to stage
    pf = any(L.layer >= 1 for L in facts.trunk_experts) and LS.prefetch_entries(facts.max_slot_bytes) > 0
    graphs = FG.fused_graph_count(len(facts.trunk_experts), pf) if path == "fused" else 0
    allocs = allocations(facts, n_ctx, kv)
    nb = FG.cuda_runtime_bytes(
        n_mod,
        graphs,
        allocs,
        module_bytes=c["module_bytes"],
        graph_bytes=c["graph_bytes"],
        generic_path_bytes=c["generic_path_bytes"],
        granularity=c["granularity"],
        packed_max=c["packed_max"],
        generic=path == "generic",
    )
    rounding = FG.allocation_rounding_bytes(allocs, c["granularity"], c["packed_max"])
    blas = (c["cublas_bytes"] if "cublas_bytes" in c else runtime_model()[0]["cublas_bytes"]) if cublas else 0
    return nb + blas, (
        (f"cuBLAS for prompt chunks {blas} B + " if cublas else "")
        + f"{n_mod} kernel modules, {graphs} CUDA graphs, {path} path, driver rounding of {len(allocs)} "
        f"allocations {rounding} B (cards.toml constants, estimate)"
    )


__all__ = [
    "activation_term",
    "chunk_term",
    "allocations",
    "decode_path",
    "draft_bind",
    "draft_weights_bytes",
    "kernel_types",
    "kv_positions",
    "runtime_term",
]
