"""The forward pass of every architecture, executed from its recipe with an array module ``xp``.

:class:`Decoder` is built from a :class:`~strata.manifests.contract.Geometry` (geometry.txt through
the architecture's manifest), the architecture's :class:`~strata.engine.recipe.Recipe`, a
:class:`~strata.engine.weights.Weights` store and, for MoE models, an
:class:`~strata.engine.experts.ExpertPath`. Its one job is ``step(token, pos, state, logits)``: one
position through every layer, returning the logits when asked (the prompt positions before the last
need none: their head GEMV is skipped). The same code runs with NumPy (the CPU path) and CuPy (the
GPU's generic path); the GPU's fused step is built from the same recipe
(:mod:`strata.engine.gpu.fused`).

Per layer (llama.cpp ``src/models/*.cpp``)::

    a = mixer(rms_norm(x) * mixer_norm)                 # attention
    x = x + (rms_norm(a) * mixer_post_norm if the block has one else a)
    f = ffn(rms_norm(x) * ffn_norm)                     # dense or routed experts
    x = x + (rms_norm(f) * ffn_post_norm if the block has one else f)

then ``logits = head(rms_norm(x) * output_norm)`` (+ ``output.bias``), soft-capped when the recipe's
``logit_softcap`` param is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata.layout import kv as LK
from strata.manifests.contract import Geometry
from strata.manifests.names import tensor_name

from . import rowpar
from .cpu.kernels import blas_single_thread
from .deltanet import DeltaNetDims, GatedDeltaNet, RecurrentState
from .layers import (
    ATTEND_MM_MIN_KEYS,
    Attention,
    KVCache,
    Rope,
    chunk_op,
    gated_mlp,
    rms_norm,
    route_topk,
    route_topk_rows,
    sigmoid,
    silu,
    to_host,
)
from .models import UnsupportedModel
from .numerics import numerics
from .recipe import Attention as AttentionSpec
from .recipe import Block, DeltaNet, DenseFFN, MoEFFN, Recipe


@dataclass
class State:
    """Per-session buffers, allocated once before the first token: the KV cache (attention layers),
    the recurrent state (recurrent layers; None without them) and rope tables (keyed by
    ``(rope base, frequency scale)``: :meth:`Decoder.rope_key_of`)."""

    n_ctx: int
    cache: KVCache
    ropes: dict[tuple[float, float], Rope] = field(default_factory=dict)
    recurrent: RecurrentState | None = None
    indexer: dict[int, Any] = field(default_factory=dict)  # attention layer -> [positions, indexer_head_dim] keys

    @property
    def rope_nbytes(self) -> int:
        return sum(r.cos.nbytes + r.sin.nbytes for r in self.ropes.values())

    @property
    def kv_nbytes(self) -> int:
        """The KV cache as the budget's "KV cache" term counts it: K and V, and the indexer's key store."""
        return self.cache.nbytes + sum(a.nbytes for a in self.indexer.values())

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.rope_nbytes + (self.recurrent.nbytes if self.recurrent else 0)


@dataclass(frozen=True)
class Hyper:
    """Hyperparameters the executors read, typed, from geometry.txt via the manifest (counts;
    ``rms_eps`` and ``attn_scale`` unitless). MoE fields are 0 for dense models. ``n_layer`` counts the
    decoder layers the forward pass runs (``block_count`` less the NextN draft blocks)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    rms_eps: float
    rope_base: float
    attn_scale: float
    n_vocab: int
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    logit_softcap: float | None = None

    @classmethod
    def from_geometry(cls, g: Geometry, recipe: Recipe) -> Hyper:
        cap = g.get(recipe.logit_softcap) if recipe.logit_softcap else None
        return cls(
            n_layer=g.n_trunk,
            n_embd=int(g["n_embd"]),
            n_head=int(g["n_head"]),
            n_head_kv=int(g["n_head_kv"]),
            head_dim=int(g["head_dim"]),
            head_dim_v=int(g["head_dim_v"]),
            rms_eps=float(g["rms_eps"]),
            rope_base=float(g["rope_base"]),
            attn_scale=float(g["attn_scale"]),
            n_vocab=int(g["n_vocab"]),
            n_expert=int(g.get("n_expert") or 0),
            n_expert_used=int(g.get("n_expert_used") or 0),
            n_ff_exp=int(g.get("n_ff_exp") or 0),
            logit_softcap=float(cap) if cap else None,
        )


