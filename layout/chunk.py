"""strata's prompt chunks on the GPU (bytes, f32 elements): the weight tile a chunk's products dequantize into and
the staging slots its missed experts are copied into. The engine allocates with these functions
(:mod:`strata.engine.gpu.chunk`) and the budget's "prompt chunk" term is them (``budget/engine_terms.py``).
docs/DESIGN.md "Prompts in chunks on the GPU".
"""

from __future__ import annotations

from strata.packer import quants

from .buffers import F32_BYTES

#: Prompt positions per chunk by default (llama.cpp's ``n_ubatch`` default, ``-ub 512``): the engine's ``-ub`` and
#: the budget's ``--ubatch-size``.
DEFAULT_UBATCH = 512
#: llama.cpp's logical batch default (``n_batch``, ``-b 2048``): with one sequence a chunk is ``min(-b, -ub)``
#: positions (:func:`chunk_positions`).
DEFAULT_BATCH = 2048


def chunk_positions(ubatch: int, batch: int, n_ctx: int) -> int:
    """Prompt positions one chunk holds at most: ``min(-ub, -b, n_ctx)``, at least 1 (llama.cpp: a ubatch is at most
    the logical batch, which is at most the context). The engine's chunk buffers and the budget's "prompt chunk" term
    are sized by it."""
    return max(1, min(int(ubatch), int(batch), int(n_ctx)))


#: The f32 weight tile's cap (bytes): a dense weight is dequantized this many bytes of rows at a time, and a
#: chunk's routed experts this many experts' parts at a time (one launch and one batched GEMM per group).
CHUNK_TILE_BYTES = 128 << 20


def chunk_tile_elements(ne0_max: int, dense_elements_max: int, expert_part_elements: int, n_expert: int) -> int:
    """f32 elements of the chunk tile: what one group needs - the largest dense weight on the device
    (``dense_elements_max``) or a layer's every routed expert (``n_expert`` x ``expert_part_elements``, ``n_embd x
    n_ff_exp``), whichever is larger - capped at :data:`CHUNK_TILE_BYTES` / 4, and never less than one row of the
    widest dense weight (``ne0_max`` values) or one expert's part."""
    want = max(int(dense_elements_max), int(n_expert) * int(expert_part_elements))
    return max(min(CHUNK_TILE_BYTES // F32_BYTES, want), int(ne0_max), int(expert_part_elements))


def chunk_group_experts(tile_elements: int, expert_part_elements: int) -> int:
    """Routed experts one group takes (their parts dequantized into the tile together): ``tile // part``, 0
    without routed experts."""
    if expert_part_elements <= 0:
        return 0
    return max(1, int(tile_elements) // int(expert_part_elements))


def chunk_staging_bytes(group_experts: int, slot_bytes: int) -> int:
    """Bytes of the staging slots: one expert-cache slot (``slot_bytes``, engine form) per expert of a group - a
    chunk copies the missed experts of each group there (the grouped f16 product copies the host tier's there too; the
    f32-tile path reads them in place)."""
    return int(group_experts) * int(slot_bytes)


def grouped_types(type_ids) -> bool:
    """Whether routed experts of ``type_ids`` (ggml type ids) take the GPU's grouped f16 product
    (:mod:`strata.engine.gpu.moe_mm`): every one a block type (more than one value a block) with device code."""
    ids = [int(t) for t in type_ids]
    return bool(ids) and all(quants.qtype(t).gpu_kernel and quants.qtype(t).block_elems > 1 for t in ids)


def chunk_pair_bytes(ubatch: int, n_expert_used: int, n_embd: int, n_ff_exp: int) -> int:
    """Bytes of the grouped product's f32 outputs for a chunk's (row, expert) pairs, ``ubatch x n_expert_used`` of
    them: gate and up ``[pairs, n_ff_exp]``, down ``[pairs, n_embd]`` (numpy order), kept for the run."""
    return F32_BYTES * int(ubatch) * int(n_expert_used) * (2 * int(n_ff_exp) + int(n_embd))


def chunk_buffer_bytes(
    ne0_max: int,
    dense_elements_max: int,
    expert_part_elements: int,
    n_expert: int,
    slot_bytes: int,
    pair_bytes: int = 0,
) -> int:
    """The prompt chunk's preallocated device buffers (bytes): the f32 tile (:func:`chunk_tile_elements`), the
    staging slots (:func:`chunk_staging_bytes` of :func:`chunk_group_experts`, at most ``n_expert``) and, when the
    experts take the grouped product (:func:`grouped_types`), its outputs (``pair_bytes``: :func:`chunk_pair_bytes`;
    0 otherwise)."""
    tile = chunk_tile_elements(ne0_max, dense_elements_max, expert_part_elements, n_expert)
    group = min(chunk_group_experts(tile, expert_part_elements), int(n_expert))
    return F32_BYTES * tile + chunk_staging_bytes(group, slot_bytes) + int(pair_bytes)


__all__ = [
    "CHUNK_TILE_BYTES",
    "DEFAULT_BATCH",
    "DEFAULT_UBATCH",
    "chunk_buffer_bytes",
    "chunk_pair_bytes",
    "chunk_positions",
    "chunk_group_experts",
    "chunk_staging_bytes",
    "chunk_tile_elements",
    "grouped_types",
]
