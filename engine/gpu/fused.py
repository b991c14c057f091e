"""The dense decode step as a short, fixed list of launches - replayed as one CUDA graph.

Why one fused list and not the shared layers with CuPy (launch overhead, measured): docs/DESIGN.md "The
decode step is one CUDA graph".

This module builds the step of a dense model (gemma3, qwen2) from a few fused kernels (CUDA source
``cuda/fused.cu`` after ``kernel_src/prelude.cuh``: :func:`strata.engine.gpu.fused_ops.fused_source`), compiled
with the same IEEE options as the matvec kernels (:data:`strata.engine.gpu.kernels.NVRTC_OPTIONS`):

- ``resid_norm``: residual add (plain, or of an RMS-normed branch: gemma's sandwich norms), or the
  embedding (times ``sqrt(n_embd)`` for gemma), followed by the next RMS norm - one launch;
- ``qk_prep``: q/k biases, q/k RMS norms, NEOX rope, gemma's q scale, and the K/V cache write at
  ring slot ``pos % size`` (rounded to f16 or kept f32) - one launch for all heads;
- ``attn``: scores over the positions the layer sees (sliding window or all), softmax, weighted
  sum of V, GQA - one launch (one CTA per query head);
- ``act_mul``: ``gelu_tanh(g) * u`` or ``silu(g) * u``; ``logit_post``: output bias / soft-cap;
- the matvec kernels of :mod:`strata.engine.gpu.kernels`, unchanged, into the weights'
  preallocated outputs: by default (``kernel="q8"``) the q8 kernels - llama.cpp's numerics, bit-identical to
  the CPU's q8 kernel - on inputs quantized once per activation format: the normed row by its own
  ``resid_norm`` (the format of its first q8 reader), other inputs by one ``quantize_q8`` launch
  (:class:`MatvecLaunches`); the exact kernels for the types without one; ``kernel="exact"``: exact throughout.

That is 12 launches per layer (3 for q/k/v, prep, attention, output, norm, gate, up, act, down,
norm) plus embedding, head and two copies: 220 per token for an 18-layer model (``bench/bench_gpu.py``
counts them).

**Per-step variables live in device memory.** The position and the embedding row (dequantized on
the host from the memory-mapped pool, exactly as the CPU path does) are written to pinned host
memory and reach the device by one host->device copy that is part of the step; every kernel reads
``pos`` from there (rope row, ring slot ``pos % size``, attention length). Nothing in the step
depends on a Python value that changes per token, so the whole step - copy in, all layers, head,
copy of the logits out to pinned memory - is captured ONCE with CuPy's stream capture
(``stream.begin_capture()`` / ``end_capture()``) and replayed with ``graph.launch(stream)``: two
graphs, with and without the head (prompt positions before the last need no logits). Nothing is
allocated in the step: every buffer is made at start-up (the CuPy pool does not grow in decode).

**Eager** (``graph=False``, ``--no-graph``) launches the same list one by one: the same kernels
with the same arguments, so graph and eager logits are bit-identical (tests/test_gpu_engine.py).
Against the CPU path the tokens are equal; the logits differ by float summation order (the
reductions here run in a fixed tree order; NumPy sums pairwise) and by CUDA's ``expf``/``tanhf``.

**Stage timers** (``stage_times=True``): CUDA events between stages (embedding, each layer's
attention and FFN halves, head) - eager only. Inside a captured graph an event recorded by the host
between launches records nothing, so asking for stage times with the graph on is REFUSED
(:class:`StageTimesRefused`), never answered with zeros.

**Routed experts** (qwen3moe and every attention + MoE recipe) are built into the same list by
:mod:`strata.engine.gpu.fused_moe`: routing on the device, one batched matvec per projection over
the selected experts read from the expert cache's slots. With every expert resident the step is
one graph; otherwise (the hybrid path: :mod:`strata.engine.gpu.moe_host`) the host computes each MoE layer's
CPU misses at one point a layer, and the segments between those points are graphs.

The ``sim`` backend (:class:`strata.engine.gpu.backend.SimBackend`) runs the same launch list with
NumPy stand-ins for the fused kernels, written with the CPU path's own layer functions, so CI
checks the wiring (buffers, ring slots, the device-side position, launch counts) without a GPU.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from strata.layout import step as LS
from strata.manifests.names import tensor_name

from .. import layers
from ..errors import GenerateError, StageTimesRefused
from ..recipe import Attention as AttentionSpec
from ..recipe import DeltaNet, DenseFFN, MoEFFN
from . import kernels as K
from .fused_attn import build_attention_layer
from .fused_gdn import GdnBuffers, build_delta_layer, gdn_unsupported
from .fused_launch import KINDS, PREFETCH_KINDS, Launch, MatvecLaunches, StageTimes, describe, graph_ms, run_timed
from .fused_moe import MAX_EXPERTS_USED, MoeStep
from .fused_ops import TOP_K, TOP_WORDS, CudaOps, route_unsupported
from .fused_sim import SimOps


class FusedUnsupported(GenerateError):
    """A model the fused step does not build (the reason is in the message)."""


def fused_unsupported(model) -> str | None:
    """Why the fused step cannot run ``model`` (a :class:`strata.engine.decoder.Decoder`), None if
    it can: it builds any recipe whose blocks are attention (without an output gate) + a dense FFN
    or routed experts (:mod:`strata.engine.gpu.fused_moe`)."""
    arch = getattr(model, "arch", "")
    for kind, b in model.recipe.blocks.items():
        if not isinstance(b.mixer, (AttentionSpec, DeltaNet)):
            return f"{arch}: layer kind {kind!r} has a mixer the fused step does not build ({b.mixer})"
        if not isinstance(b.ffn, (DenseFFN, MoEFFN)):
            return f"{arch}: layer kind {kind!r} has an FFN the fused step does not build ({b.ffn})"
    nx = model.nx
    if nx.act_quant or nx.attn_f16 or nx.gelu_f16_table:
        return f"numerics mode {nx.name}: the fused kernels implement the f32 mode only"
    why = gdn_unsupported(model)
    if why:
        return why
    if any(a is not None and a.output_gate and a.names.qkv is not None for a in model.attn):
        return f"{arch}: a fused attn_qkv with an output gate (the fused step reads the gate from attn_q)"
    biases = [
        n
        for n in ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")
        if any(model.w.has(tensor_name(n, il)) for il in range(model.hp.n_layer))
    ]
    if biases:
        return f"{arch}: MLP biases ({', '.join(biases)}): the fused act_mul kernel takes none"
    h = model.hp
    if h.n_head % h.n_head_kv:
        return f"n_head {h.n_head} is not a multiple of n_head_kv {h.n_head_kv}"
    if model.experts is not None and not 0 < h.n_expert_used <= MAX_EXPERTS_USED:
        return f"n_expert_used {h.n_expert_used}: the fused routing kernel selects 1..{MAX_EXPERTS_USED} experts"
    return route_unsupported(h.n_expert) if model.experts is not None else None


class FusedDecoder:
    """The dense model's ``step`` as a fixed launch list (see the module docstring).

    Used in place of the model by :class:`strata.engine.generate.Engine` (``step(token, pos, state,
    logits)``); everything else (``hp``, ``new_state`` ...) is the wrapped model's. ``step`` returns
    the logits as a host array that the next step overwrites (pinned memory on CUDA): copy it to keep it.

    Raises:
        FusedUnsupported: a model :func:`fused_unsupported` names a reason for.
        StageTimesRefused: ``stage_times`` with ``graph`` (an event between launches of a captured graph
            records nothing).
    """

    def __init__(self, model, backend, state, *, graph: bool = True, stage_times: bool = False, kernel: str = "exact"):
        if kernel not in ("exact", "q8"):
            raise ValueError(f"fused step kernel {kernel!r}: expected 'exact' or 'q8'")
        why = fused_unsupported(model)
        if why:
            raise FusedUnsupported(why)
        if graph and stage_times:
            raise StageTimesRefused(
                "stage timers cannot measure inside a captured CUDA graph (events recorded between its launches "
                "record nothing): refusing rather than reporting zeros; use --no-graph for per-stage times"
            )
        self.model, self.backend, self.state = model, backend, state
        self.graph_on, self.stage_times_on = bool(graph), bool(stage_times)
        self.kernel = kernel
        self.cuda = backend.name == "cuda"
        self.stream = None
        self.graphs: dict[bool, Any] = {}  # the whole step (dense, or every expert resident)
        self.graphs_pf: dict[bool, Any] = {}  # the whole step with the expert prefetch (strata.engine.gpu.prefetch)
        self.seg_graphs: dict[bool, list[tuple[Any, Launch | None]]] = {}  # hybrid: segments between host points
        self.stage_times = StageTimes()
        self.captured = False
        self._queued: tuple[bool, bool] | None = None  # (logits, routing record) of the step launch() queued
        self.busy_events: list | None = None  # --stats on the hybrid path: an event pair around each segment
        self._last_logits = True
        self._alloc()
        self._ops = CudaOps(self.stream) if self.cuda else SimOps(backend)
        self.moe = MoeStep(self, model, backend) if model.experts is not None else None
        self.gdn = GdnBuffers(model, backend) if model.delta_dims is not None else None
        if self.gdn is not None:
            self.nbytes += self.gdn.nbytes
        if self.moe is not None:
            self.nbytes += self.moe.nbytes
            self.pinned_bytes += self.moe.pinned_bytes
        self.plan = self._build()
        self._events = None
        if self.cuda:
            import cupy as cp

            self._done = cp.cuda.Event(disable_timing=True)
            if self.stage_times_on:
                self._events = [cp.cuda.Event() for _ in range(self._most_stages() + 1)]

    def __getattr__(self, name):  # the wrapped model's attributes (hp, arch, new_state, ...)
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    # ------------------------------------------------------------ buffers

    def _alloc(self) -> None:
        m, bk, st = self.model, self.backend, self.state
        h = m.hp
        nq, nao = h.n_head * h.head_dim, h.n_head * h.head_dim_v
        # the gated activation buffer: the widest dense FFN or shared expert (routed experts: fused_moe)
        n_ff = max(
            [
                int(m.w.entry(name).ne1)
                for il in range(h.n_layer)
                for name in (tensor_name("ffn_gate.weight", il), tensor_name("ffn_gate_shexp.weight", il))
                if m.w.has(name)
            ]
            or [1]
        )
        self.max_size = max(st.cache.sizes)
        stage_bytes = LS.FUSED_PARAM_BYTES + 4 * h.n_embd
        n_vocab = int(m.w.entry(m.head).ne1)
        self.n_vocab = n_vocab
        # device buffers: through the backend (counted like the engine's other allocations)
        self.x = bk.empty_f32(h.n_embd)
        self.xn = bk.empty_f32(h.n_embd)
        self.qo = bk.empty_f32(nq)
        self.ao = bk.empty_f32(nao)
        self.act = bk.empty_f32(n_ff)
        self.scores = bk.empty_f32(h.n_head * self.max_size)
        self.stage_dev = bk.empty_bytes(stage_bytes)
        self.params_dev = self.stage_dev[: LS.FUSED_PARAM_BYTES].view(np.int32)
        self.row_dev = self.stage_dev[LS.FUSED_PARAM_BYTES :].view(np.float32)
        self.top_part = bk.empty_bytes(LS.FUSED_TOP_BYTES - 4 * TOP_WORDS).view(np.float32)
        self.top_dev = bk.empty_bytes(4 * TOP_WORDS).view(np.int32)
        # the q8 kernels' quantized input: the longest matvec input (allocated whatever the kernel: the budget's term)
        value_dim = m.delta_dims.value_dim if m.delta_dims is not None else 0
        self.xq_cap = max(h.n_embd, nao, n_ff, value_dim)
        self.xq = bk.empty_bytes(LS.q8_act_bytes(self.xq_cap))
        self.xnq = bk.empty_bytes(LS.q8_act_bytes(h.n_embd))  # the normed row, quantized by its resid_norm
        self.nbytes = (
            4 * (2 * h.n_embd + nq + nao + n_ff + h.n_head * self.max_size)
            + stage_bytes
            + LS.FUSED_TOP_BYTES
            + LS.q8_act_bytes(self.xq_cap)
            + LS.q8_act_bytes(h.n_embd)
        )
        if self.cuda:
            import cupy as cp

            self.stream = cp.cuda.Stream(non_blocking=False)  # blocking: ordered with the null stream's events
            self._stage_mem = cp.cuda.alloc_pinned_memory(stage_bytes)
            self.stage_host = np.frombuffer(self._stage_mem, np.uint8, stage_bytes)
            self._logit_mem = cp.cuda.alloc_pinned_memory(4 * n_vocab)
            self.logits_host = np.frombuffer(self._logit_mem, np.float32, n_vocab)
            self._top_mem = cp.cuda.alloc_pinned_memory(4 * TOP_WORDS)
            self.top_host = np.frombuffer(self._top_mem, np.int32, TOP_WORDS)
            self.pinned_bytes = stage_bytes + 4 * n_vocab + 4 * TOP_WORDS
        else:
            self.stage_host = np.zeros(stage_bytes, dtype=np.uint8)
            self.logits_host = np.zeros(n_vocab, dtype=np.float32)
            self.top_host = np.zeros(TOP_WORDS, dtype=np.int32)
            self.pinned_bytes = 0
        self.stage_host[:] = 0
        self.params_host = self.stage_host[: LS.FUSED_PARAM_BYTES].view(np.int32)
        self.row_host = self.stage_host[LS.FUSED_PARAM_BYTES :].view(np.float32)

    # ------------------------------------------------------------ the list

    def _build(self) -> list[Launch]:
        """The step's launch list, from the model's recipe (:mod:`strata.engine.recipe`): per layer the
        attention (q/k/v matvecs, ``qk_prep``, ``attn``, output matvec), the residual add with the
        block's post-mixer norm when it has one (``resid_norm`` mode 2, else 1) fused with the FFN's
        norm, the gated FFN (``act_mul`` with the block's activation), and the residual add fused
        with the next layer's (or the output) norm; then the head and the logit post-processing."""
        m, w, ops = self.model, self.model.w, self._ops
        h = m.hp
        plan: list[Launch] = []

        def add(name, stage, run, kind="kernel"):
            plan.append(Launch(name, stage, run, kind))

        mvs = self.matvecs = MatvecLaunches(ops, w, add, self.q8_format, self.xq, self.xq_cap, plan, self.xn, self.xnq)
        mv, mv_group = mvs.mv, mvs.group

        def norm(name, stage, a, ab, wa, wn, scale, mode, **pf):
            """``resid_norm`` into ``xn``; the first q8 reader of that ``xn`` makes it write the quantized row too;
            ``pf``: the prefetch's second normed row (:meth:`strata.engine.gpu.prefetch.Prefetch.norm_args`)."""
            args = (self.x, a, ab, wa, wn, self.xn, h.rms_eps, scale, mode)
            add(name, stage, ops.resid_norm(*args, **pf))
            mvs.normed(len(plan) - 1, lambda fmt: ops.resid_norm(*args, xq=self.xnq, qfmt=fmt, **pf))

        def opt(name):
            return w.get(name) if name and w.has(name) else None

        def norm_of(role, il):
            return w.get(tensor_name(role, il))

        nbytes = int(self.stage_host.nbytes)
        if self.cuda:
            add("copy pos+row to device", "embed", ops.h2d(self.stage_dev, self._stage_mem.ptr, nbytes), "memcpy")
        else:
            add("copy pos+row to device", "embed", ops.h2d(self.stage_dev, self.stage_host, nbytes), "memcpy")
        scale = float(m.embd_scale)
        norm(
            "resid_norm embed+attn_norm",
            "embed",
            self.row_dev,
            None,
            None,
            norm_of(m.blocks[0].mixer_norm, 0),
            scale,
            0,
        )
        for il in range(h.n_layer):
            b = m.blocks[il]
            sa, sf = f"L{il} attn", f"L{il} ffn"
            if m.delta[il] is not None:  # a gated-delta-net layer (fused_gdn)
                o = build_delta_layer(self, il, add, mv, mv_group, sa)
                norm(f"resid_norm L{il} +gdn, ffn norm", sa, o, None, None, norm_of(b.ffn_norm, il), 1.0, 1)
            else:
                build_attention_layer(self, il, b, add, mv, mv_group, opt, norm_of, norm)
            if isinstance(b.ffn, MoEFFN):
                assert self.moe is not None
                f = self.moe.build_layer(il, b.ffn, add, mv, mv_group, self.act)
            else:
                g, u = mv_group([tensor_name("ffn_gate.weight", il), tensor_name("ffn_up.weight", il)], self.xn, sf)
                act = self.act[: int(g.size)]
                add(f"act_mul L{il}", sf, ops.act_mul(g, u, act, b.ffn.act))
                f = mv(tensor_name("ffn_down.weight", il), act, sf)
            nxt = (
                norm_of(m.blocks[il + 1].mixer_norm, il + 1)
                if il + 1 < h.n_layer
                else norm_of("output_norm.weight", None)
            )
            post = norm_of(b.ffn_post_norm, il) if b.ffn_post_norm else None
            pf = self.moe.prefetch.norm_args(il + 1) if self.moe is not None else {}
            name = f"resid_norm L{il} +ffn{' post-norm' if post is not None else ''}, next norm"
            norm(name, sf, f, None, post, nxt, 1.0, 2 if post is not None else 1, **pf)
            if pf:  # the next layer's predicted misses copied ahead, on the side stream (prefetch)
                self.moe.prefetch.build(il + 1, add)
        if self.moe is not None:
            self.moe.build_readback(add)
        y = mv(m.head, self.xn, "head")
        self.y = y
        bias = opt("output.bias")
        cap = h.logit_softcap
        if bias is not None or cap:
            add("logit_post", "head", ops.logit_post(y, bias, cap))
        add("logit summary, part", "head", ops.logit_top_part(y, self.top_part))
        add("logit summary", "head", ops.logit_top_final(self.top_part, self.top_dev, y))
        if self.cuda:
            add("copy logits to host", "head", ops.d2h(self._logit_mem.ptr, y, 4 * self.n_vocab), "memcpy")
            add("copy logit summary to host", "head", ops.d2h(self._top_mem.ptr, self.top_dev, 4 * TOP_WORDS), "memcpy")
        else:
            add("copy logits to host", "head", ops.d2h(self.logits_host, y, 4 * self.n_vocab), "memcpy")
            add("copy logit summary to host", "head", ops.d2h(self.top_host, self.top_dev, 4 * TOP_WORDS), "memcpy")
        return plan

    def q8_format(self, type_id: int) -> int:
        """The activation format a matvec of ``type_id`` quantizes to in this step (1 = Q8_0, 2 = Q8_K), or 0: the
        exact kernel (``kernel="exact"``, or a type without a q8 kernel)."""
        return K.q8_act_format(type_id) if self.kernel == "q8" and type_id in K.Q8_GPU_TYPES else 0

    @property
    def hybrid(self) -> bool:
        """True when the CPU computes a routed expert (a host point a MoE layer); False for dense models and when
        every expert is in a device slot or in the host tier with no split asked (one graph: MoeStep.full)."""
        return self.moe is not None and not self.moe.full

    def launches(self, logits: bool = True, hybrid: bool | None = None) -> list[Launch]:
        """The launch list (no head entries when not ``logits``); hybrid: with the host points (``fill``) and the
        entries only the hybrid step has (``host``: copies for the host point; ``host-kernel``: ``moe_take_rows``);
        else with the prefetch's (``side``: its kernels; ``edge``: fork and join; ``side-memcpy``: its counters'
        copy) where it is active."""
        hybrid = self.hybrid if hybrid is None else hybrid
        ls = self.plan if logits else [L for L in self.plan if L.stage != "head"]
        side = PREFETCH_KINDS if self.moe is not None and self.moe.prefetch.active else ()  # the prefetch's
        if hybrid:
            return [L for L in ls if L.kind not in PREFETCH_KINDS]
        return [L for L in ls if L.kind in KINDS + side]

    def segments(self, logits: bool = True) -> list[tuple[list[Launch], Launch | None]]:
        """The hybrid list cut at its host points: ``(device launches, host entry after them or None)``."""
        out: list[tuple[list[Launch], Launch | None]] = []
        cur: list[Launch] = []
        for L in self.launches(logits, hybrid=True):
            if L.kind == "fill":
                out.append((cur, L))
                cur = []
            else:
                cur.append(L)
        out.append((cur, None))
        return out

    def launches_per_token(self, logits: bool = True, hybrid: bool | None = None) -> dict[str, int]:
        """Counts of the step's device entries: ``kernels``, ``memcpy`` and ``total`` (graph nodes when
        captured), and ``host`` (points where the host waits and works: 1 per MoE layer when hybrid)."""
        ls = self.launches(logits, hybrid)
        k = sum(1 for L in ls if L.kind in ("kernel", "host-kernel", "side"))
        h = sum(1 for L in ls if L.kind == "fill")
        e = sum(1 for L in ls if L.kind == "edge")  # a fork or join orders two streams: no node of its own
        return {"kernels": k, "memcpy": len(ls) - k - h - e, "total": len(ls) - h - e, "host": h}

    def _most_stages(self) -> int:
        """Stages of the longest list the step may run: with the prefetch's (its own stage a layer), decided only
        when the cache is bound - the stage timers' events are made before."""
        pf, n = self.moe.prefetch if self.moe is not None else None, len(self.stages(True))
        if pf is None or not pf.built:
            return n
        with pf.forced_on():
            m = sum(1 for _ in itertools.groupby(L.stage for L in self.launches(True, hybrid=False)))
        return max(n, m)

    def stages(self, logits: bool = True) -> list[str]:
        return [stage for stage, _run in itertools.groupby(L.stage for L in self.launches(logits))]

    # ------------------------------------------------------------ running

    def capture(self) -> None:
        """Capture the step (with and without the head) as CUDA graphs - with routed experts also the hybrid step's
        segments and, where the prefetch is built, the whole step with its launches (before the expert cache is
        sized: their memory is the "prompt path"'s). Raises GenerateError with CUDA's message if the capture fails
        (the engine then does not start: use ``--no-graph``)."""
        if not self.graph_on:
            return
        if not self.cuda:  # the sim has no graphs: the launch list is the "graph"
            self.captured = True
            return
        pf = self.moe.prefetch if self.moe is not None else None
        for logits in (True, False):
            self.graphs[logits] = self._capture(self.launches(logits, hybrid=False))
            if pf is not None and pf.built:  # the whole step with the prefetch's launches: chosen at bind_cache
                with pf.forced_on():
                    self.graphs_pf[logits] = self._capture(self.launches(logits, hybrid=False))
            if self.moe is not None:
                self.seg_graphs[logits] = [
                    (self._capture(ls) if ls else None, host) for ls, host in self.segments(logits)
                ]
        self.stream.synchronize()
        self.captured = True

    def _capture(self, launches: list[Launch]):
        s = self.stream
        try:
            with s:
                s.begin_capture()
                try:
                    for L in launches:
                        L.run()
                finally:
                    g = s.end_capture()
            g.upload(s)
        except Exception as e:
            raise GenerateError(
                f"CUDA graph capture of the decode step failed ({type(e).__name__}: {e}); "
                "--no-graph runs the same kernels eagerly"
            ) from e
        return g

    def _run_eager(self, logits: bool) -> None:
        ls = self.launches(logits)
        if not self.stage_times_on:
            for L in ls:
                L.run()
            return
        run_timed(ls, self.stage_times, self._events if self.cuda else None, self.stream, self.stages(logits))

    def forward(self, tokens: list[int], pos0: int, state, logits: bool = True):
        """A prompt chunk through the wrapped model's :meth:`strata.engine.decoder.Decoder.forward` (the chunk path,
        :mod:`strata.engine.gpu.chunk`, on the current stream), begun after the step's stream is done (a cache swap
        queued there has moved its experts) and ended synchronised (the step's stream then reads the caches)."""
        if self._queued is not None:
            self.wait()
        if self.cuda:
            self.stream.synchronize()
        return self.model.forward(tokens, pos0, state, logits=logits)  # (Decoder.forward ends synchronised on CUDA)

    def step(self, token: int, pos: int, state, logits: bool = True):
        """One position: :meth:`launch` then :meth:`wait`. Returns the logits (host array, overwritten by the next
        step) when ``logits``, else None."""
        self.launch(token, pos, state, logits)
        return self.wait()

    @property
    def launch_ahead(self) -> bool:
        """Whether the step's host side is done once it is queued (:meth:`launch` returns before the device ends and
        :meth:`wait` holds every count): True unless the step is hybrid (its host points compute the CPU's misses
        inside :meth:`launch`). :func:`strata.engine.generate.decode` then queues the next position's step before
        it counts and reports this one, so the device runs while the host does that work."""
        return not self.hybrid

    def launch(self, token: int, pos: int, state, logits: bool = True) -> None:
        """Queue one position: ``pos`` and the embedding row of ``token`` into the staging buffer, then the launch
        list (graph replay or eager; a hybrid step's host points run here, the host waiting for each). On CUDA it
        returns once the work is queued; :meth:`wait` ends it. A step already queued is waited for first.

        Raises:
            GenerateError: another session's state, or ``pos`` outside the KV cache's positions.
        """
        if state is not self.state:
            raise GenerateError("the fused decode step was built for another session state (KV cache)")
        if not 0 <= pos < state.n_ctx:
            raise GenerateError(f"position {pos} outside the KV cache's {state.n_ctx} positions")
        if self._queued is not None:
            self.wait()
        if self.cuda:
            self._done.synchronize()  # the previous step has read the staging buffer
        self.params_host[0] = pos
        self.model.w.host_row("token_embd.weight", int(token), self.row_host)
        hybrid = self.hybrid
        if hybrid:
            self.moe.reset_flags()
        try:
            if self.captured and self.graph_on and self.cuda and not hybrid:
                pf = self.moe is not None and self.moe.prefetch.active
                (self.graphs_pf if pf else self.graphs)[bool(logits)].launch(self.stream)
            elif self.captured and self.graph_on and self.cuda:
                ev = self.busy_events
                for j, (g, host) in enumerate(self.seg_graphs[bool(logits)]):
                    if g is not None:
                        if ev is not None:
                            ev[2 * j].record(self.stream)
                        g.launch(self.stream)
                        if ev is not None:
                            ev[2 * j + 1].record(self.stream)
                    if host is not None:
                        host.run()
            else:
                self._run_eager(bool(logits))
        finally:  # also after a host point that raised: the next launch then waits for what was queued
            if self.cuda:
                self._done.record(self.stream)
        self._queued = (bool(logits), self.moe is not None)  # the routing record: counted in wait
        self._last_logits = bool(logits)

    def wait(self, settle: bool = True):
        """End the step :meth:`launch` queued: wait for the device (when it has logits or a routing record to read;
        the time goes to ``layers.HostWait``), count the routing record (MoE steps; ``settle`` False: a copy
        is held and counted by :meth:`settle`, after the next step is queued). Returns the logits (host array,
        overwritten by the next step) when the step was queued with ``logits``, else None.

        Raises:
            GenerateError: no step queued."""
        if self._queued is None:
            raise GenerateError("wait() without a queued step (launch() first)")
        logits, record = self._queued
        self._queued = None
        if self.cuda and (logits or record):
            t0 = time.perf_counter()
            self._done.synchronize()
            layers.HostWait.ms += (time.perf_counter() - t0) * 1000
        if record:
            self.moe.take_record(settle)
        return self.logits_host if logits else None

    def settle(self) -> None:
        """Count the routing record a ``wait(settle=False)`` held (nothing when none is held)."""
        if self.moe is not None:
            self.moe.settle()

    def busy_on(self) -> None:
        """``--stats``: from now on the hybrid step records an event pair around each graph segment (CUDA only)."""
        if self.cuda and self.busy_events is None and self.moe is not None:
            import cupy as cp

            n = max(len(self.seg_graphs.get(True, ())), len(self.seg_graphs.get(False, ())), len(self.segments(True)))
            self.busy_events = [cp.cuda.Event() for _ in range(2 * n)]

    def busy_ms(self, span_ms: float | None) -> float | None:
        """After a step: the device's own work in it, milliseconds - the **floor** with no host work (issue 19 item 6):
        the one-graph step's event span ``span_ms``; the hybrid step's graph segments' spans summed (:meth:`busy_on`),
        i.e. less the time the device sat idle while the host computed a layer's CPU misses. None on the sim, and
        for a hybrid step launched eagerly (``--no-graph``: no segment events)."""
        if span_ms is None or not self.cuda:
            return None
        if not self.hybrid:
            return span_ms
        ev = self.busy_events
        if ev is None or not (self.captured and self.graph_on):
            return None
        import cupy as cp

        segs = self.seg_graphs[bool(self._last_logits)]
        return sum(
            float(cp.cuda.get_elapsed_time(ev[2 * j], ev[2 * j + 1])) for j, (g, _h) in enumerate(segs) if g is not None
        )

    def logit_summary(self) -> tuple[int, list[tuple[int, float]]]:
        """After a step with logits: ``(non-finite count, pairs)`` - the count of NaN / infinite logits and the
        best ``min(TOP_K, n_vocab)`` ``(id, logit)`` pairs by logit descending then id ascending
        (:func:`strata.engine.sampling.top_k_pairs`'s definition; pairs[0] is the greedy token), ranked on the
        device (cuda/logit_top.cu). The pairs mean nothing when the count is above 0."""
        w = self.top_host
        k = min(TOP_K, self.n_vocab)
        vals = w[8 : 8 + k].view(np.float32)
        return int(w[0]), [(int(w[1 + i]), float(vals[i])) for i in range(k)]

    # ------------------------------------------------------------ benchmark helpers

    def replay_ms(self, n: int = 200, warmup: int = 10, logits: bool = True) -> float:
        """Device milliseconds per step of ``n`` back-to-back graph replays with no host work between
        them (CUDA events around the loop; the staging buffer keeps the last step's position)."""
        if not (self.cuda and self.captured):
            raise GenerateError("replay_ms needs a captured CUDA graph")
        if self.hybrid:
            raise GenerateError("replay_ms times the whole-step graph: experts must all be resident")
        pf = self.moe is not None and self.moe.prefetch.active
        return graph_ms((self.graphs_pf if pf else self.graphs)[bool(logits)], self.stream, n, warmup)


__all__ = [
    "FusedDecoder",
    "FusedUnsupported",
    "StageTimesRefused",
    "StageTimes",
    "fused_unsupported",
    "describe",
    "graph_ms",
]
