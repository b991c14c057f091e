"""The budget formulas: the one module that both ``strata-budget`` and the engine's allocator call.

Every function is pure (typed numbers in, bytes out) and says its unit and its source. A VRAM
plan is these terms summed in the engine's start-up order (docs/DESIGN.md "Start-up order"): CUDA
context, dense weights in engine form (output head before the expert cache: docs/DESIGN.md "The
head before the cache"), KV cache, recurrent state, prefill / activation buffers, then the expert
cache takes what is free minus the reserve (docs/DESIGN.md "Slots after the weights and the
session"), in slots of the largest per-expert blob in engine form.

Sizes are bytes unless a name says ``_mib`` (MiB = 2**20 bytes). "Elements" are tensor values.
Type sizes come from the one registry, :mod:`strata.packer.quants`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from strata.packer import quants
from strata.packer.conformance import expert_part_ne  # noqa: F401  (one definition, used here and re-exported)

MIB = 1 << 20
#: Recurrent state, activations and logits are f32 (llama.cpp llama-memory-recurrent.cpp:76-107
#: allocates r_l / s_l as GGML_TYPE_F32; the engine computes in f32).
F32_BYTES = 4

#: ``--kv`` choices -> the ggml type one cached K or V row is stored as. ``f16``: 2 B per element
#: (llama.cpp's default ``--cache-type-k/v f16``, and strata's engine default); ``f32``: 4 B;
#: ``int8``: ggml Q8_0 blocks (an fp16 scale + 32 int8 = 34 B per 32 elements), the layout of
#: llama.cpp's ``--cache-type-k/v q8_0``; head_dim must be a multiple of 32.
KV_CACHE_TYPES: dict[str, int] = {"f16": quants.F16.id, "int8": quants.by_name("Q8_0").id, "f32": quants.F32.id}
#: The ``--kv`` choices strata's own engine implements (K/V arrays of float16 or float32; int8 is
#: budgeted for the reference C++ engine only).
ENGINE_KV_TYPES: tuple[str, ...] = ("f16", "f32")
#: Prompt positions strata's engine processes per step: its prompt path is the decode path, one position at
#: a time (docs/DESIGN.md "The prompt goes through the decode path"), so a sliding-window layer needs its
#: window only.
ENGINE_PREFILL_CHUNK = 1
#: Alignment of every part (gate, up, down) of an expert inside an expert-cache slot, and of the
#: slot stride: a widened part starts with an f32 scale plane (needs 4), native blocks of 66/98/110 B
#: leave odd offsets behind them; 256 keeps every part's loads aligned.
EXPERT_PART_ALIGN = 256

#: The reference C++ engine reserves its prompt path's chunk buffers as
#: ``prefill_mib = chunk > 0 ? 160 + chunk * 680 / 1024 : 0`` (generate.cpp:2941-2960; docs/DESIGN.md
#: "The automatic slot count"), constants measured for ITS model. Kept as the "cpp" prefill model.
#: Defaults shared by ``strata-budget check`` and ``strata-engine`` (one definition each):
#: the VRAM reserve kept free after the expert cache (the C++ engine's ``--vram-reserve-mib``), the KV
#: cache type (llama.cpp's default ``--cache-type-k/v f16``) and the context: ``None`` = the model's
#: trained context (``n_ctx_train``), llama.cpp's default (``common.h`` ``n_ctx = 0``: "context the
#: model was trained with").
DEFAULT_RESERVE_MIB = 700
DEFAULT_KV = "f16"
DEFAULT_CTX: int | None = None

CPP_PREFILL_BASE_MIB = 160
CPP_PREFILL_KIB_PER_TOKEN = 680


def mib(nbytes: int) -> float:
    """Bytes -> MiB (2**20), for display only; never feed it back into arithmetic."""
    return nbytes / MIB


# ----------------------------------------------------------------------------- KV cache


def kv_row_bytes(elements: int, kv: str) -> int:
    """Bytes of one token's K (or V) row of ``elements`` values in the cache (``kv``: ``f16`` | ``int8``).

    Raises:
        KeyError: unknown ``kv``; quants.ShapeError: ``int8`` with ``elements`` not a multiple of 32.
    """
    if kv not in KV_CACHE_TYPES:
        raise KeyError(f"unknown KV cache type {kv!r}; known: {', '.join(KV_CACHE_TYPES)}")
    if elements == 0:
        return 0
    return quants.tensor_nbytes(KV_CACHE_TYPES[kv], (elements,), tensor=f"KV row of {elements} elements")


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's per-token cache in elements: ``k`` and ``v`` = n_head_kv x head_dim
    (n_head_kv, never n_head), ``indexer_k`` = a sparse-attention indexer's ONE shared key head
    (docs/DESIGN.md "Every budget term twice"), ``window`` = sliding window in tokens (None: the
    whole context). Multi-head latent attention (deepseek2) is the same two terms: ``k`` = the latent + the rope key
    (kv_lora_rank + rope dims, ONE "head"), ``v`` = 0 (llama.cpp allocates no V cache under MLA:
    llama-kv-cache.cpp ``has_v = !is_mla``); the manifest's [state] says so (manifests/deepseek2.toml)."""

    layer: int
    k: int
    v: int
    indexer_k: int = 0
    window: int | None = None


