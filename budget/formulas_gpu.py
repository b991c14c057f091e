"""The GPU half of the budget formulas (:mod:`strata.budget.formulas` holds the model's terms): card
emulation, the engine's device allocations and what the CUDA runtime and the driver take beyond them,
the decode path strata's engine takes, the drafter's bind buffers. Pure functions, bytes in and out,
called by both ``strata-budget`` (``budget/plan.py``, ``budget/engine_terms.py``) and the engine
(``engine/gpu``) - one definition each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from strata.packer import quants

from . import formulas as F
from .formulas import F32_BYTES, align_up, kv_bytes_per_token, matvec_out_bytes, vector_f32_bytes  # noqa: F401

# ----------------------------------------------------------------------------- card emulation


def emulated_used_bytes(physical_total: int, physical_free: int, other_bytes: int) -> int:
    """Device memory THIS process holds on the physical GPU: what ``cudaMemGetInfo`` reports used
    (``total - free``) minus what was used by others when the emulation started (``other_bytes``:
    other processes, measured once). It includes this process's CUDA context, the runtime's kernel
    modules and every allocation (bytes; never negative)."""
    return max(0, int(physical_total) - int(physical_free) - int(other_bytes))


def emulated_free_bytes(card_total: int, physical_total: int, physical_free: int, other_bytes: int) -> int:
    """What ``cudaMemGetInfo`` would report free on an emulated card of ``card_total`` bytes
    (``strata-engine --card``): the card's total minus what this process holds
    (:func:`emulated_used_bytes`, CUDA context included), at least 0 - so every start-up checkpoint and
    the automatic expert-cache size (:func:`size_expert_cache`) see the figures of that card, not of
    the larger GPU the process runs on."""
    return max(0, int(card_total) - emulated_used_bytes(physical_total, physical_free, other_bytes))


def emulated_allocation_fits(card_total: int, used_after: int) -> bool:
    """True when holding ``used_after`` bytes (:func:`emulated_used_bytes` after an allocation) stays
    within an emulated card of ``card_total`` bytes; an allocation that does not is refused, as
    ``cudaMalloc`` refuses it on that card."""
    return int(used_after) <= int(card_total)


# ----------------------------------------------------------------------------- device allocations

#: Alignment of every tensor inside one of the engine's device arenas (bytes): CuPy's own allocation
#: alignment, so a view behaves as a separate allocation would (f32 planes, u16 BF16 rows, native blocks).
ARENA_ALIGN = 256


def arena_layout(sizes: Sequence[int], align: int = ARENA_ALIGN) -> tuple[list[int], int]:
    """Offsets of ``sizes`` (bytes) packed into one device allocation, each at a multiple of ``align``,
    and the allocation's size (the end of the last, rounded up to ``align``). strata's engine uploads each
    start-up stage's tensors (and their GEMV outputs and f32 vector copies) into such arenas
    (``strata.engine.gpu.weights.DeviceWeights.upload``); a zero size takes no room."""
    offs, off = [], 0
    for n in sizes:
        off = align_up(off, align)
        offs.append(off)
        off += int(n)
    return offs, align_up(off, align) if off else 0


def allocation_rounding_bytes(sizes: Iterable[int], granularity: int, packed_max: int) -> int:
    """Device memory the driver takes beyond what ``cudaMalloc`` was asked for: an allocation larger than
    ``packed_max`` bytes gets whole pages of ``granularity`` bytes (the remainder of its last page is
    unusable), smaller ones are packed together and lose only CuPy's rounding to 512 B. The constants are the card's
    (``cards.toml`` ``cuda_alloc_granularity_kib`` / ``cuda_alloc_packed_max_kib``); why the engine
    allocates per-stage arenas (:func:`arena_layout`): docs/DESIGN.md "Kernel launch shapes"."""
    return sum(
        align_up(int(n), granularity) - int(n) if int(n) > packed_max else align_up(int(n), 512) - int(n) for n in sizes
    )


# ----------------------------------------------------------------------------- the drafter


def draft_bind_bytes(
    tensors: Iterable[tuple[int, int, Sequence[int]]], kv_per_token: int, n_ctx: int, n_embd: int
) -> int:
    """The draft head's bind buffers (bytes): what strata's engine allocates for a NextN / MTP draft head
    at the ``bind`` stage, after the expert cache, into room the cache sizing reserved for it (the
    C++ engine's ``reserve = (vram_reserve_mib + prefill_mib) MiB + draft_head_bind_bytes``,
    docs/DESIGN.md "The automatic slot count"): one f32 GEMV output per draft matrix
    (:func:`matvec_out_bytes`), an f32 copy of every draft vector whose engine form is not F32
    (:func:`vector_f32_bytes`), the draft blocks' K/V cache for ``n_ctx`` positions
    (``kv_per_token``: :func:`kv_bytes_per_token` summed over the draft blocks) and the f32
    ``[embedding | hidden]`` row its ``eh_proj`` reads (``2 x n_embd``; llama.cpp qwen3next.cpp
    ``graph_mtp``). ``tensors``: ``(pool type, source type, ne)`` of the draft blocks' dense tensors.
    The buffers are one allocation, made in whole driver pages (:data:`BIND_PAGE_BYTES`) when larger
    than :data:`BIND_PACKED_MAX_BYTES`: what the device takes, so the reserve holds all of it
    (docs/DESIGN.md "The drafter")."""
    total = 0
    for pool_t, src_t, ne in tensors:
        if quants.n_elements(ne) == int(ne[0]):
            total += vector_f32_bytes(pool_t, src_t, ne)
        else:
            total += matvec_out_bytes(ne)
    total += int(kv_per_token) * int(n_ctx) + F32_BYTES * 2 * int(n_embd)
    return align_up(total, BIND_PAGE_BYTES) if total > BIND_PACKED_MAX_BYTES else total


#: The driver's page and packing limit (:data:`strata.budget.formulas.DRIVER_PAGE_BYTES`, one definition).
BIND_PAGE_BYTES = F.DRIVER_PAGE_BYTES
BIND_PACKED_MAX_BYTES = F.DRIVER_PACKED_MAX_BYTES


def generic_step_bytes(
    act_per_token: int,
    logits_per_token: int,
    kv_positions_max: int,
    kv_elements_max: int,
    n_head: int,
    ssm_elements_max: int,
) -> int:
    """An estimate (bytes) of what the generic per-layer GPU path's warm-up leaves cached in CuPy's pool:
    the largest temporaries of one step at the last position - f32 copies of one layer's K and V for every
    position it holds (``kv_positions_max x kv_elements_max``, K and V elements per token), the attention
    scores and probabilities (``2 x n_head x kv_positions_max``), three delta-net state-sized temporaries
    (decay, outer product, readout: ``3 x ssm_elements_max``), one position's activations and the
    logits. Not exact: the pool keeps freed blocks by size; ``strata-engine measure`` reports it beside the
    measured growth."""
    return F32_BYTES * (
        act_per_token
        + logits_per_token
        + kv_positions_max * kv_elements_max
        + 2 * n_head * kv_positions_max
        + 3 * ssm_elements_max
    )


def strata_decode_path(
    n_recurrent_layers: int, mlp_biases: bool, n_expert_used: int = 0, recurrent_fusable: bool = True
) -> str:
    """``"fused"`` when strata's GPU engine runs the model with its fused step, else ``"generic"`` (the
    per-layer path): the rule of ``strata.engine.gpu.fused.fused_unsupported`` for the architectures the
    engine runs (delta-net layers the fused step cannot build - the legacy ``ssm_in`` projection, a head
    dim that is not a multiple of 32 in 32..1024: ``recurrent_fusable`` False -, MLP biases, or more than
    64 routed experts per token keep the generic path); tests check the two agree on every preset."""
    if (n_recurrent_layers and not recurrent_fusable) or mlp_biases or n_expert_used > 64:
        return "generic"
    return "fused"


def fused_graph_count(n_moe_layers: int) -> int:
    """CUDA graphs the fused step captures and uploads: the step with and without the head, and with
    routed experts each of those cut at the two host points of every MoE layer (``2 n + 1`` segments)."""
    return 2 + (2 * (2 * n_moe_layers + 1) if n_moe_layers else 0)


def cuda_runtime_bytes(
    n_modules: int,
    n_graphs: int,
    allocations: Iterable[int],
    *,
    module_bytes: int,
    graph_bytes: int,
    generic_path_bytes: int,
    granularity: int,
    packed_max: int,
    generic: bool,
) -> int:
    """Device memory taken outside the engine's buffers (bytes): ``n_modules`` kernel modules (one per
    kernel type the engine loads, the expert activation, the fused step's) at ``module_bytes`` each,
    ``n_graphs`` captured CUDA graphs at ``graph_bytes``, CuPy's own kernels of the generic path
    (``generic_path_bytes`` when ``generic``), and the driver's rounding of the engine's allocations
    (:func:`allocation_rounding_bytes`). Constants: ``cards.toml``; what the engine loads: the budget's
    reading of the pack (``strata.budget.engine_terms``)."""
    return (
        n_modules * module_bytes
        + n_graphs * graph_bytes
        + (generic_path_bytes if generic else 0)
        + allocation_rounding_bytes(allocations, granularity, packed_max)
    )
