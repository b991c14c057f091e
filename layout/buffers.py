"""The engine's preallocated buffers and device arenas (bytes): f32 GEMV outputs and vector copies,
rope tables, the embedding row, the per-stage arenas their tensors are packed into, the driver's
page that a large allocation is taken in, and the draft head's bind buffers.

Sizes are bytes; "elements" are tensor values; ``ne`` is in ggml order (``ne[0]`` = row length).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from strata.packer import quants

#: Recurrent state, activations and logits are f32 (llama.cpp llama-memory-recurrent.cpp:76-107
#: allocates r_l / s_l as GGML_TYPE_F32; the engine computes in f32).
F32_BYTES = 4

#: Alignment of every tensor inside one of the engine's device arenas (bytes): CuPy's own allocation
#: alignment, so a view behaves as a separate allocation would (f32 planes, u16 BF16 rows, native blocks).
ARENA_ALIGN = 256

#: The driver's page for one device allocation above :data:`DRIVER_PACKED_MAX_BYTES` (the rest of its last
#: page is taken too; smaller ones are packed and lose only CuPy's 512 B rounding). Measured on the H200
#: (cards.toml [defaults] ``cuda_alloc_granularity_kib`` / ``cuda_alloc_packed_max_kib``).
DRIVER_PAGE_BYTES = 2048 << 10
DRIVER_PACKED_MAX_BYTES = 1024 << 10


def align_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


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


def draft_bind_bytes(
    tensors: Iterable[tuple[int, int, Sequence[int]]], kv_per_token: int, n_ctx: int, n_embd: int
) -> int:
    """The draft head's bind buffers (bytes): what strata's engine allocates for a NextN / MTP draft head
    at the ``bind`` stage, after the expert cache, into room the cache sizing reserved for it (the
    C++ engine's ``reserve = (vram_reserve_mib + prefill_mib) MiB + draft_head_bind_bytes``,
    docs/DESIGN.md "The automatic slot count"): one f32 GEMV output per draft matrix
    (:func:`matvec_out_bytes`), an f32 copy of every draft vector whose engine form is not F32
    (:func:`vector_f32_bytes`), the draft blocks' K/V cache for ``n_ctx`` positions
    (``kv_per_token``: :func:`strata.layout.kv.kv_bytes_per_token` summed over the draft blocks) and the f32
    ``[embedding | hidden]`` row its ``eh_proj`` reads (``2 x n_embd``; llama.cpp qwen3next.cpp
    ``graph_mtp``). ``tensors``: ``(pool type, source type, ne)`` of the draft blocks' dense tensors.
    The buffers are one allocation, made in whole driver pages (:data:`DRIVER_PAGE_BYTES`) when larger
    than :data:`DRIVER_PACKED_MAX_BYTES`: what the device takes, so the reserve holds all of it (measured on
    the H200, 2026-11-30: 9,100,224 B asked took 10,485,760 B and left the reserve 1.25 MiB short)."""
    total = 0
    for pool_t, src_t, ne in tensors:
        if quants.n_elements(ne) == int(ne[0]):
            total += vector_f32_bytes(pool_t, src_t, ne)
        else:
            total += matvec_out_bytes(ne)
    total += int(kv_per_token) * int(n_ctx) + F32_BYTES * 2 * int(n_embd)
    return align_up(total, DRIVER_PAGE_BYTES) if total > DRIVER_PACKED_MAX_BYTES else total
