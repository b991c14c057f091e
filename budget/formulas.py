"""The budget's rules: the one module that both ``strata-budget`` and the engine's start-up call for
what is not the engine's own buffer layout (that is :mod:`strata.layout`, below both).

A VRAM plan is the layout's terms summed in the engine's start-up order (docs/DESIGN.md "Start-up order"):
CUDA context, dense weights in engine form (output head before the expert cache: docs/DESIGN.md "The head
before the cache"), KV cache, recurrent state, prefill / activation buffers, then the expert cache takes what
is free minus the reserve (docs/DESIGN.md "Slots after the weights and the session"), in slots of the largest
per-expert blob in engine form. Here: the defaults the two tools share, the driver's rounding of one
allocation, the expert cache's size and its profile fill (:func:`size_expert_cache`, :func:`fill_profile`),
and the budget's models of other engines (llama.cpp's KV cells, the reference C++ engine's prompt buffers, the
geometry model of activations).

Every function is pure (typed numbers in, bytes out) and says its unit and its source. Sizes are bytes
unless a name says ``_mib`` (MiB = 2**20 bytes). "Elements" are tensor values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from strata.layout import experts as LX
from strata.layout.buffers import DRIVER_PACKED_MAX_BYTES, DRIVER_PAGE_BYTES, F32_BYTES, align_up
from strata.layout.kv import KVLayer, kv_bytes_per_token

MIB = 1 << 20

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


# ----------------------------------------------------------------------------- llama.cpp's KV cache

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
    engine's sizing, not strata's (strata's is :func:`strata.layout.kv.kv_tokens`):

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
    """The KV cache llama.cpp allocates for ``layers`` (strata's per-token rows,
    :func:`strata.layout.kv.kv_bytes_per_token`) at a context of ``n_ctx``: each layer's row bytes x
    :func:`llamacpp_kv_cells` x its streams
    (llama-kv-cache.cpp, llama_kv_cache ctor: one ``[row, kv_size, n_stream]`` K tensor, and a V tensor
    unless the row is absent, as under MLA). What tests/test_budget_llamacpp.py compares with llama.cpp."""
    streams = 1 if unified else max(n_seq, 1)
    return sum(
        kv_bytes_per_token(L, kv)
        * streams
        * llamacpp_kv_cells(n_ctx, L.window, n_ubatch=n_ubatch, n_seq=n_seq, swa_full=swa_full, unified=unified)
        for L in layers
    )


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


# ----------------------------------------------------------------------------- expert cache


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


def size_with_host_tier(
    free_bytes: int,
    reserve_bytes: int,
    slot_bytes: int,
    cap: int | None,
    asked: int | None,
    pairs: int,
    *,
    cap_what: str = "",
    scratch: bool = False,
) -> tuple[CacheSize | None, int, int]:
    """The expert cache size when the pairs it does not hold go to strata's host tier, whose mapping takes device
    memory (:func:`strata.layout.experts.host_tier_map_bytes` of ``(pairs - slots) x slot_bytes``): the cache is
    sized with that mapping reserved beside the reserve. More slots mean a smaller tier and a smaller mapping, so
    the size is the fixed point of ``slots = size(reserve + map(pairs - slots))`` from the size without a mapping,
    slots falling and the mapping growing until the mapping of the final size fits in what was reserved (a few
    passes; the same in the planner and the engine); with ``asked`` slots the mapping of ``pairs - asked`` is
    reserved. Returns ``(size, reserved, map_bytes)``: the final size, the
    mapping bytes it was sized with (``size`` = :func:`size_expert_cache` with ``reserve_bytes + reserved``) and the
    mapping of its tier (``<= reserved``; bytes) - or ``(None, reserved, map_bytes)`` when the mapping does not fit
    between the free bytes and the reserve even with no slot (no host tier then: its misses go to the CPU). With
    ``scratch`` the tier holds :func:`strata.layout.experts.host_tier_pairs`' pair more (the cache policy's swap
    scratch slot)."""
    if asked is not None:  # N slots asked: the tier, and so its mapping, is known
        need = LX.host_tier_map_bytes(LX.host_tier_bytes(LX.host_tier_pairs(pairs, asked, scratch), slot_bytes))
        if need and free_bytes - reserve_bytes < need:
            return None, need, need
        size = size_expert_cache(free_bytes, reserve_bytes + need, slot_bytes, cap, asked, cap_what=cap_what)
        return size, need, need  # refused or not: the mapping of the cache asked
    size = size_expert_cache(free_bytes, reserve_bytes, slot_bytes, cap, asked, cap_what=cap_what)
    held = 0
    for _ in range(16):
        if size.refused:
            return size, held, 0
        need = LX.host_tier_map_bytes(LX.host_tier_bytes(LX.host_tier_pairs(pairs, size.slots, scratch), slot_bytes))
        if need and free_bytes - reserve_bytes < need:
            return None, need, need
        if need <= held:
            return size, held, need
        held = need
        size = size_expert_cache(free_bytes, reserve_bytes + held, slot_bytes, cap, asked, cap_what=cap_what)
    raise AssertionError(f"host tier sizing did not settle ({free_bytes} B free, {slot_bytes} B slots, {pairs} pairs)")


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
