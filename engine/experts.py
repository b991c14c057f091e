"""Routed experts: where they live (the GGUF shards), the resident set, and the hit/miss split.

Three pieces, each replaceable by the GPU path:

- :class:`ShardExperts` - the experts as they sit in the GGUF shards, memory-mapped read-only and
  located only by ``native_experts.txt`` (expert ``e`` of layer ``il``: ``gate_off + e * gate_stride``
  for ``gate_bytes`` in shard ``gate_shard``; likewise up and down). ``weights(il, e)`` dequantizes
  one expert; nothing else is read, so an unused expert's pages are never touched.
- an :class:`ExpertCache` - the resident set: ``resident(il, e)`` says whether expert ``e`` of
  layer ``il`` is a hit, ``ffn(il, e, x)`` runs a hit. :class:`strata.engine.cpu.experts.CpuExpertCache` is the
  CPU stand-in (a set of resident pairs; the CPU computes hits and misses alike); the GPU path plugs in its VRAM
  cache.
- :class:`ExpertPath` - per MoE layer, sends every selected expert to the cache (hit) or computes it
  from the shards (miss), then combines the outputs **in selection order**, whatever the split.

The hit path is all or nothing (docs/DESIGN.md "The hit path is all or nothing"): a selected expert runs
exactly once, either as a hit or as a miss, and both paths compute ``down @ (silu(gate @ x) * (up @ x))``
from the same f32 weights (:func:`strata.engine.layers.expert_ffn`), so the tokens cannot depend on which
experts are resident. ``tests/test_engine_moe.py`` checks all / half / none resident give identical logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from strata.packer import quants
from strata.packer.packfmt import ExpertLayer

from . import layers
from .checkpoints import proc_kib_bytes
from .chunk_routing import ChunkRouting, DeferredCounts, chunk_row_counts
from .cpu import kernels as cpukernels
from .dequant import dequantize_rows
from .gpu.reference import silu_mul as gpu_silu_mul
from .loader import LoadPlan
from .mapped import MappedFile

#: ``MADV_POPULATE_READ`` (linux/mman.h, Linux 5.14): prefault page tables, reading pages as needed.
MADV_POPULATE_READ = 22


def mem_available() -> int | None:
    """The host's available memory in bytes (/proc/meminfo ``MemAvailable``, kB x 1024), or None without it."""
    return proc_kib_bytes("/proc/meminfo", "MemAvailable")


def activation_in_c(silu_mul, down_type: int, kernel: str) -> bool:
    """Whether the experts' activation is made in C inside the down products' region (cpukernels.call_many_silu, the
    same bits): ``silu_mul`` is the GPU's (reference.silu_mul) and ``kernel`` runs q8 for ``down_type``."""
    return silu_mul is gpu_silu_mul and cpukernels.kernel_for(down_type, kernel) == "q8"


