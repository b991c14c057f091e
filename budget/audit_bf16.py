"""The audit's BF16 check (check 6 of :mod:`strata.budget.audit`): a BF16-source tensor is stored as F32 in
the pool (bf16 << 16, :func:`strata.packer.quants.bf16_to_f32_bits`), so every one of its values must have
its low 16 bits zero - re-rounding it to 16 bits in the engine is then exact. The pool is scanned through a
memory map in bounded chunks.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from strata.packer import quants
from strata.packer.packfmt import IndexEntry

#: Values per numpy call: bounded memory on multi-GB tensors.
BF16_SCAN_CHUNK = 1 << 24
#: ``err(tensor, found, required, message)``: how a failure is reported (the auditor's ``err``).
Err = Callable[[str, Any, Any, str], None]


def bf16_values(pool: Path, entries: Iterable[IndexEntry], scan: bool, err: Err) -> tuple[int, int]:
    """Check 6 of the audit (:mod:`strata.budget.audit`) over the dense tensors ``entries`` of the pack whose
    pool is ``pool``: every BF16-source tensor is F32 in the pool and, when ``scan``, every one of its values
    is bf16-exact (low 16 bits zero). Each failure is reported through ``err(tensor, found, required,
    message)``. Returns ``(BF16-source tensors, values scanned)``; 0 values when ``scan`` is False, there
    is none, or ``pool`` is missing (the pool layout check names that)."""
    bf = [e for e in entries if e.src_type == quants.BF16.id]
    scanned = 0
    for e in bf:
        if e.type != quants.F32.id:
            err(
                e.name,
                f"pool type {quants.QTYPES.get(e.type, e.type)}",
                "F32 (BF16 promoted: bf16 << 16)",
                f"tensor {e.name}: a BF16 source must be F32 in the pool",
            )
    if not scan or not bf or not pool.exists():
        return len(bf), 0
    size = pool.stat().st_size
    with open(pool, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        for e in bf:
            if e.type != quants.F32.id or e.offset + e.nbytes > size or e.offset % 4:
                continue  # named above or by the pool layout check
            n = e.nbytes // 4
            bad, first, first_v = _bf16_scan(mm, e.offset, n)
            scanned += n
            if bad:
                err(
                    e.name,
                    f"{bad} of {n} values with nonzero low 16 bits (first: element {first} = 0x{first_v:08x})",
                    "every value bf16-exact (low 16 bits zero: the pool holds bf16 << 16)",
                    f"tensor {e.name}: BF16-source values are not bf16-exact, re-rounding to 16 bits would change them",
                )
    finally:
        mm.close()
    return len(bf), scanned


_LOW16 = np.uint64(0x0000FFFF0000FFFF)


def _bf16_scan(mm: mmap.mmap, offset: int, n: int) -> tuple[int, int | None, int]:
    """Count the f32 values of ``[offset, offset + 4n)`` whose low 16 bits are not zero; returns
    ``(bad, first bad element, its bits)``. Two f32 per u64 masked at once, in bounded chunks (the
    common all-clean case reads each byte once); only a dirty chunk is looked at value by value.
    Every numpy view of ``mm`` dies with this frame, so the caller can close the map."""
    bad, first, first_v = 0, None, 0
    for s in range(0, n, BF16_SCAN_CHUNK):
        k = min(BF16_SCAN_CHUNK, n - s)
        pairs = np.frombuffer(mm, dtype="<u8", count=k // 2, offset=offset + 4 * s)
        dirty = bool(np.bitwise_and(pairs, _LOW16).any())
        if k % 2:
            dirty = dirty or bool(np.frombuffer(mm, dtype="<u4", count=1, offset=offset + 4 * (s + k - 1))[0] & 0xFFFF)
        if dirty:
            u32 = np.frombuffer(mm, dtype="<u4", count=k, offset=offset + 4 * s)
            nz = np.flatnonzero(u32 & 0xFFFF)
            bad += len(nz)
            if first is None:
                first, first_v = s + int(nz[0]), int(u32[nz[0]])
    return bad, first, first_v
