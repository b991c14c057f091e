"""What every architecture file shares: the session state and the head/embedding bookkeeping.

A model is built from a :class:`~strata.manifests.contract.Geometry` (geometry.txt through the
architecture's manifest), a :class:`~strata.engine.weights.Weights` store and, for MoE models, an
:class:`~strata.engine.experts.ExpertPath`. Its one job is ``step(token, pos, state, logits)``:
one position through every layer, returning the logits when asked (the prompt positions before
the last need none: their head GEMV is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.budget import formulas as F
from strata.manifests.contract import Geometry

from ..layers import KVCache, Rope
from ..numerics import numerics


class UnsupportedModel(ValueError):
    """A geometry or metadata feature this engine does not implement (named), refused at load."""


@dataclass
class State:
    """Per-session buffers, allocated once before the first token: the KV cache and rope tables
    (keyed by rope base)."""

    n_ctx: int
    cache: KVCache
    ropes: dict[float, Rope] = field(default_factory=dict)

    @property
    def rope_nbytes(self) -> int:
        return sum(r.cos.nbytes + r.sin.nbytes for r in self.ropes.values())

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + self.rope_nbytes


@dataclass(frozen=True)
class Hyper:
    """Hyperparameters every architecture here has, typed, from geometry.txt via the manifest."""

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

    @classmethod
    def from_geometry(cls, g: Geometry, **extra: Any) -> "Hyper":
        common = dict(
            n_layer=int(g["n_layer"]), n_embd=int(g["n_embd"]), n_head=int(g["n_head"]), n_head_kv=int(g["n_head_kv"]),
            head_dim=int(g["head_dim"]), head_dim_v=int(g["head_dim_v"]), rms_eps=float(g["rms_eps"]),
            rope_base=float(g["rope_base"]), attn_scale=float(g["attn_scale"]), n_vocab=int(g["n_vocab"]),
        )
        return cls(**common, **extra)


class BaseModel:
    """Common parts: head and embedding names, state allocation, the output head."""

    arch = ""

    def __init__(self, g: Geometry, w, experts=None, metadata: dict[str, Any] | None = None):
        self.g, self.w, self.experts = g, w, experts
        self.xp = w.xp
        # the numerics profile travels with the weight store (strata.engine.numerics); a store without one is f32
        self.nx = getattr(w, "nx", None) or numerics("f32")
        md = metadata or {}
        for key in (f"{g.arch}.rope.scaling.type", f"{g.arch}.rope.scaling.factor"):
            v = md.get(key)
            if v not in (None, "none", 1.0, 0.0):
                raise UnsupportedModel(f"metadata {key} = {v!r}: rope scaling is not implemented by strata's engine")
        self.hp = self.hyper(g)
        self.head = "output.weight" if w.has("output.weight") else "token_embd.weight"

    @classmethod
    def hyper(cls, g: Geometry) -> Hyper:
        return Hyper.from_geometry(g)

    def head_tensors(self) -> list[str]:
        """Tensors of the output head (loaded at the 'head' checkpoint, before the expert cache)."""
        names = [self.head]
        if self.w.has("output.bias"):
            names.append("output.bias")
        return names

    def row_tensors(self) -> list[str]:
        """Tensors read only by rows (embedding lookup): kept quantized unless they are the head."""
        return [] if self.head == "token_embd.weight" else ["token_embd.weight"]

    def rope_bases(self) -> list[float]:
        return [self.hp.rope_base]

    def layer_windows(self) -> list[int | None]:
        """Per layer: the sliding window its attention sees, None for the whole context."""
        return [a.window for a in self.attn]

    def kv_sizes(self, n_ctx: int, sliding: str = "ring") -> list[int]:
        """Positions each layer's KV cache holds: ``n_ctx``, or for a sliding-window layer the
        budget's :func:`strata.budget.formulas.kv_tokens` at the engine's one-position prompt path
        (``sliding="ring"``; ``"full"``: ``n_ctx`` everywhere, the reference the ring is tested against)."""
        if sliding not in ("ring", "full"):
            raise ValueError(f"sliding {sliding!r}: expected ring or full")
        if sliding == "full":
            return [n_ctx] * self.hp.n_layer
        return [F.kv_tokens(n_ctx, w, F.ENGINE_PREFILL_CHUNK) for w in self.layer_windows()]

    def new_state(self, n_ctx: int, kv: str = "f16", sliding: str = "ring") -> State:
        """KV cache (``kv``: f16 | f32, :meth:`kv_sizes` positions per layer) and rope tables for
        ``n_ctx`` positions, allocated once."""
        h = self.hp
        st = State(n_ctx, KVCache(self.xp, self.kv_sizes(n_ctx, sliding), h.n_head_kv, h.head_dim, h.head_dim_v, kv))
        for base in self.rope_bases():
            st.ropes[base] = Rope(self.xp, h.head_dim, base, n_ctx)
        return st

    def logits(self, x):
        """Output norm, head GEMV (+ bias)."""
        from ..layers import rms_norm

        xp, w = self.xp, self.w
        x = rms_norm(xp, x, w.get("output_norm.weight"), self.hp.rms_eps)
        y = w.matmul(self.head, x)
        if w.has("output.bias"):
            y = y + w.get("output.bias")
        return y

    def step(self, token: int, pos: int, state: State, logits: bool = True):  # pragma: no cover - abstract
        raise NotImplementedError
