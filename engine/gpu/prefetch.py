"""The fused step's expert prefetch: a predicted miss copied over PCIe while the layers before it run.

At a high hit rate the misses left are few (98% hits on the Qwen3-30B-A3B geometry: ~6 of a token's 384 selections)
but each one stalls its layer: the batched expert matvecs read it from the host tier over PCIe (~3 MiB, ~77 us on an
H200) only once the layer's routing is known, and nothing else in that layer can run meanwhile. The routing of layer
``j`` is predictable from the output of layer ``j - 1`` (the residual changes only by layer ``j``'s attention in
between): layer ``j``'s router on that output, normed with layer ``j``'s ``ffn_norm``, ranks 88% of the experts layer
``j`` then selects among its top ``K`` and 97% among its top ``2K`` (the 30B-A3B geometry with
``TokenRouting(0.5)`` routers, 6 layers, 1,280 selections: ``bench/prefetch_recall.py``; from layer ``j - 1``'s
attention output instead, before its experts: 54% / 70%). Pre-gating, as in "Pre-gated MoE" (Hwang et al. 2024)
and Eliseev & Mazur 2023 (Mixtral offloading).

So, per MoE layer ``j >= 1`` of the full graph (cuda/prefetch.cu):

1. the ``resid_norm`` after layer ``j - 1`` also writes that row normed with layer ``j``'s ``ffn_norm`` (``xn2``);
2. on a side stream (forked there, in the same CUDA graph): layer ``j``'s router on ``xn2`` (the exact ``matvec``),
   ``moe_stage`` (of the ``K`` best predicted experts, those in the host tier, most probable first, at most
   :data:`strata.layout.step.PREFETCH_SLOTS`) and ``moe_stage_copy`` (their bytes into the staging slots; no reader
   of them is left in the main stream: layer ``j - 1``'s experts ran before the fork);
3. the main stream joins the side stream before layer ``j``'s ``moe_route``, which reads a selected host-tier expert
   from its staging slot when it was staged.

The copy overlaps layer ``j``'s attention (~45 us on the 30B-A3B step). The staged bytes are the tier's bytes of the
same (layer, expert) and the expert kernels are the same, so the tokens and logits do not depend on the prediction
(tested bitwise on the sim and on CUDA); a wrong prediction costs only PCIe time. A staged expert is still a miss in
every count; the bytes of a staged expert no layer read are added to the PCIe bytes (the link carried them), and
:meth:`Prefetch.counts` says how many were staged and how many were read (per step, per layer, in the routing
record's copy: :meth:`Prefetch.build_readback`).

It runs where the step is one graph and reads misses from the host tier (:attr:`Prefetch.active`, decided when the
cache is bound): not with every pair in a slot (nothing can miss), nor in the hybrid step (its misses go to the CPU).
Experts whose staging slots would pass :data:`strata.layout.step.PREFETCH_MAX_BYTES` get none (nothing is built).
``STRATA_PREFETCH=0`` turns it off (an A/B switch: the buffers and graphs stay, so the budget's plan does not change).
Its device bytes are :func:`strata.layout.step.prefetch_bytes`, part of the budget's "prefill/activations" term; its
two graphs (the whole step with its launches, with and without the head) are captured with the others, before the
expert cache is sized (:func:`strata.budget.formulas_gpu.fused_graph_count`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.layout import step as LS
from strata.manifests.names import tensor_name

from ..errors import ExpertCacheError

#: The sim's addresses of the staging slots start here (the device slots' are 1 + offset, the host tier's from
#: :data:`strata.engine.gpu.slots.SIM_HOST_BASE` = 1 << 48).
SIM_STAGE_BASE = 1 << 47


def asked_off() -> bool:
    """``STRATA_PREFETCH`` in the environment: ``0`` / ``off`` / ``false`` / ``no`` turn the prefetch off; unset,
    empty, ``1`` / ``on`` / ``true`` / ``yes`` leave it on where it applies.

    Raises:
        ExpertCacheError: any other value, named (a typo is not silently taken as on).
    """
    raw = os.environ.get("STRATA_PREFETCH", "")
    v = raw.strip().lower()
    if v in ("", "1", "on", "true", "yes"):
        return False
    if v in ("0", "off", "false", "no"):
        return True
    raise ExpertCacheError(f"STRATA_PREFETCH={raw!r}: expected 0, off, false or no (no prefetch) or 1, on, true, yes")


@dataclass
class StageSet:
    """One staging set (what ``moe_stage`` writes and ``moe_route`` reads): ``n`` entries; ``staged`` int32 ``[n]``
    (tag ``layer * n_expert + id`` or -1), ``src`` u64 ``[n]`` (the host-tier address copied, 0: none),
    ``counts`` int32 ``[n_layer, 2]`` (per layer this step: entries staged, staged entries read; shared by the sets),
    ``base``: the address of the set's first staging slot (device address, or a sim address)."""

    n: int
    staged: Any
    src: Any
    counts: Any
    base: int


