"""Routed experts inside the fused decode step (:mod:`strata.engine.gpu.fused`).

Per MoE layer the step runs, on the device, with no host value in between:

1. the router GEMV and ``moe_route`` (softmax, the ``n_expert_used`` best experts, renormalised
   weights, and the cache lookup: the device slot table ``slot_of[layer, expert]`` gives each
   selected expert's slot, hence the addresses of its gate, up and down parts; -1 = a miss the CPU computes,
   also a host-tier pair past the split's ``keep`` table);
2. one batched matvec per part over the selected experts (``matvec_batched`` or, with the q8 kernels,
   ``matvec_q8_batched`` on the layer's input quantized by its norm kernel (or one ``quantize_q8``) and on the
   K down inputs made (``silu(gate) * up``) and quantized by one ``quantize_q8``, on the part addresses; a miss's
   address is 0 and is skipped), ``silu_mul`` between them with the exact kernels - one launch per projection,
   not one per expert;
3. the weighted sum in selection order (plus the shared expert times its sigmoid gate, qwen3next / qwen2moe),
   computed by the ``resid_norm`` that adds it to the residual and makes the next norm (:class:`~strata.engine.gpu.
   fused_ops.Combine`: one launch for all three).

**All experts resident** (every (layer, expert) pair in a slot): nothing can miss, so the whole
step - every layer, the head - is one captured CUDA graph, like the dense step.

**Some resident (the hybrid path)**: some (layer, expert) pair is in neither a slot nor the host tier, or the misses
are split between the tier and the CPU (:mod:`strata.engine.gpu.miss_split`: the tier holds every pair and
``moe_route`` marks part of each layer's -1 by the ``keep`` table), so the CPU computes some. The device work still
runs on without the host: after ``moe_route`` each MoE layer copies its routing row, its input and then a flag to
pinned memory, and the batched matvecs of the hits (and host-tier misses) follow at once; the host's one point a layer
(:mod:`strata.engine.gpu.moe_host`) spins on the flag, computes the CPU misses
(:class:`strata.engine.cpu.miss_calls.LayerMisses`, with the step's numerics - :meth:`MoeStep.miss_kernel`: the CPU q8
kernel for the types the GPU runs ``matvec_q8``, the exact kernels' order for the rest - and the GPU's silu replica,
so a miss is bit-identical to what a hit would give) into pinned, mapped rows, and launches the next segment, whose
first kernel (``moe_take_rows``) reads those rows into the experts' outputs. The segments between those points are
captured as CUDA graphs too. Nothing is allocated on the token path: every device and pinned buffer is made once, at
start-up.

The slot table and the cache's device address live in device memory and are written when the cache
is opened (after the graphs were captured): the graphs read them at replay.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata.budget import cache_policy as CP
from strata.budget.cache_policy import DecayedFrequency, key_pair, pair_key
from strata.layout import experts as LX
from strata.layout import step as LS
from strata.manifests.names import tensor_name

from ..errors import ExpertCacheError
from ..recipe import MoEFFN
from . import miss_split as MS
from .fused_ops import Combine, MoeIO
from .moe_host import HybridHost
from .prefetch import SIM_STAGE_BASE, Prefetch
from .slots import SIM_HOST_BASE

#: Most experts one token may select (the routing kernel's shared table).
MAX_EXPERTS_USED = 64


def check_policy(opts, tier_on: bool, slots: int, pairs: int, miss_tier: str, note: dict) -> bool:
    """Whether the cache of ``slots`` slots (of ``pairs`` (layer, expert) pairs) learns at decode time, decided
    before the cache is filled: ``opts`` (:class:`strata.engine.options.ResolvedOptions`) asks for it
    (``opts.learns``: ``--cache-policy class``, or ``auto`` without a profile) and something can miss (``note`` says
    so when nothing can). Where it cannot swap - misses going to the CPU (``miss_tier``: the start-up's reason) or
    fewer than 2 slots (one is the swap's scratch) - ``class`` is refused and ``auto`` keeps the fill (``note``
    says why).

    Raises:
        ExpertCacheError: ``--cache-policy class`` where it cannot swap, naming the option and the numbers.
    """
    if not opts.learns:
        if opts.cache_policy == "auto":
            why = "the profile's fill" if opts.profile is not None else f"--resident {opts.resident}"
            note["cache policy"] = f"auto: fill ({why} stays: --cache-policy class learns anyway)"
        return False
    policy = opts.cache_policy
    if slots >= pairs:
        note["cache policy"] = f"{policy}: nothing to learn ({slots} slots hold all {pairs} pairs)"
        return False
    no_tier = miss_tier or ("--miss-tier cpu" if opts.miss_tier == "cpu" else "no host tier")
    why = CP.class_refusal(tier_on, slots, pairs, no_tier)
    if why is None:
        if policy == "auto":
            note["cache policy"] = "auto: class (no profile: misses read over PCIe are swapped in as they get hot)"
        return True
    if policy == "auto":
        note["cache policy"] = f"auto: fill (the class rule {why})"
        return False
    raise ExpertCacheError(f"--cache-policy class {why}; refusing (--cache-policy fill keeps the fill)")


class MoeStep(HybridHost):
    """The MoE part of one fused decoder: its buffers, its launches, the host side of the hybrid path.

    Built at the prompt-path checkpoint (buffers allocated before the expert cache measures what is
    free); :meth:`bind_cache` connects the cache when it exists.
    """

    def __init__(self, dec, model, backend):
        self.dec, self.model, self.bk = dec, model, backend
        h = model.hp
        self.E, self.K, self.n_embd, self.n_ff = h.n_expert, h.n_expert_used, h.n_embd, h.n_ff_exp
        if not 0 < self.K <= MAX_EXPERTS_USED:
            raise ValueError(f"n_expert_used {self.K}: the fused step routes 1..{MAX_EXPERTS_USED} experts")
        src = model.experts.source
        self.source = src
        self.layers = list(src.layers)
        self.offsets: dict[int, tuple[int, int, int]] = {}
        self.part_bytes: dict[int, tuple[int, int, int]] = {}
        self.blob_bytes: dict[int, int] = {}
        self.slot_bytes = 0
        for il in self.layers:  # the SlotCache's layout: one function of the budget
            g, u, d = src.types(il)
            (pg, pu, pd), stride = LX.expert_slot_layout(g, u, d, self.n_embd, self.n_ff)
            self.offsets[il] = (pg[0], pu[0], pd[0])
            self.part_bytes[il] = (pg[1], pu[1], pd[1])
            self.blob_bytes[il] = pg[1] + pu[1] + pd[1]  # what a miss over PCIe reads (engine form)
            self.slot_bytes = max(self.slot_bytes, stride)
        self.layer_rows = np.array(self.layers, dtype=np.intp)  # the MoE layers' rows of the routing record
        self.blob_row = np.array([self.blob_bytes[il] for il in self.layers], dtype=np.int64)
        bk, K, E, n = backend, self.K, self.E, self.n_embd
        self.probs = bk.empty_f32(E)
        self.weights = bk.empty_f32(K)
        self.bases = bk.empty_bytes(8 * 3 * K).view(np.uint64)
        # the step's routing record: per layer the selected ids then their slot_of values (int32 [n_layer, 2K]),
        # copied to the host once, at the end of the step (counts, the routing hook, admission)
        self.info_all = bk.empty_bytes(4 * 2 * K * h.n_layer).view(np.int32)
        self.info_all[...] = 0
        self.GU = bk.empty_f32(2 * K * self.n_ff)  # gate outputs then up outputs: one batched launch fills both
        self.G, self.U = self.GU[: K * self.n_ff], self.GU[K * self.n_ff :]
        self.H = bk.empty_f32(K * self.n_ff)
        self.D = bk.empty_f32(K * n)
        self.gdot = bk.empty_f32(1)
        self.slot_of = bk.empty_bytes(4 * h.n_layer * E).view(np.int32)
        self.slot_of[...] = -1
        self.storage_ptr = bk.empty_bytes(8).view(np.uint64)
        self.storage_ptr[...] = 0
        self.host_ptr = bk.empty_bytes(8).view(np.uint64)  # the host tier's mapped address (0: none)
        self.host_ptr[...] = 0
        # the split of a layer's misses between the host tier and the CPU (miss_split.keep_table): none until set
        self.keep = bk.empty_bytes(4 * (K + 1)).view(np.int32)
        self._write_keep(np.arange(K + 1, dtype=np.int32))
        self.share = 1.0
        self.hq_stride = LS.q8_act_bytes(self.n_ff)  # the selected experts' quantized down inputs (q8 kernel)
        self.Hq = bk.empty_bytes(K * self.hq_stride)
        self.nbytes = (
            4 * (E + K + 3 * K * self.n_ff + K * n + 1 + h.n_layer * E + K + 1)
            + 8 * 3 * K
            + 4 * 2 * K * h.n_layer
            + 8
            + 8
            + K * self.hq_stride
        )
        if dec.cuda:
            import cupy as cp

            self._info_mem = cp.cuda.alloc_pinned_memory(4 * 2 * K)
            self._xn_mem = cp.cuda.alloc_pinned_memory(4 * n)
            self._slot_mem = cp.cuda.alloc_pinned_memory(4 * h.n_layer * E)
            self._record_mem = cp.cuda.alloc_pinned_memory(4 * 2 * K * h.n_layer)
            self.record_host = np.frombuffer(self._record_mem, np.int32, 2 * K * h.n_layer)
            self.info_host = np.frombuffer(self._info_mem, np.int32, 2 * K)
            self.xn_host = np.frombuffer(self._xn_mem, np.float32, n)
            # host mirror of slot_of: a changed entry (an admission, a swap) is copied up from here; a copy still
            # queued reads the newest value when it runs, the one wanted (MoeStep._set_entry)
            self.slot_host = np.frombuffer(self._slot_mem, np.int32, h.n_layer * E)
            self.pinned_bytes = 4 * (2 * K + n + h.n_layer * E + 2 * K * h.n_layer)
        else:
            self.record_host = np.zeros(2 * K * h.n_layer, np.int32)
            self.info_host = np.zeros(2 * K, np.int32)
            self.xn_host = np.zeros(n, np.float32)
            self.pinned_bytes = 0
        self.pinned_bytes += self.init_host(dec.cuda, h.n_layer)  # the hybrid point's flags and CPU rows
        self.prefetch = Prefetch(self, dec, backend)  # the next layer's predicted misses copied ahead (full graph)
        self.nbytes += self.prefetch.nbytes
        self.pinned_bytes += self.prefetch.pinned_bytes
        self._held_pf: np.ndarray | None = None  # the prefetch's counters held with the record
        self.cache = None
        self.tier = None  # the host tier (strata.engine.gpu.slots.HostTier), when misses are read over PCIe
        self.n_pairs = len(self.layers) * E
        #: the decode-time cache policy (``--cache-policy class``: :meth:`learn`), None: the fill stays
        self.policy: DecayedFrequency | None = None
        self.policy_steps = 0  # steps the policy has seen
        self.swaps = 0  # decode-time swaps between the slots and the host tier, over the run
        self._held: np.ndarray | None = None  # a step's routing record held for settle() (take_record(now=False))
        self.scratch_slot = -1  # the cache slot a swap passes through (SlotCache.reserve_scratch)

    # ------------------------------------------------------------ launches

    def build_layer(self, il: int, ffn: MoEFFN, add, mv, mv_group, act_buf) -> Any:
        """Add layer ``il``'s expert launches (module docstring); returns the FFN's output (before the residual add)
        as a :class:`~strata.engine.gpu.fused_ops.Combine`: the ``resid_norm`` after the layer sums it."""
        dec, ops, w = self.dec, self.dec._ops, self.model.w
        sf = f"L{il} ffn"
        K, n, nff = self.K, self.n_embd, self.n_ff
        logits = mv(tensor_name("ffn_gate_inp.weight", il), dec.xn, sf)
        info = self.info_all[il * 2 * K : (il + 1) * 2 * K]
        self.prefetch.join(il, add)
        M = MoeIO(
            il=il,
            logits=logits,
            n_expert=self.E,
            k=K,
            norm=ffn.norm_weights,
            slot_of=self.slot_of,
            storage_ptr=self.storage_ptr,
            host_ptr=self.host_ptr,
            keep=self.keep,
            slot_bytes=self.slot_bytes,
            offsets=self.offsets[il],
            probs=self.probs,
            weights=self.weights,
            bases=self.bases,
            info=info,
            stage=self.prefetch.stage_of(il),
        )
        add(f"moe_route L{il}", sf, ops.moe_route(M))
        # the hybrid step's copies for the host point (moe_host): routing row, input, then the flag (the position)
        pos = dec.params_dev[:1]
        if dec.cuda:
            add(f"copy routing L{il} to host", sf, ops.d2h(self._info_mem.ptr, info, 4 * 2 * K), "host")
            add(f"copy x L{il} to host", sf, ops.d2h(self._xn_mem.ptr, dec.xn, 4 * n), "host")
            add(f"copy flag L{il} to host", sf, ops.d2h(self.flag_mem.ptr + 4 * il, pos, 4), "host")
        else:
            add(f"copy routing L{il} to host", sf, ops.d2h(self.info_host, info, 4 * 2 * K), "host")
            add(f"copy x L{il} to host", sf, ops.d2h(self.xn_host, dec.xn, 4 * n), "host")
            add(f"copy flag L{il} to host", sf, ops.d2h(self.flag_host[il : il + 1], pos, 4), "host")
        gt, ut, dt = self.source.types(il)
        pb = self.part_bytes[il]
        store = self._bytes_at
        fg, fu, fd = dec.q8_format(gt), dec.q8_format(ut), dec.q8_format(dt)

        def xn_q8(fmt, what):  # the layer's input quantized for the q8 kernel of the parts that follow
            return dec.matvecs.input(dec.xn, fmt, n, sf, f"experts {what} L{il}") if fmt else None

        if gt == ut and pb[0] == pb[1]:  # gate and up of every selected expert: one launch (G, U adjacent)
            add(
                f"experts gate+up L{il}",
                sf,
                ops.matvec_batched(
                    gt,
                    self.bases[0 : 2 * K],
                    nff,
                    n,
                    dec.xn,
                    0,
                    self.GU,
                    storage=store,
                    nbytes=pb[0],
                    xq=xn_q8(fg, "gate+up"),
                ),
            )
        else:
            add(
                f"experts gate L{il}",
                sf,
                ops.matvec_batched(
                    gt, self.bases[0:K], nff, n, dec.xn, 0, self.G, storage=store, nbytes=pb[0], xq=xn_q8(fg, "gate")
                ),
            )
            add(
                f"experts up L{il}",
                sf,
                ops.matvec_batched(
                    ut,
                    self.bases[K : 2 * K],
                    nff,
                    n,
                    dec.xn,
                    0,
                    self.U,
                    storage=store,
                    nbytes=pb[1],
                    xq=xn_q8(fu, "up"),
                ),
            )
        if fd:  # silu(gate) * up and its q8 form in one launch
            add(
                f"experts silu_mul + quantize q8 down L{il}",
                sf,
                ops.quantize(
                    self.H, self.Hq, fd, nff, rows=K, x_stride=nff, out_stride=self.hq_stride, silu=(self.G, self.U)
                ),
            )
        else:
            add(f"experts silu_mul L{il}", sf, ops.silu_mul(self.G, self.U, self.H))
        add(
            f"experts down L{il}",
            sf,
            ops.matvec_batched(
                dt,
                self.bases[2 * K : 3 * K],
                n,
                nff,
                self.H,
                nff,
                self.D,
                storage=store,
                nbytes=pb[2],
                xq=self.Hq if fd else None,
                xq_stride=self.hq_stride,
            ),
        )
        add(f"fill misses L{il}", sf, lambda: self.on_fill(il), "fill")
        rows = self.rows_dev if dec.cuda else self.miss_host
        add(f"take CPU rows L{il}", sf, ops.take_rows(self.D, rows, info, K, n), "host-kernel")
        S = gdot = None
        if ffn.shared_expert:
            g, u = mv_group(
                [tensor_name("ffn_gate_shexp.weight", il), tensor_name("ffn_up_shexp.weight", il)], dec.xn, sf
            )
            a = act_buf[: int(g.size)]
            add(f"act_mul shexp L{il}", sf, ops.act_mul(g, u, a, "silu"))
            S = mv(tensor_name("ffn_down_shexp.weight", il), a, sf)
            if ffn.shared_gate:
                t, buf, _rows, ne0, _o = w.vector_args(tensor_name("ffn_gate_inp_shexp.weight", il))
                add(f"matvec shexp gate L{il}", sf, ops.matvec(t, buf, 1, ne0, dec.xn, self.gdot))
                gdot = self.gdot
        return Combine(self.D, self.weights, K, n, S, gdot)  # summed by the resid_norm after the layer

    def build_readback(self, add) -> None:
        """Add the end-of-step copy of the routing record (every MoE layer's ids and slot_of values) to pinned
        host memory: the host counts hits and misses, feeds the routing hook and admits from it after the step
        (:meth:`take_record`), without stopping the step."""
        ops, nb = self.dec._ops, 4 * int(self.info_all.size)
        dst = self._record_mem.ptr if self.dec.cuda else self.record_host
        add("copy routing record to host", "routing record", ops.d2h(dst, self.info_all, nb), "memcpy")
        self.prefetch.build_readback(add)

    def _bytes_at(self, address: int, nbytes: int):
        """The sim's memory at a sim address (1 + offset: the slot storage; from :data:`SIM_STAGE_BASE`: the
        prefetch's staging slots; from :data:`SIM_HOST_BASE`: the host tier): what its batched matvec reads."""
        if address >= SIM_HOST_BASE:
            o = address - SIM_HOST_BASE
            return self.tier.storage[o : o + nbytes]
        if address >= SIM_STAGE_BASE:  # the prefetch's staging slots
            o = address - SIM_STAGE_BASE
            return self.prefetch.storage[o : o + nbytes]
        return self.cache.storage[address - 1 : address - 1 + nbytes]

    # ------------------------------------------------------------ the expert cache

    def bind_cache(self, cache, tier=None, share: float = 1.0) -> None:
        """Connect the expert cache and the host tier (:class:`~strata.engine.gpu.slots.HostTier`, or None): the
        device address of each and the slot table: a resident pair's slot (>= 0), a host-tier pair's ``-2 - h``,
        -1 for the rest (computed by the host); a ``share`` below 1 splits the tier's misses with the CPU
        (:meth:`set_split`)."""
        self.cache, self.tier = cache, tier
        self.miss_calls = {}  # made anew: a layer's CPU misses may now read the tier (moe_host.HybridHost.layer_misses)
        table = np.full(self.model.hp.n_layer * self.E, -1, dtype=np.int32)
        if tier is not None:
            for (il, e), h in tier.where.items():
                table[il * self.E + e] = -2 - h
        for (il, e), s in cache.where.items():
            table[il * self.E + e] = s
        bk = self.bk
        host = tier.address if tier is not None and len(tier) else 0
        if self.dec.cuda:
            self.slot_host[:] = table
            self.slot_of.set(table)
            ptr = cache.storage.data.ptr if cache.storage is not None else 0
            self.storage_ptr.set(np.array([ptr], dtype=np.uint64))
            self.host_ptr.set(np.array([host], dtype=np.uint64))
            bk.synchronize()
        else:
            self.slot_of[...] = table
            self.storage_ptr[...] = 1  # sim addresses: 1 + offset into the storage (0 = a miss)
            self.host_ptr[...] = host
        if cache.slot_bytes != self.slot_bytes:
            raise AssertionError(f"slot stride {cache.slot_bytes} B != the fused step's {self.slot_bytes} B")
        cache.on_admit = self._admitted
        self.prefetch.bind(tier, share)  # the whole-step graph with or without its launches
        if share < 1:
            self.set_split(share)
            if self.dec.cuda and MS.asked_share() is None and self.K > 1:  # chosen at start-up: timed as it runs
                self.tuner = MS.SplitTuner(self.K, MS.keep_table(share, self.K)[self.K])
                self.apply_keep(self.tuner.t)  # the table the tuner times from its first step

    def set_split(self, share: float) -> None:
        """Split each layer's misses in the host tier between the tier and the CPU at ``share`` (in [0, 1]; 1: every
        one over PCIe): ``moe_route``'s keep table (:func:`strata.engine.gpu.miss_split.keep_table`). With a share
        below 1 the step is hybrid (:attr:`full` False) even where every pair is readable.

        Raises:
            ValueError: ``share`` outside [0, 1]."""
        self._write_keep(np.array(MS.keep_table(share, self.K), dtype=np.int32))
        self.share = float(share)

    def apply_keep(self, t: int) -> None:
        """The split's table for ``t`` of ``K`` selected experts in the tier kept there (:class:`~strata.engine.gpu.
        miss_split.SplitTuner`): :func:`~strata.engine.gpu.miss_split.keep_table` of ``t / K``, between steps."""
        self._write_keep(np.array(MS.keep_table(t / self.K, self.K), dtype=np.int32))

    def _write_keep(self, keep: np.ndarray) -> None:
        if self.dec.cuda:
            self.keep.set(keep)
            self.bk.synchronize()
        else:
            self.keep[...] = keep

    def _admitted(self, il: int, e: int, slot: int) -> None:
        """A miss admitted into a free slot at decode time: its table entry, on the device too."""
        self._set_entry(il, e, slot)

    def _set_entry(self, il: int, e: int, value: int) -> None:
        """Slot-table entry of ``(il, e)`` (a slot >= 0, ``-2 - h`` for host slot ``h``, -1) on the host mirror and,
        on CUDA, copied up on the step's stream (ordered before the next step; a copy still queued reads the mirror
        when it runs - the newest value, which is the one wanted: nothing reads the table between the copies)."""
        i = il * self.E + e
        if self.dec.cuda:
            import cupy as cp

            self.slot_host[i] = value
            cp.cuda.runtime.memcpyAsync(
                self.slot_of.data.ptr + 4 * i,
                self._slot_mem.ptr + 4 * i,
                4,
                cp.cuda.runtime.memcpyHostToDevice,
                self.dec.stream.ptr,
            )
        else:
            self.slot_of[i] = value

    def start_policy(self, tier: Any, opts, why_no_tier: str) -> str:
        """The decode-time cache policy at the expert-cache stage (after :meth:`bind_cache`; ``opts``:
        :class:`strata.engine.options.ResolvedOptions` whose ``learns``): :meth:`learn` with the fill in load order
        and, with a profile, counters at its steady state (:func:`strata.budget.cache_policy.profile_seed_scores`).
        Where it cannot learn - no host tier was built (``why_no_tier``: the reason the start-up gives), or the fill
        left slots empty (``resident``) - ``--cache-policy auto`` keeps the fill (first-come admission as ``fill``;
        the scratch slot stays unused, said) and ``class`` is refused. Returns the start-up note.

        Raises:
            ExpertCacheError: ``--cache-policy class`` where it cannot learn, naming the reason.
        """
        cache = self.cache
        why = None
        if tier is None:
            why = f"the host tier was not built ({why_no_tier})"
        elif len(cache) != cache.capacity:
            why = f"the fill left {cache.capacity - len(cache)} of {cache.capacity} slots empty (--resident)"
        if why is not None:
            if opts.cache_policy == "class":
                raise ExpertCacheError(
                    f"--cache-policy class needs the host tier and a full cache, and {why}; refusing (--cache-policy "
                    "fill keeps the fill)"
                )
            cache.admit_enabled = opts.admit is None or bool(opts.admit)
            return f"auto: fill ({why}; the swap scratch slot stays empty)"
        profile = opts.profile
        seed = CP.profile_seed_scores(profile, CP.profile_steps(profile, self.K), CP.DEFAULT_DECAY) if profile else None
        self.learn(list(cache.where), seed, CP.DEFAULT_DECAY)
        return (
            f"{'auto: ' if opts.cache_policy == 'auto' else ''}class (decay {CP.DEFAULT_DECAY} a token"
            f"{', counters from the profile' if seed else ''}): {cache.capacity} slots for experts, slot "
            f"{self.scratch_slot} the swap scratch"
        )

    def learn(self, initial: list[tuple[int, int]], seed: dict[int, float] | None, decay: float) -> None:
        """Turn on the decode-time cache policy (``--cache-policy class``): the decayed-frequency rule
        (:class:`strata.budget.cache_policy.DecayedFrequency`, the offline replay's ``class`` policy) over the
        cache's slots, started with ``initial`` (the start-up fill, in load order) and ``seed`` counters (a profile's
        steady state, or None). Needs the host tier holding every other pair (:attr:`full`) and a scratch slot
        (:meth:`strata.engine.gpu.slots.SlotCache.reserve_scratch`): :meth:`take_record` then swaps an admitted pair
        in and its victim out after each step.

        Raises:
            ValueError: no host tier, a cache that is not full, or no scratch slot.
        """
        cache, tier = self.cache, self.tier
        if cache is None or tier is None or not self.full:
            raise ValueError("the decode-time cache policy needs the host tier holding every pair the cache does not")
        if cache.capacity != cache.n_slots - 1 or len(cache) != cache.capacity:
            raise ValueError(f"the cache policy needs a full cache and a scratch slot: {len(cache)} of {cache.n_slots}")
        self.scratch_slot = cache.n_slots - 1
        self.policy = DecayedFrequency(
            cache.capacity, decay, [pair_key(il, e) for il, e in initial], seed, bypass=True
        )  # the replay's class+bypass (bench/bench_cache_policy.py: as many hits as plain class, fewer swaps)

    def swap(self, out: tuple[int, int], into: tuple[int, int]) -> None:
        """Pair ``into`` (in the host tier) takes pair ``out``'s cache slot, ``out`` takes ``into``'s host slot:
        three copies of a slot on the step's stream (the slot to the scratch slot, the host slot to the slot, the
        scratch to the host slot) and the two table entries, all ordered before the next step's kernels read them.
        The bytes are the same engine form wherever they sit: the tokens do not change (tests/test_gpu_cache_policy.py).
        """
        cache, tier = self.cache, self.tier
        sb = cache.slot_bytes
        if out not in cache.where or into not in tier.where:  # checked before anything changes
            raise KeyError(f"swap: blk.{out[0]} expert {out[1]} must be in a slot, blk.{into[0]} expert {into[1]} in "
                           "the host tier")  # fmt: skip
        s = cache.replace(out, into)  # both maps first (they refuse a pair already placed) - then the bytes
        h = tier.replace(into, out)
        x = self.scratch_slot
        if self.dec.cuda:
            import cupy as cp

            rt, st = cp.cuda.runtime, self.dec.stream.ptr
            dev, host = int(cache.storage.data.ptr), int(tier.storage.ctypes.data)
            rt.memcpyAsync(dev + x * sb, dev + s * sb, sb, rt.memcpyDeviceToDevice, st)
            rt.memcpyAsync(dev + s * sb, host + h * sb, sb, rt.memcpyHostToDevice, st)
            rt.memcpyAsync(host + h * sb, dev + x * sb, sb, rt.memcpyDeviceToHost, st)
        else:
            c, t = cache.storage, tier.storage
            c[x * sb : (x + 1) * sb] = c[s * sb : (s + 1) * sb]
            c[s * sb : (s + 1) * sb] = t[h * sb : (h + 1) * sb]
            t[h * sb : (h + 1) * sb] = c[x * sb : (x + 1) * sb]
            self.bk.forget(c[s * sb : (s + 1) * sb])  # the sim's weights, cached by address, are stale there now
            self.bk.forget(t[h * sb : (h + 1) * sb])
        self._set_entry(*into, s)
        self._set_entry(*out, -2 - h)
        self.swaps += 1

    def _learn_from(self, rec: np.ndarray) -> None:
        """Feed one step's routing record (``[MoE layer, ids | slots, k]``) to :attr:`policy` in routing order
        (layer, then selection order) and swap what it admits."""
        pol = self.policy
        assert pol is not None
        self.policy_steps += 1
        t = self.policy_steps
        before = self.swaps
        for j, il in enumerate(self.layers):
            for e in rec[j, 0].tolist():
                _hit, victim, admitted = pol.access(pair_key(il, e), t)
                if admitted:
                    assert victim is not None  # the cache is full (learn)
                    self.swap(key_pair(victim), (il, int(e)))
        n = self.swaps - before
        if n:  # a swap moves a slot each way over PCIe (the device-to-device copy stays on the card)
            self.model.experts.count_link(2 * n * self.cache.slot_bytes, swaps=n)

    @property
    def readable(self) -> bool:
        """Every (layer, expert) pair readable by the kernels (in a device slot or in the host tier)."""
        if self.cache is None:
            return False
        n = len(self.cache.where) + (len(self.tier) if self.tier is not None else 0)
        return n >= self.n_pairs

    @property
    def full(self) -> bool:
        """Every pair in a device slot, or every pair :attr:`readable` and no split of the misses asked
        (:meth:`set_split`): the step never stops at the host."""
        if self.cache is None:
            return False
        return len(self.cache.where) >= self.n_pairs or (self.readable and self.share >= 1)

    def take_record(self, now: bool = True) -> None:
        """After a step has finished (one graph or hybrid): count its routing record (hits, CPU misses, misses read
        over PCIe: counts of experts), feed the routing hook, and admit misses into free slots - the CPU's only where
        the host tier does not hold every pair (:meth:`settle`) - or swap them in (the policy). ``now`` False, where
        nothing can change what is resident (no policy, no admission into a free slot): only a copy of the record is
        taken (the next step overwrites the pinned one) and :meth:`settle` counts it - after the next step was queued,
        so that the counting (~125 us a token on the 30B-A3B, H200 host) runs while the device works; every count
        stays the step's. A record still held is counted first."""
        self.settle()
        self._held = self.record_host.reshape(-1, 2, self.K)[self.layer_rows]  # [MoE layer, ids | slots, k]: a copy
        self._held_pf = self.prefetch.counters_host.copy() if self.prefetch.active else None
        cache = self.cache
        if now or self.policy is not None or (cache is not None and cache.admit_enabled and cache.free_slots > 0):
            self.settle()

    def settle(self) -> None:
        """Count the routing record :meth:`take_record` holds, if any (its docstring)."""
        rec, self._held = self._held, None
        if rec is None:
            return
        ex, K = self.model.experts, self.K
        slots = rec[:, 1, :]
        hits = (slots >= 0).sum(axis=1)  # whole-record array operations: this runs every token (~4 us a layer
        pcie = (slots <= -2).sum(axis=1)  # as a Python loop over 48 layers)
        ex.count_layers(self.layers, hits, K - hits, pcie, pcie * self.blob_row)
        pf, self._held_pf = self._held_pf, None
        if pf is not None:  # the staged experts no layer read crossed PCIe too
            staged, read, nbytes = self.prefetch.take(pf, self.layer_rows)
            ex.count_link(nbytes, prefetched=staged, prefetch_read=read)
        if ex.on_route is not None:
            for j, il in enumerate(self.layers):
                ex.on_route(il, rec[j, 0].tolist())
        if self.policy is not None:
            self._learn_from(rec)
            return
        admit = self.cache is not None and self.cache.admit_enabled and self.cache.free_slots > 0
        if admit:
            # where the tier does not hold every pair, the CPU's misses only (-1): a tier pair admitted would stay in
            # the tier too, and :attr:`readable` (slots + tier pairs) would say every pair is readable while some
            # pair is in neither; with a split the tier holds every pair, and both kinds are admitted
            cpu_only = not self.readable
            for j in np.flatnonzero(hits < K).tolist():
                for k in range(K):
                    if slots[j, k] == -1 or (slots[j, k] < 0 and not cpu_only):
                        self.cache.admit(self.layers[j], int(rec[j, 0, k]))


__all__ = ["MAX_EXPERTS_USED", "MoeStep"]