class ShardExperts:
    """Routed experts read by offset from the memory-mapped GGUF shards (see the module docstring)."""

    def __init__(self, plan: LoadPlan):
        self.rows: dict[int, ExpertLayer] = dict(plan.experts)
        self.shapes = dict(plan.expert_shapes)
        self._maps = {k: np.memmap(p, dtype=np.uint8, mode="r") for k, p in plan.shard_paths.items()}
        # watched for in-place changes before every step (strata.engine.mapped)
        self.mapped_files = [MappedFile(p) for p in plan.shard_paths.values()]
        # each shard's address in this process and size (bytes): the token path hands the C kernels addresses
        self._base = {k: (int(m.ctypes.data) if m.size else 0, int(m.size)) for k, m in self._maps.items()}
        self._addr: dict[tuple[int, int], tuple[int, int, int]] = {}  # (layer, expert) -> addresses, located once
        self._prefetch = None  # the populate thread prefetch() started, if any
        for il, r in self.rows.items():  # a part's bytes are its rows x the row size of its type (checked once)
            shp = self.shapes[il]
            for part, t, (ne0, rows), nbytes in (
                ("gate", r.gate_type, shp.gate, r.gate_bytes),
                ("up", r.up_type, shp.up, r.up_bytes),
                ("down", r.down_type, shp.down, r.down_bytes),
            ):
                need = quants.row_nbytes(t, ne0) * rows
                if nbytes != need:
                    raise ValueError(
                        f"blk.{il} {part} experts: {nbytes} bytes per expert in native_experts.txt, "
                        f"{quants.qtype(t).name} x {ne0} x {rows} is {need}"
                    )

    @property
    def layers(self) -> list[int]:
        return sorted(self.rows)

    def shard_bytes(self) -> int:
        """Total bytes of the mapped shards (every shard that holds an expert of this pack)."""
        return sum(int(m.size) for m in self._maps.values())

    def prefetch(self) -> str:
        """Start :meth:`populate` in a background thread when the shards fit in the host's available memory
        (``MemAvailable`` of /proc/meminfo, bytes), so that decode takes no page fault on an expert's first use
        and start-up does not wait for it. Returns what was done, for the start-up notes: ``"started"``, or why
        not (a model larger than the available memory would only evict itself)."""
        import threading

        def size(b: int) -> str:
            return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"

        need = self.shard_bytes()
        avail = mem_available()
        if avail is None:
            return "skipped: no /proc/meminfo"
        if need > avail:
            return f"skipped: the shards ({size(need)}) exceed available memory ({size(avail)})"
        self._prefetch = threading.Thread(target=self.populate, name="strata-expert-prefetch", daemon=True)
        self._prefetch.start()
        return f"started ({size(need)} of shards)"

    def prefetch_wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (None: no limit) for :meth:`prefetch`'s thread; True when none runs any more."""
        t = self._prefetch
        return t is None or (t.join(timeout) or not t.is_alive())

    def populate(self) -> bool:
        """Map every page of the shards into this process's page tables now (``madvise(MADV_POPULATE_READ)``,
        Linux 5.14+; what llama.cpp's ``MAP_POPULATE`` does at load), so that the token path takes no page
        fault on an expert's first use. The pages are file-backed (page cache): RssFile grows, RssAnon does
        not. Slow for shards not in the page cache (it reads them); the engine calls it from a background
        thread only when the shards fit in available memory (:func:`strata.engine.startup` ``prefetch``).
        Returns False where the kernel refuses it (nothing changes then)."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        ok = True
        for m in self._maps.values():
            if m.size and libc.madvise(m.ctypes.data, m.size, MADV_POPULATE_READ) != 0:
                ok = False
        return ok

    def locate(self, il: int, e: int) -> list[tuple[int, int, int]]:
        """Where expert ``e`` of layer ``il`` is: ``(shard, absolute offset, bytes)`` of its gate, up and down
        weights (``native_experts.txt``), each checked to lie inside its shard - the one place an expert's bytes
        are located (:meth:`raw` and :meth:`addresses` use it).

        Raises:
            KeyError: ``il`` is not an MoE layer. ValueError: a negative ``e``, or bytes past the shard's end
            (both numbers in the message).
        """
        out = []
        for part, shard, off, nbytes in self.rows[il].ranges(e):
            size = self._base[shard][1]
            if e < 0 or off + nbytes > size:
                raise ValueError(
                    f"blk.{il} expert {e}: {part} bytes {off}..{off + nbytes} are not in shard {shard} ({size} bytes)"
                )
            out.append((shard, off, nbytes))
        return out

    def raw(self, il: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expert ``e`` of layer ``il`` as three read-only byte views ``(gate, up, down)`` of the shards."""
        v = [self._maps[shard][off : off + nbytes] for shard, off, nbytes in self.locate(il, e)]
        return v[0], v[1], v[2]

    def addresses(self, il: int, e: int) -> tuple[int, int, int]:
        """The addresses in this process of expert ``e``'s gate, up and down bytes (the mapped shards; valid
        while this object lives): what the token path hands the C kernels, without building views."""
        got = self._addr.get((il, e))
        if got is None:
            a = [self._base[shard][0] + off for shard, off, _n in self.locate(il, e)]
            got = self._addr[(il, e)] = (a[0], a[1], a[2])
        return got

    def weights(self, il: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expert ``e`` of layer ``il`` dequantized: f32 ``gate [n_ff, n_embd]``, ``up [n_ff, n_embd]``,
        ``down [n_embd, n_ff]`` (numpy order: rows, row length)."""
        row, shp = self.rows[il], self.shapes[il]
        g, u, d = self.raw(il, e)
        out = []
        for raw, t, (ne0, ne1) in (
            (g, row.gate_type, shp.gate),
            (u, row.up_type, shp.up),
            (d, row.down_type, shp.down),
        ):
            out.append(dequantize_rows(raw.reshape(ne1, -1), t, ne0, name=f"blk.{il} expert {e}"))
        return out[0], out[1], out[2]

    def ffn(self, il: int, e: int, x: np.ndarray, **kw: Any) -> np.ndarray:
        """Expert ``e`` of layer ``il`` on ``x`` (f32 ``[n_embd]``): ``down @ (silu(gate @ x) * (up @ x))``,
        f32 ``[n_embd]``; :meth:`ffn_many` of one expert (the same bits; its keyword arguments and errors)."""
        return self.ffn_many(il, [e], x, **kw)[0]

    def ffn_many(
        self,
        il: int,
        experts: list[int],
        x: np.ndarray,
        *,
        exact: bool = False,
        silu_mul: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
        threads: int | None = None,
        act_quant: bool = False,
        kernel: str | None = None,
    ) -> np.ndarray:
        """Experts ``experts`` of layer ``il`` on the same ``x`` (f32 ``[n_embd]``): f32 ``[len(experts), n_embd]``
        (numpy order), row ``k`` = ``down_k @ silu_mul(gate_k @ x, up_k @ x)``, read in place from the mapped
        shards (nothing dequantized is kept; each expert's bytes are located by ``native_experts.txt``).

        Two C calls when gate and up share a type and shape (else three): ONE OpenMP region over all
        (expert, row) pairs of the gate and up products (``x`` quantized / laid out once), then ONE over the
        down products (with ``silu_mul=strata.engine.gpu.reference.silu_mul`` and a ``"q8"`` down the activation
        is made in that region: the same bits) - the threads spread over experts x rows. Row ``k`` is
        bit-identical to :meth:`ffn` of expert ``experts[k]`` alone (the same per-row code; the activation is
        elementwise).

        ``kernel`` (default ``"exact"`` if ``exact`` else ``"q8"``, :data:`strata.engine.cpu.kernels.KERNELS`):
        ``"exact"`` is the GPU kernels' summation order (with ``silu_mul=strata.engine.gpu.reference.silu_mul``
        a miss equals the GPU's hit bit for bit); ``"q8"`` llama.cpp's CPU numerics. ``silu_mul``: the
        activation on ``[len(experts), n_ff]`` arrays (default ``silu(g) * u``, :func:`strata.engine.layers.silu`).
        ``act_quant``: llama.cpp's activation rounding per weight type (:mod:`strata.engine.numerics`) for
        the products that do not run ``"q8"`` (which quantizes by itself). ``threads``: default all cores.

        Raises:
            KeyError: ``il`` is not an MoE layer. ValueError: an expert id whose bytes are not in the shard
            (negative, or past its end), an ``x`` of the wrong length, an unknown kernel.
        """
        from .numerics import quantize_activation as qa

        kernel = kernel or ("exact" if exact else "q8")
        threads = threads or cpukernels.default_threads()
        shp = self.shapes[il]
        (gt, ut, dt), ((ge0, gr), (ue0, ur), (de0, dr)) = self.types(il), (shp.gate, shp.up, shp.down)
        x = np.ascontiguousarray(x, dtype=np.float32)

        def prep(v: np.ndarray, t: int) -> np.ndarray:
            return qa(np, v, t) if act_quant and cpukernels.kernel_for(t, kernel) != "q8" else v

        if x.shape != (ge0,) or ue0 != ge0:
            raise ValueError(f"blk.{il} experts: x has shape {x.shape}, the gate and up rows have {ge0} / {ue0} values")
        addrs = [self.addresses(il, int(e)) for e in experts]
        n = len(addrs)
        if n == 0:
            return np.zeros((0, dr), dtype=np.float32)

        ga, ua, da = ([a[p] for a in addrs] for p in range(3))

        def products(t: int, bases: list[int], rows: int, ne0: int, ptrs: np.ndarray) -> np.ndarray:
            # y[m] = W_m @ x_m in one C call, x_m at address ptrs[m] (the parts' byte counts were checked at
            # construction, x's above); equal consecutive addresses are quantized / laid out once
            out = np.empty(len(ptrs) * rows, dtype=np.float32)
            cpukernels.call_many(
                t, kernel, np.array(bases, dtype=np.uint64), rows, ne0, quants.row_nbytes(t, ne0), ptrs, out, threads
            )
            return out.reshape(len(ptrs), rows)

        def same(v: np.ndarray, m: int) -> np.ndarray:  # m times the address of v
            return np.full(m, v.__array_interface__["data"][0], dtype=np.uint64)

        xg, xu = prep(x, gt), prep(x, ut)
        if (gt, ge0, gr) == (ut, ue0, ur) and (xg is xu or gt == ut):
            gu = products(gt, ga + ua, gr, ge0, np.concatenate([same(xg, n), same(xu, n)]))  # gate and up: one call
            g, u = gu[:n], gu[n:]
        else:
            g, u = products(gt, ga, gr, ge0, same(xg, n)), products(ut, ua, ur, ue0, same(xu, n))
        fuse = activation_in_c(silu_mul, dt, kernel)
        h = np.empty((n, de0), np.float32) if fuse else silu_mul(g, u) if silu_mul else layers.silu(np, g) * u
        if (g.shape if fuse else h.shape) != (n, de0):
            raise ValueError(f"blk.{il} experts: the activation has shape {h.shape}, the down rows have {de0} values")
        if fuse:  # silu_mul in the down products' OpenMP region, the same bits (cpukernels.call_many_silu)
            out, rb = np.empty(n * dr, dtype=np.float32), quants.row_nbytes(dt, de0)
            g, u = np.ascontiguousarray(g), np.ascontiguousarray(u)
            cpukernels.call_many_silu(dt, np.array(da, dtype=np.uint64), dr, de0, rb, g, u, h, out, threads)
            return out.reshape(n, dr)
        h = np.ascontiguousarray(h, dtype=np.float32)
        if act_quant and cpukernels.kernel_for(dt, kernel) != "q8":
            h = np.ascontiguousarray(np.stack([prep(h[k], dt) for k in range(n)]), dtype=np.float32)
        # row k of h at its address (rows are distinct inputs: each quantized / laid out by itself)
        return products(dt, da, dr, de0, h.__array_interface__["data"][0] + np.arange(n, dtype=np.uint64) * (4 * de0))

    def ffn_grouped(
        self,
        il: int,
        groups: list[tuple[int, np.ndarray]],
        *,
        threads: int | None = None,
        act_quant: bool = False,
        kernel: str | None = None,
    ) -> list[np.ndarray]:
        """A prompt chunk's experts of layer ``il``, grouped by expert: for each ``(e, X_e)`` (``X_e`` f32
        ``[T_e, n_embd]``, numpy order: the chunk's rows routed to expert ``e``) the output f32 ``[T_e, n_embd]``;
        row ``t`` is bit-identical to :meth:`ffn` of ``e`` on ``X_e[t]`` (the same per-row code; the activation
        is elementwise). Each expert's weights are read once for all its rows (:func:`strata.engine.cpu.kernels.
        call_matmat`): two C calls (gate and up of every expert together when they share a type, then down).

        Raises:
            KeyError: ``il`` is not an MoE layer. ValueError: an expert whose bytes are not in the shard, an
            ``X_e`` of the wrong width.
        """
        from .numerics import quantize_activation as qa

        kernel = kernel or "q8"
        threads = threads or cpukernels.default_threads()
        shp = self.shapes[il]
        (gt, ut, dt), ((ge0, gr), (ue0, ur), (de0, dr)) = self.types(il), (shp.gate, shp.up, shp.down)
        if not groups:
            return []
        xs = [np.ascontiguousarray(x, dtype=np.float32) for _, x in groups]
        bad = [x.shape for x in xs if x.ndim != 2 or x.shape[1] != ge0]
        if bad or ue0 != ge0:
            raise ValueError(
                f"blk.{il} experts: rows of shape {bad[:1]}, the gate and up rows have {ge0} / {ue0} values"
            )
        addrs = [self.addresses(il, int(e)) for e, _ in groups]

        def prep(v: np.ndarray, t: int) -> np.ndarray:
            q = act_quant and cpukernels.kernel_for(t, kernel) != "q8"
            return np.ascontiguousarray(qa(np, v, t), dtype=np.float32) if q else v

        def products(t: int, bases: list[int], rows: int, ne0: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
            b = np.array(bases, dtype=np.uint64)
            return cpukernels.call_matmat(t, kernel, b, rows, ne0, quants.row_nbytes(t, ne0), inputs, threads)

        xg = [prep(x, gt) for x in xs]
        xu = xg if ut == gt else [prep(x, ut) for x in xs]
        if (gt, ge0, gr) == (ut, ue0, ur):  # gate and up of every expert in one call, gate_k then up_k
            gu = products(gt, [a[p] for a in addrs for p in (0, 1)], gr, ge0, [v for x in xg for v in (x, x)])
            g, u = gu[0::2], gu[1::2]
        else:
            g, u = products(gt, [a[0] for a in addrs], gr, ge0, xg), products(ut, [a[1] for a in addrs], ur, ue0, xu)
        hs = [prep(np.ascontiguousarray(layers.silu(np, gk) * uk), dt) for gk, uk in zip(g, u)]
        return products(dt, [a[2] for a in addrs], dr, de0, hs)

    def types(self, il: int) -> tuple[int, int, int]:
        """ggml types of layer ``il``'s gate, up and down experts."""
        r = self.rows[il]
        return r.gate_type, r.up_type, r.down_type

    def blob_bytes(self, il: int) -> int:
        """Source bytes of one expert of layer ``il`` (gate + up + down; differs per layer)."""
        return self.rows[il].blob_bytes


class ExpertCache(Protocol):
    """The resident set the hit path serves (GPU: VRAM slots; CPU:
    :class:`strata.engine.cpu.experts.CpuExpertCache`)."""

    def resident(self, il: int, e: int) -> bool: ...

    def ffn(self, il: int, e: int, x: Any) -> Any: ...


def resident_pairs(policy: str | float, layers_: list[int], n_expert: int) -> list[tuple[int, int]]:
    """The (layer, expert) pairs a residency policy marks resident.

    ``"all"``, ``"none"``, ``"half"`` (a checkerboard: expert ``e`` of layer ``il`` iff
    ``(il + e) % 2 == 0``, so every layer has half its experts resident), or a fraction in
    ``[0, 1]`` (the first ``round(f * n_expert)`` experts of every layer).

    Raises:
        ValueError: an unknown policy or a fraction outside [0, 1].
    """
    if policy == "all":
        return [(il, e) for il in layers_ for e in range(n_expert)]
    if policy == "none":
        return []
    if policy == "half":
        return [(il, e) for il in layers_ for e in range(n_expert) if (il + e) % 2 == 0]
    try:
        f = float(policy)
    except (TypeError, ValueError):
        raise ValueError(f"expert residency {policy!r}: expected all, none, half or a fraction in [0, 1]") from None
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"expert residency fraction {f} is outside [0, 1]")
    k = round(f * n_expert)
    return [(il, e) for il in layers_ for e in range(k)]


@dataclass
class ExpertCounts:
    """Hit/miss counts (experts, not bytes or tokens)."""

    hits: int = 0
    misses: int = 0
    per_layer_misses: dict[int, int] = field(default_factory=dict)
    pcie: int = 0  # of the misses, those the GPU read from the host tier over PCIe (the rest ran on the CPU)
    pcie_bytes: int = 0  # the bytes over PCIe: those experts (engine form: gate + up + down) and the cache's swaps
    swaps: int = 0  # decode-time swaps between the VRAM slots and the host tier (--cache-policy class)
    prefetched: int = 0  # experts the fused step's prefetch copied ahead (strata.engine.gpu.prefetch)
    prefetch_read: int = 0  # of those, the ones their layer read


class ExpertPath:
    """The hit/miss split of one engine (see the module docstring).

    ``cache`` may be None (every expert a miss). ``counts`` accumulates over the run;
    ``take_step()`` returns and resets the per-layer counts since the last call (one position);
    ``reset_counts()`` starts both over. ``on_route`` (the routing hook, e.g. ``strata-engine
    profile``'s counter) sees every layer's selection ``(layer, expert ids)`` before it runs.
    ``kernel`` (default ``"exact"`` if ``exact`` else ``"q8"``): the CPU kernels of the misses.
    """

    def __init__(
        self,
        source: ShardExperts,
        cache: ExpertCache | None,
        xp=np,
        act_quant: bool = False,
        exact: bool = False,
        threads: int | None = None,
        kernel: str | None = None,
    ):
        self.source, self.cache, self.xp, self.act_quant = source, cache, xp, act_quant
        self.kernel = kernel or ("exact" if exact else "q8")
        self.exact, self.threads = self.kernel == "exact", threads
        self.counts = ExpertCounts()
        self._step: dict[int, list[int]] = {}  # layer -> [hits, misses, of them over PCIe] this step
        self._step_pcie = self._step_pcie_bytes = 0
        # the last chunk's routing a layer: (layer, ids [T, k], hits, misses, pcie, pcie bytes [T]), stacked later
        self._chunk_layers: list[tuple] = []
        self._chunk_stack: tuple | None = None
        self.on_route: Callable[[int, list[int]], None] | None = None

    def reset_counts(self) -> None:
        """Zero the run's counts and the current step's (e.g. after a warm-up step)."""
        self.counts = ExpertCounts()
        self._step = {}
        self._step_pcie = self._step_pcie_bytes = 0
        self._chunk_layers, self._chunk_stack = [], None

    def miss_ffn(self, il: int, e: int, x):
        return self.source.ffn(il, e, x, threads=self.threads, act_quant=self.act_quant, kernel=self.kernel)

    def outputs(self, il: int, x, ids: list[int]) -> Iterator:
        """Each selected expert's output on ``x``, in selection order, counted: a hit from the cache,
        a miss from :meth:`miss_ffn` (one expert at a time). A generator: an output may live in a buffer
        the next one reuses (the GPU slot cache's hit buffers), so each is valid until the next is asked."""
        for e in ids:
            if self.cache is not None and self.cache.resident(il, e):
                self.count(il, 1, 0)
                yield self.cache.ffn(il, e, x)
            else:
                self.count(il, 0, 1)
                yield self.miss_ffn(il, e, x)

    def __call__(self, il: int, x, ids: list[int], weights) -> Any:
        """``sum_k weights[k] * expert_{ids[k]}(x)``, summed in selection order (k = 0, 1, ...)."""
        if self.on_route is not None:
            self.on_route(il, ids)
        y = None
        for k, ye in enumerate(self.outputs(il, x, ids)):
            ye = ye * weights[k]
            y = ye if y is None else y + ye
        return y

    def chunk(self, il: int, X, ids: list[list[int]], weights) -> Any:
        """A prompt chunk through layer ``il``'s routed experts: ``X [T, n_embd]`` (numpy order), ``ids[t]`` the
        experts of row ``t`` in selection order, ``weights [T, k]``. Row ``t`` = ``sum_k weights[t, k] *
        expert_{ids[t][k]}(X[t])`` summed in selection order: :meth:`__call__`'s value per row. The outputs come
        from :meth:`chunk_outputs`; the routing hook and the counts of each row are kept until
        :meth:`replay` of that row (the loop reports one position at a time). Misses read from a host tier
        (:meth:`tier_bytes`) count as PCIe misses on every row that routes to them; their bytes go to the first row
        that does (a chunk reads each such expert once), so a chunk's rows sum to the bytes it read. ``ids`` may be a
        device array (the GPU's routing left there): copied to the host here."""
        if not isinstance(ids, (np.ndarray, list)):
            ids = layers.to_host(ids)
        r = ChunkRouting.of(ids)
        res, tb = self.residency(il, r.used)
        n = int(r.used.max()) + 1 if r.used.size else 0
        res_e, tb_e = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
        res_e[r.used], tb_e[r.used] = res, tb
        self._chunk_layers.append((il, r.ids, *chunk_row_counts(r.ids, res_e, tb_e)))
        self._chunk_stack = None
        return self.combine(self.chunk_outputs(il, X, r), weights)  # [T, k, n_embd] -> [T, n_embd]

    def combine(self, E, weights) -> Any:
        """A chunk's rows ``sum_k weights[t, k] * E[t, k]`` in selection order (``E [T, k, n]``, ``weights [T, k]``):
        each row what :meth:`__call__` sums for one position."""
        y = E[:, 0] * weights[:, 0:1]
        for k in range(1, E.shape[1]):
            y = y + E[:, k] * weights[:, k : k + 1]
        return y

    def chunk_outputs(self, il: int, X, r: ChunkRouting) -> Any:
        """Every selected expert's output on its row, ``[T, k, n_embd]`` (not counted: :meth:`chunk` does). One
        row and expert at a time here (a hit from the cache, a miss from :meth:`miss_ffn`); the CPU path groups
        the rows by expert."""
        xp = self.xp
        out = []
        for t, row in enumerate(r.ids.tolist()):
            ys = []
            for e in row:
                hit = self.cache is not None and self.cache.resident(il, e)
                ys.append(xp.array(self.cache.ffn(il, e, X[t]) if hit else self.miss_ffn(il, e, X[t]), copy=True))
            out.append(xp.stack(ys))
        return xp.stack(out)

    def replay(self, t: int) -> None:
        """Hand row ``t`` of the last chunk to the routing hook (each layer's selection, in layer order) and
        the counts (:meth:`take_step` then reports that position as if it had run alone); the chunk's record is
        dropped after its last row."""
        rows = self._chunk_layers
        if not rows:
            return
        if self._chunk_stack is None:
            dev = [i for i, r in enumerate(rows) if not isinstance(r[1], np.ndarray)]
            deferred = any(isinstance(rows[i][2], DeferredCounts) for i in dev)
            if dev and (self.on_route is not None or deferred):  # layers grouped on the device: their ids come down
                host = layers.to_host(self.xp.stack([rows[i][1] for i in dev])).astype(np.int64)  # once, together
                for n, i in enumerate(dev):
                    rows[i] = (rows[i][0], host[n], *rows[i][2:])
            for i, (il, sel, c, *_rest) in enumerate(rows):  # counts that waited for the ids
                if isinstance(c, DeferredCounts):
                    rows[i] = (il, sel, *chunk_row_counts(sel, c.resident, c.tier_bytes))
            self._chunk_stack = ([r[0] for r in rows], *(np.stack([r[j] for r in rows]) for j in range(2, 6)))
        if self.on_route is not None:
            for il, sel, *_ in rows:
                self.on_route(il, sel[t].tolist())
        ils, H, M, P, B = self._chunk_stack
        self.count_layers(ils, H[:, t], M[:, t], P[:, t], B[:, t])
        if t == rows[0][1].shape[0] - 1:
            self._chunk_layers, self._chunk_stack = [], None

    def residency(self, il: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For ``experts`` (int64) of layer ``il``: whether each is resident (bool) and the bytes a miss of it reads
        over PCIe from a host tier (int64; 0 for a resident one, :meth:`tier_bytes`)."""
        cache = self.cache
        res = np.array([cache is not None and cache.resident(il, e) for e in experts.tolist()], dtype=bool)
        tb = [0 if r else self.tier_bytes(il, e) for e, r in zip(experts.tolist(), res.tolist())]
        return res, np.array(tb, dtype=np.int64)

    def tier_bytes(self, il: int, e: int) -> int:
        """Bytes a miss of expert ``e`` in layer ``il`` reads over PCIe from a host tier (0: no host tier holds it;
        the GPU path overrides this)."""
        return 0

    def count(self, il: int, hits: int, misses: int, pcie: int = 0, pcie_bytes: int = 0) -> None:
        """Add one layer's routed experts to the counts (a path that splits hits and misses itself,
        e.g. the fused GPU step); ``pcie``: how many of the misses the GPU read from the host tier, ``pcie_bytes``
        their bytes."""
        self.counts.hits += hits
        self.counts.misses += misses
        self.counts.pcie += pcie
        self.counts.pcie_bytes += pcie_bytes
        self._step_pcie += pcie
        self._step_pcie_bytes += pcie_bytes
        if misses:
            self.counts.per_layer_misses[il] = self.counts.per_layer_misses.get(il, 0) + misses
        step = self._step.setdefault(il, [0, 0, 0])
        step[0] += hits
        step[1] += misses
        step[2] += pcie

    def count_link(self, nbytes: int, swaps: int = 0, prefetched: int = 0, prefetch_read: int = 0) -> None:
        """``nbytes`` the link carried beside the misses' reads (in :attr:`counts` and :meth:`take_pcie`: "MiB over
        PCIe" is every expert byte it carried): ``swaps`` of the cache (``MoeStep.swap``, a slot each way) or a step's
        prefetch (``prefetched`` copied ahead, ``prefetch_read`` of them read: ``strata.engine.gpu.prefetch``)."""
        c = self.counts
        c.swaps += swaps
        c.prefetched += prefetched
        c.prefetch_read += prefetch_read
        c.pcie_bytes += int(nbytes)
        self._step_pcie_bytes += int(nbytes)

    def count_layers(self, layers: Sequence[int], hits, misses, pcie, pcie_bytes) -> None:
        """:meth:`count` of every layer in ``layers`` at once - one call per step for a path that routes a whole step
        before the host sees it (the fused GPU step's routing record). ``hits``, ``misses``, ``pcie``, ``pcie_bytes``:
        int numpy arrays aligned with ``layers`` (counts of experts; bytes)."""
        c = self.counts
        h, m, p, b = int(hits.sum()), int(misses.sum()), int(pcie.sum()), int(pcie_bytes.sum())
        c.hits += h
        c.misses += m
        c.pcie += p
        c.pcie_bytes += b
        self._step_pcie += p
        self._step_pcie_bytes += b
        ms = misses.tolist()
        if m:
            for il, mi in zip(layers, ms):
                if mi:
                    c.per_layer_misses[il] = c.per_layer_misses.get(il, 0) + mi
        step = self._step
        for il, hi, mi, pi in zip(layers, hits.tolist(), ms, pcie.tolist()):
            hm = step.get(il)
            if hm is None:
                step[il] = [hi, mi, pi]
            else:
                hm[0] += hi
                hm[1] += mi
                hm[2] += pi

    def take_step(self) -> dict[int, tuple[int, int, int]]:
        """Per MoE layer, ``(hits, misses, pcie)`` since the previous call (counts of routed experts; ``pcie``: of the
        misses, those the GPU read from the host tier - the rest ran on the CPU)."""
        out = {il: (hm[0], hm[1], hm[2]) for il, hm in sorted(self._step.items())}
        self._step = {}
        return out

    def take_pcie(self) -> tuple[int, int]:
        """Misses read over PCIe from the host tier since the previous call: (count of experts, their bytes)."""
        v = (self._step_pcie, self._step_pcie_bytes)
        self._step_pcie = self._step_pcie_bytes = 0
        return v

    def step_counts(self) -> tuple[int, int]:
        """(hits, misses) since the previous call (summed over layers; resets like :meth:`take_step`)."""
        per = self.take_step()
        return sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