class Decoder:
    """The forward pass of ``g.arch`` from ``recipe`` (see the module docstring).

    Attributes:
        hp: :class:`Hyper`; ``kinds``: each layer's kind; ``blocks``: each layer's recipe block;
        ``attn``: each layer's :class:`strata.engine.layers.Attention` (None for a layer whose mixer
        is not attention); ``head``: the tensor the output head multiplies with (``output.weight``,
        or ``token_embd.weight`` when tied); ``embd_scale``: the embedding multiplier (1 unless the
        recipe scales by sqrt(n_embd)).

    The metadata keys the forward pass depends on were honoured or refused before (the manifest's
    ``[keys]``: :func:`strata.engine.startup.open_checked`); ``g`` carries the honoured values.

    Raises:
        UnsupportedModel: a layer kind the recipe has no block for.
        ValueError: a recipe with routed experts and no ``experts`` path.
    """

    def __init__(self, g: Geometry, recipe: Recipe, w, experts=None):
        self.g, self.recipe, self.w, self.experts = g, recipe, w, experts
        self.arch = g.arch
        self.xp = w.xp
        # the numerics mode travels with the weight store (strata.engine.numerics); a store without one is f32
        self.nx = getattr(w, "nx", None) or numerics("f32")
        self.hp = Hyper.from_geometry(g, recipe)
        self.kinds = list(g.layer_kinds[: g.n_trunk])  # draft blocks (NextN heads) come last and are not run
        try:
            self.blocks: list[Block] = [recipe.block(k) for k in self.kinds]
        except KeyError as e:
            raise UnsupportedModel(f"{g.arch}: {e.args[0]}") from None
        if any(isinstance(b.ffn, MoEFFN) for b in self.blocks) and experts is None:
            raise ValueError(f"{g.arch} has routed experts: the decoder needs an ExpertPath")
        h = self.hp
        self.attn: list[Attention | None] = []
        self.delta: list[GatedDeltaNet | None] = []
        self.delta_dims: DeltaNetDims | None = None
        for il, b in enumerate(self.blocks):
            m = b.mixer
            if isinstance(m, AttentionSpec):
                self.attn.append(
                    Attention(
                        w,
                        il,
                        n_head=h.n_head,
                        n_head_kv=h.n_head_kv,
                        head_dim=h.head_dim,
                        head_dim_v=h.head_dim_v,
                        scale=h.attn_scale,
                        window=g.layer_window(il),
                        eps=h.rms_eps,
                        qk_norm=m.qk_norm,
                        scale_q=m.scale_q,
                        f16_operands=self.nx.attn_f16,
                        output_gate=m.output_gate,
                    )
                )
                self.delta.append(None)
            else:
                assert isinstance(m, DeltaNet)
                if self.delta_dims is None:
                    self.delta_dims = DeltaNetDims.of(g, h.rms_eps)
                self.attn.append(None)
                self.delta.append(GatedDeltaNet(w, il, self.delta_dims))
        self.embd_scale = self.xp.float32(math.sqrt(h.n_embd)) if recipe.embed_scale else self.xp.float32(1.0)
        self.head = "output.weight" if w.has("output.weight") else "token_embd.weight"
        self.gelu = "gelu_f16" if self.nx.gelu_f16_table else "gelu"

    # ------------------------------------------------------------ what the start-up asks

    def head_tensors(self) -> list[str]:
        """Tensors of the output head (loaded at the 'head' checkpoint, before the expert cache)."""
        names = [self.head]
        if self.w.has("output.bias"):
            names.append("output.bias")
        return names

    def row_tensors(self) -> list[str]:
        """Tensors read only by rows (embedding lookup): kept quantized unless they are the head."""
        return [] if self.head == "token_embd.weight" else ["token_embd.weight"]

    def rope_key_of(self, il: int) -> tuple[float, float]:
        """The rope table of layer ``il``: ``(base, frequency scale)`` from its block's ``rope_base`` and
        ``rope_scale`` geometry params (llama.cpp ``llama_model::get_rope_freq_base`` / ``_scale``)."""
        m = self.blocks[il].mixer
        return float(self.g[m.rope_base]), float(self.g[m.rope_scale])

    def rope_dim(self) -> int:
        """Rotated dims per head (the recipe's ``rope_dim`` param, head_dim when it has none)."""
        dims = {
            int(self.g[b.mixer.rope_dim]) if b.mixer.rope_dim else self.hp.head_dim
            for b in self.blocks
            if isinstance(b.mixer, AttentionSpec)
        }
        if len(dims) > 1:
            raise UnsupportedModel(f"{self.arch}: layers rotate different numbers of dims {sorted(dims)}")
        return dims.pop() if dims else self.hp.head_dim

    def rope_mode(self) -> str:
        """The rope pairing of the attention layers (the recipe's ``rope``: ``neox`` | ``norm``)."""
        modes = {b.mixer.rope for b in self.blocks if isinstance(b.mixer, AttentionSpec)}
        if len(modes) > 1:
            raise UnsupportedModel(f"{self.arch}: layers use different rope pairings {sorted(modes)}")
        return modes.pop() if modes else "neox"

    def rope_factors(self):
        """The ``rope_freqs.weight`` factors (f32 ``[n_rot/2]``, host) when the pack has them, else None."""
        if not self.w.has("rope_freqs.weight"):
            return None
        return to_host(self.w.get("rope_freqs.weight"))

    def rope_keys(self) -> list[tuple[float, float]]:
        """The distinct ``(rope base, frequency scale)`` of the attention layers (one table each), in layer order."""
        out: list[tuple[float, float]] = []
        for il, a in enumerate(self.attn):
            if a is not None and self.rope_key_of(il) not in out:
                out.append(self.rope_key_of(il))
        return out

    def layer_windows(self) -> list[int | None]:
        """Per layer: the sliding window its attention sees, None for the whole context."""
        return [a.window if a is not None else None for a in self.attn]

    def kv_sizes(self, n_ctx: int, sliding: str = "ring") -> list[int]:
        """Positions each layer's KV cache holds: ``n_ctx``, or for a sliding-window layer the
        :func:`strata.layout.kv.kv_tokens` at the engine's one-position prompt path
        (``sliding="ring"``; ``"full"``: ``n_ctx`` everywhere, the reference the ring is tested against)."""
        if sliding not in ("ring", "full"):
            raise ValueError(f"sliding {sliding!r}: expected ring or full")
        if sliding == "full":
            return [n_ctx if a is not None else 0 for a in self.attn]
        return [
            LK.kv_tokens(n_ctx, w, LK.ENGINE_PREFILL_CHUNK) if a is not None else 0
            for a, w in zip(self.attn, self.layer_windows())
        ]

    def new_state(self, n_ctx: int, kv: str = "f16", sliding: str = "ring") -> State:
        """KV cache (``kv``: f16 | f32, :meth:`kv_sizes` positions per layer) and rope tables for
        ``n_ctx`` positions, allocated once."""
        h = self.hp
        st = State(n_ctx, KVCache(self.xp, self.kv_sizes(n_ctx, sliding), h.n_head_kv, h.head_dim, h.head_dim_v, kv))
        mode, factors = self.rope_mode(), self.rope_factors()
        for base, scale in self.rope_keys():
            st.ropes[(base, scale)] = Rope(self.xp, self.rope_dim(), base, n_ctx, mode, factors, freq_scale=scale)
        rec = [il for il, d in enumerate(self.delta) if d is not None]
        if rec:
            st.recurrent = RecurrentState(self.xp, rec, self.delta_dims)
        ihd = self.indexer_head_dim
        if ihd:  # the indexer's ONE shared key head per position (docs/DESIGN.md "Every budget term twice")
            dt = self.xp.float16 if kv == "f16" else self.xp.float32
            st.indexer = {
                il: self.xp.zeros((n, ihd), dtype=dt)
                for il, n in enumerate(self.kv_sizes(n_ctx, sliding))
                if self.attn[il] is not None
            }
        return st

    @property
    def indexer_head_dim(self) -> int:
        """Width of a sparse-attention indexer's cached key (``indexer_head_dim``, one shared head), 0 without
        one. The session holds its key store as the reference C++ engine does, so the KV term is what the
        budget plans (:class:`strata.layout.kv.KVLayer` ``indexer_k``); this forward pass does not
        compute the indexer (the model file says so), the store stays zero."""
        v = self.g.get("indexer_head_dim")
        return int(v) if v else 0

    # ------------------------------------------------------------ the step

    def _norm(self, x, role: str, il: int | None):
        fast = chunk_op(self.w, "rms_norm_rows") if x.ndim == 2 else None  # a prompt chunk's rows: one launch
        if fast is not None:
            return fast(x, self.w.get(tensor_name(role, il)), self.hp.rms_eps)
        return rms_norm(self.xp, x, self.w.get(tensor_name(role, il)), self.hp.rms_eps)

    def ffn(self, il: int, x):
        """The FFN of layer ``il`` on its normed input ``x``: ``[n_embd]``, or a prompt chunk's rows ``[T, n_embd]``
        (routed experts then go through :meth:`~strata.engine.experts.ExpertPath.chunk`, the chunk's tokens grouped
        by expert; each row is the one-position result, bit for bit where the weight store's products are)."""
        f = self.blocks[il].ffn
        if isinstance(f, DenseFFN):
            return gated_mlp(self.xp, self.w, il, x, "silu" if f.act == "silu" else self.gelu)
        assert isinstance(f, MoEFFN)
        xp, w = self.xp, self.w
        logits = w.matmul(tensor_name("ffn_gate_inp.weight", il), x)
        if x.ndim == 2:
            fast = chunk_op(w, "route_rows")  # the device's one-launch routing, when it takes these shapes
            r = None if fast is None else fast(logits, self.hp.n_expert_used, f.norm_weights)
            ids_rows, wts = r if r is not None else route_topk_rows(xp, logits, self.hp.n_expert_used, f.norm_weights)
            y = self.experts.chunk(il, x, ids_rows, wts)
        else:
            ids, wts = route_topk(xp, logits, self.hp.n_expert_used, norm=f.norm_weights)
            y = self.experts(il, x, ids, wts)
        return y + self.shared_expert(il, x) if f.shared_expert else y

    def shared_expert(self, il: int, x):
        """Layer ``il``'s shared expert on ``x`` (``[n_embd]``, or a chunk's rows ``[T, n_embd]``), times its gate
        when the block has one: ``ffn_gate_inp_shexp`` is one row, a dot product per row, then sigmoid
        (llama.cpp ``src/models/qwen3next.cpp``, ``qwen2moe.cpp``)."""
        xp, w = self.xp, self.w
        g = w.matmul(tensor_name("ffn_gate_shexp.weight", il), x)
        u = w.matmul(tensor_name("ffn_up_shexp.weight", il), x)
        s = w.matmul(tensor_name("ffn_down_shexp.weight", il), silu(xp, g) * u)
        f = self.blocks[il].ffn
        assert isinstance(f, MoEFFN)
        if f.shared_gate:
            gw = w.get(tensor_name("ffn_gate_inp_shexp.weight", il))
            s = s * sigmoid(xp, (gw * x).sum(axis=-1, keepdims=True))
        return s

    def logits(self, x):
        """Output norm, head GEMV (+ bias), soft-cap (ggml_scale(1/cap) -> ggml_tanh -> ggml_scale(cap))."""
        xp, w = self.xp, self.w
        y = w.matmul(self.head, self._norm(x, "output_norm.weight", None))
        if w.has("output.bias"):
            y = y + w.get("output.bias")
        cap = self.hp.logit_softcap
        if cap:
            y = xp.tanh(y * xp.float32(1.0 / cap)) * xp.float32(cap)
        return y

    def step(self, token: int, pos: int, state: State, logits: bool = True):
        """Position ``pos`` of token ``token`` through every layer; the f32 logits ``[n_vocab]`` when
        ``logits``, else None (the KV cache is written either way). On the CPU, from
        :data:`strata.engine.layers.ATTEND_MM_MIN_KEYS` positions on, the attention takes NumPy's BLAS, on one thread
        as in :meth:`forward` (its workers would spin and take the kernels' cores)."""
        if self.xp is np and pos + 1 >= ATTEND_MM_MIN_KEYS:
            with blas_single_thread():
                return self._step(token, pos, state, logits)
        return self._step(token, pos, state, logits)

    def _step(self, token: int, pos: int, state: State, logits: bool):
        xp, w = self.xp, self.w
        if pos == 0 and state.recurrent is not None:
            state.recurrent.reset()  # position 0 starts a sequence: the recurrent state starts at zero
        x = w.rows("token_embd.weight", [token])[0]
        if self.recipe.embed_scale:
            x = x * self.embd_scale
        for il, b in enumerate(self.blocks):
            h = self._norm(x, b.mixer_norm, il)
            if self.attn[il] is not None:
                a = self.attn[il](xp, h, pos, state.cache, state.ropes[self.rope_key_of(il)])
            else:
                a = self.delta[il](xp, h, state.recurrent)
            x = x + (self._norm(a, b.mixer_post_norm, il) if b.mixer_post_norm else a)
            f = self.ffn(il, self._norm(x, b.ffn_norm, il))
            x = x + (self._norm(f, b.ffn_post_norm, il) if b.ffn_post_norm else f)
        return self.logits(x) if logits else None

    @property
    def chunked(self) -> bool:
        """Whether :meth:`forward` can take a prompt chunk: the weight store multiplies rows of inputs at once
        (its ``matmul_rows``; the CPU store does, the GPU's generic store does not)."""
        return bool(getattr(self.w, "matmul_rows", False))

    def forward(self, tokens: list[int], pos0: int, state: State, logits: bool = True):
        """A prompt chunk: tokens ``tokens`` at positions ``pos0 .. pos0 + T - 1`` through every layer, each
        layer's products on the whole chunk (:meth:`chunked` stores only); the f32 logits ``[n_vocab]`` of the
        LAST position when ``logits``, else None. The caches end as after :meth:`step` of each position.

        Numerics: every product row, norm, rope and expert output is the one-position value bit for bit (the
        same kernels per row; the routed experts summed per token in selection order); the attention takes
        matrix products (:func:`strata.engine.layers.attend_rows`), so scores differ from :meth:`step`'s by
        float rounding only. docs/DESIGN.md "Prompts in chunks".

        Raises:
            ValueError: the store cannot take rows (``chunked`` false), or an empty chunk.
        """
        if not self.chunked:
            raise ValueError(f"{type(self.w).__name__} multiplies one position at a time: no chunked forward")
        if not tokens:
            raise ValueError("an empty prompt chunk")
        # on the CPU the kernels' threads own the cores: NumPy's BLAS (the attention's products) on one thread, the
        # NumPy work between the kernels split by rows over the same threads (strata.engine.rowpar)
        if self.xp is not np:  # ended synchronised: a chunk's time is its device work (nothing else may wait for it)
            y = self._forward(tokens, pos0, state, logits)
            if hasattr(self.xp, "cuda"):
                self.xp.cuda.get_current_stream().synchronize()
            return y
        with blas_single_thread(), rowpar.row_threads(getattr(self.w, "threads", 1)):
            return self._forward(tokens, pos0, state, logits)

    def _forward(self, tokens: list[int], pos0: int, state: State, logits: bool):
        xp, w = self.xp, self.w
        if pos0 == 0 and state.recurrent is not None:
            state.recurrent.reset()
        x = w.rows("token_embd.weight", list(tokens))
        if self.recipe.embed_scale:
            x = x * self.embd_scale
        for il, b in enumerate(self.blocks):
            h = self._norm(x, b.mixer_norm, il)
            if self.attn[il] is not None:
                a = self.attn[il].chunk(xp, h, pos0, state.cache, state.ropes[self.rope_key_of(il)])
            else:
                a = self.delta[il].chunk(xp, h, state.recurrent)
            x = x + (self._norm(a, b.mixer_post_norm, il) if b.mixer_post_norm else a)
            f = self.ffn(il, self._norm(x, b.ffn_norm, il))
            x = x + (self._norm(f, b.ffn_post_norm, il) if b.ffn_post_norm else f)
        return self.logits(x[-1]) if logits else None


__all__ = ["Decoder", "Hyper", "State"]