def kv_bytes_per_token(layer: KVLayer, kv: str) -> int:
    """Bytes one token adds to one layer's cache: K row + V row (+ the indexer's key row), at ``kv``."""
    return kv_row_bytes(layer.k, kv) + kv_row_bytes(layer.v, kv) + kv_row_bytes(layer.indexer_k, kv)


def kv_tokens(n_ctx: int, window: int | None, chunk: int, kv_resident: int | None = None) -> int:
    """Tokens one layer's cache holds in VRAM for one sequence. strata's engine sizes its KV arrays
    with this function (``chunk`` = :data:`ENGINE_PREFILL_CHUNK`): a sliding-window layer is a ring
    buffer of exactly this many positions (position ``p`` in slot ``p % kv_tokens``).

    - Full-context layer: ``n_ctx``, or ``kv_resident`` if smaller (the C++ engine's ``--kv-resident``:
      the resident window; older positions stream from the host).
    - Sliding-window layer: ``min(n_ctx, window + max(chunk, 1) - 1)``: a position p attends to the
      ``window`` positions ``p - window + 1 .. p`` (llama.cpp ``llama_hparams::is_masked_swa``,
      LLAMA_SWA_TYPE_STANDARD: masked when ``p1 - p0 >= n_swa``), so a chunk of ``c`` positions starting
      at p0 needs ``p0 - window + 1 .. p0 + c - 1``: the window plus what the prompt path adds.
      (llama.cpp allocates a little more, ``n_swa + n_ubatch`` padded; this is the engine's need.)
    """
    n = n_ctx if window is None else min(n_ctx, window + max(chunk, 1) - 1)
    if kv_resident is not None and window is None:  # a sliding layer keeps its window whatever N is
        n = min(n, kv_resident)
    return max(n, 0)


def kv_cache_bytes(
    layers: Iterable[KVLayer], n_ctx: int, chunk: int, kv: str, batch: int, kv_resident: int | None = None
) -> int:
    """KV cache for ``batch`` sequences of up to ``n_ctx`` tokens: attention layers only (recurrent
    layers hold no KV), each at :func:`kv_tokens` tokens x :func:`kv_bytes_per_token`."""
    per_seq = sum(kv_bytes_per_token(L, kv) * kv_tokens(n_ctx, L.window, chunk, kv_resident) for L in layers)
    return per_seq * batch


#: llama.cpp's defaults for the cache sizing below (llama-context.cpp llama_context_default_params:
#: n_ubatch 512, swa_full true) and the padding of its context and SWA cache (256 cells).
LLAMACPP_N_UBATCH = 512
LLAMACPP_CELL_PAD = 256


