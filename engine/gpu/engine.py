"""``strata-engine generate --device cuda``: the same forward pass on a GPU, weights in VRAM in
engine form, a slot-based expert cache sized by the budget module, misses on the CPU.

Start-up (:func:`load_engine_gpu`), each stage a checkpoint that records ``cudaMemGetInfo`` and the
CuPy pool's bytes (``extra``: ``gpu_free_bytes``, ``gpu_used_bytes``, ``pool_used_bytes``, and
the stage's own ``*_bytes`` figures), in this order (BRIEF.md, "Start-up order"):

1. ``pack`` - the strict readers and every load-time check (:func:`strata.engine.loader.check_pack`);
2. ``weights`` - dense layer weights uploaded by byte offset from the mapped ``pool.bin``, each
   converted to engine form (:mod:`strata.engine.engine_form`) on the way;
3. ``head`` - the output head, BEFORE the expert cache (incident 1: a head loaded after the cache
   ate the reserve);
4. ``session`` - KV cache, rope tables, per-tensor output buffers: allocated before the slots, so
   "free" below is what this process has left (incident 2);
5. ``expert cache`` - ``--expert-cache auto``: ``budget.formulas.expert_slots(free, reserve,
   slot_bytes, cap)`` on the free memory measured right there; ``--expert-cache N``: N slots or a
   refusal with both numbers (never a silently smaller cache). Filled once from a profile (the
   budget module's ranking and per-layer ranges) or from the ``resident`` policy; without a
   profile, free slots also admit experts first-come during decode (no eviction);
6. ``prompt path`` - kernel compilation and warm-up steps at positions 0 and ``n_ctx - 1`` (pool
   blocks of the largest sizes allocated here, so the token loop allocates no new device memory;
   the benchmark and tests check the pool does not grow during decode).

Hit/miss (all or nothing): a routed expert in a slot runs on the GPU (3 matvecs + ``silu_mul``);
a miss runs on the CPU from the memory-mapped shard with :func:`strata.engine.gpu.reference.expert_ffn`,
which replays the GPU's arithmetic bit for bit - so an expert's output, and therefore the tokens,
do not depend on which experts are resident.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from strata.budget import formulas as F
from strata.engine import engine_form as EF
from strata.manifests.contract import geometry_from_params
from strata.packer import quants
from strata.packer.packfmt import IndexEntry, Pack, open_pack

from ..checkpoints import Checkpoint, Checkpoints
from ..dequant import dequantize_rows
from ..experts import ExpertPath, ShardExperts, resident_pairs
from ..generate import DEFAULT_N_CTX, Engine, GenerateError
from ..loader import check_pack
from ..models import model_class
from ..tokenizer import load_tokenizer
from . import reference as R
from .backend import Backend, make_backend

#: Default VRAM reserve (MiB) left free after the expert cache (the documents' --vram-reserve-mib).
DEFAULT_RESERVE_MIB = 700
#: Alignment of every engine-form buffer inside a slot (f32 scale planes need 4; 256 keeps loads aligned).
SLOT_ALIGN = 256


class ExpertCacheError(GenerateError):
    """An expert cache that cannot be built as asked (both numbers in the message)."""


def _align(n: int, a: int = SLOT_ALIGN) -> int:
    return (n + a - 1) // a * a


def _rows_of(e: IndexEntry) -> int:
    return e.ne1 * e.ne2 * e.ne3


# ---------------------------------------------------------------------------- weights

class DeviceWeights:
    """The :class:`strata.engine.weights.Weights` interface over VRAM.

    Matrices live in engine form (one device buffer each, ``engine_bytes`` counts them exactly);
    ``matmul`` runs the type's matvec kernel into a buffer preallocated per tensor at upload, so
    the token loop allocates no output memory. Vectors (norms, biases) are also kept as f32 for
    ``get`` (``f32_vector_bytes``). Tensors read only by rows (an untied ``token_embd``) stay in
    the memory-mapped pool on the host: one row is dequantized there per token and copied up into a
    preallocated buffer (the budget's "embeddings on host").
    """

    def __init__(self, pack: Pack, dense: dict[str, IndexEntry], backend: Backend):
        self.backend = backend
        self.xp = backend.xp
        self._pool = np.memmap(pack.pool_path, dtype=np.uint8, mode="r")
        self._entries = dense
        self._buf: dict[str, Any] = {}
        self._type: dict[str, int] = {}
        self._out: dict[str, Any] = {}
        self._f32: dict[str, Any] = {}
        self._row_buf: Any = None
        self.engine_bytes = 0
        self.f32_vector_bytes = 0
        self.output_bytes = 0

    def has(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> IndexEntry:
        return self._entries[name]

    def _raw(self, e: IndexEntry) -> np.ndarray:
        return self._pool[e.offset:e.offset + e.nbytes]

    def upload(self, names: Iterable[str]) -> int:
        """Upload ``names`` in engine form (by byte offset from the pool); returns engine bytes added."""
        added = 0
        for name in names:
            if name in self._buf:
                continue
            e = self._entries[name]
            ef = EF.to_engine_form(self._raw(e), e.type, e.src_type, e.ne, name=name)
            self._buf[name] = self.backend.upload(ef)
            self._type[name] = EF.engine_type(e.type, e.src_type)
            added += ef.size
            rows = _rows_of(e)
            if rows == 1:  # a vector: also f32 for get()
                v = dequantize_rows(np.asarray(self._raw(e)).reshape(1, -1), e.type, e.ne0, name=name)[0]
                self._f32[name] = self.backend.upload(v.view(np.uint8)).view(self.xp.float32)
                self.f32_vector_bytes += v.nbytes
            else:
                self._out[name] = self.backend.empty_f32(rows)
                self.output_bytes += 4 * rows
        self.engine_bytes += added
        return added

    def get(self, name: str):
        a = self._f32.get(name)
        if a is not None:
            return a
        # a matrix asked for whole (not on the token path of the models here): dequantize on the host
        e = self._entries[name]
        rows = _rows_of(e)
        m = dequantize_rows(np.asarray(self._raw(e)).reshape(rows, -1), e.type, e.ne0, name=name)
        return self.xp.asarray(m)

    def matmul(self, name: str, x):
        e = self._entries[name]
        return self.backend.matvec(self._type[name], self._buf[name], _rows_of(e), e.ne0, x, out=self._out[name])

    def rows(self, name: str, ids: list[int]):
        e = self._entries[name]
        rows = _rows_of(e)
        raw = np.asarray(self._raw(e)).reshape(rows, -1)[np.asarray(ids, dtype=np.int64)]
        host = dequantize_rows(raw, e.type, e.ne0, name=name)
        if len(ids) == 1:
            if self._row_buf is None or self._row_buf.size != e.ne0:
                self._row_buf = self.backend.empty_f32(e.ne0)
            self.backend.copy_into(self._row_buf, host[0])
            return self._row_buf.reshape(1, e.ne0)
        return self.xp.asarray(host)


# ---------------------------------------------------------------------------- expert cache

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

    mode: str                  # "auto" | "fixed"
    slots: int
    slot_bytes: int            # per-slot stride (largest engine-form blob, parts aligned)
    max_blob_engine: int       # budget.formulas.expert_blob_bytes(engine=True), largest layer
    free_bytes: int            # cudaMemGetInfo free when the cache was opened
    reserve_bytes: int
    cap: int | None
    cache_bytes: int


class SlotCache:
    """VRAM slots holding experts in engine form (gate | up | down, each at a 256-aligned offset).

    One allocation of ``slots * slot_bytes`` bytes, made once. ``fill(pairs)`` loads experts by
    offset from the memory-mapped shards (converted to engine form); ``admit`` takes a free slot at
    decode time (first-come, no eviction); ``ffn`` runs a resident expert on the device.
    """

    def __init__(self, source: ShardExperts, backend: Backend, n_embd: int, n_ff: int, n_slots: int):
        self.source, self.backend = source, backend
        self.layouts: dict[int, tuple[PartLayout, PartLayout, PartLayout]] = {}
        for il in source.layers:
            row, shp = source.rows[il], source.shapes[il]
            off, parts = 0, []
            for t, (ne0, rows) in ((row.gate_type, shp.gate), (row.up_type, shp.up), (row.down_type, shp.down)):
                nb = quants.engine_nbytes(t, t, (ne0, rows))
                parts.append(PartLayout(t, ne0, rows, off, nb))
                off = _align(off + nb)
            self.layouts[il] = (parts[0], parts[1], parts[2])
        self.slot_bytes = max((p[2].offset + p[2].nbytes for p in self.layouts.values()), default=0)
        self.slot_bytes = _align(self.slot_bytes)
        self.n_slots = int(n_slots)
        self.storage = backend.empty_bytes(self.n_slots * self.slot_bytes) if self.n_slots else None
        self.where: dict[tuple[int, int], int] = {}
        self.n_embd, self.n_ff = n_embd, n_ff
        self.admit_enabled = False
        self.admitted = 0

    def __len__(self) -> int:
        return len(self.where)

    @property
    def free_slots(self) -> int:
        return self.n_slots - len(self.where)

    def _load(self, il: int, e: int) -> None:
        s = len(self.where)
        base = s * self.slot_bytes
        raws = self.source.raw(il, e)
        for part, raw in zip(self.layouts[il], raws):
            ef = EF.to_engine_form(raw, part.type_id, part.type_id, (part.ne0, part.rows), name=f"blk.{il} expert {e}")
            dst = self.storage[base + part.offset: base + part.offset + part.nbytes]
            self.backend.copy_into(dst, ef)
        self.where[(il, e)] = s

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
        return True

    def resident(self, il: int, e: int) -> bool:
        return (il, e) in self.where

    def _view(self, s: int, p: PartLayout):
        b = s * self.slot_bytes + p.offset
        return self.storage[b:b + p.nbytes]

    def ffn(self, il: int, e: int, x):
        s = self.where[(il, e)]
        g_l, u_l, d_l = self.layouts[il]
        bk = self.backend
        g = bk.matvec(g_l.type_id, self._view(s, g_l), g_l.rows, g_l.ne0, x)
        u = bk.matvec(u_l.type_id, self._view(s, u_l), u_l.rows, u_l.ne0, x)
        h = bk.silu_mul(g, u)
        return bk.matvec(d_l.type_id, self._view(s, d_l), d_l.rows, d_l.ne0, h)


class GpuExpertPath(ExpertPath):
    """:class:`strata.engine.experts.ExpertPath` with the CPU miss path made bit-identical to the
    GPU hit path (:func:`strata.engine.gpu.reference.expert_ffn`) and per-token timers
    (``cpu_expert_ms``: host time spent on misses, incl. the device->host copy of ``x``)."""

    def __init__(self, source: ShardExperts, cache: SlotCache | None, backend: Backend):
        super().__init__(source, cache, xp=backend.xp)
        self.backend = backend
        self.cpu_expert_ms = 0.0
        self._x_host: tuple[int, Any, np.ndarray] | None = None

    def miss_ffn(self, il: int, e: int, x):
        t0 = time.perf_counter()
        if self._x_host is None or self._x_host[0] != il or self._x_host[1] is not x:
            self._x_host = (il, x, self.backend.to_host(x).astype(np.float32, copy=False))
        xh = self._x_host[2]
        g, u, d = self.source.weights(il, e)
        row = self.source.rows[il]
        y = R.expert_ffn((row.gate_type, row.up_type, row.down_type), g, u, d, xh)
        out = self.xp.asarray(y)
        self.cpu_expert_ms += (time.perf_counter() - t0) * 1000
        if isinstance(self.cache, SlotCache):
            self.cache.admit(il, e)
        return out

    def take_cpu_ms(self) -> float:
        v, self.cpu_expert_ms = self.cpu_expert_ms, 0.0
        return v


# ---------------------------------------------------------------------------- profile fill

def profile_pairs(pairs: list[tuple[int, int, int]], slots: int) -> list[tuple[int, int]]:
    """The (layer, expert) pairs the profile fill loads, in load order: ranked by count
    (descending; ties by layer, then expert), per-layer ranges from
    :func:`strata.budget.formulas.layer_ranges`, a full layer skipping only its own pairs. The
    counts are cross-checked against :func:`strata.budget.formulas.fill_profile` (the one
    definition of the rule); a disagreement raises."""
    per_layer: dict[int, int] = {}
    for il, _e, _c in pairs:
        per_layer[int(il)] = per_layer.get(int(il), 0) + 1
    ranges = F.layer_ranges(per_layer, slots)
    filled = {il: 0 for il in per_layer}
    out = []
    for c, il, e in sorted(((int(c), int(il), int(e)) for il, e, c in pairs), key=lambda r: (-r[0], r[1], r[2])):
        if filled[il] >= ranges[il]:
            continue
        filled[il] += 1
        out.append((il, e))
    ref = F.fill_profile(pairs, slots)
    if ref.used != len(out) or any(L.filled != filled[L.layer] for L in ref.layers):
        raise ExpertCacheError(f"profile fill disagrees with budget.formulas.fill_profile: {len(out)} vs {ref.used} pairs")
    return out


# ---------------------------------------------------------------------------- loader

@dataclass
class GpuInfo:
    """GPU-side facts of a loaded engine (bytes), for audit, stats and the benchmark."""

    backend: str
    device: str
    weights_engine_bytes: int = 0
    head_engine_bytes: int = 0
    f32_vector_bytes: int = 0
    output_buffer_bytes: int = 0
    kv_bytes: int = 0
    rope_bytes: int = 0
    slot_plan: SlotPlan | None = None
    filled: int = 0
    fill: str = ""
    pool_after_warmup: int = 0
    marks: dict[str, dict[str, int]] = field(default_factory=dict)


def _mark(backend: Backend, note: dict, info: GpuInfo, name: str) -> None:
    backend.synchronize()
    m = backend.mem_info()
    d = {"gpu_free_bytes": m.free, "gpu_used_bytes": m.total - m.free, "gpu_total_bytes": m.total,
         "pool_used_bytes": m.pool_used, "pool_total_bytes": m.pool_total}
    note.update(d)
    info.marks[name] = d


def load_engine_gpu(pack_dir: str | Path, *, n_ctx: int = DEFAULT_N_CTX, resident: str | float = "all",
                    on_checkpoint: Callable[[Checkpoint], None] | None = None, device: str = "cuda",
                    expert_cache: str | int = "auto", profile: list[tuple[int, int, int]] | None = None,
                    vram_reserve_mib: int = DEFAULT_RESERVE_MIB, admit: bool | None = None,
                    backend: Backend | None = None, warmup: bool = True) -> Engine:
    """Open, check and load ``pack_dir`` for the GPU path (see the module docstring).

    Args:
        resident: without a profile, the pairs the start-up fill may load (``all`` | ``none`` |
            ``half`` | fraction, as the CPU path's ``--resident``), in layer/expert order.
        expert_cache: ``"auto"`` or a slot count.
        profile: ``(layer, expert, count)`` rows (e.g. :func:`strata.budget.plan.read_profile`).
        admit: first-come admission of misses into free slots; default on without a profile.
        backend: a :class:`~strata.engine.gpu.backend.Backend` (default: ``make_backend(device)``).

    Raises:
        ExpertCacheError: ``expert_cache`` N that does not fit (N x slot bytes vs free - reserve).
        Everything :func:`strata.engine.generate.load_engine` raises.
    """
    if n_ctx < 1:
        raise GenerateError(f"n_ctx {n_ctx} < 1")
    bk = backend or make_backend(device)
    info = GpuInfo(bk.name, bk.device_name())
    cps = Checkpoints(on_checkpoint)
    with cps.stage("pack") as note:
        pack = open_pack(pack_dir)
        geom = geometry_from_params(pack.arch, pack.geometry_params)
        cls = model_class(pack.arch)
        plan = check_pack(pack, geom)
        note["arch"] = pack.arch
        note["device"] = info.device
        _mark(bk, note, info, "pack")

    weights = DeviceWeights(pack, plan.dense, bk)
    source = ShardExperts(plan) if plan.experts else None
    experts = GpuExpertPath(source, None, bk) if source is not None else None
    model = cls(geom, weights, experts, pack.metadata)
    head = set(model.head_tensors())
    rows_only = set(model.row_tensors())
    with cps.stage("weights") as note:
        info.weights_engine_bytes = weights.upload([n for n in plan.dense if n not in head and n not in rows_only])
        note["engine_bytes"] = info.weights_engine_bytes
        note["host rows"] = ",".join(sorted(rows_only)) or "-"
        _mark(bk, note, info, "weights")
    with cps.stage("head") as note:
        info.head_engine_bytes = weights.upload(sorted(head))
        note["tensor"] = model.head
        note["engine_bytes"] = info.head_engine_bytes
        _mark(bk, note, info, "head")
    with cps.stage("session") as note:
        state = model.new_state(n_ctx)
        tokenizer = load_tokenizer(pack)
        info.kv_bytes = state.cache.nbytes
        info.rope_bytes = state.nbytes - state.cache.nbytes
        info.f32_vector_bytes = weights.f32_vector_bytes
        info.output_buffer_bytes = weights.output_bytes
        note["n_ctx"] = n_ctx
        note["kv_bytes"] = info.kv_bytes
        _mark(bk, note, info, "session")
    with cps.stage("expert cache") as note:
        if source is not None:
            n_expert = int(geom["n_expert"])
            n_embd, n_ff = int(geom["n_embd"]), int(geom["n_ff_exp"])
            if profile is not None:
                eligible_n = len(profile)
            else:
                eligible = resident_pairs(resident, source.layers, n_expert)
                eligible_n = len(eligible)
            probe = SlotCache(source, bk, n_embd, n_ff, 0)  # layouts only, no allocation
            max_blob = max(F.expert_blob_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff, engine=True)
                           for r in source.rows.values())
            bk.synchronize()
            free = bk.mem_info().free
            reserve = vram_reserve_mib * F.MIB
            cap = eligible_n if (profile is not None or resident != "all") else len(source.layers) * n_expert
            if expert_cache == "auto":
                slots = F.expert_slots(free, reserve, probe.slot_bytes, cap)
                mode = "auto"
            else:
                slots = int(expert_cache)
                mode = "fixed"
                if slots < 0:
                    raise ExpertCacheError(f"--expert-cache {slots}: a slot count cannot be negative")
                if slots * probe.slot_bytes > free - reserve:
                    raise ExpertCacheError(
                        f"--expert-cache {slots}: {slots} slots x {probe.slot_bytes} B = {slots * probe.slot_bytes} B, "
                        f"but {free} B free - {reserve} B reserve = {free - reserve} B are available "
                        f"(at most {F.expert_slots(free, reserve, probe.slot_bytes)} slots); refusing rather than "
                        "building a smaller cache")
            cache = SlotCache(source, bk, n_embd, n_ff, slots)
            if profile is not None:
                order = profile_pairs(profile, slots)
                info.fill = f"profile ({len(profile)} pairs)"
            else:
                order = eligible
                info.fill = f"resident={resident} (layer, expert order)"
            info.filled = cache.fill(order)
            admit_on = (profile is None) if admit is None else bool(admit)
            experts.cache = cache
            info.slot_plan = SlotPlan(mode, slots, probe.slot_bytes, max_blob, free, reserve, cap,
                                      slots * probe.slot_bytes)
            note["slots"] = slots
            note["slot_bytes"] = probe.slot_bytes
            note["max_blob_engine"] = max_blob
            note["cache_bytes"] = slots * probe.slot_bytes
            note["filled"] = info.filled
            note["fill"] = info.fill + (", first-come admission" if admit_on else "")
            note["free_at_open_bytes"] = free
            note["reserve_bytes"] = reserve
        else:
            note["slots"] = 0
            note["fill"] = "dense model"
        _mark(bk, note, info, "expert cache")
    with cps.stage("prompt path") as note:
        if warmup:
            # compiles every kernel and allocates the pool blocks one step uses; position 0 is
            # overwritten by the first real token
            model.step(0, 0, state, logits=True)
            if n_ctx > 1:
                # and at the last position: attention temporaries are largest there, so the pool
                # holds blocks big enough for every later step (no new device memory in the loop)
                model.step(0, n_ctx - 1, state, logits=True)
            if experts is not None:
                experts.step_counts()
                experts.counts.hits = experts.counts.misses = 0
                experts.counts.per_layer_misses.clear()
                experts.take_cpu_ms()
        if experts is not None and isinstance(experts.cache, SlotCache):
            experts.cache.admit_enabled = admit_on  # after the warm-up: its routing must not fill slots
        _mark(bk, note, info, "prompt path")
        info.pool_after_warmup = info.marks["prompt path"]["pool_total_bytes"]
    eng = Engine(pack, geom, plan, weights, model, tokenizer, state, experts, cps.done, device=bk.name)
    eng.gpu = info  # type: ignore[attr-defined]
    return eng


def load_engine_cuda(pack_dir, **kw) -> Engine:
    """:func:`load_engine_gpu` on the CUDA backend (``strata-engine generate --device cuda``)."""
    return load_engine_gpu(pack_dir, device="cuda", **kw)
