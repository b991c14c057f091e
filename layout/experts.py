"""One expert in strata's expert cache (bytes): its blob in source and engine form, where its parts sit
inside a cache slot, and the hit path's f32 vectors. How MANY slots a start-up takes, and which
(layer, expert) pairs fill them, are the budget's rules (:func:`strata.budget.formulas.size_expert_cache`,
:func:`strata.budget.formulas.fill_profile`).
"""

from __future__ import annotations

from strata.packer import quants
from strata.packer.conformance import expert_part_ne

from .buffers import F32_BYTES, align_up

#: Alignment of every part (gate, up, down) of an expert inside an expert-cache slot, and of the
#: slot stride: a widened part starts with an f32 scale plane (needs 4), native blocks of 66/98/110 B
#: leave odd offsets behind them; 256 keeps every part's loads aligned.
EXPERT_PART_ALIGN = 256


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


def expert_hit_buffer_bytes(n_embd: int, n_ff_exp: int) -> int:
    """The expert hit path's preallocated f32 vectors: gate, up, and silu(gate) * up (``n_ff_exp``
    each) and the expert's output (``n_embd``)."""
    return F32_BYTES * (3 * n_ff_exp + n_embd)


#: Host memory the engine leaves unpinned when it sizes the host tier (bytes): the host tier is built only where
#: ``MemAvailable`` less this margin holds it (the OS, the page cache of the dense pool, the Python process).
HOST_TIER_MARGIN_BYTES = 4 << 30


def host_tier_bytes(n_pairs: int, slot_bytes: int) -> int:
    """Pinned host memory of strata's host tier (bytes): the ``n_pairs`` (layer, expert) pairs the VRAM cache does not
    hold, one expert-cache slot each (``slot_bytes``, :func:`expert_slot_bytes` of the largest layer), laid out as
    the cache's slots so that the GPU reads a miss with the kernel and bytes of a hit (docs/DESIGN.md "Misses over
    PCIe"). Worked example: Qwen3-30B-A3B's geometry (48 layers x 128 experts, n_embd 2048, n_ff_exp 768) with Q4_K
    gate/up and Q6_K down: 884,736 + 884,736 + 1,290,240 = 3,059,712 B a slot; 4,000 slots leave 2,144 pairs:
    2,144 x 3,059,712 = 6,560,022,528 B (6.11 GiB)."""
    if n_pairs < 0 or slot_bytes < 0:
        raise ValueError(f"host tier of {n_pairs} pairs x {slot_bytes} B: both must be >= 0")
    return n_pairs * slot_bytes


def expert_capacity(pairs: int, slots: int, scratch: bool = False) -> int:
    """Experts a VRAM cache of ``slots`` slots holds, of ``pairs`` (layer, expert) pairs: ``slots``, or with
    ``scratch`` (``--cache-policy class``, which keeps one slot as its swap scratch wherever it has something to
    learn: ``2 <= slots < pairs``) one fewer. One rule for the planner, the cache sizing and the engine
    (:meth:`strata.engine.gpu.slots.SlotCache.reserve_scratch`)."""
    return slots - (1 if scratch and 2 <= slots < pairs else 0)


def host_tier_pairs(pairs: int, slots: int, scratch: bool = False) -> int:
    """(layer, expert) pairs in strata's host tier beside a cache of ``slots`` slots: those it does not hold,
    ``max(pairs - expert_capacity(pairs, slots, scratch), 0)``."""
    return max(pairs - expert_capacity(pairs, slots, scratch), 0)


#: The driver maps pinned host memory into the GPU's address space with one 8-byte page-table entry per 4 KiB
#: page: device memory that grows with the host tier (measured on the H200, 2026-12-01, CUDA 12 driver: a
#: 13,523,927,040 B tier took 25.7-28.6 MiB of device memory, 1/512 of it = 25.2 MiB; bench/results/h200-2026-12-01d-*).
HOST_MAP_PAGE_BYTES = 4096
HOST_MAP_ENTRY_BYTES = 8
#: ... counted in the driver's 2 MiB allocation units.
HOST_MAP_UNIT_BYTES = 2 << 20


def host_tier_map_bytes(tier_bytes: int) -> int:
    """Device memory the driver takes to map a host tier of ``tier_bytes`` into the GPU's address space (bytes):
    :data:`HOST_MAP_ENTRY_BYTES` per :data:`HOST_MAP_PAGE_BYTES` page, rounded up to :data:`HOST_MAP_UNIT_BYTES`
    (0 for no tier). An estimate of a driver-internal cost, measured (:data:`HOST_MAP_PAGE_BYTES` comment):
    ``strata-engine measure`` sets the engine's figure beside it."""
    if tier_bytes <= 0:
        return 0
    entries = -(-tier_bytes // HOST_MAP_PAGE_BYTES)
    return align_up(entries * HOST_MAP_ENTRY_BYTES, HOST_MAP_UNIT_BYTES)
