"""The expert cache in device memory, and the hit/miss split of the GPU path.

- :class:`SlotCache`: VRAM slots holding experts in engine form, laid out by
  :func:`strata.layout.experts.expert_slot_layout`, filled once at start-up (from a profile, in
  the order :func:`strata.budget.formulas.fill_profile` gives, or from the ``resident`` policy) and
  optionally by first-come admission of misses (no eviction);
- :class:`GpuExpertPath`: :class:`strata.engine.experts.ExpertPath` whose misses run on the CPU from
  the memory-mapped shard with :func:`strata.engine.gpu.reference.expert_ffn`, which replays the
  GPU's arithmetic bit for bit - so an expert's output, and therefore the tokens, do not depend on
  which experts are resident (the hit path is all or nothing);
- :class:`GpuStepProbe`: ``--stats`` timers of one step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.engine import engine_form as EF
from strata.layout import experts as LX
from strata.packer import quants

from .. import layers
from ..chunk_routing import DeferredCounts
from ..experts import ExpertPath, ShardExperts, mem_available
from . import reference as R
from .backend import Backend


@dataclass(frozen=True)
class PartLayout:
    """One expert matrix inside a slot: ggml type, ``(ne0, rows)``, byte offset and engine bytes."""

    type_id: int
    ne0: int
    rows: int
    offset: int
    nbytes: int


@dataclass
class SlotPlan:
    """How the expert cache was sized (bytes; the numbers the audit compares)."""

    mode: str  # "auto" | "fixed"
    slots: int
    slot_bytes: int  # per-slot stride (largest engine-form blob, parts aligned)
    max_blob_engine: int  # strata.layout.experts.expert_blob_bytes(engine=True), largest layer
    free_bytes: int  # cudaMemGetInfo free when the cache was opened
    reserve_bytes: int
    cap: int | None
    cache_bytes: int
    tier_map_reserved: int = 0  # the host tier's device mapping reserved with the reserve (size_with_host_tier)


class SlotCache:
    """VRAM slots holding experts in engine form, laid out by
    :func:`strata.layout.experts.expert_slot_layout` (gate | up | down, each part 256-aligned).

    One allocation of ``slots * slot_bytes`` bytes, made once. ``fill(pairs)`` loads experts by
    offset from the memory-mapped shards (converted to engine form); ``admit`` takes a free slot at
    decode time (first-come, no eviction); ``ffn`` runs a resident expert on the device into the
    hit path's preallocated vectors (``bufs``: gate, up, act, out).
    """

    def __init__(
        self,
        source: ShardExperts,
        backend: Backend,
        n_embd: int,
        n_ff: int,
        n_slots: int,
        bufs: tuple[Any, Any, Any, Any] | None = None,
    ):
        self.source, self.backend = source, backend
        self.layouts: dict[int, tuple[PartLayout, PartLayout, PartLayout]] = {}
        stride = 0
        for il in source.layers:
            row, shp = source.rows[il], source.shapes[il]
            ((go, gb), (uo, ub), (do, db)), st = LX.expert_slot_layout(
                row.gate_type, row.up_type, row.down_type, n_embd, n_ff
            )
            parts = [
                PartLayout(t, ne0, rows, off, nb)
                for t, (ne0, rows), (off, nb) in (
                    (row.gate_type, shp.gate, (go, gb)),
                    (row.up_type, shp.up, (uo, ub)),
                    (row.down_type, shp.down, (do, db)),
                )
            ]
            for p in parts:  # the loader's shapes are the budget's expert_part_ne
                assert p.nbytes == quants.engine_nbytes(p.type_id, p.type_id, (p.ne0, p.rows)), (il, p)
            self.layouts[il] = (parts[0], parts[1], parts[2])
            stride = max(stride, st)
        self.slot_bytes = stride
        self.n_slots = int(n_slots)
        self.storage = backend.empty_bytes(self.n_slots * self.slot_bytes) if self.n_slots else None
        self.where: dict[tuple[int, int], int] = {}
        #: slots experts may take: all of them, or one less once :meth:`reserve_scratch` kept the last for swaps
        self.capacity = self.n_slots
        #: bumped on every change of :attr:`where` (a load, an admission, a swap): tables built from it are stale
        self.version = 0
        self.n_embd, self.n_ff = n_embd, n_ff
        self.bufs = bufs
        self.admit_enabled = False
        self.admitted = 0
        #: called as ``on_admit(layer, expert, slot)`` after a decode-time admission (the fused step's slot table)
        self.on_admit: Any = None

    def __len__(self) -> int:
        return len(self.where)

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.where)

    def reserve_scratch(self) -> int:
        """Keep the last slot out of the cache as the scratch of decode-time swaps (:meth:`strata.engine.gpu.
        fused_moe.MoeStep.swap`): the budget's expert-cache bytes unchanged, one expert fewer resident. Returns its
        slot index. Call before :meth:`fill`.

        Raises:
            ValueError: no slot, or slots already taken.
        """
        if self.n_slots < 1 or self.where:
            raise ValueError(f"a swap scratch slot needs an empty cache of >= 1 slot ({self.n_slots} slots)")
        self.capacity = self.n_slots - 1
        return self.n_slots - 1

    def replace(self, old: tuple[int, int], new: tuple[int, int]) -> int:
        """Give ``old``'s slot to ``new`` in :attr:`where` (the bytes are the caller's to move); returns the slot.

        Raises:
            KeyError: ``old`` not resident; ValueError: ``new`` already resident.
        """
        if new in self.where:
            raise ValueError(f"blk.{new[0]} expert {new[1]} is already in slot {self.where[new]}")
        s = self.where.pop(old)
        self.where[new] = s
        self.version += 1
        return s

    def engine_parts(self, il: int, e: int) -> Iterable[tuple[PartLayout, np.ndarray]]:
        """Expert ``e`` of layer ``il`` in engine form: ``(part layout, bytes)`` for gate, up, down, converted from
        the memory-mapped shard (:func:`strata.engine.engine_form.to_engine_form`)."""
        for part, raw in zip(self.layouts[il], self.source.raw(il, e)):
            ne = (part.ne0, part.rows)
            yield part, EF.to_engine_form(raw, part.type_id, part.type_id, ne, name=f"blk.{il} expert {e}")

    def _load(self, il: int, e: int) -> None:
        s = len(self.where)
        base = s * self.slot_bytes
        for part, ef in self.engine_parts(il, e):
            dst = self.storage[base + part.offset : base + part.offset + part.nbytes]
            self.backend.copy_into(dst, ef)
        self.where[(il, e)] = s
        self.version += 1

    def fill(self, pairs: Iterable[tuple[int, int]]) -> int:
        """Load ``pairs`` in order while slots are free; returns how many were loaded."""
        n = 0
        for il, e in pairs:
            if self.free_slots <= 0:
                break
            if (il, e) not in self.where:
                self._load(il, e)
                n += 1
        return n

    def admit(self, il: int, e: int) -> bool:
        """First-come admission of a missed expert into a free slot (never evicts)."""
        if not self.admit_enabled or self.free_slots <= 0 or (il, e) in self.where:
            return False
        self._load(il, e)
        self.admitted += 1
        if self.on_admit is not None:
            self.on_admit(il, e, self.where[(il, e)])
        return True

    def resident(self, il: int, e: int) -> bool:
        return (il, e) in self.where

    def _view(self, s: int, p: PartLayout):
        b = s * self.slot_bytes + p.offset
        return self.storage[b : b + p.nbytes]

    def ffn(self, il: int, e: int, x):
        s = self.where[(il, e)]
        g_l, u_l, d_l = self.layouts[il]
        bk = self.backend
        gb, ub, hb, yb = self.bufs if self.bufs is not None else (None, None, None, None)
        g = bk.matvec(g_l.type_id, self._view(s, g_l), g_l.rows, g_l.ne0, x, out=gb)
        u = bk.matvec(u_l.type_id, self._view(s, u_l), u_l.rows, u_l.ne0, x, out=ub)
        h = bk.silu_mul(g, u, out=hb)
        return bk.matvec(d_l.type_id, self._view(s, d_l), d_l.rows, d_l.ne0, h, out=yb)


#: Copies the start-up PCIe probe times (after one untimed) and the most bytes one copies.
PROBE_COPIES, PROBE_MAX_BYTES = 4, 64 * 2**20


def probe_pcie(tier: HostTier, dst: Any, cuda: bool) -> tuple[float | None, int] | None:
    """The host tier's link measured at start-up (issue 19 item 2, the documents' engine probes it the same way):
    :data:`PROBE_COPIES` asynchronous copies of the tier's first ``n`` bytes (pinned host memory) into the device
    buffer ``dst`` (scratch: the chunk path's staging slots; ``n`` = the smaller, at most
    :data:`PROBE_MAX_BYTES`), timed by CUDA events after one untimed copy: ``(GB/s (1e9 B/s), n)``. A DMA copy's
    rate: the decode step's kernels read a miss through the mapping, which may go slower. None on the
    simulated device (it has no link: no figure rather than a made-up one), without ``dst`` (None: no staging
    slots, ``-ub 1``) or with nothing to copy."""
    n = min(int(tier.nbytes), int(dst.nbytes), PROBE_MAX_BYTES) if dst is not None else 0
    if not cuda or n <= 0:
        return None
    import cupy as cp

    rt, st = cp.cuda.runtime, cp.cuda.get_current_stream()
    src, d = int(tier.storage.ctypes.data), int(dst.data.ptr)
    rt.memcpyAsync(d, src, n, rt.memcpyHostToDevice, st.ptr)
    t0, t1 = cp.cuda.Event(), cp.cuda.Event()
    t0.record(st)
    for _ in range(PROBE_COPIES):
        rt.memcpyAsync(d, src, n, rt.memcpyHostToDevice, st.ptr)
    t1.record(st)
    t1.synchronize()
    ms = cp.cuda.get_elapsed_time(t0, t1)
    return (PROBE_COPIES * n / (ms / 1000) / 1e9 if ms > 0 else None), n


#: Experts the CPU probe computes at once, its timed runs a round (after one untimed) and the pause before each
#: (seconds), its rounds and the pause between two rounds (seconds).
CPU_PROBE_EXPERTS, CPU_PROBE_RUNS, CPU_PROBE_PAUSE_S = 4, 5, 0.0005
CPU_PROBE_ROUNDS, CPU_PROBE_ROUND_GAP_S = 3, 0.02


def probe_cpu_experts(
    source: ShardExperts, n_expert: int, kernel: str, threads: int | None
) -> tuple[float, int, int, int]:
    """The CPU miss tier measured at start-up (issue 19 item 2: the CPU's expert throughput with the threads given,
    beside the host tier's link): the call the hybrid step makes for a layer's misses
    (:class:`strata.engine.cpu.miss_calls.LayerMisses`, its ``kernel``, ``threads`` - default all cores - and
    activation) on ``min(CPU_PROBE_EXPERTS, n_expert)`` experts and one f32 input. :data:`CPU_PROBE_ROUNDS` rounds,
    :data:`CPU_PROBE_ROUND_GAP_S` apart, each of one untimed call then :data:`CPU_PROBE_RUNS` timed ones, every call on
    another MoE layer's experts (layers spread over the model: weights not in the CPU's caches, as in decode, where
    each layer's misses come once a token; the first probe's best-of runs on one layer's 24 MB measured the L3
    cache: 32-42 us an expert against 66-90 in decode, H200 host, 2026-12-02) after a pause of
    :data:`CPU_PROBE_PAUSE_S` (the worker threads idle as between two layers). The figure is the least of the
    rounds' medians: one round of ~3 ms can fall in a transient that holds a core (the same start-up said 88 and
    327 us an expert back to back, H200 host, 2026-12-03 call j; 327 chose a share that decoded at 32.5 tok/s against
    39.8), while a round cannot run faster than the memory it reads. Every page is touched first (one byte a 4 KiB
    page: page faults are not timed). A model with fewer MoE layers than calls repeats layers across rounds and has
    fewer calls a round (a layer once a round). Returns ``(microseconds an expert, experts, the first timed call's
    layer in the round kept, timed calls in that round)``."""
    from ..cpu import kernels as CK
    from ..cpu.miss_calls import LayerMisses

    layers = source.layers
    n_calls = CPU_PROBE_ROUNDS * (CPU_PROBE_RUNS + 1)
    spread = [layers[i * len(layers) // n_calls] for i in range(n_calls)]  # round r: calls r, r + ROUNDS, ...
    # round r: calls r, r + ROUNDS, ...; a layer repeated back to back (a model of few MoE layers) once only, so no
    # timed call reads what the call before it just read (a one-layer model: its second call is timed)
    rounds = [list(dict.fromkeys(spread[r::CPU_PROBE_ROUNDS])) for r in range(CPU_PROBE_ROUNDS)]
    rounds = [p if len(p) > 1 else p * 2 for p in rounds]
    experts = np.arange(min(CPU_PROBE_EXPERTS, n_expert), dtype=np.int32)
    x = np.full(source.shapes[layers[0]].gate[0], 0.01, dtype=np.float32)
    out = np.empty(experts.size * source.shapes[layers[0]].down[1], dtype=np.float32)
    threads = threads or CK.default_threads()
    best: tuple[float, int] | None = None
    for r, picks in enumerate(rounds):
        calls = {
            il: LayerMisses(
                source, il, n_expert, x, kernel=kernel, threads=threads, max_ids=int(experts.size), silu_mul=R.silu_mul
            )
            for il in picks
        }
        for il in picks:
            for e in experts.tolist():
                for part in source.raw(il, e):
                    int(part[::4096].sum())  # a byte a page: the page tables filled, ~1.6% of the bytes read
        if r:
            time.sleep(CPU_PROBE_ROUND_GAP_S)
        times = []
        for run, il in enumerate(picks):
            time.sleep(CPU_PROBE_PAUSE_S)
            t0 = time.perf_counter()
            calls[il].run(experts, out)
            if run:
                times.append(time.perf_counter() - t0)
        med = float(np.median(times))
        if best is None or med < best[0]:
            best = (med, picks[1], len(times))
    assert best is not None
    return best[0] * 1e6 / experts.size, int(experts.size), best[1], best[2]


def cpu_experts_note(experts: GpuExpertPath, moe, note: dict) -> float:
    """:func:`probe_cpu_experts` for the fused step's misses (``moe``: its :class:`~strata.engine.gpu.fused_moe.
    MoeStep`, the miss kernel; ``experts``: the threads), said in ``note["cpu experts"]`` and kept as the figure the
    note shows (``moe.cpu_probe_us``, whole microseconds: what ``strata-engine measure`` predicts from); returns us an
    expert."""
    us, k, il, runs = probe_cpu_experts(experts.source, moe.E, moe.miss_kernel(experts.kernel), experts.threads)
    moe.cpu_probe_us = float(round(us))
    note["cpu experts"] = (
        f"{us:.0f} us an expert on the CPU (measured: {k} experts a call, {experts.threads or 'all'} threads; the "
        f"least of {CPU_PROBE_ROUNDS} rounds' medians ({runs} calls, on layers spread over the model, from layer {il}))"
    )
    return us


#: The sim's addresses of the host tier start here (the device slots' are 1 + offset; 0 is a miss).
SIM_HOST_BASE = 1 << 48

#: cudaHostAllocPortable | cudaHostAllocMapped (CUDA runtime API, cudaHostAlloc flags): pinned pages every
#: context may use, mapped into the device's address space (with UVA the device address is the host address).
HOST_ALLOC_FLAGS = 1 | 2


class HostTierError(MemoryError):
    """A host tier that does not fit the host's available memory (both numbers in the message)."""


def host_tier_room() -> tuple[int | None, int | None]:
    """``(MemAvailable, room)`` in bytes: the host's available memory and what a host tier may pin of it (less
    :data:`strata.layout.experts.HOST_TIER_MARGIN_BYTES`, at least 0); ``(None, None)`` without /proc/meminfo."""
    avail = mem_available()
    return avail, None if avail is None else max(avail - LX.HOST_TIER_MARGIN_BYTES, 0)


class HostTier:
    """The experts the VRAM cache does not hold, in engine form, in pinned host memory mapped into the
    device's address space: the fused step's batched matvecs read a miss from here over PCIe with the same
    kernel and the same bytes as a hit (docs/DESIGN.md "Misses over PCIe"), so the step never stops at the host.

    Laid out as the cache's slots (:func:`strata.layout.experts.expert_slot_layout`, stride ``slot_bytes``):
    host slot ``h`` of pair ``pairs[h]`` at byte ``h * slot_bytes``; ``nbytes = len(pairs) * slot_bytes``
    pinned bytes (a host-memory term of the plan, :func:`strata.layout.experts.host_tier_bytes`). One
    allocation, made and filled once at start-up; nothing is evicted from it.

    ``address``: the device address of byte 0 (CUDA) or :data:`SIM_HOST_BASE` (sim); ``storage``: the bytes
    as a host NumPy array (uint8).

    Raises:
        HostTierError: ``nbytes`` above ``avail`` (the host's available memory, bytes), both numbers named.
    """

    def __init__(self, cache: SlotCache, pairs: list[tuple[int, int]], *, cuda: bool, avail: int | None):
        self.slot_bytes = cache.slot_bytes
        self.pairs = list(pairs)
        self.nbytes = len(self.pairs) * self.slot_bytes
        if avail is not None and self.nbytes > avail:
            raise HostTierError(
                f"host tier: {len(self.pairs)} experts x {self.slot_bytes} B = {self.nbytes} B "
                f"({self.nbytes / 2**20:.1f} MiB) of pinned host memory, above the {avail} B "
                f"({avail / 2**20:.1f} MiB) available (MemAvailable less the margin)"
            )
        self._mem = None
        if cuda and self.nbytes:
            import cupy as cp

            self._mem = cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(self.nbytes, HOST_ALLOC_FLAGS), 0)
            self.storage = np.frombuffer(self._mem, np.uint8, self.nbytes)
            # the device's address of the mapped pages (cudaPointerGetAttributes; with UVA it is the host address)
            self.address = int(cp.cuda.runtime.pointerGetAttributes(self._mem.ptr).devicePointer)
        else:
            self.storage = np.zeros(self.nbytes, np.uint8)
            self.address = SIM_HOST_BASE
        self.where: dict[tuple[int, int], int] = {}
        for h, (il, e) in enumerate(self.pairs):
            base = h * self.slot_bytes
            for part, ef in cache.engine_parts(il, e):
                self.storage[base + part.offset : base + part.offset + part.nbytes] = np.frombuffer(ef, np.uint8)
            self.where[(il, e)] = h
        self.version = 0  # bumped on every change of where (a decode-time swap)

    def __len__(self) -> int:
        return len(self.pairs)

    def replace(self, old: tuple[int, int], new: tuple[int, int]) -> int:
        """Give ``old``'s host slot to ``new`` in :attr:`where` (the bytes are the caller's to move); returns the
        host slot.

        Raises:
            KeyError: ``old`` not in the tier; ValueError: ``new`` already in it.
        """
        if new in self.where:
            raise ValueError(f"blk.{new[0]} expert {new[1]} is already in host slot {self.where[new]}")
        h = self.where.pop(old)
        self.where[new] = h
        self.pairs[h] = new
        self.version += 1
        return h


class GpuExpertPath(ExpertPath):
    """:class:`strata.engine.experts.ExpertPath` with the CPU miss path made bit-identical to the
    GPU hit path (:func:`strata.engine.gpu.reference.expert_ffn`) and per-token timers
    (``cpu_expert_ms``: host time computing misses and copying their outputs up; the wait for the
    expert's input to come down counts in :class:`strata.engine.layers.HostWait`).

    ``kernel``: the CPU kernel of the misses on the generic path (:data:`strata.engine.cpu.kernels.KERNELS`):
    ``"exact"`` (the default: the exact GPU kernels' summation order, a miss bit-identical to a hit, so the
    tokens cannot depend on residency) or another kernel asked for; the fused step picks its own from its
    numerics (:meth:`strata.engine.gpu.fused_moe.MoeStep.miss_kernel`; docs/DESIGN.md "Misses equal hits: one
    numerics on both devices").
    ``threads``: the CPU kernels' threads (default all cores)."""

    def __init__(
        self,
        source: ShardExperts,
        cache: SlotCache | None,
        backend: Backend,
        kernel: str | None = None,
        threads: int | None = None,
    ):
        super().__init__(source, cache, xp=backend.xp, kernel=kernel or "exact", threads=threads)
        self.backend = backend
        self.cpu_expert_ms = 0.0
        self._x_host: tuple[int, Any, np.ndarray] | None = None
        self.bufs: tuple[Any, Any, Any, Any] | None = None
        self.buffer_bytes = 0
        self.tier: HostTier | None = None  # the host tier, once the expert cache stage made one
        self.chunk_path: Any = None  # strata.engine.gpu.chunk.ChunkPath: a prompt chunk's experts, grouped by expert

    def alloc_hit_buffers(self, n_embd: int, n_ff: int) -> int:
        """Preallocate the hit path's f32 vectors (gate, up, act: ``n_ff``; out: ``n_embd``)."""
        bk = self.backend
        self.bufs = (bk.empty_f32(n_ff), bk.empty_f32(n_ff), bk.empty_f32(n_ff), bk.empty_f32(n_embd))
        self.buffer_bytes = LX.expert_hit_buffer_bytes(n_embd, n_ff)
        assert self.buffer_bytes == sum(4 * b.size for b in self.bufs)
        return self.buffer_bytes

    def miss_ffn(self, il: int, e: int, x):
        if self._x_host is None or self._x_host[0] != il or self._x_host[1] is not x:
            self._x_host = (il, x, layers.to_host(x).astype(np.float32, copy=False))
        t0 = time.perf_counter()
        # "exact": the CPU kernels in the GPU's summation order and the GPU's silu replica, bit-identical to a hit
        y = self.source.ffn(il, e, self._x_host[2], kernel=self.kernel, threads=self.threads, silu_mul=R.silu_mul)
        out = self.xp.asarray(y)
        self.cpu_expert_ms += (time.perf_counter() - t0) * 1000
        if isinstance(self.cache, SlotCache):
            self.cache.admit(il, e)
        return out

    def tier_bytes_of_layer(self, il: int) -> int:
        """The engine-form bytes of one expert of layer ``il`` (gate + up + down): what a chunk reads over PCIe for
        each of the layer's host-tier experts it uses (0 without a chunk path)."""
        path = self.chunk_path
        return sum(p.nbytes for p in path.layout.layouts[il]) if path is not None and path.layout is not None else 0

    def tier_bytes(self, il: int, e: int) -> int:
        """The engine-form bytes of expert ``e`` of layer ``il`` (gate + up + down) when the host tier holds it and
        the cache does not (a chunk reads it from there once: copied to staging, or in place on the f32-tile path),
        else 0."""
        tier, path = self.tier, self.chunk_path
        if tier is None or path is None or (il, e) not in tier.where:
            return 0
        return self.tier_bytes_of_layer(il)

    def residency(self, il, experts):
        """:meth:`strata.engine.experts.ExpertPath.residency` from the chunk path's slot tables (no lookup per
        expert)."""
        path = self.chunk_path
        if path is None or path.layout is None:
            return super().residency(il, experts)
        slots, tiers = path.tables(self)
        res = slots[il][experts] >= 0
        blob = sum(p.nbytes for p in path.layout.layouts[il])
        return res, np.where(~res & (tiers[il][experts] >= 0), blob, 0).astype(np.int64)

    def combine(self, E, weights):
        """:meth:`strata.engine.experts.ExpertPath.combine` in one CUDA launch (:func:`strata.engine.gpu.rows_ops.
        weighted_rows`, the same order) when the chunk path has device kernels."""
        path = self.chunk_path
        if path is not None and path.device_kernels:
            from .rows_ops import weighted_rows

            return weighted_rows(E, weights)
        return super().combine(E, weights)

    def chunk(self, il: int, X, ids, weights):
        """:meth:`strata.engine.experts.ExpertPath.chunk`; a layer whose experts are all in cache slots
        (:meth:`strata.engine.gpu.chunk.ChunkPath.groups_on_device`) stays on the device: its pairs sorted there
        (``ids`` may be the device's), the grouped product, the weighted sum reading the sorted outputs in place; its
        rows count ``k`` hits each and its ids come to the host with the chunk's others at :meth:`replay`. The same
        bits as the host's grouping (tests/test_gpu_chunk.py)."""
        path = self.chunk_path
        if path is None or not path.groups_on_device(self, il):
            return super().chunk(il, X, ids, weights)
        if isinstance(ids, list):
            ids = np.asarray(ids, dtype=np.int64)
        slots, tiers = path.tables(self)
        resident = slots[il] >= 0
        D, at = path.device_grouped(self, il, X, ids)
        T, k = ids.shape
        if resident.all():
            z = np.zeros(T, dtype=np.int64)
            self._chunk_layers.append((il, ids, np.full(T, k, dtype=np.int64), z, z, z))
        else:  # host-tier experts read over PCIe: the rows' counts once the ids come down (replay)
            tb = np.where(resident, 0, np.where(tiers[il] >= 0, self.tier_bytes_of_layer(il), 0)).astype(np.int64)
            self._chunk_layers.append((il, ids, DeferredCounts(resident, tb), None, None, None))
        self._chunk_stack = None
        if path.device_kernels:
            from .rows_ops import weighted_rows

            return weighted_rows(D, weights, at)
        return super().combine(D[np.asarray(at)].reshape(T, k, -1), weights)

    def chunk_outputs(self, il: int, X, r):
        """A prompt chunk's expert outputs ``[T, k, n_embd]`` on the device, grouped by expert
        (:meth:`strata.engine.gpu.chunk.ChunkPath.expert_outputs`: hits, host-tier and staged misses through the same
        kernels); without a chunk path, one row and expert at a time."""
        if self.chunk_path is not None:
            return self.chunk_path.expert_outputs(self, il, X, r)
        return super().chunk_outputs(il, X, r)

    def take_cpu_ms(self) -> float:
        v, self.cpu_expert_ms = self.cpu_expert_ms, 0.0
        return v


class GpuStepProbe:
    """``--stats`` timers of one step (:class:`strata.engine.generate.StepProbe`): device span
    between CUDA events (``gpu_ms``; None on a simulated device), the device's own work in it (``busy_ms``: the floor
    with no host work, :meth:`strata.engine.gpu.fused.FusedDecoder.busy_ms`; None without a fused step), host time on
    missed experts (``cpu_expert_ms``), host time blocked on device->host copies (``wait_ms``)."""

    def __init__(self, backend: Backend, experts: GpuExpertPath | None, decoder=None):
        self.experts = experts
        self.span = backend.span_timer()
        self.decoder = decoder

    def begin(self) -> None:
        if self.decoder is not None:
            self.decoder.busy_on()  # (once: the hybrid step's segment events, only in runs with --stats)
        layers.HostWait.take()
        if self.experts is not None:
            self.experts.take_cpu_ms()
        if self.span is not None:
            self.span.start()

    def end(self) -> dict[str, float | None]:
        gpu = self.span.stop() if self.span is not None else None
        cpu = self.experts.take_cpu_ms() if self.experts is not None else 0.0
        busy = self.decoder.busy_ms(gpu) if self.decoder is not None else None
        return {"gpu_ms": gpu, "busy_ms": busy, "cpu_expert_ms": cpu, "wait_ms": layers.HostWait.take()}


__all__ = [
    "HOST_ALLOC_FLAGS",
    "SIM_HOST_BASE",
    "GpuExpertPath",
    "GpuStepProbe",
    "HostTier",
    "HostTierError",
    "host_tier_room",
    "probe_cpu_experts",
    "cpu_experts_note",
    "PartLayout",
    "SlotCache",
    "SlotPlan",
]