class Prefetch:
    """The prefetch of one fused decoder's MoE step (module docstring): buffers made at construction (before the
    expert cache measures what is free), launches added by :meth:`build` / :meth:`join` as the step's list is built.

    ``moe``: the :class:`strata.engine.gpu.fused_moe.MoeStep` (its layers, slot table, host-tier address, slot
    stride and blob offsets)."""

    def __init__(self, moe, dec, backend):
        self.moe, self.dec = moe, dec
        n, E, sb = moe.n_embd, moe.E, moe.slot_bytes
        self.entries = LS.prefetch_entries(sb)  # 0: experts too large to stage (no prefetch, nothing built)
        P, S = (LS.PREFETCH_SLOTS, LS.PREFETCH_SETS) if self.entries else (0, 0)
        bk = backend
        self.xn2 = bk.empty_f32(n)
        self.logits = bk.empty_f32(E)
        self.staged = bk.empty_bytes(4 * S * P).view(np.int32)
        self.src = bk.empty_bytes(8 * S * P).view(np.uint64)
        n_layer = dec.model.hp.n_layer
        self.counters = bk.empty_bytes(8 * n_layer).view(np.int32)
        self.storage = bk.empty_bytes(S * P * sb)
        self.nbytes = LS.prefetch_bytes(n, E, sb, n_layer)
        self.layers = set(moe.layers)
        self.totals = np.zeros((n_layer, 2), np.int64)  # per layer, staged and read: since start-up or reset_counts
        #: per layer, bytes a staged expert's copy carried (its blob span) and a miss read in place carries (its parts)
        self.span = np.array([self._span(il) if il in self.layers else 0 for il in range(n_layer)], np.int64)
        self.blob = np.array([moe.blob_bytes.get(il, 0) for il in range(n_layer)], np.int64)
        self.built: set[int] = set()  # the layers whose staging launches are in the list
        self.active = False  # decided by bind (MoeStep.bind_cache)
        if dec.cuda:
            import cupy as cp

            from .fused_ops import CudaOps

            if S * P:
                self.staged.set(np.full(S * P, -1, np.int32))
                self.src.set(np.zeros(S * P, np.uint64))
            self.counters.set(np.zeros(2 * n_layer, np.int32))
            self._counters_mem = cp.cuda.alloc_pinned_memory(8 * n_layer)
            self.counters_host = np.frombuffer(self._counters_mem, np.int32, 2 * n_layer)
            self.counters_host[:] = 0
            self.pinned_bytes = 8 * n_layer
            self.side = cp.cuda.Stream(non_blocking=True)
            self.ops = CudaOps(self.side)
            self._fork, self._join = (cp.cuda.Event(disable_timing=True) for _ in range(2))
            base = int(self.storage.data.ptr)
        else:
            self.staged[...] = -1
            self.counters_host = np.zeros(2 * n_layer, np.int32)
            self.pinned_bytes = 0
            self.ops = dec._ops  # the sim runs the list in order: one stream
            base = SIM_STAGE_BASE
        part = [slice(s * P, (s + 1) * P) for s in range(S)]
        self.sets = [
            StageSet(P, self.staged[q], self.src[q], self.counters, base + s * P * sb) for s, q in enumerate(part)
        ]

    def norm_args(self, j: int) -> dict:
        """The extra arguments of the ``resid_norm`` after layer ``j - 1`` when layer ``j`` is prefetched (``w2`` =
        layer ``j``'s ``ffn_norm``, ``xn2``), else ``{}``."""
        if j not in self.layers or j < 1 or not self.entries:
            return {}
        ffn_norm = self.dec.model.blocks[j].ffn_norm
        return {"w2": self.dec.model.w.get(tensor_name(ffn_norm, j)), "xn2": self.xn2}

    def build(self, j: int, add) -> None:
        """Add layer ``j``'s staging launches (after the ``resid_norm`` :meth:`norm_args` gave ``w2`` to): the fork
        onto the side stream, the router on ``xn2``, ``moe_stage``, ``moe_stage_copy``."""
        m, ops, st = self.moe, self.ops, self.sets[j % LS.PREFETCH_SETS]
        stage = f"L{j} prefetch"
        t, buf, rows, ne0, _out = self.dec.model.w.matvec_args(tensor_name("ffn_gate_inp.weight", j))
        nbytes = int(self.span[j])
        add(f"fork prefetch L{j}", stage, self._fork_run(), "edge")
        add(f"prefetch router L{j}", stage, ops.matvec(t, buf, rows, ne0, self.xn2, self.logits), "side")
        add(
            f"prefetch plan L{j}",
            stage,
            ops.moe_stage(self.logits, m.E, m.K, m.slot_of, j, m.host_ptr, m.slot_bytes, st),
            "side",
        )
        copy = ops.moe_stage_copy(st, m.slot_bytes, nbytes, read=m._bytes_at, dest=(self.storage, SIM_STAGE_BASE))
        add(f"prefetch copy L{j}", stage, copy, "side")
        self.built.add(j)

    def join(self, j: int, add) -> None:
        """Add the main stream's wait for layer ``j``'s staging (before its ``moe_route``), where :meth:`build` ran."""
        if j in self.built:
            add(f"join prefetch L{j}", f"L{j} ffn", self._join_run(), "edge")

    def stage_of(self, j: int) -> StageSet | None:
        """Layer ``j``'s staging set for its ``moe_route`` (None where it is not prefetched)."""
        return self.sets[j % LS.PREFETCH_SETS] if j in self.built else None

    def _fork_run(self):
        if not self.dec.cuda:
            return lambda: None
        ev, side = self._fork, self.side

        def run():
            ev.record(self.dec.stream)
            side.wait_event(ev)

        return run

    def _join_run(self):
        if not self.dec.cuda:
            return lambda: None
        ev, side = self._join, self.side

        def run():
            ev.record(side)
            self.dec.stream.wait_event(ev)

        return run

    @contextlib.contextmanager
    def forced_on(self):
        """:attr:`active` True inside the block, restored after (the decoder's list with the prefetch's launches,
        before the cache is bound: its graphs' capture, its stage timers' count)."""
        was, self.active = self.active, True
        try:
            yield
        finally:
            self.active = was

    def bind(self, tier, share: float) -> None:
        """Decide :attr:`active` when the cache is bound: a host tier holding pairs, no split of its misses with
        the CPU (``share`` 1), staging launches built and not ``STRATA_PREFETCH=0``. Off, the staged tags are
        cleared (-1): the other graphs' ``moe_route`` (which reads them too) then finds none, whatever ran before."""
        off = asked_off()  # (a bad value is refused wherever the cache is bound)
        self.active = bool(self.built) and tier is not None and len(tier) > 0 and share >= 1 and not off
        if not self.active and self.entries:
            if self.dec.cuda:
                self.staged.set(np.full(self.staged.size, -1, np.int32))
                self.dec.stream.synchronize()
            else:
                self.staged[...] = -1

    def _span(self, il: int) -> int:
        """Bytes ``moe_stage_copy`` copies for a layer-``il`` expert: its slot from byte 0 to the end of the down
        part (gate, up, down and the alignment between them), rounded up to 16."""
        m = self.moe
        return -(-(m.offsets[il][2] + m.part_bytes[il][2]) // 16) * 16

    def build_readback(self, add) -> None:
        """Add the end-of-step copy of the per-layer counters to pinned host memory (beside the routing record's;
        the prefetch's whole step only: kind ``side-memcpy``)."""
        if not self.built:
            return
        ops, nb = self.dec._ops, 4 * int(self.counters.size)
        dst = self._counters_mem.ptr if self.dec.cuda else self.counters_host
        add("copy prefetch counts to host", "routing record", ops.d2h(dst, self.counters, nb), "side-memcpy")

    def take(self, counters: np.ndarray, rows: np.ndarray) -> tuple[int, int, int]:
        """A step's counters (int32 ``[n_layer, 2]`` flattened, a copy of :attr:`counters_host`) at the MoE layers
        ``rows``: ``(staged, read, bytes)`` - experts staged and read (counts), and the bytes the staging carried
        beyond the misses' own (each staged expert's span, less each read one's parts, which the misses' count
        holds already). Adds to :meth:`counts`."""
        c = counters.reshape(-1, 2)[rows].astype(np.int64)
        staged, read = int(c[:, 0].sum()), int(c[:, 1].sum())
        extra = int((c[:, 0] * self.span[rows]).sum() - (c[:, 1] * self.blob[rows]).sum())
        self.totals[rows] += c
        return staged, read, extra

    def counts(self) -> tuple[int, int]:
        """(experts staged, staged experts read by ``moe_route``) since start-up or :meth:`reset_counts` (counts;
        the steps whose routing record was counted)."""
        return int(self.totals[:, 0].sum()), int(self.totals[:, 1].sum())

    def reset_counts(self) -> None:
        """Zero :meth:`counts`."""
        self.totals[...] = 0


__all__ = ["SIM_STAGE_BASE", "Prefetch", "StageSet", "asked_off"]
