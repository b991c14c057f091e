"""Card emulation: the GPU engine behaving as on a smaller card (``strata-engine ... --card 24G``).

The engine runs on the GPU it has (an H200) but every figure it decides by is the emulated card's
(docs/DESIGN.md "Start-up order": the automatic cache size is computed from what is free at that
checkpoint, so the card decides the result):

- **free memory** at every checkpoint is the card's total minus what this process holds
  (:func:`strata.budget.formulas_gpu.emulated_free_bytes`): ``cudaMemGetInfo``'s used figure minus what
  other processes used when the emulation started, so this process's CUDA context (as measured), the
  runtime's kernel modules, CUDA graphs and every allocation count against the card;
- **an allocation past the card fails** as it would there: every device allocation of the process
  goes through CuPy's default pool, and a hook (:meth:`CardEmulation.install`) refuses one that makes
  the process hold more than the card (:class:`CardOutOfMemory`, naming the card, the bytes asked and
  held, and the physical figures). Memory the CUDA runtime takes outside any allocator (kernel
  modules) cannot be refused there; it still counts in every later free figure;
- the automatic expert-cache size is then :func:`strata.budget.formulas.size_expert_cache` on that
  emulated free memory, exactly as on the real card.

The baseline: in a process whose CUDA context does not exist yet, NVML's used memory before and
after the context is created gives this process's context; what CUDA reports used beyond it and the
CuPy pool belongs to others. In a process that used CUDA before (a test session), the context is
taken as the card's planned one (``cards.toml``) and everything else held then counts as others'.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from strata.budget import formulas as F
from strata.budget import formulas_gpu as FG
from strata.budget.cards import Card, nvml_memory

from ..errors import GenerateError


class CardOutOfMemory(GenerateError, MemoryError):
    """An allocation the emulated card could not make (a ``cudaMalloc`` that fails on that card)."""


def primary_context_active(device: int = 0) -> bool | None:
    """Whether this process already has the primary CUDA context of ``device`` (driver API
    ``cuDevicePrimaryCtxGetState``; creates no context), None when libcuda is not loadable."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if lib.cuInit(0) != 0:
        return None
    dev = ctypes.c_int()
    flags, active = ctypes.c_uint(), ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), device) != 0:
        return None
    if lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
        return None
    return bool(active.value)


@dataclass
class CardEmulation:
    """An emulated card on a physical GPU (bytes).

    Attributes:
        card: the emulated card (a ``strata.budget.cards`` preset or ``--card-mib`` size).
        physical_total: the physical GPU's total (``cudaMemGetInfo``).
        other_bytes: physical memory others held when the emulation started (not charged to the card).
        context_bytes: this process's CUDA context, as measured (or the card's planned context, ``how``).
        how: how the baseline was measured (one line).
        refused: allocations refused so far.
    """

    card: Card
    physical_total: int
    other_bytes: int
    context_bytes: int
    how: str
    refused: int = 0

    def used(self, physical_free: int) -> int:
        """What this process holds (:func:`strata.budget.formulas_gpu.emulated_used_bytes`)."""
        return FG.emulated_used_bytes(self.physical_total, physical_free, self.other_bytes)

    def free(self, physical_free: int) -> int:
        """What the card would report free (:func:`strata.budget.formulas_gpu.emulated_free_bytes`)."""
        return FG.emulated_free_bytes(self.card.total_bytes, self.physical_total, physical_free, self.other_bytes)

    def check(self, nbytes: int, physical_free: int, what: str = "an allocation") -> None:
        """Refuse holding ``nbytes`` more when the process would then hold more than the card
        (``physical_free``: the physical figure before the allocation; ``nbytes`` 0 checks what is held
        after an allocation already made).

        Raises:
            CardOutOfMemory: naming the card, the bytes asked, held and the card's total.
        """
        used = self.used(physical_free)
        if not FG.emulated_allocation_fits(self.card.total_bytes, used + int(nbytes)):
            self.refused += 1
            raise CardOutOfMemory(
                f"out of memory on the emulated card {self.card.name}: {what}"
                + (f" of {int(nbytes)} B ({F.mib(int(nbytes)):.1f} MiB)" if nbytes else "")
                + f" with {used} B held ({F.mib(used):.1f} MiB, CUDA context included) of the card's"
                f" {self.card.total_bytes} B ({F.mib(self.card.total_bytes):.0f} MiB) - the allocation fails as "
                f"it would on that card (physical: {physical_free} B free of {self.physical_total} B)"
            )

    def describe(self) -> str:
        """One line: the card, this process's context and what others held (not charged), and how measured."""
        return (
            f"emulating {self.card.name}: {self.card.total_bytes} B; this process's CUDA context "
            f"{self.context_bytes} B, others' memory {self.other_bytes} B not charged ({self.how})"
        )

    # ------------------------------------------------------------------ CuPy

    @classmethod
    def start(cls, card: Card, cp: Any, nvml_before: tuple[int, int, str] | None, device: int = 0) -> CardEmulation:
        """Measure the baseline (module docstring) right after CUDA was initialised and install the
        allocation hook. ``nvml_before``: NVML's ``(total, used, name)`` taken before this process
        created its context (None: the context existed already, or NVML is not there)."""
        free, total = (int(x) for x in cp.cuda.runtime.memGetInfo())
        pool = int(cp.get_default_memory_pool().total_bytes())
        used = total - free
        after = nvml_memory(device) if nvml_before is not None else None
        if nvml_before is not None and after is not None:
            ctx = max(0, after[1] - nvml_before[1])
            how = f"context measured: NVML used {nvml_before[1]} -> {after[1]} B when it was created"
        else:
            ctx = card.cuda_context_bytes
            how = "CUDA was in use before the emulation started: context taken as the card's planned one"
        other = max(0, used - pool - ctx)
        emu = cls(card, total, other, ctx, how)
        emu.install(cp)
        return emu

    def install(self, cp: Any) -> None:
        """Route CuPy's device allocations through the default pool with the card's limit: an allocation
        that grows the pool past the card is given back and refused (:class:`CardOutOfMemory`)."""
        pool = cp.get_default_memory_pool()
        runtime = cp.cuda.runtime

        def malloc(size: int):
            before = pool.total_bytes()
            mem = pool.malloc(size)
            grew = pool.total_bytes() - before
            if grew > 0:  # new device memory (not a block the pool had cached): held now, checked now
                free_after = int(runtime.memGetInfo()[0])
                try:
                    self.check(0, free_after, f"an allocation of {size} B (new device memory {grew} B, now held)")
                except CardOutOfMemory:
                    del mem
                    pool.free_all_blocks()
                    raise
            return mem

        cp.cuda.set_allocator(malloc)

    @staticmethod
    def uninstall(cp: Any) -> None:
        """Back to CuPy's default pool without a card limit (a later engine of this process that
        emulates nothing)."""
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)


__all__ = ["CardEmulation", "CardOutOfMemory", "primary_context_active"]
