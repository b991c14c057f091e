"""The fused decode step's launch list: its entries (:class:`Launch`) and how the step's matrix-vector products
are planned into it (:class:`MatvecLaunches`: the exact kernels, or the q8 kernels with their input quantized
once per activation format). The launches themselves are bound by :mod:`strata.engine.gpu.fused_ops`
(CUDA) or :mod:`strata.engine.gpu.fused_sim` (the ``sim`` backend).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .fused_ops import MAX_GROUP


@dataclass
class Launch:
    """One entry of the step: a kernel launch or a copy (``kind``), in stage ``stage``."""

    name: str
    stage: str
    run: Callable[[], None]
    # "kernel" | "memcpy" | "fill" (the host point: CPU misses) | "host" / "host-kernel" (hybrid only: copies for the
    # host point, moe_take_rows) | "side" / "edge" / "side-memcpy" (the whole step's prefetch only: its kernels on the
    # side stream, the fork onto it and the join back, its counters' copy: strata.engine.gpu.prefetch)
    kind: str = "kernel"


@dataclass
class StageTimes:
    """Device milliseconds per stage, summed over the steps that ran it (eager path only; ``n`` counts
    them: the head runs only on positions that produce logits)."""

    ms: dict[str, float] = field(default_factory=dict)
    n: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    def add(self, stage: str, ms: float) -> None:
        self.ms[stage] = self.ms.get(stage, 0.0) + ms
        self.n[stage] = self.n.get(stage, 0) + 1

    def per_token(self) -> dict[str, float]:
        """Mean ms of each stage over the steps that ran it."""
        return {k: v / self.n[k] for k, v in self.ms.items()}

    def grouped(self) -> dict[str, float]:
        """Per token: ``embed``, ``attn`` and ``ffn`` (summed over the layers), ``head``."""
        out: dict[str, float] = {}
        for k, v in self.per_token().items():
            key = k.split(" ", 1)[1] if k.startswith("L") else k
            out[key] = out.get(key, 0.0) + v
        return out


class MatvecLaunches:
    """The step's matrix-vector launches, added to the list in order by ``add(name, stage, run)``: the exact
    kernels, or - for a weight type ``q8_format`` gives a format (1 = Q8_0, 2 = Q8_K) - one ``quantize_q8`` of the
    input into ``xq`` (``xq_cap`` values at most; reused in stream order) then the ``matvec_q8`` launches.
    ``w``: the device weights (``matvec_args(name)`` = type, buffer, rows, ne0, output)."""

    def __init__(self, ops, w, add, q8_format, xq, xq_cap: int, plan: list, xn=None, xnq=None):
        self.ops, self.w, self.add, self.q8_format, self.xq, self.xq_cap = ops, w, add, q8_format, xq, xq_cap
        self.plan, self.xn, self.xnq = plan, xn, xnq
        self._pending: tuple[int, Callable[[int], Callable[[], None]]] | None = None
        self._xn_fmt = 0

    def normed(self, index: int, rebuild: Callable[[int], Callable[[], None]]) -> None:
        """The launch at ``plan[index]`` (a ``resid_norm``) wrote a new ``xn``; ``rebuild(fmt)`` is that launch also
        writing it quantized to ``fmt`` into ``xnq``. The first q8 matvec that reads this ``xn`` picks the format;
        matvecs of that format then read ``xnq`` (no quantize launch), others quantize ``xn`` into ``xq``."""
        self._pending, self._xn_fmt = (index, rebuild), 0

    def input(self, x, fmt: int, n: int, stage: str, what: str):
        """The quantized ``x`` for q8 matvecs of format ``fmt``: ``xnq`` when ``x`` is the normed row and its norm
        writes that format (chosen here by its first reader), else one ``quantize_q8`` launch into ``xq``."""
        if x is self.xn and self.xnq is not None:
            if self._pending is not None:
                index, rebuild = self._pending
                self._pending = None
                self.plan[index].run = rebuild(fmt)
                self.plan[index].name += f" + quantize q8 ({'Q8_0' if fmt == 1 else 'Q8_K'})"
                self._xn_fmt = fmt
            if fmt == self._xn_fmt:
                return self.xnq
        self.quantize(x, fmt, n, stage, what)
        return self.xq

    def quantize(self, x, fmt: int, n: int, stage: str, what: str) -> None:
        """One launch: ``x`` (``n`` values) quantized to ``fmt`` into ``xq`` for the q8 matvecs that follow."""
        if n > self.xq_cap:
            raise AssertionError(f"q8 input of {n} values > the buffer's {self.xq_cap}")
        self.add(f"quantize q8 {what}", stage, self.ops.quantize(x, self.xq, fmt, n))

    def mv(self, name: str, x, stage: str, out=None):
        """``name`` @ ``x`` into its preallocated output (or ``out``); returns the output."""
        t, buf, rows, ne0, o = self.w.matvec_args(name)
        out = o if out is None else out
        fmt = self.q8_format(t)
        if fmt:
            xq = self.input(x, fmt, ne0, stage, name)
            self.add(f"matvec_q8 {name}", stage, self.ops.matvec(t, buf, rows, ne0, x, out, xq=xq))
        else:
            self.add(f"matvec {name}", stage, self.ops.matvec(t, buf, rows, ne0, x, out))
        return out

    def group(self, names: list[str], x, stage: str) -> list:
        """Matvecs of ``names`` on one ``x``: one ``matvec_group`` launch per run of weights with the same type
        and row length (q/k/v; gate/up), a plain matvec for a weight alone; with the q8 kernels ``x`` is quantized
        once per activation format the weights meet. Returns the outputs in order."""
        ops, args = self.ops, [self.w.matvec_args(nm) for nm in names]
        for fmt in sorted({self.q8_format(a[0]) for a in args}):
            sel = [i for i, a in enumerate(args) if self.q8_format(a[0]) == fmt]
            xq = self.input(x, fmt, args[sel[0]][3], stage, " + ".join(names[i] for i in sel)) if fmt else None
            kind = "matvec_q8" if fmt else "matvec"
            i = 0
            while i < len(sel):
                j, a0 = i + 1, args[sel[i]]
                while j < len(sel) and j - i < MAX_GROUP and args[sel[j]][0] == a0[0] and args[sel[j]][3] == a0[3]:
                    j += 1
                run = sel[i:j]
                if len(run) == 1:
                    self.add(f"{kind} {names[run[0]]}", stage, ops.matvec(a0[0], a0[1], a0[2], a0[3], x, a0[4], xq=xq))
                else:
                    parts = [(args[r][1], args[r][2], args[r][4]) for r in run]
                    self.add(
                        f"{kind}_group {' + '.join(names[r] for r in run)}",
                        stage,
                        ops.matvec_group(a0[0], parts, a0[3], x, xq=xq),
                    )
                i = j
        return [a[4] for a in args]


#: The kinds of entry every whole-step list holds (others: the hybrid step's or the prefetch's, :class:`Launch`).
KINDS = ("kernel", "memcpy")
#: The kinds of the prefetch's entries (strata.engine.gpu.prefetch): in its whole step only.
PREFETCH_KINDS = ("side", "edge", "side-memcpy")


def run_timed(ls: list, times: StageTimes, events, stream, names: list[str]) -> None:
    """Run the launch list ``ls`` eagerly with stage timers into ``times``: a CUDA event (``events``, one more than
    the stages ``names``) before each stage and after the last, on ``stream``; the host clock where ``events`` is
    None (the sim). Milliseconds per stage."""
    if events is not None:
        i, cur = 0, None
        for L in ls:
            if L.stage != cur:
                events[i].record(stream)
                i, cur = i + 1, L.stage
            L.run()
        events[i].record(stream)
        events[i].synchronize()
        import cupy as cp

        for j, name in enumerate(names):
            times.add(name, float(cp.cuda.get_elapsed_time(events[j], events[j + 1])))
    else:
        cur, t0 = None, time.perf_counter()
        for L in ls + [None]:
            if L is None or L.stage != cur:
                t1 = time.perf_counter()
                if cur is not None:
                    times.add(cur, (t1 - t0) * 1000)
                t0 = t1
                cur = L.stage if L is not None else None
            if L is not None:
                L.run()
    times.steps += 1


def graph_ms(graph, stream, n: int = 200, warmup: int = 10) -> float:
    """Device milliseconds per replay of the captured CUDA ``graph`` on ``stream``: ``n`` replays back to back between
    two CUDA events, after ``warmup`` (benchmarks: :meth:`FusedDecoder.replay_ms`, bench/profile_step.py)."""
    import cupy as cp

    for _ in range(warmup):
        graph.launch(stream)
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(stream)
    for _ in range(n):
        graph.launch(stream)
    b.record(stream)
    b.synchronize()
    return float(cp.cuda.get_elapsed_time(a, b)) / n


def describe(dec) -> str:
    """One line: which way the fused decoder ``dec`` (:class:`strata.engine.gpu.fused.FusedDecoder`) runs its step and
    its launches per token."""
    c = dec.launches_per_token(True)
    graph = "CUDA graph" if dec.cuda else "graph (sim: the list replayed)"
    if dec.moe is None:
        what, how = "fused dense step", graph if dec.graph_on else "eager"
    elif not dec.hybrid:
        tier = dec.moe.tier
        if tier is not None and len(tier):
            what = (
                f"fused MoE step, {len(dec.moe.cache)} experts in VRAM + {len(tier)} read over PCIe from the host tier"
            )
            if dec.moe.prefetch.active:
                what += ", the next layer's predicted misses copied ahead on a side stream"
        else:
            what = "fused MoE step, every expert resident"
        how = graph if dec.graph_on else "eager"
    else:
        n = c["host"]  # one host point a MoE layer
        what = f"fused MoE step, hybrid ({n} MoE layers: the host computes the CPU's misses at one point a layer)"
        how = f"{c['host'] + 1} {graph} segments" if dec.graph_on else "eager"
    return (
        f"{what}, {how}: {c['kernels']} kernels + {c['memcpy']} copies per token "
        f"({dec.model.hp.n_layer} layers; {dec.kernel} matvecs)"
    )


__all__ = ["KINDS", "PREFETCH_KINDS", "Launch", "MatvecLaunches", "StageTimes", "describe", "graph_ms", "run_timed"]
