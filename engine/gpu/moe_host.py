"""The host side of the hybrid decode step (:mod:`strata.engine.gpu.fused_moe`): one point per MoE layer.

Where some routed expert is in neither a VRAM slot nor the host tier, or the step splits the tier's misses with the
CPU (:mod:`strata.engine.gpu.miss_split`), the CPU computes it - from the host tier's pinned copy where that holds
the layer's native bytes, else from the mapped shard (:meth:`HybridHost.cpu_reads_tier`). Per MoE layer the step's
device work runs on without the host: ``moe_route`` (ids, weights, slots, part addresses), the copies of the routing
row and of the layer's input to pinned host memory, then a copy of the step's position to the layer's **flag** (the
last copy: the host sees it only once the two before it have landed), and the batched expert matvecs of the hits and
of the host tier's misses. The host point of the layer (:meth:`HybridHost.on_fill`, run between two graph segments)
spins on that flag instead of a stream synchronisation (no event, no round trip before the hits start), computes the
layer's CPU misses in two C calls (:class:`strata.engine.cpu.miss_calls.LayerMisses`, bit-identical to a hit) into
pinned, mapped host memory packed in selection order, and returns; the next segment's first kernel
(``moe_take_rows``, cuda/fused.cu) reads those rows over PCIe into the experts' outputs. No copy is queued per miss
and nothing is counted per layer: hits, CPU misses and misses over PCIe are counted from the step's routing record
after the step (:meth:`strata.engine.gpu.fused_moe.MoeStep.settle`), as on the one-graph path.

The flags are reset to -1 before each hybrid step is launched (:meth:`HybridHost.reset_flags`; the position copied in
is >= 0). A flag that never arrives is not waited for forever: the stream ending without writing it is refused with
the layer named (:class:`~strata.engine.errors.GenerateError`), a stream that failed raises CUDA's own error.

What the flag relies on: the three copies are consecutive nodes of one stream (one graph segment), so the flag's copy
starts after the routing row's and the input's have completed, and the host (x86: loads are not reordered with other
loads) reads them after it has seen the flag. Measured on the H200's x86 host; a host with a weaker memory order
(aarch64) would need an acquire fence between the flag and the reads - not built.
"""

from __future__ import annotations

import time

import numpy as np

from .. import layers
from ..errors import GenerateError
from . import reference as R

#: Polls of a layer's flag between two checks that the stream is still running (cudaStreamQuery).
POLLS_PER_QUERY = 4096


