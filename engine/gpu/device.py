"""``--device cuda`` (and its NumPy simulation ``sim``): the GPU's part of each start-up stage.

The stages and their order are :func:`strata.engine.startup.load_engine`'s; this device fills them
in (every stage records ``cudaMemGetInfo`` and the CuPy pool's bytes in its checkpoint notes:
``gpu_free_bytes``, ``gpu_used_bytes``, ``pool_used_bytes``, ``pool_total_bytes``):

- ``weights`` / ``head``: engine-form upload by byte offset (:class:`DeviceWeights`), one
  preallocated f32 GEMV output per matrix (:func:`strata.layout.buffers.matvec_out_bytes`);
- ``session``: KV cache, rope tables, the embedding row, the expert hit path's vectors;
- ``prompt path``: every kernel compiled and loaded (dense and expert types). Models whose recipe
  the fused step builds get it (:mod:`strata.engine.gpu.fused`): its buffers and pinned staging
  memory, one eager step (loads every kernel), the step captured as CUDA graphs (``graph=False``:
  replayed eagerly). Others keep the generic per-layer path, whose warm-up steps at positions 0 and
  ``n_ctx - 1`` put the largest temporaries in the CuPy pool. Either way the token loop allocates no
  new device memory; memory taken here outside the pool is the CUDA runtime's first-use cost
  (kernel modules, graph instantiation), which the budget charges as a measured constant;
- ``expert cache``: :func:`strata.budget.formulas.size_expert_cache` on the free memory measured
  right there (``--expert-cache auto``) or N slots, refused with both numbers when N does not fit;
  filled from a profile in :func:`strata.budget.formulas.fill_profile`'s order or from ``resident``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.budget import formulas as F
from strata.budget.cards import Card
from strata.layout import buffers as LB
from strata.layout import chunk as LC
from strata.layout import experts as LX
from strata.layout import kv as LK
from strata.manifests.contract import Geometry
from strata.packer.pack import Pack

from ..chunk_routing import ChunkRouting
from ..core import Engine
from ..decoder import Decoder, State
from ..errors import ExpertCacheError, GenerateError, StageTimesRefused, StartupRefused
from ..experts import ShardExperts, resident_pairs
from ..loader import LoadPlan
from ..options import ResolvedOptions
from . import miss_split as MS
from . import slots as SL
from .backend import Backend, make_backend
from .chunk import ChunkPath
from .fused import FusedDecoder, FusedUnsupported, StageTimes, describe, fused_unsupported
from .fused_moe import check_policy
from .slots import PROBE_COPIES, GpuExpertPath, GpuStepProbe, HostTier, HostTierError, SlotCache, SlotPlan, probe_pcie
from .weights import DeviceWeights, rows_of


@dataclass
class GpuInfo:
    """GPU-side facts of a loaded engine (bytes), for ``strata-engine measure``, stats and benchmarks.

    ``buffer_bytes``: the budget's "engine buffers" as allocated (GEMV outputs, f32 vector copies,
    embedding row, rope tables, expert hit path); ``runtime_bytes``: device memory the warm-up took
    outside the CuPy pool (kernel modules); ``warmup_pool_bytes``: what the warm-up left in the pool
    (temporaries, the budget's "prefill/activations"). ``alloc_rounded``: per stage, the bytes the
    engine asked the backend for, each rounded to the pool's 512 B unit (to check against the pool)."""

    backend: str
    device: str
    kv: str = "f16"
    weights_engine_bytes: int = 0
    head_engine_bytes: int = 0
    f32_vector_bytes: int = 0
    output_buffer_bytes: int = 0
    row_buffer_bytes: int = 0
    hit_buffer_bytes: int = 0
    kv_bytes: int = 0
    recurrent_bytes: int = 0  # conv + delta state of the recurrent layers (one sequence)
    rope_bytes: int = 0
    buffer_bytes: int = 0
    runtime_bytes: int = 0
    warmup_pool_bytes: int = 0
    session_rounded_bytes: int = 0
    slot_plan: SlotPlan | None = None
    filled: int = 0
    fill: str = ""
    pool_after_warmup: int = 0
    alloc_rounded: dict[str, int] = field(default_factory=dict)
    marks: dict[str, dict[str, int]] = field(default_factory=dict)
    decode_path: str = ""  # fused step (graph | eager) or the generic per-layer path, and why
    launches_per_token: dict[str, int] = field(default_factory=dict)  # fused step: kernels, memcpy, total
    fused_buffer_bytes: int = 0  # the fused step's activation buffers (in "prefill/activations")
    fused: bool = False  # the decode step is the fused one (else the generic per-layer path)
    draft_engine_bytes: int = 0  # the draft head's weights in engine form (stage "drafter")
    draft_bind_bytes: int = 0  # its bind buffers (stage "bind": strata.layout.buffers.draft_bind_bytes)
    miss_tier: str = ""  # where misses run: "pcie" (the host tier, read by the GPU), "cpu", or "" (nothing misses)
    host_tier_bytes: int = 0  # pinned host memory of the host tier (strata.layout.experts.host_tier_bytes)
    host_tier_pairs: int = 0
    host_tier_map_bytes: int = 0  # device memory the driver took to map the host tier (measured: free before - after)
    host_tier_map_predicted_bytes: int = 0  # strata.layout.experts.host_tier_map_bytes of the tier
    pcie_gbs_measured: float | None = None  # the host tier -> VRAM copy rate at start-up (slots.probe_pcie), GB/s
    chunk_bytes: int = 0  # the prompt chunk's tile and staging slots (strata.layout.chunk.chunk_buffer_bytes)
    chunk_ubatch: int = 1  # -ub: prompt positions per chunk (1: one position at a time, no chunk path)
    # the chunk path's GEMMs use cuBLAS (CUDA) and its first use in this thread happens at this start-up's warm-up
    # chunk (the plan charges it in "CUDA runtime"); False on the sim, with -ub 1, without the warm-up, or when the
    # thread had used it before (measure then plans without it)
    cublas_first_use: bool = False
    reserve_bytes: int = 0  # --vram-reserve-mib, kept free after start-up
    free_after_bytes: int = 0  # free at the end of start-up (measured; >= reserve_bytes, or the start is refused)


def _rounded(arrays, unit: int) -> int:
    return sum(-(-int(a.nbytes) // unit) * unit for a in arrays)


class GpuDevice:
    """The GPU device (see the module docstring). ``name``: ``cuda`` (CuPy) or ``sim`` (NumPy
    stand-in of a card, :class:`strata.engine.gpu.backend.SimBackend`); ``backend`` overrides it.

    Raises:
        GpuUnavailable: ``cuda`` without CuPy or a CUDA device (the reason is in the message).
    """

    def __init__(self, name: str = "cuda", backend: Backend | None = None, card: Card | None = None):
        self.bk = backend or make_backend(name, card=card)
        self.name = self.bk.name
        self.info = GpuInfo(self.bk.name, self.bk.device_name())
        self.experts: GpuExpertPath | None = None
        self.decoder: FusedDecoder | None = None

    def describe(self) -> str:
        return self.info.device

    def configure(self, opts: ResolvedOptions) -> None:
        self.info.kv = opts.kv
        self.info.reserve_bytes = opts.vram_reserve_mib * F.MIB
        self.opts = opts

    def mark(self, stage: str, note: dict) -> None:
        bk, info = self.bk, self.info
        bk.synchronize()
        m = bk.mem_info()
        d = {
            "gpu_free_bytes": m.free,
            "gpu_used_bytes": m.total - m.free,
            "gpu_total_bytes": m.total,
            "pool_used_bytes": m.pool_used,
            "pool_total_bytes": m.pool_total,
        }
        if m.physical_free is not None:  # an emulated card (--card): the GPU's own figures beside the card's
            d |= {"physical_free_bytes": m.physical_free, "physical_total_bytes": m.physical_total}
            emu = getattr(bk, "emulation", None)
            if stage == "pack" and emu is not None:
                note["emulation"] = emu.describe()
        note.update(d)
        info.marks[stage] = d
        info.alloc_rounded[stage] = bk.alloc_rounded_bytes
        if stage == "prompt path":
            a, b = info.marks[list(info.marks)[-2]], d  # the stage before it (session, or the drafter)
            info.warmup_pool_bytes = b["pool_total_bytes"] - a["pool_total_bytes"]
            info.runtime_bytes = (b["gpu_used_bytes"] - a["gpu_used_bytes"]) - info.warmup_pool_bytes
            note["runtime_bytes"] = info.runtime_bytes
            note["warmup_pool_bytes"] = info.warmup_pool_bytes
        if stage == "expert cache":
            info.pool_after_warmup = d["pool_total_bytes"]

    def memory_available(self) -> tuple[int, str]:
        return self.bk.mem_info().free, f"free VRAM on {self.info.device} (cudaMemGetInfo)"

    def make_weights(self, pack: Pack, plan: LoadPlan, nx) -> DeviceWeights:
        return DeviceWeights(pack, plan.dense, self.bk)

    def make_experts(self, plan: LoadPlan, nx) -> GpuExpertPath:
        opts = self.opts
        self.experts = GpuExpertPath(ShardExperts(plan), None, self.bk, kernel=opts.miss_kernel, threads=opts.threads)
        return self.experts

    def load_weights(self, weights: DeviceWeights, names: list[str], stage: str, note: dict) -> None:
        added = weights.upload(names)
        note["engine_bytes"] = added
        if stage == "head":
            self.info.head_engine_bytes = added
        else:
            self.info.weights_engine_bytes += added

    def open_session(self, model: Decoder, opts: ResolvedOptions, note: dict) -> State:
        info, bk, w = self.info, self.bk, model.w
        state = model.new_state(opts.n_ctx, kv=opts.kv, sliding=opts.sliding)
        for name in sorted(model.row_tensors()):
            info.row_buffer_bytes += w.alloc_row_buffer(name)
        if self.experts is not None:
            info.hit_buffer_bytes = self.experts.alloc_hit_buffers(model.hp.n_embd, model.hp.n_ff_exp)
        info.kv_bytes = state.kv_nbytes
        info.rope_bytes = state.rope_nbytes
        info.f32_vector_bytes = w.f32_vector_bytes
        info.output_buffer_bytes = w.output_bytes
        info.buffer_bytes = w.buffer_bytes + info.rope_bytes + info.hit_buffer_bytes
        # KV and rope arrays come from the array module itself, not through the backend
        rec = state.recurrent
        info.recurrent_bytes = rec.nbytes if rec is not None else 0
        rec_arrays = [rec.arena] if rec is not None else []  # one allocation (deltanet.RecurrentState)
        arrays = (
            state.cache.k
            + state.cache.v
            + list(state.indexer.values())
            + [a for r in state.ropes.values() for a in (r.cos, r.sin)]
            + rec_arrays
        )
        info.session_rounded_bytes = _rounded(arrays, bk.POOL_UNIT)
        bk.external(sum(int(a.nbytes) for a in arrays), "the session's KV cache, rope tables and recurrent state")
        note["n_ctx"] = opts.n_ctx
        note["kv"] = (
            f"{opts.kv}, {opts.sliding}: {min(state.cache.sizes)}..{max(state.cache.sizes)} positions per layer"
        )
        note["kv_bytes"] = info.kv_bytes
        note["recurrent_bytes"] = info.recurrent_bytes
        note["buffer_bytes"] = info.buffer_bytes
        return state

    def prompt_path(self, model: Decoder, state: State, opts: ResolvedOptions, note: dict) -> Any:
        info, bk = self.info, self.bk
        source = self.experts.source if self.experts is not None else None
        expert_types = (
            {t for r in source.rows.values() for t in (r.gate_type, r.up_type, r.down_type)} if source else set()
        )
        why = fused_unsupported(model)
        kernel = opts.kernel
        bk.prepare(model.w.types() | expert_types, q8=kernel == "q8" and why is None and opts.fused is not False)
        if opts.fused and why:
            raise FusedUnsupported(why)
        if opts.stage_times and why:
            raise StageTimesRefused(f"--stage-times: per-stage timers exist on the fused step only; {why}")
        n_ctx = state.n_ctx
        runner: Any = model
        if (opts.fused is None or opts.fused) and why is None:
            if not model.w.uploaded(model.head):
                # the fused step binds every matrix, the head included, when it is built
                raise GenerateError(
                    f"stage order: the fused step binds the output head ({model.head}) when the "
                    "prompt path is built - load 'head' before 'prompt path', or turn the fused step "
                    "off (fused=False)"
                )
            # the fused step: its buffers, one eager step (loads every kernel), then the graphs
            dec = FusedDecoder(model, bk, state, graph=opts.graph, stage_times=opts.stage_times, kernel=kernel)
            for pos in sorted({0, n_ctx - 1} if opts.warmup else {0}):
                dec.step(0, pos, state, logits=True)
            dec.capture()
            if dec.captured and bk.name == "cuda":
                dec.step(0, 0, state, logits=True)  # one replay: the graphs are uploaded and run
            dec.stage_times = StageTimes()
            if self.experts is not None:  # the warm-up's experts were all misses: not the run's counts
                self.experts.reset_counts()
                self.experts.take_cpu_ms()
            runner = self.decoder = dec
            info.decode_path = describe(dec)
            info.launches_per_token = dec.launches_per_token(True)
            info.fused_buffer_bytes = dec.nbytes
            info.fused = True
        elif opts.warmup:
            # allocates the pool blocks one step uses; positions are overwritten by real tokens. The
            # last two positions: attention temporaries are largest there, and one of the two reads a
            # wrapped ring (no new device memory in the token loop)
            for pos in sorted({0, max(n_ctx - 2, 0), n_ctx - 1}):
                model.step(0, pos, state, logits=True)
            if self.experts is not None:
                self.experts.reset_counts()
                self.experts.take_cpu_ms()
        if opts.ubatch > 1:
            self._chunk_path(model, state, opts, note)
        if info.decode_path == "":
            info.decode_path = f"generic per-layer path, eager ({why or 'fused step off'})"
        note["decode path"] = info.decode_path
        return runner

    def _chunk_path(self, model: Decoder, state: State, opts: ResolvedOptions, note: dict) -> None:
        """Prompts in chunks of ``-ub`` (docs/DESIGN.md "Prompts in chunks on the GPU"): the chunk path's tile and
        staging slots (:class:`ChunkPath`, the budget's "prompt chunk" term), then one warm-up chunk of ``-ub``
        positions ending at ``n_ctx - 2`` (the largest attention) and, for MoE models, one layer's experts with every
        row routed to the same ``n_expert_used`` experts (one group of ``-ub`` rows per expert: the largest padded
        group a chunk can make, as its rows never pass ``-ub x n_expert_used``), so CuPy's pool holds what a chunk
        takes before the expert cache is sized."""
        info, bk, w = self.info, self.bk, model.w
        mats = [w.entry(n) for n in w.matrices()]
        ne0_max = max((e.ne0 for e in mats), default=1)
        dense_max = max((e.ne0 * rows_of(e) for e in mats), default=1)
        h, layout = model.hp, None
        if self.experts is not None:
            layout = SlotCache(self.experts.source, bk, h.n_embd, h.n_ff_exp, 0)
        path = ChunkPath(
            bk,
            ne0_max,
            dense_max,
            layout,
            h.n_expert,
            tf32=opts.kernel != "exact",
            ubatch=LC.chunk_positions(opts.ubatch, opts.ubatch, state.n_ctx),
            n_expert_used=h.n_expert_used if self.experts is not None else 0,
        )
        w.chunk = path
        if self.experts is not None:
            self.experts.chunk_path = path
        info.chunk_bytes = path.nbytes
        info.chunk_ubatch = opts.ubatch
        note["chunk_bytes"] = path.nbytes
        note["prompt chunks"] = (
            f"-ub {opts.ubatch}: tile {path.tile_elements * 4} B, {path.group} staging slots ({path.staging_bytes} B)"
        )
        if opts.warmup and state.n_ctx >= 3:
            if bk.name == "cuda":  # the warm-up's GEMMs pay cuBLAS's first use here unless the process did before
                from .gemm import cublas_used

                info.cublas_first_use = not cublas_used()
            t = min(opts.ubatch, state.n_ctx - 2)
            model.forward([0] * t, state.n_ctx - 2 - t, state, logits=False)
            if self.experts is not None and self.experts.source.layers:
                k, il = h.n_expert_used, self.experts.source.layers[0]
                X = bk.xp.zeros((t, h.n_embd), dtype=bk.xp.float32)
                path.expert_outputs(self.experts, il, X, ChunkRouting.of([list(range(k))] * t))
            bk.synchronize()
            if self.experts is not None:
                self.experts.reset_counts()
                self.experts.take_cpu_ms()
            path.staged = 0

    def open_expert_cache(self, experts: GpuExpertPath, geom: Geometry, opts: ResolvedOptions, note: dict) -> None:
        info, bk = self.info, self.bk
        source = experts.source
        n_expert = int(geom["n_expert"])
        n_embd, n_ff = int(geom["n_embd"]), int(geom["n_ff_exp"])
        if opts.profile is not None:  # the profile orders the fill; the slots past its pairs fill by admission
            eligible = None
        else:
            eligible = resident_pairs(opts.resident, source.layers, n_expert)
            cap, what = len(eligible), f"the {len(eligible)} (layer, expert) pairs --resident {opts.resident} allows"
        if opts.admit or opts.profile is not None:  # slots beyond the fill are taken by misses as they come
            cap = len(source.layers) * n_expert
            what = f"all {cap} (layer, expert) pairs (--admit fills slots beyond the initial fill)"
        slot_bytes = max(
            LX.expert_slot_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff) for r in source.rows.values()
        )
        max_blob = max(
            LX.expert_blob_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff, engine=True)
            for r in source.rows.values()
        )
        bk.synchronize()
        free = bk.mem_info().free
        bind = self.draft_bind_need
        reserve = opts.vram_reserve_mib * F.MIB + bind  # the C++ engine's reserve: + the draft head's bind bytes
        self.refuse_eaten_reserve(free, reserve, "expert cache")
        asked = opts.expert_cache  # None: automatic
        pairs = len(source.layers) * n_expert
        tier_on = self._tier_wanted(opts, free, reserve, slot_bytes, cap, asked, pairs, what)
        size, held, map_bytes = None, 0, 0
        if tier_on:  # the host tier's device mapping is reserved beside the reserve (one rule with the budget)
            size, held, map_bytes = F.size_with_host_tier(  # (--cache-policy class: its scratch's pair in the tier)
                free, reserve, slot_bytes, cap, asked, pairs, cap_what=what, scratch=opts.learns
            )
            if size is None:  # the mapping alone does not fit above the reserve
                why = (
                    f"the host tier's device mapping ({map_bytes} B) does not fit between the {free} B free and the "
                    f"{reserve} B reserve"
                )
                if opts.miss_tier == "pcie":
                    raise ExpertCacheError(f"--miss-tier pcie: {why}; refusing (--miss-tier cpu needs no mapping)")
                info.miss_tier, tier_on, held, map_bytes = f"cpu ({why})", False, 0, 0
        if size is None:
            size = F.size_expert_cache(free, reserve, slot_bytes, cap, asked, cap_what=what)
        if size.refused:
            raise ExpertCacheError(
                f"{size.refused}; refusing rather than building a smaller cache "
                f"({free} B free at the expert cache checkpoint)"
            )
        slots = size.slots
        cache = SlotCache(source, bk, n_embd, n_ff, slots, bufs=experts.bufs)
        assert cache.slot_bytes == slot_bytes
        self.share = MS.decide(self, experts, opts, slots, pairs, slot_bytes, note) if tier_on else 1.0
        split = f"a share {1 - self.share:.2f} of them: the hybrid step" if self.share < 1 else ""  # (nothing learns)
        if learn := check_policy(opts, tier_on and self.share == 1, slots, pairs, info.miss_tier or split, note):
            cache.reserve_scratch()
        if opts.profile is not None:
            order = F.fill_profile(opts.profile, cache.capacity).order  # (less a swap scratch slot)
            # the slots the profile leaves free take the other pairs now, in (layer, expert) order: where every
            # expert fits, every expert is resident (the one-graph path) whatever the profile saw
            have = set(order)
            rest = [(il, e) for il in source.layers for e in range(n_expert) if (il, e) not in have]
            more = rest[: max(cache.capacity - len(order), 0)]
            order = order + more
            info.fill = f"profile ({len(opts.profile)} pairs)" + (f" + {len(more)} more in layer order" if more else "")
        else:
            order = eligible
            info.fill = f"resident={opts.resident} (layer, expert order)"
        info.filled = cache.fill(order)
        admit_on = (True if opts.admit is None else bool(opts.admit)) and not learn  # the policy admits by its rule
        experts.cache = cache
        cache.admit_enabled = admit_on
        dec = self.decoder
        if dec is not None and dec.moe is not None:  # the fused step reads the slot table at replay
            tier = self._host_tier(cache, opts, n_expert, note) if tier_on else None
            if tier is None and not info.miss_tier.startswith("cpu"):
                info.miss_tier = "cpu" if len(cache) < pairs else ""
            note["miss tier"] = info.miss_tier or "none (every expert resident)"
            dec.moe.bind_cache(cache, tier, self.share if tier is not None else 1.0)
            experts.tier = tier
            if learn:
                note["cache policy"] = dec.moe.start_policy(tier, opts, info.miss_tier)
            info.host_tier_map_predicted_bytes = map_bytes if tier is not None else 0
            info.decode_path = describe(dec)
            info.launches_per_token = dec.launches_per_token(True)
            note["decode path"] = info.decode_path
        info.slot_plan = SlotPlan(
            "auto" if asked is None else "fixed",
            slots,
            slot_bytes,
            max_blob,
            free,
            reserve,
            cap,
            slots * slot_bytes,
            held,
        )
        note["slots"] = slots
        note["slot_bytes"] = slot_bytes
        note["max_blob_engine"] = max_blob
        note["cache_bytes"] = slots * slot_bytes
        note["filled"] = info.filled
        note["fill"] = info.fill + (", first-come admission" if admit_on else "")
        note["free_at_open_bytes"] = free
        note["reserve_bytes"] = reserve
        note["auto" if asked is None else "fixed"] = (
            f"expert cache {'auto' if asked is None else 'fixed'}: {free / 2**30:.2f} GiB free, "
            f"{opts.vram_reserve_mib} MiB "
            f"reserved (+{bind / F.MIB:.1f} MiB for the draft head) -> {slots} slots"
        )

    def _tier_wanted(self, opts, free, reserve, slot_bytes, cap, asked, pairs, what) -> bool:
        """Whether the cache's misses go to a host tier (``--miss-tier`` ``pcie``, or ``auto`` where the tier of
        the cache sized without it fits the host's available memory less
        :data:`strata.layout.experts.HOST_TIER_MARGIN_BYTES`); never without the fused MoE step."""
        dec = self.decoder
        if opts.miss_tier == "cpu" or dec is None or dec.moe is None:
            return False
        if opts.miss_tier == "pcie":
            return True
        first = F.size_expert_cache(free, reserve, slot_bytes, cap, asked, cap_what=what)
        avail, room = SL.host_tier_room()
        tier = LX.host_tier_bytes(LX.host_tier_pairs(pairs, first.slots, opts.learns), slot_bytes)
        if room is not None and tier > room:
            self.info.miss_tier = (
                f"cpu (a host tier of {tier} B ({tier / 2**20:.1f} MiB) does not fit the {avail} B "
                f"({avail / 2**20:.1f} MiB) of available host memory less 4 GiB)"
            )
            return False
        return True

    def _host_tier(self, cache: SlotCache, opts: ResolvedOptions, n_expert: int, note: dict) -> HostTier | None:
        """The host tier of the pairs the cache does not hold (``--miss-tier``: ``auto`` and ``pcie`` build it,
        ``cpu`` does not; :class:`~strata.engine.gpu.slots.HostTier`), or None.

        Raises:
            ExpertCacheError: ``--miss-tier pcie`` with a tier above the host's available memory (both numbers);
                ``auto`` then leaves the misses to the CPU and says so in the start-up notes.
        """
        info = self.info
        rest = [(il, e) for il in cache.source.layers for e in range(n_expert) if not cache.resident(il, e)]
        if not rest:
            info.miss_tier = ""
            return None
        if opts.miss_tier == "cpu":
            info.miss_tier = "cpu"
            return None
        _avail, room = SL.host_tier_room()
        bk = self.bk
        bk.synchronize()
        before = bk.mem_info().free
        try:
            tier = HostTier(cache, rest, cuda=bk.name == "cuda", avail=room)
        except HostTierError as e:
            if opts.miss_tier == "pcie":
                raise ExpertCacheError(
                    f"--miss-tier pcie: {e}; refusing (--miss-tier cpu computes misses on the CPU)"
                ) from None
            info.miss_tier = f"cpu ({e})"
            return None
        assert tier.nbytes == LX.host_tier_bytes(len(rest), cache.slot_bytes)
        if bk.name != "cuda":  # the sim's card takes the driver's mapping as the budget models it
            bk.external(LX.host_tier_map_bytes(tier.nbytes), "the host tier's device mapping")
        bk.synchronize()
        info.host_tier_map_bytes = before - bk.mem_info().free  # measured: device memory the mapping took
        info.miss_tier, info.host_tier_bytes, info.host_tier_pairs = "pcie", tier.nbytes, len(tier)
        if self.share < 1:  # the tier holds every pair; moe_route splits each token's (dec.moe.set_split)
            note["miss split"] = MS.split_note(self.share, self.decoder.moe.K, len(rest))
        note["host_tier_bytes"] = tier.nbytes
        note["host_tier_pairs"] = len(tier)
        got = probe_pcie(tier, getattr(self.experts and self.experts.chunk_path, "staging", None), bk.name == "cuda")
        if got is not None and got[0] is not None:
            info.pcie_gbs_measured = round(got[0], 2)
            note["pcie"] = f"{info.pcie_gbs_measured} GB/s host tier -> VRAM (measured: {got[1]} B x {PROBE_COPIES})"
        return tier

    # ------------------------------------------------------------------ the reserve and the drafter

    def refuse_eaten_reserve(self, free: int, reserve: int, where: str) -> None:
        """Refuse a start with less than ``reserve`` bytes free at ``where`` (docs/DESIGN.md "The head before
        the cache", "The reserve and the prompt buffers"), naming what every stage so far took.

        Raises:
            StartupRefused: with the free bytes, the reserve and each stage's device memory.
        """
        if free >= reserve:
            return
        marks, prev, took = self.info.marks, None, []
        for stage, d in marks.items():
            if prev is not None:
                took.append(f"{stage} {d['gpu_used_bytes'] - marks[prev]['gpu_used_bytes']} B")
            prev = stage
        raise StartupRefused(
            f"{where}: {free} B ({free / F.MIB:.1f} MiB) free on {self.info.device}, under the {reserve} B "
            f"({reserve / F.MIB:.1f} MiB) that must stay free (--vram-reserve-mib {self.opts.vram_reserve_mib}"
            + (f" + {self.draft_bind_need} B of draft-head bind buffers" if self.draft_bind_need else "")
            + "); "
            f"device memory taken by stage: {', '.join(took) or '-'}; refusing to start on top of the reserve "
            f"(strata-budget check plans every term: a smaller --ctx, fewer slots or another card)"
        )

    @property
    def draft_bind_need(self) -> int:
        """The draft head's bind buffers the cache sizing must leave room for (0 without one)."""
        return getattr(self, "_bind_need", 0)

    def load_drafter(self, pack: Pack, plan: LoadPlan, model: Decoder, note: dict) -> None:
        """The ``drafter`` stage: the NextN draft blocks' dense tensors in engine form, in one arena (the
        draft head is loaded where the plan puts it; this engine does not run speculative decoding), and
        the bind bytes the expert cache must leave free for them
        (:func:`strata.layout.buffers.draft_bind_bytes`)."""
        import numpy as np

        from strata.engine import engine_form as EF
        from strata.packer import quants

        ents = list(plan.draft.values())
        sizes = [quants.engine_nbytes(e.type, e.src_type, e.ne) for e in ents]
        offs, total = LB.arena_layout(sizes)
        arena = self.bk.empty_bytes(total) if total else None
        pool = np.memmap(pack.pool_path, dtype=np.uint8, mode="r")
        for e, off, n in zip(ents, offs, sizes):
            ef = EF.to_engine_form(pool[e.offset : e.offset + e.nbytes], e.type, e.src_type, e.ne, name=e.name)
            self.bk.copy_into(arena[off : off + n], ef)
        self._draft_arena = arena
        self.info.draft_engine_bytes = sum(sizes)
        self._bind_need = LB.draft_bind_bytes(
            [(e.type, e.src_type, e.ne) for e in ents],
            self._draft_kv_per_token(model, plan),
            self.opts.n_ctx,
            model.hp.n_embd,
        )
        note["engine_bytes"] = self.info.draft_engine_bytes
        note["draft tensors"] = len(ents)
        note["bind_bytes_reserved"] = self._bind_need

    def _draft_kv_per_token(self, model: Decoder, plan: LoadPlan) -> int:
        h = model.hp
        layers = sorted({int(n.split(".")[1]) for n in plan.draft})
        return sum(
            LK.kv_bytes_per_token(LK.KVLayer(il, h.n_head_kv * h.head_dim, h.n_head_kv * h.head_dim_v), self.info.kv)
            for il in layers
        )

    def bind_drafter(self, plan: LoadPlan, model: Decoder, opts: ResolvedOptions, note: dict) -> None:
        """The ``bind`` stage: the draft head's bind buffers (GEMV outputs, f32 vector copies, its K/V
        cache, the ``eh_proj`` input row), into the room the expert cache left for them."""
        from strata.packer import quants

        bk = self.bk
        ents = list(plan.draft.values())
        pieces = [
            LB.matvec_out_bytes(e.ne)
            if quants.n_elements(e.ne) != e.ne[0]
            else LB.vector_f32_bytes(e.type, e.src_type, e.ne)
            for e in ents
        ]
        kv = self._draft_kv_per_token(model, plan) * opts.n_ctx
        pieces += [kv, LB.F32_BYTES * 2 * model.hp.n_embd]
        # one allocation of exactly the reserved bytes: the f32-aligned pieces, rounded to the driver's pages
        # as strata.layout.buffers.draft_bind_bytes rounds them
        total = sum(pieces)
        if total > LB.DRIVER_PACKED_MAX_BYTES:
            total = -(-total // LB.DRIVER_PAGE_BYTES) * LB.DRIVER_PAGE_BYTES
        self._bind_arena = bk.empty_bytes(total)
        self.info.draft_bind_bytes = total
        assert self.info.draft_bind_bytes == self._bind_need, (self.info.draft_bind_bytes, self._bind_need)
        note["bind_bytes"] = self.info.draft_bind_bytes

    def finish(self, engine: Engine) -> None:
        engine.probe = GpuStepProbe(self.bk, self.experts, self.decoder)
        engine.decoder = self.decoder
        engine.gpu = self.info
        self.bk.synchronize()
        free = self.bk.mem_info().free
        self.info.free_after_bytes = free
        # the reserve is still free after start-up, measured (docs/DESIGN.md "The head before the cache")
        self.refuse_eaten_reserve(free, self.info.reserve_bytes, "after start-up")


__all__ = ["GpuDevice", "GpuInfo"]
