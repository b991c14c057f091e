"""A tensor's size in pack form and in engine form (bytes): what strata's engine uploads for a dense
tensor (docs/DESIGN.md "Pack form and engine form"; the byte layout itself: docs/FORMAT.md "Pack form
and engine form" and :mod:`strata.engine.engine_form`). Type facts come from :mod:`strata.packer.quants`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from strata.packer import quants

from .buffers import F32_BYTES


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
