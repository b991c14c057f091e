"""The GPU half of the budget's rules (:mod:`strata.budget.formulas` holds the model's): card
emulation, what the CUDA runtime and the driver take beyond the engine's buffers, the decode path
strata's engine takes. The engine's own device buffers (arenas, step buffers, the drafter's bind
buffers) are :mod:`strata.layout`. Pure functions, bytes in and out, called by both ``strata-budget``
(``budget/plan.py``, ``budget/engine_terms.py``) and the engine (``engine/gpu``) - one definition each.
"""

from __future__ import annotations

from collections.abc import Iterable

from strata.layout.buffers import align_up

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


# ----------------------------------------------------------------------------- the driver's rounding


def allocation_rounding_bytes(sizes: Iterable[int], granularity: int, packed_max: int) -> int:
    """Device memory the driver takes beyond what ``cudaMalloc`` was asked for: an allocation larger than
    ``packed_max`` bytes gets whole pages of ``granularity`` bytes (the remainder of its last page is
    unusable), smaller ones are packed together and lose only CuPy's rounding to 512 B. The constants are the card's
    (``cards.toml`` ``cuda_alloc_granularity_kib`` / ``cuda_alloc_packed_max_kib``); the model explains why
    the memory outside every allocator grew with the number of large allocations on the H200 (157 MiB at
    Qwen3-30B-A3B scale with one allocation per tensor, 6 MiB on a 270M model) - the reason the engine
    now allocates per stage arenas (:func:`strata.layout.buffers.arena_layout`)."""
    return sum(
        align_up(int(n), granularity) - int(n) if int(n) > packed_max else align_up(int(n), 512) - int(n) for n in sizes
    )


# ----------------------------------------------------------------------------- strata's engine


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


def fused_graph_count(n_moe_layers: int, prefetch: bool = False) -> int:
    """CUDA graphs the fused step captures and uploads: the step with and without the head, and with
    routed experts each of those cut at the host point of every MoE layer (``n + 1`` segments; two points a layer
    until 2026-12-03: ``2 n + 1``), and where the expert prefetch is built (``prefetch``: a MoE layer after the
    first layer, ``strata.engine.gpu.prefetch``) the whole step with its launches, with and without the head (2
    more). ``strata.engine.gpu.fused.FusedDecoder.capture``; tests check the two agree."""
    return 2 + (2 * (n_moe_layers + 1) if n_moe_layers else 0) + (2 if prefetch else 0)


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
