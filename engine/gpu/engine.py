"""``strata-engine generate --device cuda``: the same forward pass on a GPU, weights in VRAM in
engine form, a slot-based expert cache sized by the budget module, misses on the CPU.

Start-up (:func:`load_engine_gpu`), each stage a checkpoint that records ``cudaMemGetInfo`` and the
CuPy pool's bytes (``extra``: ``gpu_free_bytes``, ``gpu_used_bytes``, ``pool_used_bytes``, and
the stage's own ``*_bytes`` figures), in this order (BRIEF.md, "Start-up order"): everything the
engine will ever hold is allocated before the expert cache measures what is free, so the cache
takes exactly what is left minus the reserve and nothing allocated later eats the reserve:

1. ``pack`` - the strict readers and every load-time check (:func:`strata.engine.loader.check_pack`);
2. ``weights`` - dense layer weights uploaded by byte offset from the mapped ``pool.bin``, each
   converted to engine form (:mod:`strata.engine.engine_form`) on the way, with one preallocated
   f32 GEMV output per matrix (:func:`strata.budget.formulas.matvec_out_bytes`);
3. ``head`` - the output head, before the expert cache (incident 1);
4. ``session`` - KV cache (``kv`` f16 | f32; sliding-window layers as ring buffers of the budget's
   size), rope tables, the embedding row, the expert hit path's vectors (incident 2);
5. ``prompt path`` - every kernel the engine will run is compiled and loaded (dense and expert
   types). Dense models (gemma3, qwen2) get the fused step (:mod:`strata.engine.gpu.fused`): its
   activation buffers and pinned staging memory are allocated, one eager step loads its kernels,
   and the step is captured as CUDA graphs (``graph=False`` / ``--no-graph``: replayed eagerly).
   MoE models keep the generic per-layer path, whose warm-up steps at positions 0 and ``n_ctx - 1``
   put the largest temporaries in the CuPy pool. Either way the token loop allocates no new
   device memory (the tests and the benchmark check the pool does not grow during decode). Device
   memory taken here outside the pool is the CUDA runtime's first-use cost (kernel modules, graph
   instantiation; no cuBLAS: attention is elementwise + reductions or the fused kernel), which the
   budget charges as a measured constant (manifests/cards.toml ``cuda_runtime_mib``);
6. ``expert cache`` - ``--expert-cache auto``: ``budget.formulas.expert_slots(free, reserve,
   slot_bytes, cap)`` on the free memory measured right there; ``--expert-cache N``: N slots or a
   refusal with both numbers (never a silently smaller cache). Slots are laid out by
   :func:`strata.budget.formulas.expert_slot_layout`. Filled once from a profile (the budget
   module's ranking and per-layer ranges) or from the ``resident`` policy; without a profile, free
   slots also admit experts first-come during decode (no eviction).

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
from strata.packer import quants
from strata.packer.packfmt import IndexEntry, Pack

from .. import layers
from ..checkpoints import Checkpoint, Checkpoints
from ..dequant import dequantize_rows
from ..experts import ExpertPath, ShardExperts, resident_pairs
from ..generate import DEFAULT_KV, DEFAULT_N_CTX, Engine, GenerateError, check_ctx, check_kv, open_checked
from ..tokenizer import load_tokenizer
from . import reference as R
from .backend import Backend, make_backend
from .fused import FusedDecoder, FusedUnsupported, StageTimes, StageTimesRefused, describe, fused_unsupported

#: Default VRAM reserve (MiB) left free after the expert cache (the documents' --vram-reserve-mib).
DEFAULT_RESERVE_MIB = 700
#: Alignment of every engine-form buffer inside a slot (the budget's, so the plan is the layout).
SLOT_ALIGN = F.EXPERT_PART_ALIGN


class ExpertCacheError(GenerateError):
    """An expert cache that cannot be built as asked (both numbers in the message)."""


def _rows_of(e: IndexEntry) -> int:
    return e.ne1 * e.ne2 * e.ne3


# ---------------------------------------------------------------------------- weights

class DeviceWeights:
    """The :class:`strata.engine.weights.Weights` interface over VRAM.

    Matrices live in engine form (one device buffer each, ``engine_bytes`` counts them exactly);
    ``matmul`` runs the type's matvec kernel into an f32 output preallocated per tensor at upload
    (``output_bytes``), so the token loop allocates no output memory. Vectors (norms, biases) are
    read as f32 by ``get``: an F32 vector's engine-form buffer is viewed as f32 (no copy), others
    get an f32 copy (``f32_vector_bytes``). Tensors read only by rows (an untied ``token_embd``)
    stay in the memory-mapped pool on the host: one row is dequantized there per token and copied
    up into a preallocated buffer (``row_bytes``; the budget's "embeddings on host").
    Every size is one function of :mod:`strata.budget.formulas` (the budget's "engine buffers").
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
        self.row_bytes = 0

    def has(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> IndexEntry:
        return self._entries[name]

    def _raw(self, e: IndexEntry) -> np.ndarray:
        return self._pool[e.offset:e.offset + e.nbytes]

    def types(self) -> set[int]:
        """Kernel types of the uploaded tensors."""
        return set(self._type.values())

    def upload(self, names: Iterable[str]) -> int:
        """Upload ``names`` in engine form (by byte offset from the pool); returns engine bytes added."""
        added = 0
        for name in names:
            if name in self._buf:
                continue
            e = self._entries[name]
            ef = EF.to_engine_form(self._raw(e), e.type, e.src_type, e.ne, name=name)
            buf = self.backend.upload(ef)
            self._buf[name] = buf
            self._type[name] = EF.engine_type(e.type, e.src_type)
            added += ef.size
            if _rows_of(e) == 1:  # a vector: f32 for get()
                extra = F.vector_f32_bytes(e.type, e.src_type, e.ne)
                if extra == 0:  # engine form is F32 already: view it
                    self._f32[name] = buf.view(self.xp.float32)
                else:
                    v = dequantize_rows(np.asarray(self._raw(e)).reshape(1, -1), e.type, e.ne0, name=name)[0]
                    self._f32[name] = self.backend.upload(v.view(np.uint8)).view(self.xp.float32)
                    assert v.nbytes == extra
                self.f32_vector_bytes += extra
            else:
                nb = F.matvec_out_bytes(e.ne)
                self._out[name] = self.backend.empty_f32(nb // 4)
                self.output_bytes += nb
        self.engine_bytes += added
        return added

    def alloc_row_buffer(self, name: str) -> int:
        """Preallocate the f32 row ``rows(name, [id])`` is looked up into; returns its bytes."""
        e = self._entries[name]
        nb = F.embedding_row_bytes(e.ne0)
        self._row_buf = self.backend.empty_f32(nb // 4)
        self.row_bytes += nb
        return nb

    @property
    def buffer_bytes(self) -> int:
        """Engine buffers held here: GEMV outputs, f32 vector copies, the embedding row."""
        return self.output_bytes + self.f32_vector_bytes + self.row_bytes

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

    def matvec_args(self, name: str) -> tuple[int, Any, int, int, Any]:
        """``(kernel type, engine-form buffer, rows, ne0, preallocated output)`` of a matrix: what a
        launch list (:mod:`strata.engine.gpu.fused`) binds once."""
        e = self._entries[name]
        return self._type[name], self._buf[name], _rows_of(e), e.ne0, self._out[name]

    def host_row(self, name: str, row: int, out: np.ndarray) -> None:
        """Dequantize row ``row`` of ``name`` on the host from the memory-mapped pool into ``out``
        (f32, e.g. pinned memory): the values :meth:`rows` and the CPU path give."""
        e = self._entries[name]
        rows = _rows_of(e)
        if not 0 <= row < rows:
            raise GenerateError(f"{name}: row {row} outside 0..{rows - 1}")
        raw = np.asarray(self._raw(e)).reshape(rows, -1)[row:row + 1]
        out[...] = dequantize_rows(raw, e.type, e.ne0, name=name)[0]

    def rows(self, name: str, ids: list[int]):
        e = self._entries[name]
        rows = _rows_of(e)
        raw = np.asarray(self._raw(e)).reshape(rows, -1)[np.asarray(ids, dtype=np.int64)]
        host = dequantize_rows(raw, e.type, e.ne0, name=name)
        if len(ids) == 1 and self._row_buf is not None and self._row_buf.size == e.ne0:
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
    """VRAM slots holding experts in engine form, laid out by
    :func:`strata.budget.formulas.expert_slot_layout` (gate | up | down, each part 256-aligned).

    One allocation of ``slots * slot_bytes`` bytes, made once. ``fill(pairs)`` loads experts by
    offset from the memory-mapped shards (converted to engine form); ``admit`` takes a free slot at
    decode time (first-come, no eviction); ``ffn`` runs a resident expert on the device into the
    hit path's preallocated vectors (``bufs``: gate, up, act, out).
    """

    def __init__(self, source: ShardExperts, backend: Backend, n_embd: int, n_ff: int, n_slots: int,
                 bufs: tuple[Any, Any, Any, Any] | None = None):
        self.source, self.backend = source, backend
        self.layouts: dict[int, tuple[PartLayout, PartLayout, PartLayout]] = {}
        stride = 0
        for il in source.layers:
            row, shp = source.rows[il], source.shapes[il]
            ((go, gb), (uo, ub), (do, db)), st = F.expert_slot_layout(row.gate_type, row.up_type, row.down_type, n_embd, n_ff)
            parts = [PartLayout(t, ne0, rows, off, nb) for t, (ne0, rows), (off, nb) in
                     ((row.gate_type, shp.gate, (go, gb)), (row.up_type, shp.up, (uo, ub)), (row.down_type, shp.down, (do, db)))]
            for p in parts:  # the loader's shapes are the budget's expert_part_ne
                assert p.nbytes == quants.engine_nbytes(p.type_id, p.type_id, (p.ne0, p.rows)), (il, p)
            self.layouts[il] = (parts[0], parts[1], parts[2])
            stride = max(stride, st)
        self.slot_bytes = stride
        self.n_slots = int(n_slots)
        self.storage = backend.empty_bytes(self.n_slots * self.slot_bytes) if self.n_slots else None
        self.where: dict[tuple[int, int], int] = {}
        self.n_embd, self.n_ff = n_embd, n_ff
        self.bufs = bufs
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
        gb, ub, hb, yb = self.bufs if self.bufs is not None else (None, None, None, None)
        g = bk.matvec(g_l.type_id, self._view(s, g_l), g_l.rows, g_l.ne0, x, out=gb)
        u = bk.matvec(u_l.type_id, self._view(s, u_l), u_l.rows, u_l.ne0, x, out=ub)
        h = bk.silu_mul(g, u, out=hb)
        return bk.matvec(d_l.type_id, self._view(s, d_l), d_l.rows, d_l.ne0, h, out=yb)


class GpuExpertPath(ExpertPath):
    """:class:`strata.engine.experts.ExpertPath` with the CPU miss path made bit-identical to the
    GPU hit path (:func:`strata.engine.gpu.reference.expert_ffn`) and per-token timers
    (``cpu_expert_ms``: host time computing misses and copying their outputs up; the wait for the
    expert's input to come down counts in :class:`strata.engine.layers.HostWait`)."""

    def __init__(self, source: ShardExperts, cache: SlotCache | None, backend: Backend):
        super().__init__(source, cache, xp=backend.xp)
        self.backend = backend
        self.cpu_expert_ms = 0.0
        self._x_host: tuple[int, Any, np.ndarray] | None = None
        self.bufs: tuple[Any, Any, Any, Any] | None = None
        self.buffer_bytes = 0

    def alloc_hit_buffers(self, n_embd: int, n_ff: int) -> int:
        """Preallocate the hit path's f32 vectors (gate, up, act: ``n_ff``; out: ``n_embd``)."""
        bk = self.backend
        self.bufs = (bk.empty_f32(n_ff), bk.empty_f32(n_ff), bk.empty_f32(n_ff), bk.empty_f32(n_embd))
        self.buffer_bytes = F.expert_hit_buffer_bytes(n_embd, n_ff)
        assert self.buffer_bytes == sum(4 * b.size for b in self.bufs)
        return self.buffer_bytes

    def miss_ffn(self, il: int, e: int, x):
        if self._x_host is None or self._x_host[0] != il or self._x_host[1] is not x:
            self._x_host = (il, x, layers.to_host(x).astype(np.float32, copy=False))
        t0 = time.perf_counter()
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


class GpuStepProbe:
    """``--stats`` timers of one step (:class:`strata.engine.generate.StepProbe`): device span
    between CUDA events (``gpu_ms``; None on a simulated device), host time on missed experts
    (``cpu_expert_ms``), host time blocked on device->host copies (``wait_ms``)."""

    def __init__(self, backend: Backend, experts: GpuExpertPath | None):
        self.experts = experts
        self.span = backend.span_timer()

    def begin(self) -> None:
        layers.HostWait.take()
        if self.experts is not None:
            self.experts.take_cpu_ms()
        if self.span is not None:
            self.span.start()

    def end(self) -> dict[str, float | None]:
        gpu = self.span.stop() if self.span is not None else None
        cpu = self.experts.take_cpu_ms() if self.experts is not None else 0.0
        return {"gpu_ms": gpu, "cpu_expert_ms": cpu, "wait_ms": layers.HostWait.take()}


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
    """GPU-side facts of a loaded engine (bytes), for audit, stats and the benchmark.

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


def _mark(backend: Backend, note: dict, info: GpuInfo, name: str) -> None:
    backend.synchronize()
    m = backend.mem_info()
    d = {"gpu_free_bytes": m.free, "gpu_used_bytes": m.total - m.free, "gpu_total_bytes": m.total,
         "pool_used_bytes": m.pool_used, "pool_total_bytes": m.pool_total}
    note.update(d)
    info.marks[name] = d
    info.alloc_rounded[name] = backend.alloc_rounded_bytes


def _rounded(arrays, unit: int) -> int:
    return sum(-(-int(a.nbytes) // unit) * unit for a in arrays)


def load_engine_gpu(pack_dir: str | Path, *, n_ctx: int = DEFAULT_N_CTX, resident: str | float = "all",
                    on_checkpoint: Callable[[Checkpoint], None] | None = None, device: str = "cuda",
                    expert_cache: str | int = "auto", profile: list[tuple[int, int, int]] | None = None,
                    vram_reserve_mib: int = DEFAULT_RESERVE_MIB, admit: bool | None = None, kv: str = DEFAULT_KV,
                    sliding: str = "ring", backend: Backend | None = None, warmup: bool = True,
                    graph: bool = True, fused: bool | None = None, stage_times: bool = False,
                    on_warning: Callable[[str], None] | None = None) -> Engine:
    """Open, check and load ``pack_dir`` for the GPU path (see the module docstring).

    Args:
        resident: without a profile, the pairs the start-up fill may load (``all`` | ``none`` |
            ``half`` | fraction, as the CPU path's ``--resident``), in layer/expert order.
        expert_cache: ``"auto"`` or a slot count.
        profile: ``(layer, expert, count)`` rows (e.g. :func:`strata.budget.plan.read_profile`).
        admit: first-come admission of misses into free slots; default on without a profile.
        kv: KV cache type, ``f16`` (default) or ``f32``; ``sliding``: ``ring`` or ``full`` (as the CPU path).
        backend: a :class:`~strata.engine.gpu.backend.Backend` (default: ``make_backend(device)``).
        fused: the dense step as a fixed launch list (:mod:`strata.engine.gpu.fused`); default: on for
            the models it builds (gemma3, qwen2 in the f32 profile), off for MoE models (the generic
            per-layer path). True on a model it does not build raises FusedUnsupported.
        graph: with the fused step, capture it as CUDA graphs at the prompt-path checkpoint and replay
            them (``--no-graph``: the same launches one by one).
        stage_times: per-stage device timers (fused eager path only; refused with ``graph``).

    Raises:
        ExpertCacheError: ``expert_cache`` N that does not fit (N x slot bytes vs free - reserve).
        StageTimesRefused: ``stage_times`` with ``graph``, or on a model without the fused step.
        Everything :func:`strata.engine.generate.load_engine` raises.
    """
    if n_ctx < 1:
        raise GenerateError(f"n_ctx {n_ctx} < 1")
    check_kv(kv)
    if expert_cache != "auto" and int(expert_cache) < 0:
        raise ExpertCacheError(f"--expert-cache {expert_cache}: a slot count cannot be negative")
    if stage_times and graph:
        raise StageTimesRefused(
            "--stage-times: stage timers cannot measure inside a captured CUDA graph (events recorded between its "
            "launches record nothing); refusing rather than reporting zeros - add --no-graph")
    bk = backend or make_backend(device)
    info = GpuInfo(bk.name, bk.device_name(), kv=kv)
    cps = Checkpoints(on_checkpoint)
    with cps.stage("pack") as note:
        pack, geom, cls, plan = open_checked(pack_dir)
        note["arch"] = pack.arch
        note["device"] = info.device
        _mark(bk, note, info, "pack")

    weights = DeviceWeights(pack, plan.dense, bk)
    source = ShardExperts(plan) if plan.experts else None
    experts = GpuExpertPath(source, None, bk) if source is not None else None
    model = cls(geom, weights, experts, pack.metadata)
    check_ctx(model, geom, n_ctx, kv, bk.mem_info().free, f"free VRAM on {info.device} (cudaMemGetInfo)", sliding,
              on_warning)
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
        state = model.new_state(n_ctx, kv=kv, sliding=sliding)
        tokenizer = load_tokenizer(pack)
        for name in sorted(rows_only):
            info.row_buffer_bytes += weights.alloc_row_buffer(name)
        if experts is not None:
            info.hit_buffer_bytes = experts.alloc_hit_buffers(int(geom["n_embd"]), int(geom["n_ff_exp"]))
        info.kv_bytes = state.cache.nbytes
        info.rope_bytes = state.rope_nbytes
        info.f32_vector_bytes = weights.f32_vector_bytes
        info.output_buffer_bytes = weights.output_bytes
        info.buffer_bytes = weights.buffer_bytes + info.rope_bytes + info.hit_buffer_bytes
        # KV and rope arrays come from the array module itself, not through the backend
        info.session_rounded_bytes = _rounded(state.cache.k + state.cache.v + [a for r in state.ropes.values()
                                                                               for a in (r.cos, r.sin)], bk.POOL_UNIT)
        note["n_ctx"] = n_ctx
        note["kv"] = f"{kv}, {sliding}: {state.cache.sizes[0]}..{max(state.cache.sizes)} positions per layer"
        note["kv_bytes"] = info.kv_bytes
        note["buffer_bytes"] = info.buffer_bytes
        _mark(bk, note, info, "session")
    with cps.stage("prompt path") as note:
        # every kernel the engine will run is loaded now, before the cache measures free memory
        expert_types = {t for r in source.rows.values() for t in (r.gate_type, r.up_type, r.down_type)} if source else set()
        bk.prepare(weights.types() | expert_types)
        why = fused_unsupported(model)
        if fused and why:
            raise FusedUnsupported(why)
        if stage_times and why:
            raise StageTimesRefused(f"--stage-times: per-stage timers exist on the fused dense step only; {why}")
        if (fused is None or fused) and why is None:
            # the fused step: its buffers, one eager step (loads every kernel), then the graphs
            decoder = FusedDecoder(model, bk, state, graph=graph, stage_times=stage_times)
            for pos in sorted({0, n_ctx - 1} if warmup else {0}):
                decoder.step(0, pos, state, logits=True)
            decoder.capture()
            if decoder.captured and bk.name == "cuda":
                decoder.step(0, 0, state, logits=True)  # one replay: the graphs are uploaded and run
            decoder.stage_times = StageTimes()
            model = decoder
            info.decode_path = describe(decoder)
            info.launches_per_token = decoder.launches_per_token(True)
            info.fused_buffer_bytes = decoder.nbytes
            note["decode path"] = info.decode_path
        elif warmup:
            # allocates the pool blocks one step uses; positions are overwritten by real tokens. The
            # last two positions: attention temporaries are largest there, and one of the two reads a
            # wrapped ring (no new device memory in the token loop)
            for pos in sorted({0, max(n_ctx - 2, 0), n_ctx - 1}):
                model.step(0, pos, state, logits=True)
            if experts is not None:
                experts.take_step()
                experts.counts.hits = experts.counts.misses = 0
                experts.counts.per_layer_misses.clear()
                experts.take_cpu_ms()
        if info.decode_path == "":
            info.decode_path = f"generic per-layer path, eager ({why or 'fused step off'})"
            note["decode path"] = info.decode_path
        _mark(bk, note, info, "prompt path")
        a, b = info.marks["session"], info.marks["prompt path"]
        info.warmup_pool_bytes = b["pool_total_bytes"] - a["pool_total_bytes"]
        info.runtime_bytes = (b["gpu_used_bytes"] - a["gpu_used_bytes"]) - info.warmup_pool_bytes
        note["runtime_bytes"] = info.runtime_bytes
        note["warmup_pool_bytes"] = info.warmup_pool_bytes
    with cps.stage("expert cache") as note:
        if source is not None:
            n_expert = int(geom["n_expert"])
            n_embd, n_ff = int(geom["n_embd"]), int(geom["n_ff_exp"])
            if profile is not None:
                eligible_n = len(profile)
            else:
                eligible = resident_pairs(resident, source.layers, n_expert)
                eligible_n = len(eligible)
            slot_bytes = max(F.expert_slot_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff)
                             for r in source.rows.values())
            max_blob = max(F.expert_blob_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff, engine=True)
                           for r in source.rows.values())
            bk.synchronize()
            free = bk.mem_info().free
            reserve = vram_reserve_mib * F.MIB
            cap = eligible_n if (profile is not None or resident != "all") else len(source.layers) * n_expert
            if expert_cache == "auto":
                slots = F.expert_slots(free, reserve, slot_bytes, cap)
                mode = "auto"
            else:
                slots = int(expert_cache)
                mode = "fixed"
                if slots * slot_bytes > free - reserve:
                    raise ExpertCacheError(
                        f"--expert-cache {slots}: {slots} slots x {slot_bytes} B = {slots * slot_bytes} B, "
                        f"but {free} B free - {reserve} B reserve = {free - reserve} B are available "
                        f"(at most {F.expert_slots(free, reserve, slot_bytes)} slots); refusing rather than "
                        "building a smaller cache")
            cache = SlotCache(source, bk, n_embd, n_ff, slots, bufs=experts.bufs)
            assert cache.slot_bytes == slot_bytes
            if profile is not None:
                order = profile_pairs(profile, slots)
                info.fill = f"profile ({len(profile)} pairs)"
            else:
                order = eligible
                info.fill = f"resident={resident} (layer, expert order)"
            info.filled = cache.fill(order)
            admit_on = (profile is None) if admit is None else bool(admit)
            experts.cache = cache
            cache.admit_enabled = admit_on
            info.slot_plan = SlotPlan(mode, slots, slot_bytes, max_blob, free, reserve, cap, slots * slot_bytes)
            note["slots"] = slots
            note["slot_bytes"] = slot_bytes
            note["max_blob_engine"] = max_blob
            note["cache_bytes"] = slots * slot_bytes
            note["filled"] = info.filled
            note["fill"] = info.fill + (", first-come admission" if admit_on else "")
            note["free_at_open_bytes"] = free
            note["reserve_bytes"] = reserve
        else:
            note["slots"] = 0
            note["fill"] = "dense model"
        _mark(bk, note, info, "expert cache")
        info.pool_after_warmup = info.marks["expert cache"]["pool_total_bytes"]
    eng = Engine(pack, geom, plan, weights, model, tokenizer, state, experts, cps.done, device=bk.name, kv=kv,
                 probe=GpuStepProbe(bk, experts))
    eng.decoder = model if isinstance(model, FusedDecoder) else None  # type: ignore[attr-defined]
    eng.gpu = info  # type: ignore[attr-defined]
    return eng


def load_engine_cuda(pack_dir, **kw) -> Engine:
    """:func:`load_engine_gpu` on the CUDA backend (``strata-engine generate --device cuda``)."""
    return load_engine_gpu(pack_dir, device="cuda", **kw)
