"""Prompt chunks on the GPU: the chunk's dense products as dequantized tiles times cuBLAS, its routed experts grouped
by expert (docs/DESIGN.md "Prompts in chunks on the GPU").

:class:`ChunkPath` holds the two preallocated buffers (:mod:`strata.layout.chunk`, the budget's "prompt chunk"
term): the f32 weight tile and the staging slots. The shared forward pass (:meth:`strata.engine.decoder.Decoder.
forward`) runs a chunk on the device through it:

- a dense weight meets the chunk's rows ``X [T, ne0]`` (numpy order) through
  :meth:`strata.engine.gpu.backend.Backend.rows_product` (:class:`strata.engine.gpu.weights.DeviceWeights`
  ``matmul`` of a 2-D input);
- layer ``il``'s routed experts (:meth:`ChunkPath.expert_outputs`), block types with the default kernels: the
  grouped f16 tensor-core product (:mod:`strata.engine.gpu.moe_mm`), one launch per part for the experts in cache
  slots, the others in rounds through the staging slots (a host-tier expert copied there whole from pinned memory,
  a miss converted from the memory-mapped shard); ``--kernel exact`` or plain types: groups of at most
  :func:`strata.layout.chunk.chunk_group_experts` through the f32 tile, each group one dequantization launch and
  one batched GEMM per part (gate, up, down) over its rows padded to its largest row count (never past the chunk's
  pairs), a host-tier expert read in place over PCIe. The same bytes go through the same kernels wherever they
  come from, and the grouping depends on the routing only, so **a chunk's output does not depend on which experts
  are resident** (tests/test_gpu_chunk.py, bit for bit);
- attention, RMS norms, rope, routing and the experts' weighted sum in one launch each on CUDA
  (:mod:`strata.engine.gpu.attn_rows`, :mod:`strata.engine.gpu.rows_ops`), offered to the shared layer code
  through this object (:func:`strata.engine.layers.chunk_op`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.layout import chunk as LC

from ..errors import ExpertCacheError
from . import attn_rows as AR
from . import moe_mm as MM
from . import rows_ops as RO
from .backend import Backend
from .slots import SlotCache


def tier_on_device() -> bool:
    """``STRATA_CHUNK_TIER_ON_DEVICE`` (a benchmark knob: ``1`` sorts a partly resident layer's pairs on the device,
    reading its host-tier experts in place; ``0``, the default, on the host with staging rounds).

    Raises:
        ExpertCacheError: any other value, naming it (a typo must not measure the default silently).
    """
    raw = os.environ.get("STRATA_CHUNK_TIER_ON_DEVICE", "0")
    if raw not in ("0", "1"):
        raise ExpertCacheError(f"STRATA_CHUNK_TIER_ON_DEVICE={raw!r}: 0 (the default) or 1")
    return raw == "1"


@dataclass
class StagingRound:
    """One round of a chunk layer's experts through the staging slots (:meth:`ChunkPath._rounds`): ``members``
    (indices into the layer's used experts), each one's byte ``offsets`` in the staging buffer, the ``half`` of the
    buffer they fill, whether :meth:`ChunkPath.prefetch_next` already copied them (``prefetched``), and the token
    of their copies (:meth:`strata.engine.gpu.backend.Backend.side_copies`; None: none, or not issued yet)."""

    members: np.ndarray
    offsets: np.ndarray
    half: int
    token: Any = None
    prefetched: bool = False


#: A chunk of at least this many (row, expert) pairs per expert copies the next layer's host-tier experts ahead
#: (:meth:`ChunkPath.prefetch_next`): its layers then use nearly every expert (``1 - (1 - k / E)^T`` of them: 86% at
#: two pairs an expert), so the copies are rarely wasted.
PREFETCH_PAIRS_PER_EXPERT = 2


class ChunkPath:
    """The device's prompt-chunk buffers and the chunk's routed experts (see the module docstring).

    ``ne0_max``: the widest dense weight's row (values), ``dense_max``: the largest one's elements; ``layout``: a
    :class:`SlotCache` whose slot layout the staging slots take (one of no slots, made at the prompt-path stage);
    ``n_expert``: experts per layer; ``tf32``: cuBLAS's TF32 tensor-core mode and the grouped f16 expert product
    (False: plain f32 tiles, ``--kernel exact``); ``ubatch`` / ``n_expert_used``: a chunk's most positions and the
    experts a row selects (the grouped product's outputs hold their product of pairs). ``nbytes``: the tile, the
    staging slots and those outputs, :func:`strata.layout.chunk.chunk_buffer_bytes`.
    """

    def __init__(
        self,
        backend: Backend,
        ne0_max: int,
        dense_max: int,
        layout: SlotCache | None,
        n_expert: int,
        *,
        tf32=True,
        ubatch: int = LC.DEFAULT_UBATCH,
        n_expert_used: int = 0,
    ):
        self.bk, self.xp, self.tf32 = backend, backend.xp, bool(tf32)
        self.layout = layout
        part = layout.n_embd * layout.n_ff if layout is not None else 0
        n_expert = n_expert if layout is not None else 0
        self.tile_elements = LC.chunk_tile_elements(ne0_max, dense_max, part, n_expert)
        self.group = min(LC.chunk_group_experts(self.tile_elements, part), n_expert)
        self.tile = backend.empty_f32(self.tile_elements)
        slot = layout.slot_bytes if layout is not None else 0
        self.staging_bytes = LC.chunk_staging_bytes(self.group, slot)
        self.staging = backend.empty_bytes(self.staging_bytes) if self.staging_bytes else None
        types = {p.type_id for lays in layout.layouts.values() for p in lays} if layout is not None else set()
        #: the experts' types take the grouped product: its outputs are allocated here, for ubatch x n_expert_used
        #: pairs (the budget plans them from the types alone; --kernel exact leaves them unused)
        self.grouped = layout is not None and n_expert > 0 and n_expert_used > 0 and LC.grouped_types(types)
        self.pair_capacity = int(ubatch) * int(n_expert_used) if self.grouped else 0
        pair_bytes = 0
        self._mm_bufs: tuple = ()
        if self.grouped:
            assert layout is not None
            pair_bytes = LC.chunk_pair_bytes(ubatch, n_expert_used, layout.n_embd, layout.n_ff)
            P = self.pair_capacity
            self._mm_bufs = tuple(
                backend.empty_f32(P * r).reshape(P, r) for r in (layout.n_ff, layout.n_ff, layout.n_embd)
            )
        self.nbytes = 4 * self.tile_elements + self.staging_bytes + pair_bytes
        assert self.nbytes == LC.chunk_buffer_bytes(ne0_max, dense_max, part, n_expert, slot, pair_bytes)
        #: staging in two halves taking turns (a round's copies cross PCIe while the other half's round computes), each
        #: of stage_cap experts; one half of all the slots when a group is one expert
        self.halves = 2 if self.group >= 2 else 1
        self.stage_cap = self.group // self.halves
        self._half_read: list[Any] = [None, None]  # per half: the token of the last round that read it
        self._last_half = 0
        self._read_half: int | None = None  # the prefetched half device_grouped's table points at (see _all_bases)
        self._prefetched: dict[int, tuple] = {}  # next layer -> (tables key, half, expert ids, token)
        self.prefetched = 0  # host-tier experts copied ahead of their layer (prefetch_next), over the run
        self.prefetch_used = 0  # of them, those their layer's chunk used
        self.staged = 0  # experts copied into staging (misses outside the host tier), over the run
        self.tier_copied = 0  # host-tier experts copied into staging by the grouped product, over the run
        self.n_expert = n_expert
        #: the chunk kernels of this module's attend_rows / rms_norm_rows / rope_rows run (CUDA; not the sim)
        self.device_kernels = self.xp is not np
        self._tab_key: tuple | None = None
        self._tab: tuple = ({}, {})
        self._bases: dict = {}
        #: a layer whose experts are all in slots sorts its pairs on the device (:meth:`device_grouped`); False: on the
        #: host, as a partly resident layer (the tests compare the two)
        self.device_grouping = True
        #: True: so does a layer whose experts are each in a slot or the host tier (its tier experts read in place by
        #: the grouped kernel, or from a prefetch). Off by default (STRATA_CHUNK_TIER_ON_DEVICE=1 turns it on): such a
        #: layer sorts its pairs on the host and copies its tier experts to staging on the side stream, under the
        #: compute - 2,211 tok/s on the 80B-A3B at 24G (pp512, H200, bench/results/h200-2026-12-02y-*) against
        #: 1,526 with the in-place reads (the same call, but that run came first, while the GGUF just written was still
        #: being flushed); the grouped kernel's reads over PCIe are scattered 32-byte pieces (every expert so read took
        #: 5.5 s a chunk on the 30B-A3B: docs/DESIGN.md). The tests compare the two.
        self.device_grouping_tier = tier_on_device()
        #: the grouped f16 product (moe_mm) for the routed experts: block types, not --kernel exact
        self.mm = bool(tf32) and self.grouped and backend.mm_types(types)

    def attend_rows(self, q, K, V, scale: float, pos0: int, lo: int, window: int | None, f16_operands: bool):
        """The chunk's causal attention in one CUDA launch (:func:`strata.engine.gpu.attn_rows.attend_rows`, the
        arguments of :func:`strata.engine.layers.attend_rows`); None for shapes the kernel
        does not take (the caller then takes the array form)."""
        return AR.attend_rows(q, K, V, scale, pos0, lo, window, f16_operands)

    def rms_norm_rows(self, x, w, eps: float):
        """:func:`strata.engine.layers.rms_norm` of a chunk's rows in one CUDA launch
        (:func:`strata.engine.gpu.rows_ops.rms_norm_rows`)."""
        return RO.rms_norm_rows(x, w, eps)

    def route_rows(self, logits, k: int, norm: bool):
        """:func:`strata.engine.layers.route_topk_rows` in one CUDA launch (:func:`strata.engine.gpu.rows_ops.
        route_rows`): the ids ``cupy.int32 [T, k]`` stay on the device (:meth:`device_grouped` sorts them there; the
        expert path copies them to the host for a layer that needs the host); None for more experts than it takes."""
        return RO.route_rows(logits, k, norm, host=False)

    def unit_lower_inverse(self, A):
        """:func:`strata.engine.deltanet.unit_lower_inverse` in one CUDA launch (:func:`strata.engine.gpu.rows_ops.
        unit_lower_inverse`); None for matrices larger than it takes."""
        return RO.unit_lower_inverse(A)

    def rope_rows(self, rope, x, pos0: int):
        """:meth:`strata.engine.layers.Rope.rows` in one CUDA launch (:func:`strata.engine.gpu.rows_ops.rope_rows`)."""
        return RO.rope_rows(x, rope.cos, rope.sin, rope.n_rot, pos0, rope.mode == "neox")

    def matmul(self, type_id: int, buf, rows: int, ne0: int, X):
        """``X @ W.T`` (``X [T, ne0]`` f32 on the device): f32 ``[T, rows]``."""
        return self.bk.rows_product(type_id, buf, rows, ne0, X, self.tile, self.tf32)

    def _parts(self, path, il: int, e: int, stage: int) -> tuple[list[Any], bool]:
        """Expert ``e`` of layer ``il``'s (gate, up, down) engine-form buffers (:meth:`Backend.ref`: addresses on
        CUDA) and whether they are staging: its slot, its host-tier bytes, or (a miss) staging slot ``stage`` (views,
        filled by :meth:`_stage` when its group runs)."""
        cache, tier = path.cache, getattr(path, "tier", None)
        lay = self.layout
        assert lay is not None
        bk = self.bk
        if isinstance(cache, SlotCache) and cache.resident(il, e):
            base = cache.where[(il, e)] * cache.slot_bytes
            return [bk.ref(cache.storage, base + p.offset, p.nbytes) for p in cache.layouts[il]], False
        if tier is not None and (il, e) in tier.where:
            base, tb = tier.where[(il, e)] * tier.slot_bytes, bk.tier_base(tier)
            return [bk.ref(tb, base + p.offset, p.nbytes) for p in lay.layouts[il]], False
        base = stage * lay.slot_bytes
        return [self.staging[base + p.offset : base + p.offset + p.nbytes] for p in lay.layouts[il]], True

    def _stage(self, il: int, e: int, parts: list[Any]) -> None:
        """Copy a missed expert's engine form from the memory-mapped shard into its staging slot ``parts``
        (stream-ordered after the previous group's kernels, which read the same slots)."""
        lay = self.layout
        assert lay is not None
        for dst, (_p, ef) in zip(parts, lay.engine_parts(il, e)):
            self.bk.copy_into(dst, ef)
        self.staged += 1

    def groups(self, counts: dict[int, int], pairs: int) -> list[list[int]]:
        """The chunk's experts in groups: by row count, descending (ties by id), a group closed when it has
        :attr:`group` experts or its padded rows (experts x its first, largest count) would pass ``pairs``."""
        order = sorted(counts, key=lambda e: (-counts[e], e))
        out: list[list[int]] = []
        for e in order:
            g = out[-1] if out else None
            if g is None or len(g) >= self.group or (len(g) + 1) * counts[g[0]] > pairs:
                out.append([e])
            else:
                g.append(e)
        return out

    def expert_outputs(self, path, il: int, X, r):
        """Every selected expert's output on its row, ``[T, k, n_embd]`` f32 (``X [T, n_embd]``; ``r`` the layer's
        :class:`strata.engine.experts.ChunkRouting`: ``r.ids[t]`` row ``t``'s experts in selection order). Not counted
        here (:meth:`strata.engine.experts.ExpertPath.chunk`).
        Block-type experts outside ``--kernel exact``: :meth:`_grouped_mm` (one launch a part); otherwise
        :meth:`_tiled_gemm` (f32 tiles and cuBLAS)."""
        if self.mm:
            out = self._grouped_mm(path, il, X, r)
            self.prefetch_next(path, il, int(r.perm.size))
            return out
        return self._tiled_gemm(path, il, X, r)

    def tables(self, path) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Per MoE layer, ``int64 [n_expert]``: each expert's cache slot and its host-tier slot (-1: none), rebuilt
        when the cache or the tier changed since (an admission, a decode-time swap: their ``version``)."""
        cache, tier = path.cache, getattr(path, "tier", None)
        n_res = len(cache.where) if isinstance(cache, SlotCache) else 0
        key = (id(cache), cache.version if n_res else 0, id(tier), getattr(tier, "version", 0))
        if self._tab_key != key:
            assert self.layout is not None
            slots = {il: np.full(self.n_expert, -1, np.int64) for il in self.layout.layouts}
            tiers = {il: np.full(self.n_expert, -1, np.int64) for il in self.layout.layouts}
            if n_res:
                for (il, e), sl in cache.where.items():
                    slots[il][e] = sl
            if tier is not None:
                for (il, e), h in tier.where.items():
                    tiers[il][e] = h
            self._tab, self._tab_key = (slots, tiers), key
        return self._tab

    def _buffers(self, P: int):
        """The grouped product's f32 outputs for ``P`` pairs (gate, up, down: ``[P, rows_i]``): the first ``P`` rows of
        the buffers made at start-up for ``-ub x n_expert_used`` pairs. A round reads only its own rows; the others
        hold finite values of an earlier layer (or the start's zeros). A chunk longer than the engine's ``-ub`` (a
        caller of :func:`strata.engine.generate.generate` asking for more) gets buffers of its own, outside the plan."""
        if P > self.pair_capacity:
            lay = self.layout
            assert lay is not None
            return tuple(self.xp.zeros((P, r), dtype=self.xp.float32) for r in (lay.n_ff, lay.n_ff, lay.n_embd))
        return tuple(b[:P] for b in self._mm_bufs)

    def groups_on_device(self, path, il: int) -> bool:
        """Whether layer ``il``'s chunk experts go through :meth:`device_grouped`: the grouped product (block types,
        not ``--kernel exact``), :attr:`device_grouping` on, at most :data:`strata.engine.gpu.rows_ops.ROUTE_MAX_E`
        experts on CUDA (the sort's shared table), and every expert of the layer in a cache slot or (with
        :attr:`device_grouping_tier`) in the host tier - then nothing of the layer needs the host: no host sort, no
        round trip, no staging round (a shard miss does: that layer takes :meth:`_grouped_mm`)."""
        if not (self.mm and self.device_grouping and self.n_expert):
            return False
        if self.device_kernels and self.n_expert > RO.ROUTE_MAX_E:  # (the routing then came to the host anyway)
            return False
        slots, tiers = self.tables(path)
        if (slots[il] >= 0).all():
            return True
        return self.device_grouping_tier and bool(((slots[il] >= 0) | (tiers[il] >= 0)).all())

    def _take_prefetch(self, il: int) -> tuple[list[int], np.ndarray] | None:
        """Layer ``il``'s prefetch (:meth:`prefetch_next`), waited for on the compute stream: ``(expert ids, their
        byte offsets in staging)``, or None (none, or made under other slot tables); any other prefetch is stale and
        waited for too (its half is written next)."""
        pre = self._prefetched.pop(il, None)
        for _k, _h, _i, t in self._prefetched.values():
            self.bk.wait(t)
        self._prefetched.clear()
        if pre is None:
            return None
        key, half, ids, token = pre
        self.bk.wait(token)
        if key != self._tab_key:
            return None
        assert self.layout is not None
        return ids, (half * self.stage_cap + np.arange(len(ids), dtype=np.int64)) * self.layout.slot_bytes

    def _all_bases(self, path, il: int) -> list[Any]:
        """Layer ``il``'s (gate, up, down) weight references of every expert id (:meth:`Backend.refs`): its cache slot,
        else its place in staging where :meth:`prefetch_next` copied it, else its host-tier bytes (the kernels read
        them over PCIe, in place). Kept while the slot tables stand when the layer is wholly in slots."""
        slots, tiers = self.tables(path)  # first: it renews the key when the cache changed (an admission, a swap)
        lay, bk = self.layout, self.bk
        assert lay is not None
        pre = self._take_prefetch(il)
        sl = slots[il]
        if (sl >= 0).all():
            key = (self._tab_key, il)
            got = self._bases.get(key)
            if got is None:
                sb = path.cache.slot_bytes
                got = [bk.refs(path.cache.storage, sl * sb + p.offset, p.nbytes) for p in lay.layouts[il]]
                if len(self._bases) > 4 * len(lay.layouts):
                    self._bases.clear()
                self._bases[key] = got
            return got
        tier = path.tier
        tl = tiers[il]
        res = np.flatnonzero(sl >= 0)
        staged = np.asarray(pre[0] if pre is not None else [], dtype=np.int64)
        in_tier = np.setdiff1d(np.flatnonzero(sl < 0), staged)
        if pre is not None:
            self.prefetch_used += int(staged.size)  # (in its table: the chunk may not route to all of them)
            self._read_half = int(pre[1][0] // (self.stage_cap * lay.slot_bytes)) if staged.size else None
        out = []
        for p in lay.layouts[il]:
            row: list[Any] = [None] * self.n_expert
            for ids_, base, offs in (
                (res, path.cache.storage if res.size else None, sl[res] * (path.cache.slot_bytes if res.size else 0)),
                (staged, self.staging, pre[1] if pre is not None else staged),
                (in_tier, bk.tier_base(tier) if in_tier.size else None, tl[in_tier] * tier.slot_bytes),
            ):
                if ids_.size:
                    for e, r in zip(ids_.tolist(), bk.refs(base, offs + p.offset, p.nbytes)):
                        row[e] = r
            out.append(row)
        return out

    def device_grouped(self, path, il: int, X, ids):
        """Layer ``il``'s routed experts when :meth:`groups_on_device`: the pairs sorted by expert where the routing
        is (the device: ``rows_ops.group_pairs``, one launch; the simulated device: :func:`strata.engine.gpu.moe_mm.
        group_pairs_reference`), one round of every expert id (tiles past the last return at once), three launches
        and ``silu_mul`` - no copy to the host, no host sort. ``X [T, n_embd]`` f32, ``ids`` ``[T, k]`` (device int32
        or host ints). Returns ``(D, at)``: ``D [P, n_embd]`` the pairs' outputs sorted by expert and ``at`` int32
        ``[T * k]`` pair ``t k + kk``'s row of ``D``. The same tiles, rows and kernels as :meth:`_grouped_mm`'s one
        round of slot experts: the same bits (tests/test_gpu_chunk.py)."""
        xp, bk, lay = self.xp, self.bk, self.layout
        assert lay is not None
        T, k = ids.shape
        P, E = T * k, self.n_expert
        rnd, inv0 = MM.group_layout(P, E)
        if self.device_kernels:
            index = RO.group_pairs(xp.asarray(ids, dtype=xp.int32), E, MM.TILE_PAIRS, rnd[1])
        else:
            index = bk.index_array(MM.group_pairs_reference(ids, E))
        gl, ul, dl = lay.layouts[il]
        bases = bk.address_table(self._all_bases(path, il))  # [3][n_expert]: gate, up, down of every expert id
        Xc = xp.ascontiguousarray(X, dtype=xp.float32)
        Gm, Um, D = self._buffers(P)
        xs = bk.row_scales(gl.type_id, Xc)
        bk.expert_mm(gl.type_id, bases[0][0:E], gl.rows, gl.ne0, Xc, index, rnd, Gm, True, xs)
        bk.expert_mm(ul.type_id, bases[1][0:E], ul.rows, ul.ne0, Xc, index, rnd, Um, True, xs)
        H = bk.silu_mul(Gm.reshape(-1), Um.reshape(-1)).reshape(Gm.shape)
        bk.expert_mm(dl.type_id, bases[2][0:E], dl.rows, dl.ne0, H, index, rnd, D, False)
        if self._read_half is not None:  # its table read a prefetched half: the next copy there waits for these
            self._half_read[self._read_half] = bk.mark()
            self._last_half, self._read_half = self._read_half, None
        self.prefetch_next(path, il, P)
        return D, index[inv0:]

    def _rounds(self, il: int, used, other, tl) -> list[StagingRound]:
        """Layer ``il``'s staging rounds for the experts ``used[other]`` (not in slots): first the experts
        :meth:`prefetch_next` already copied (those this chunk uses, where they are), then the rest in rounds of
        :attr:`stage_cap`, the halves alternating from the one the prefetch did not take."""
        lay = self.layout
        assert lay is not None
        sb, cap = lay.slot_bytes, self.stage_cap
        pre = self._take_prefetch(il)
        out: list[StagingRound] = []
        half = 1 - self._last_half if self.halves == 2 else 0  # the half not read last: its copies need not wait
        if pre is not None:
            ids, offs_all = pre
            pos = {e: j for j, e in enumerate(ids)}
            half = int(offs_all[0] // (cap * sb)) if len(ids) else 0
            got = np.array([int(e) in pos for e in used[other].tolist()], dtype=bool)
            if got.any():
                m = other[got]
                self.prefetch_used += int(m.size)
                offs = np.array([offs_all[pos[int(e)]] for e in used[m].tolist()], dtype=np.int64)
                out.append(StagingRound(m, offs, half, None, True))
                other = other[~got]
            half = 1 - half if self.halves == 2 else 0
        for a in range(0, other.size, cap):
            m = other[a : a + cap]
            out.append(StagingRound(m, (half * cap + np.arange(m.size, dtype=np.int64)) * sb, half))
            half = 1 - half if self.halves == 2 else 0
        return out

    def _issue(self, used, tl, tier, rd: StagingRound) -> Any:
        """Copy a staging round's host-tier experts (``tl``: the host-tier slots of ``used``) into their places on the
        side stream, after the last round that read that half (:meth:`Backend.side_copies`); returns the copies'
        token (None: nothing copied)."""
        pairs = zip(rd.members.tolist(), rd.offsets.tolist())
        copies = [(int(o), int(tl[i]) * tier.slot_bytes) for i, o in pairs if tl[i] >= 0]
        if not copies:
            return None
        self.tier_copied += len(copies)
        assert self.layout is not None
        return self.bk.side_copies(self.staging, self.bk.tier_base(tier), copies, self.layout.slot_bytes,
                                   after=self._half_read[rd.half])  # fmt: skip

    def prefetch_next(self, path, il: int, pairs: int) -> None:
        """After layer ``il``'s experts are queued: copy the next MoE layer's first :attr:`stage_cap` host-tier experts
        not in slots (by id) into the staging half layer ``il`` did not read last, on the side stream - they cross
        PCIe while that layer's attention runs. Only for chunks of at least :data:`PREFETCH_PAIRS_PER_EXPERT` pairs
        per expert (then a layer uses nearly every expert: ``1 - (1 - k / E)^T``), the grouped product and two
        halves; the next layer's :meth:`_rounds` takes what it uses (the rest was a wasted copy)."""
        lay, tier = self.layout, getattr(path, "tier", None)
        if not (self.mm and self.halves == 2 and tier is not None and lay is not None):
            return
        if pairs < PREFETCH_PAIRS_PER_EXPERT * self.n_expert:
            return
        nxt = [j for j in lay.layouts if j > il]
        if not nxt:
            return
        il2 = min(nxt)
        slots, tiers = self.tables(path)
        ids = np.flatnonzero((slots[il2] < 0) & (tiers[il2] >= 0))[: self.stage_cap]
        if not ids.size:
            return
        half = 1 - self._last_half
        sb = lay.slot_bytes
        offs = (half * self.stage_cap + np.arange(ids.size, dtype=np.int64)) * sb
        copies = [(int(o), int(tiers[il2][e]) * tier.slot_bytes) for o, e in zip(offs.tolist(), ids.tolist())]
        token = self.bk.side_copies(self.staging, self.bk.tier_base(tier), copies, sb, after=self._half_read[half])
        self.tier_copied += len(copies)
        self.prefetched += len(copies)
        self._prefetched = {il2: (self._tab_key, half, ids.tolist(), token)}
        self._last_half = half

    def _grouped_mm(self, path, il: int, X, r):
        """:meth:`expert_outputs` by :func:`strata.engine.gpu.moe_mm.grouped_mm`: the chunk's pairs sorted by expert;
        the experts in cache slots in one round, the others in rounds through the staging slots (:meth:`_rounds`: two
        halves taking turns, the first round possibly :meth:`prefetch_next`'s); a host-tier expert copied there whole
        on the side stream (a round's copies issued before the previous round's launches, after the last reads of its
        half: PCIe under compute), a miss converted from the shard on the compute stream. Per round three launches
        (gate, up, down) and ``silu_mul``. The pair index and the weight addresses go to the device in two copies;
        every pair's output is the same whatever the rounds (moe_mm's docstring)."""
        xp, bk, lay = self.xp, self.bk, self.layout
        assert lay is not None
        T, n_embd = X.shape
        k, perm, used, starts, counts = r.k, r.perm, r.used, r.starts, r.counts  # sorted pair p = pair q perm[p]
        parts = lay.layouts[il]
        gl, ul, dl = parts
        slots, tiers = self.tables(path)
        sl, tl = slots[il][used], tiers[il][used]
        dev = np.flatnonzero(sl >= 0)
        staged = self._rounds(il, used, np.flatnonzero(sl < 0), tl)
        rounds = ([dev] if dev.size else []) + [rd.members for rd in staged]
        sb = path.cache.slot_bytes if dev.size else 0
        bases = []
        for p in parts:
            row = list(bk.refs(path.cache.storage, sl[dev] * sb + p.offset, p.nbytes)) if dev.size else []
            for rd in staged:
                row.extend(bk.refs(self.staging, rd.offsets + p.offset, p.nbytes))
            bases.append(row)
        inv = np.empty_like(perm)
        inv[perm] = np.arange(perm.size)
        pi = MM.PairIndex.build(perm // k, starts, counts, rounds)
        index = bk.index_array(np.concatenate([pi.host, inv.astype(np.int32)]))
        bases = bk.address_table(bases)  # [3][experts]: gate, up, down
        Xc = xp.ascontiguousarray(X, dtype=xp.float32)
        Gm, Um, D = self._buffers(perm.size)
        tier = getattr(path, "tier", None)
        xs = bk.row_scales(gl.type_id, Xc)  # (gate and up read the same rows)
        # A round's copies are issued one round ahead with two halves (into the half the round before last read: its
        # reads are queued and marked by then), at its own turn with one: never into a half a queued round still reads.
        look = 1 if self.halves == 2 else 0
        ahead = 0  # the next staging round whose copies are not issued yet (its token then set)

        def issue_upto(j: int) -> None:
            nonlocal ahead
            while ahead <= min(j, len(staged) - 1):
                if not staged[ahead].prefetched:
                    staged[ahead].token = self._issue(used, tl, tier, staged[ahead])
                ahead += 1

        issue_upto(look)  # the first copies cross PCIe under the slot experts' launches
        a = 0
        for n, (members, rnd) in enumerate(zip(rounds, pi.rounds)):
            G = members.size
            s = n - (1 if dev.size else 0)  # the staging round, or -1
            if s >= 0:
                issue_upto(s + look)  # this round's copies, and the next one's under this round's launches
                bk.wait(staged[s].token)
                half = staged[s].half
                for i, o in zip(members.tolist(), staged[s].offsets.tolist()):
                    if tl[i] < 0:  # a miss outside the host tier: converted from the shard, on the compute stream
                        self._stage(il, int(used[i]), [self.staging[o + p.offset :][: p.nbytes] for p in parts])
            bk.expert_mm(gl.type_id, bases[0][a : a + G], gl.rows, gl.ne0, Xc, index, rnd, Gm, True, xs)
            bk.expert_mm(ul.type_id, bases[1][a : a + G], ul.rows, ul.ne0, Xc, index, rnd, Um, True, xs)
            H = bk.silu_mul(Gm.reshape(-1), Um.reshape(-1)).reshape(Gm.shape)
            bk.expert_mm(dl.type_id, bases[2][a : a + G], dl.rows, dl.ne0, H, index, rnd, D, False)
            if s >= 0:
                self._half_read[half] = bk.mark()
                self._last_half = half
            a += G
        return D[index[pi.host.size :]].reshape(T, k, n_embd)

    def _tiled_gemm(self, path, il: int, X, r):
        """:meth:`expert_outputs` through the f32 tile: experts in groups (:meth:`groups`), each group one
        dequantization launch and one batched cuBLAS GEMM per part over its rows padded to the group's largest.
        The layer's index arrays and weight addresses go to the device in two copies, whatever the groups."""
        xp, bk, lay = self.xp, self.bk, self.layout
        assert lay is not None
        T, n_embd = X.shape
        k, perm, used, first, counts = r.k, r.perm, r.used, r.starts, r.counts  # pair p = t * k + kk, by expert
        start = dict(zip(used.tolist(), first.tolist()))
        gl, ul, dl = lay.layouts[il]
        groups = self.groups(dict(zip(used.tolist(), counts.tolist())), T * k)
        # per group: src rows (padded with row T, zeros), the flat (t, k) slots it fills, and its rows in the output
        src, dst, take, spans, parts, misses = [], [], [], [], [], []
        n_src = n_dst = 0
        for grp in groups:
            cnt = [int(counts[np.searchsorted(used, e)]) for e in grp]
            M = cnt[0]
            pad = np.full((len(grp), M), T, dtype=np.int64)
            d0 = n_dst
            for g, (e, c) in enumerate(zip(grp, cnt)):
                flat = perm[start[e] : start[e] + c]
                pad[g, :c] = flat // k
                dst.append(flat)
                take.append(g * M + np.arange(c, dtype=np.int64))
                ps, staged = self._parts(path, il, e, g)
                parts.append(ps)
                misses.append((e, ps) if staged else None)
            src.append(pad.ravel())
            n_dst += sum(cnt)
            spans.append((len(grp), M, n_src, d0, n_dst))
            n_src += pad.size
        host = np.concatenate(src + dst + take) if groups else np.zeros(0, dtype=np.int64)
        idx = xp.asarray(host)
        bases = bk.addresses([[ps[j] for ps in parts] for j in range(3)])  # [3][experts]: gate, up, down
        Xz = xp.concatenate([xp.asarray(X, dtype=xp.float32), xp.zeros((1, n_embd), dtype=xp.float32)])
        E = xp.zeros((T * k, n_embd), dtype=xp.float32)
        e0 = 0
        for G, M, s0, d0, d1 in spans:
            for m in misses[e0 : e0 + G]:
                if m is not None:
                    self._stage(il, m[0], m[1])
            Xg = Xz[idx[s0 : s0 + G * M]].reshape(G, M, n_embd)
            gate = bk.grouped_product(gl.type_id, bases[0][e0 : e0 + G], gl.rows, gl.ne0, Xg, self.tile, self.tf32)
            up = bk.grouped_product(ul.type_id, bases[1][e0 : e0 + G], ul.rows, ul.ne0, Xg, self.tile, self.tf32)
            h = bk.silu_mul(gate.reshape(-1), up.reshape(-1)).reshape(gate.shape)
            y = bk.grouped_product(dl.type_id, bases[2][e0 : e0 + G], dl.rows, dl.ne0, h, self.tile, self.tf32)
            E[idx[n_src + d0 : n_src + d1]] = y.reshape(-1, n_embd)[idx[n_src + n_dst + d0 : n_src + n_dst + d1]]
            e0 += G
        return E.reshape(T, k, n_embd)


__all__ = ["PREFETCH_PAIRS_PER_EXPERT", "ChunkPath", "StagingRound", "tier_on_device"]