class HybridHost:
    """Mixin of :class:`strata.engine.gpu.fused_moe.MoeStep`: the hybrid step's host point (module docstring).

    Uses the step's ``K``, ``n_embd``, ``layers``, ``info_host`` (int32 ``[2K]``: the layer's ids then slots),
    ``xn_host`` (f32 ``[n_embd]``), ``source`` and ``model.experts``; :meth:`init_host` adds the flags and the
    CPU rows' buffer."""

    def init_host(self, cuda: bool, n_layer: int) -> int:
        """Allocate the flags (int32 ``[n_layer]``, pinned) and the CPU rows (f32 ``[K * n_embd]``, pinned and mapped:
        ``moe_take_rows`` reads them over PCIe); the sim's are NumPy arrays. Returns the pinned bytes."""
        K, n = self.K, self.n_embd
        self.miss_calls: dict = {}  # layer -> LayerMisses, made at the layer's first miss
        if cuda:
            import cupy as cp

            from .slots import HOST_ALLOC_FLAGS

            self.flag_mem = cp.cuda.alloc_pinned_memory(4 * n_layer)
            self.flag_host = np.frombuffer(self.flag_mem, np.int32, n_layer)
            self.rows_mem = cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(4 * K * n, HOST_ALLOC_FLAGS), 0)
            self.miss_host = np.frombuffer(self.rows_mem, np.float32, K * n)
            # the device's address of the mapped rows (cudaPointerGetAttributes; with UVA the host address)
            self.rows_dev = int(cp.cuda.runtime.pointerGetAttributes(self.rows_mem.ptr).devicePointer)
            pinned = 4 * (n_layer + K * n)
        else:
            self.flag_host = np.zeros(n_layer, np.int32)
            self.miss_host = np.zeros(K * n, np.float32)
            self.rows_dev = 0
            pinned = 0
        self.flag_host[...] = -1
        self.tuner = None  # the split's online choice (MoeStep.set_split), None: the table stays
        self.cpu_probe_us: float | None = None  # the start-up's CPU figure, us an expert (slots.cpu_experts_note)
        self._tune_to: int | None = None
        self._t0 = 0.0
        return pinned

    def reset_flags(self) -> None:
        """Before a hybrid step is launched (the previous one has ended): every layer's flag to -1; the split's table
        the tuner asked for after the last step written (:class:`~strata.engine.gpu.miss_split.SplitTuner`), and the
        step's clock started."""
        self.flag_host[...] = -1
        if self.tuner is not None:
            if self._tune_to is not None:
                self.apply_keep(self._tune_to)
                self._tune_to = None
            self._t0 = time.perf_counter()

    def await_routing(self, il: int) -> None:
        """Spin until layer ``il``'s flag has landed (its routing row and input are then in pinned memory); the time
        goes to ``layers.HostWait``.

        Raises:
            GenerateError: the flag did not land and the stream has ended (CUDA), or at once on the sim (its launches
                run in order: a missing flag there is a wiring error)."""
        f = self.flag_host
        if f[il] >= 0:
            return
        dec = self.dec
        if not dec.cuda:
            raise GenerateError(f"hybrid step: layer {il}'s routing flag was not written before its host point")
        t0, n = time.perf_counter(), 0
        while f[il] < 0:
            n += 1
            if n % POLLS_PER_QUERY == 0 and dec.stream.done and f[il] < 0:
                raise GenerateError(
                    f"hybrid step: layer {il}'s routing never reached the host (the stream ended without writing its "
                    f"flag after {(time.perf_counter() - t0) * 1000:.1f} ms)"
                )
        layers.HostWait.ms += (time.perf_counter() - t0) * 1000

    def miss_kernel(self, asked: str) -> str:
        """The CPU kernel of a miss: with the step's q8 numerics ``"q8-exact"`` (q8 for the types the GPU runs q8,
        exact for the rest: a miss is bit-identical to a hit either way); else the one asked (``"exact"`` by
        default, bit-identical to the exact GPU kernels)."""
        return "q8-exact" if self.dec.kernel == "q8" else asked

    def layer_misses(self, il: int):
        """Layer ``il``'s :class:`~strata.engine.cpu.miss_calls.LayerMisses` (made once, on the pinned input)."""
        got = self.miss_calls.get(il)
        if got is None:
            from ..cpu import kernels as CK
            from ..cpu.miss_calls import LayerMisses

            ex = self.model.experts
            got = self.miss_calls[il] = LayerMisses(
                self.source,
                il,
                self.E,
                self.xn_host,
                kernel=self.miss_kernel(ex.kernel),
                threads=ex.threads or CK.default_threads(),
                max_ids=self.K,
                silu_mul=R.silu_mul,
                addresses=self.tier_addresses if self._tier_native(il) else None,
            )
        return got

    def _tier_native(self, il: int) -> bool:
        from ..engine_form import engine_layout

        parts = getattr(self.cache, "layouts", {}).get(il)
        return (
            self.tier is not None
            and parts is not None
            and all(engine_layout(p.type_id, p.type_id, (p.ne0, p.rows)).kind == "native" for p in parts)
        )

    def cpu_reads_tier(self, il: int) -> bool:
        """Whether the CPU reads layer ``il``'s misses from the host tier rather than the mapped shards: the tier
        holds them, the layer's three parts are native there (:func:`strata.engine.engine_form.engine_layout` kind
        ``native``: the shard's bytes), and its miss call takes addresses (:attr:`strata.engine.cpu.miss_calls.
        LayerMisses.fast`; the other path reads the shards)."""
        return self._tier_native(il) and self.layer_misses(il).fast

    @property
    def cpu_reads_shards(self) -> bool:
        """Whether any CPU miss reads the mapped shards (their pages then prefetched at start-up)."""
        return not all(self.cpu_reads_tier(il) for il in self.layers)

    def tier_addresses(self, il: int, e: int) -> tuple[int, int, int]:
        """Host addresses of expert ``e``'s gate, up and down in the host tier (its pinned storage, slot layout
        ``cache.layouts[il]``), or in the shards where the tier does not hold the pair (a resident one)."""
        h = self.tier.where.get((il, e))
        if h is None:
            return self.source.addresses(il, e)
        b = self.tier.storage.__array_interface__["data"][0] + h * self.tier.slot_bytes
        g, u, d = (b + p.offset for p in self.cache.layouts[il])
        return g, u, d

    def on_fill(self, il: int) -> None:
        """Layer ``il``'s host point: wait for its routing (:meth:`await_routing`), compute the experts whose slot is
        -1 on the CPU into the packed rows ``moe_take_rows`` reads (bit-identical to hits with the default ``"exact"``
        miss kernel, :class:`~strata.engine.gpu.slots.GpuExpertPath`). Counting and admission happen after the step,
        from its routing record. At the last MoE layer the split's tuner is given the step's time so far."""
        self.await_routing(il)
        K = self.K
        ks = np.flatnonzero(self.info_host[K : 2 * K] == -1)
        if ks.size:
            ex = self.model.experts
            t0 = time.perf_counter()
            self.layer_misses(il).run(self.info_host[ks], self.miss_host)
            ex.cpu_expert_ms += (time.perf_counter() - t0) * 1000
        if self.tuner is not None and il == self.layers[-1]:  # the step up to its last host point, timed
            self._tune_to = self.tuner.observe(time.perf_counter() - self._t0)


__all__ = ["POLLS_PER_QUERY", "HybridHost"]