def llamacpp_kv_cells(
    n_ctx: int,
    window: int | None,
    *,
    n_ubatch: int = LLAMACPP_N_UBATCH,
    n_seq: int = 1,
    swa_full: bool = True,
    unified: bool = False,
) -> int:
    """Cells (token positions) llama.cpp allocates for one layer's KV cache per stream - the reference
    engine's sizing, not strata's (strata's is :func:`kv_tokens`):

    - every layer: ``n_ctx_seq``, the context padded to 256 (llama-context.cpp, llama_context ctor:
      ``n_ctx = GGML_PAD(n_ctx, 256)``; ``n_ctx_seq = GGML_PAD(n_ctx / n_seq_max, 256)`` unless the cache
      is unified);
    - a sliding-window layer when ``swa_full`` is false: ``GGML_PAD(min(n_ctx_seq, n_swa * (n_seq if
      unified else 1) + n_ubatch), 256)`` (llama-kv-cache-iswa.cpp, llama_kv_cache_iswa ctor: "the SWA
      cache is always padded to 256"); with ``swa_full`` (llama.cpp's default) it is ``n_ctx_seq`` too.
    """

    def pad(n: int) -> int:
        return (n + LLAMACPP_CELL_PAD - 1) // LLAMACPP_CELL_PAD * LLAMACPP_CELL_PAD

    n_ctx_seq = pad(n_ctx) if unified else pad(pad(n_ctx) // max(n_seq, 1))
    if window is None or swa_full:
        return n_ctx_seq
    return pad(min(n_ctx_seq, window * (n_seq if unified else 1) + n_ubatch))


def llamacpp_kv_cache_bytes(
    layers: Iterable[KVLayer],
    n_ctx: int,
    kv: str,
    *,
    n_ubatch: int = LLAMACPP_N_UBATCH,
    n_seq: int = 1,
    swa_full: bool = True,
    unified: bool = False,
) -> int:
    """The KV cache llama.cpp allocates for ``layers`` (strata's per-token rows, :func:`kv_bytes_per_token`)
    at a context of ``n_ctx``: each layer's row bytes x :func:`llamacpp_kv_cells` x its streams
    (llama-kv-cache.cpp, llama_kv_cache ctor: one ``[row, kv_size, n_stream]`` K tensor, and a V tensor
    unless the row is absent, as under MLA). What tests/test_budget_llamacpp.py compares with llama.cpp."""
    streams = 1 if unified else max(n_seq, 1)
    return sum(
        kv_bytes_per_token(L, kv)
        * streams
        * llamacpp_kv_cells(n_ctx, L.window, n_ubatch=n_ubatch, n_seq=n_seq, swa_full=swa_full, unified=unified)
        for L in layers
    )


# ----------------------------------------------------------------------------- recurrent state


@dataclass(frozen=True)
class RecurrentLayer:
    """One recurrent layer's per-sequence state in f32 elements: the conv tail
    ``(d_conv - 1) x conv channels`` and the SSM / delta-net state ``d_state x d_inner``
    (llama.cpp ``n_embd_r`` / ``n_embd_s``, llama-hparams.cpp:208-260)."""

    layer: int
    conv: int
    ssm: int


def recurrent_state_bytes_per_seq(layers: Iterable[RecurrentLayer]) -> int:
    """Recurrent state of one sequence: ``4 x (conv + ssm)`` per recurrent layer. Independent of the
    context length (llama-memory-recurrent.cpp:76-107: one row per sequence, no rollback snapshots)."""
    return sum(F32_BYTES * (L.conv + L.ssm) for L in layers)


def recurrent_state_bytes(layers: Iterable[RecurrentLayer], batch: int) -> int:
    """Recurrent state for ``batch`` sequences (linear in ``batch``, constant in the context)."""
    return recurrent_state_bytes_per_seq(layers) * batch


# ----------------------------------------------------------------------------- activations


def activation_bytes(
    chunk: int, act_per_token: int, logits_per_token: int, logits_all: bool = False, batch: int = 1
) -> int:
    """Prompt-path / activation buffers, geometry model.

    ``rows = max(chunk, batch, 1)`` positions (a prompt chunk of ``chunk`` positions, or one decode
    row per sequence; ``chunk`` 0 = the decode path, one token at a time) times the f32 activations
    one position keeps live in one layer step (``act_per_token``, the manifest's ``[state]
    act_per_token``; buffers are reused layer to layer), plus the f32 logits buffer: one vocabulary
    row per sequence, or one per row when every position emits logits (``logits_all``, e.g. a
    verifier scoring a drafted window). Attention is assumed fused: no chunk x context score matrix.
    """
    rows = max(chunk, batch, 1)
    logit_rows = rows if logits_all else max(batch, 1)
    return F32_BYTES * (rows * act_per_token + logit_rows * logits_per_token)


def cpp_prefill_bytes(chunk: int) -> int:
    """The reference C++ engine's prompt-path reserve (generate.cpp:2941-2960, C integer division):
    ``(160 + chunk * 680 / 1024) MiB`` for ``chunk > 0``, else 0. Measured for the qwen3next reference
    model only; strata uses :func:`activation_bytes` unless ``--prefill-model cpp`` asks for this."""
    if chunk <= 0:
        return 0
    return (CPP_PREFILL_BASE_MIB + chunk * CPP_PREFILL_KIB_PER_TOKEN // 1024) * MIB


# ----------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class EngineForm:
    """One tensor in pack form and in engine form (bytes).

    ``engine`` = ``payload + scales_f32`` for widened types (f32 scale plane + payload plane),
    ``2 x elements`` for a BF16-source tensor (pool F32 re-rounded to 16 bits, exact), else the pool
    bytes. ``widened_extra`` = ``engine - pack`` for widened types (2 B per fp16 field per block,
    registry ``widen_extra_bytes``); ``bf16_saved`` = ``pack - engine`` for BF16 sources.
    """

    pack: int
    engine: int
    payload: int
    scales_f32: int
    widened_extra: int
    bf16_saved: int


def engine_form(pool_type: int, src_type: int, ne: Sequence[int]) -> EngineForm:
    """Pack vs engine form of one dense tensor, both directions (docs/DESIGN.md "Pack form and engine form";
    the byte layout: docs/FORMAT.md "Pack form and engine form").

    Raises like :func:`quants.tensor_nbytes` (unknown type, ne[0] not a multiple of the block).
    """
    t = quants.qtype(pool_type)
    pack = quants.tensor_nbytes(pool_type, ne)
    engine = quants.engine_nbytes(pool_type, src_type, ne)
    if pool_type == quants.F32.id and src_type == quants.BF16.id:
        return EngineForm(pack, engine, engine, 0, 0, pack - engine)
    if t.widened:
        n_blocks = pack // t.block_bytes
        scales = n_blocks * len(t.fp16_scale_offsets) * F32_BYTES
        extra = quants.widened_extra_nbytes(pool_type, ne)
        return EngineForm(pack, engine, engine - scales, scales, extra, 0)
    return EngineForm(pack, engine, engine, 0, 0, 0)


def expert_blob_bytes(
    gate_type: int, up_type: int, down_type: int, n_embd: int, n_ff_exp: int, *, engine: bool = False
) -> int:
    """Bytes of one expert (gate + up + down) in source form, or in engine form (widened types carry f32
    scales: what one cache slot holds). Worked example (docs/DESIGN.md "Expert sizes change per layer"):
    IQ2_XS gate/up + IQ4_NL down at n_embd 2560, n_ff_exp 640: 473,600 + 473,600 + 921,600 = 1,868,800 B
    source; the IQ4_NL down widens 18 -> 20 B per 32: 1,024,000, so 1,971,200 B engine form."""
    total = 0
    for part, t in (("gate", gate_type), ("up", up_type), ("down", down_type)):
        ne = expert_part_ne(part, n_embd, n_ff_exp)
        total += quants.engine_nbytes(t, t, ne) if engine else quants.tensor_nbytes(t, ne)
    return total


def align_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def expert_slot_layout(
    gate_type: int,
    up_type: int,
    down_type: int,
    n_embd: int,
    n_ff_exp: int,
) -> tuple[tuple[tuple[int, int], ...], int]:
    """Where one expert sits inside an expert-cache slot: ``((offset, nbytes) for gate, up, down)``
    in engine form, each part at a multiple of :data:`EXPERT_PART_ALIGN`, and the slot stride (the end
    of ``down`` rounded up to the same alignment). strata's engine lays its slots out with this."""
    off, parts = 0, []
    for part, t in (("gate", gate_type), ("up", up_type), ("down", down_type)):
        nb = quants.engine_nbytes(t, t, expert_part_ne(part, n_embd, n_ff_exp))
        off = align_up(off, EXPERT_PART_ALIGN)
        parts.append((off, nb))
        off += nb
    return tuple(parts), align_up(off, EXPERT_PART_ALIGN)


def expert_slot_bytes(gate_type: int, up_type: int, down_type: int, n_embd: int, n_ff_exp: int) -> int:
    """Bytes one expert-cache slot must hold for an expert of these types: its engine-form blob
    (:func:`expert_blob_bytes` ``engine=True``) with each part aligned to :data:`EXPERT_PART_ALIGN`. Equal
    to the blob whenever every part is a multiple of 256 B (the qwen3next reference model:
    docs/DESIGN.md "Expert sizes change per layer")."""
    return expert_slot_layout(gate_type, up_type, down_type, n_embd, n_ff_exp)[1]


# ----------------------------------------------------------------------------- engine buffers


def matvec_out_bytes(ne: Sequence[int]) -> int:
    """strata's engine keeps one f32 output vector per weight matrix it multiplies (a GEMV writes
    into it; the token path allocates none): 4 x rows (``ne[1] * ne[2] * ne[3]``)."""
    rows = 1
    for d in list(ne)[1:]:
        rows *= int(d)
    return F32_BYTES * rows


def vector_f32_bytes(pool_type: int, src_type: int, ne: Sequence[int]) -> int:
    """A vector (norm weight, bias) the layers read as f32: 0 extra bytes when its engine form is
    already F32 (the engine views that buffer), else an f32 copy of 4 x elements (F16, BF16 sources)."""
    if pool_type == quants.F32.id and src_type == quants.F32.id:
        return 0
    return F32_BYTES * quants.n_elements(ne)


def rope_table_bytes(n_ctx: int, n_rot: int) -> int:
    """One rope table: cos and sin of ``n_rot / 2`` angles for positions ``0..n_ctx-1`` in f32:
    ``2 x n_ctx x n_rot / 2 x 4 = 4 x n_ctx x n_rot`` bytes (one per distinct rope base)."""
    return 2 * n_ctx * (n_rot // 2) * F32_BYTES


def embedding_row_bytes(n_embd: int) -> int:
    """The f32 row an untied token embedding is looked up into (dequantized on the host, copied up)."""
    return F32_BYTES * n_embd


def expert_hit_buffer_bytes(n_embd: int, n_ff_exp: int) -> int:
    """The expert hit path's preallocated f32 vectors: gate, up, and silu(gate) * up (``n_ff_exp``
    each) and the expert's output (``n_embd``)."""
    return F32_BYTES * (3 * n_ff_exp + n_embd)


# ----------------------------------------------------------------------------- expert cache

#: The driver's page for one device allocation above :data:`DRIVER_PACKED_MAX_BYTES` (the rest of its last
#: page is taken too; smaller ones are packed and lose only CuPy's 512 B rounding). Measured on the H200
#: (cards.toml [defaults] ``cuda_alloc_granularity_kib`` / ``cuda_alloc_packed_max_kib``).
DRIVER_PAGE_BYTES = 2048 << 10
DRIVER_PACKED_MAX_BYTES = 1024 << 10


def driver_allocation_bytes(nbytes: int) -> int:
    """Device memory one allocation of ``nbytes`` takes (bytes): whole :data:`DRIVER_PAGE_BYTES` pages above
    :data:`DRIVER_PACKED_MAX_BYTES`, else rounded to 512 B."""
    n = int(nbytes)
    return align_up(n, DRIVER_PAGE_BYTES) if n > DRIVER_PACKED_MAX_BYTES else align_up(n, 512)


def expert_slots(free_bytes: int, reserve_bytes: int, max_blob: int, cap: int | None = None) -> int:
    """Automatic expert-cache slot count, as the reference C++ engine computes it (generate.cpp:2941-2960):
    ``floor((free - reserve) / max_blob)``, never negative, capped at ``cap`` (the number of profiled
    (layer, expert) pairs when a profile is given, else every (layer, expert) pair). ``max_blob`` is the
    largest per-expert blob in engine form: every slot must hold any layer's expert. The cache is ONE
    allocation and, above :data:`DRIVER_PACKED_MAX_BYTES`, the driver takes it in whole
    :data:`DRIVER_PAGE_BYTES` pages: the count is the largest whose pages still leave the reserve free (a
    smaller cache is packed into pages the driver already holds and counted at its size; docs/DESIGN.md
    "The automatic slot count")."""
    if max_blob <= 0:
        return 0
    room = free_bytes - reserve_bytes
    n = max(0, room // max_blob)
    if cap is not None:
        n = min(n, max(cap, 0))
    while n > 0 and n * max_blob > DRIVER_PACKED_MAX_BYTES and align_up(n * max_blob, DRIVER_PAGE_BYTES) > room:
        n -= 1
    return n


@dataclass(frozen=True)
class CacheSize:
    """How many expert-cache slots a start-up takes (:func:`size_expert_cache`)."""

    slots: int  # the slots allocated (0 when refused)
    slots_fit: int  # the most that fit: the automatic value
    cap: int | None  # the (layer, expert) pairs that can fill a slot (None: no cap)
    refused: str | None  # why an asked N is refused (both numbers), else None


def size_expert_cache(
    free_bytes: int,
    reserve_bytes: int,
    slot_bytes: int,
    cap: int | None,
    asked: int | None = None,
    *,
    cap_what: str = "",
) -> CacheSize:
    """The expert cache size, as both the planner and the engine decide it (one definition).

    Automatic (``asked`` None): :func:`expert_slots` of what is free minus the reserve, at most ``cap`` (the
    profile's pairs, else every pair the fill may load). Asked for N: N slots, or a refusal with N and the
    most that fit whenever N is more than the automatic value could ever be (more than fit after the
    reserve, or more than the pairs that can fill them): a silently smaller cache makes every later number
    incomparable (docs/DESIGN.md "A cache that does not fit is refused with both numbers").
    """
    fit = expert_slots(free_bytes, reserve_bytes, slot_bytes, cap)
    if asked is None:
        return CacheSize(fit, fit, cap, None)
    if asked <= fit:
        return CacheSize(int(asked), fit, cap, None)
    room = expert_slots(free_bytes, reserve_bytes, slot_bytes)
    why = []
    if cap is not None and asked > cap:
        why.append(
            f"capped at {cap_what or f'{cap} (layer, expert) pairs'}, as the automatic value is: a slot "
            f"beyond them is never filled"
        )
    if asked > room:
        why.append(
            f"{mib(max(free_bytes - reserve_bytes, 0)):.1f} MiB free after the {mib(reserve_bytes):.0f} MiB "
            f"reserve holds {room}"
        )
    return CacheSize(
        0,
        fit,
        cap,
        f"--expert-cache {asked} refused: {asked} slots x {slot_bytes} B = {asked * slot_bytes} B "
        f"({mib(asked * slot_bytes):.1f} MiB) asked, at most {fit} slots fit ({'; '.join(why)})",
    )


@dataclass
class LayerFill:
    """One layer's part of the profile fill: its slot range, how many pairs it filled, the routing
    counts of the filled pairs and of all its profiled pairs."""

    layer: int
    range: int
    filled: int = 0
    hit_count: int = 0
    total_count: int = 0


@dataclass
class ProfileFill:
    """Result of :func:`fill_profile`: slots used, per-layer fills, and the expected hit rate
    (fraction of the profile's routed (layer, expert) evaluations whose expert sits in VRAM)."""

    slots: int
    used: int
    pairs: int
    total_count: int
    hit_count: int
    layers: list[LayerFill] = field(default_factory=list)
    order: list[tuple[int, int]] = field(default_factory=list)  # (layer, expert) pairs filled, in load order

    @property
    def hit_rate(self) -> float:
        return self.hit_count / self.total_count if self.total_count else 0.0


def layer_ranges(pairs_per_layer: dict[int, int], slots: int) -> dict[int, int]:
    """Per-layer slot ranges: all of a layer's pairs when the slots cover every pair, else each
    layer's share of ``slots`` proportional to its number of profiled pairs (largest remainder,
    ties to the lower layer), so the ranges sum to ``min(slots, pairs)`` and no range exceeds its
    layer's pairs."""
    total = sum(pairs_per_layer.values())
    if slots >= total:
        return dict(pairs_per_layer)
    base = {L: slots * n // total for L, n in pairs_per_layer.items()}
    rem = sorted(pairs_per_layer, key=lambda L: (-(slots * pairs_per_layer[L] % total), L))
    for L in rem[: slots - sum(base.values())]:
        base[L] += 1
    return base


def fill_profile(pairs: Iterable[tuple[int, int, int]], slots: int) -> ProfileFill:
    """The profile fill as the reference C++ engine runs it, once, at start-up (generate.cpp:3165);
    strata's engine loads its slots in ``order``, the planner reports the hit rate - one definition:
    pairs ``(layer, expert, count)`` ranked by routing count (descending; ties by layer, then expert),
    no eviction; a pair whose layer's range is full is skipped and the fill goes on (a full layer
    skips only its own remaining pairs: docs/DESIGN.md "The profile fill").

    Raises:
        ValueError: a duplicate (layer, expert) pair or a negative count (naming it).
    """
    seen: set[tuple[int, int]] = set()
    rows = []
    per_layer: dict[int, int] = {}
    count_per_layer: dict[int, int] = {}
    for layer, expert, count in pairs:
        key = (int(layer), int(expert))
        if key in seen:
            raise ValueError(f"expert profile: pair (layer {key[0]}, expert {key[1]}) appears twice")
        if count < 0:
            raise ValueError(f"expert profile: pair (layer {key[0]}, expert {key[1]}) has negative count {count}")
        seen.add(key)
        rows.append((int(count), key[0], key[1]))
        per_layer[key[0]] = per_layer.get(key[0], 0) + 1
        count_per_layer[key[0]] = count_per_layer.get(key[0], 0) + int(count)
    ranges = layer_ranges(per_layer, slots)
    fills = {L: LayerFill(L, ranges[L], total_count=count_per_layer[L]) for L in sorted(per_layer)}
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    used = hit = 0
    order: list[tuple[int, int]] = []
    for count, layer, expert in rows:
        f = fills[layer]
        if f.filled >= f.range:
            continue
        f.filled += 1
        f.hit_count += count
        used += 1
        hit += count
        order.append((layer, expert))
    total = sum(count_per_layer.values())
    return ProfileFill(slots, used, len(rows), total, hit, list(fills.values()), order)


# ----------------------------------------------------------------------------- strata's engine on a GPU

#: Bytes at the start of the fused step's staging buffer holding its integers (``pos``): the engine's
#: ``strata.engine.gpu.fused.PARAM_BYTES``.
FUSED_PARAM_BYTES = 16

#: The fused step's logit summary (engine/gpu/cuda/logit_top.cu, read by the greedy decode instead of the whole
#: row): the best LOGIT_TOP_K (id, logit) pairs, ranked by LOGIT_TOP_PARTS CTAs then merged, into
#: LOGIT_TOP_WORDS int32 words (the non-finite count, the ids at 1.., the logits' bits at 8..).
LOGIT_TOP_K, LOGIT_TOP_PARTS, LOGIT_TOP_WORDS = 5, 64, 16
#: Device bytes of that summary: per part LOGIT_TOP_K logits, LOGIT_TOP_K ids and a count (4 bytes each), and
#: the LOGIT_TOP_WORDS words of the result.
FUSED_TOP_BYTES = 4 * (LOGIT_TOP_PARTS * (2 * LOGIT_TOP_K + 1) + LOGIT_TOP_WORDS)


def q8_act_bytes(n: int) -> int:
    """Bytes of one quantized activation vector of ``n`` values (``n`` a multiple of 32) as strata's q8 kernels lay
    it out on both devices (engine/q8_layout.h ``act_nbytes_of``): int8 values, f32 block scales (one per 32
    slots), int16 sums per 16 and per 32 values, each plane padded to 64 bytes. The C function and this one are
    compared in tests/test_engine_cpu_q8.py."""

    def pad(b: int) -> int:
        return (b + 63) // 64 * 64

    return pad(n) + pad(n // 32 * 4) + pad(n // 16 * 2) + pad(n // 32 * 2)


def gdn_step_bytes(conv_dim: int, value_dim: int, conv_weight_elements: int) -> int:
    """The fused step's gated-delta-net buffers (bytes; ``strata.engine.gpu.fused_gdn.GdnBuffers``): the
    conv output (``conv_dim``) and the gated-normed output (``value_dim``), shared by the layers, and
    every recurrent layer's ``ssm_conv1d`` weights as f32 (``conv_weight_elements`` = their sum of
    ``d_conv x conv_dim``): f32 each. 0 for a model without delta-net layers."""
    if not conv_weight_elements:
        return 0
    return F32_BYTES * (conv_dim + value_dim + conv_weight_elements)


def fused_step_bytes(
    n_embd: int,
    n_head: int,
    head_dim: int,
    head_dim_v: int,
    n_ff_max: int,
    kv_positions_max: int,
    *,
    n_layer: int = 0,
    n_expert: int = 0,
    n_expert_used: int = 0,
    n_ff_exp: int = 0,
    value_dim: int = 0,
) -> int:
    """Device buffers of strata's fused GPU decode step (bytes; ``strata.engine.gpu.fused.FusedDecoder.nbytes``,
    allocated at the "prompt path" checkpoint, before the expert cache): the residual and normed rows
    (``2 n_embd``), the query and attention outputs (``n_head x head_dim``, ``n_head x head_dim_v``), the
    gated activation of the widest dense FFN or shared expert (``n_ff_max``, 1 without one), the attention
    scores (``n_head x`` the longest KV cache of any layer) - f32 each - the staging row
    (:data:`FUSED_PARAM_BYTES` + ``4 n_embd``), the logit summary (:data:`FUSED_TOP_BYTES`) and the q8 kernels'
    quantized input (:func:`q8_act_bytes` of the longest matvec input: ``n_embd``, ``n_head x head_dim_v``,
    ``n_ff_max`` or a delta-net layer's ``value_dim``, and the normed row's, written by its ``resid_norm``:
    ``n_embd``; allocated whatever the kernel, so the term does not depend on ``--kernel``). With routed
    experts (``n_expert`` > 0) the MoE step's (``strata.engine.gpu.fused_moe.MoeStep.nbytes``): router
    probabilities (``n_expert``), the selected weights (``n_expert_used``), gate, up and activation of the
    selected experts (``3 x n_expert_used x n_ff_exp``), their outputs (``n_expert_used x n_embd``), the
    combined row (``n_embd``), the shared gate (1) and the slot table (``n_layer x n_expert``) in f32 / int32,
    the three part addresses per selected expert (u64), the routing ids and slots (int32), the cache's address
    (u64) and the selected experts' quantized down-projection inputs (``n_expert_used x
    q8_act_bytes(n_ff_exp)``). The one definition of the budget's "prefill/activations" term on the fused
    path; tests check it against the engine's."""
    dense = (
        F32_BYTES
        * (2 * n_embd + n_head * head_dim + n_head * head_dim_v + max(n_ff_max, 1) + n_head * kv_positions_max)
        + FUSED_PARAM_BYTES
        + F32_BYTES * n_embd
        + FUSED_TOP_BYTES
        + q8_act_bytes(max(n_embd, n_head * head_dim_v, max(n_ff_max, 1), value_dim))
        + q8_act_bytes(n_embd)
    )
    if not n_expert:
        return dense
    E, K, n = n_expert, n_expert_used, n_embd
    return (
        dense
        + 4 * (E + K + 3 * K * n_ff_exp + K * n + n + 1 + n_layer * E)
        + 8 * 3 * K
        + 4 * 2 * K
        + 8
        + K * q8_act_bytes(n_ff_exp)
    )
