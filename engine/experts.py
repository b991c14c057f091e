"""Routed experts: where they live (the GGUF shards), the resident set, and the hit/miss split.

Three pieces, each replaceable by the GPU path:

- :class:`ShardExperts` - the experts as they sit in the GGUF shards, memory-mapped read-only and
  located only by ``native_experts.txt`` (expert ``e`` of layer ``il``: ``gate_off + e * gate_stride``
  for ``gate_bytes`` in shard ``gate_shard``; likewise up and down). ``weights(il, e)`` dequantizes
  one expert; nothing else is read, so an unused expert's pages are never touched.
- an :class:`ExpertCache` - the resident set: ``resident(il, e)`` says whether expert ``e`` of
  layer ``il`` is a hit, ``ffn(il, e, x)`` runs a hit. :class:`CpuExpertCache` is the CPU stand-in
  (resident experts dequantized once at start-up); the GPU path plugs in its VRAM cache.
- :class:`ExpertPath` - per MoE layer, sends every selected expert to the cache (hit) or computes it
  from the shards (miss), then combines the outputs **in selection order**, whatever the split.

The hit path is all or nothing (docs/DESIGN.md "The hit path is all or nothing"): a selected expert runs
exactly once, either as a hit or as a miss, and both paths compute ``down @ (silu(gate @ x) * (up @ x))``
from the same f32 weights (:func:`strata.engine.layers.expert_ffn`), so the tokens cannot depend on which
experts are resident. ``tests/test_engine_moe.py`` checks all / half / none resident give identical logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import numpy as np

from strata.packer.packfmt import ExpertLayer

from . import layers
from .dequant import dequantize_rows
from .loader import LoadPlan


class ShardExperts:
    """Routed experts read by offset from the memory-mapped GGUF shards (see the module docstring)."""

    def __init__(self, plan: LoadPlan):
        self.rows: dict[int, ExpertLayer] = dict(plan.experts)
        self.shapes = dict(plan.expert_shapes)
        self._maps = {k: np.memmap(p, dtype=np.uint8, mode="r") for k, p in plan.shard_paths.items()}

    @property
    def layers(self) -> list[int]:
        return sorted(self.rows)

    def raw(self, il: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expert ``e`` of layer ``il`` as three read-only byte views ``(gate, up, down)`` of the shards."""
        out = []
        for part, shard, off, nbytes in self.rows[il].ranges(e):
            out.append(self._maps[shard][off:off + nbytes])
        return out[0], out[1], out[2]

    def weights(self, il: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expert ``e`` of layer ``il`` dequantized: f32 ``gate [n_ff, n_embd]``, ``up [n_ff, n_embd]``,
        ``down [n_embd, n_ff]`` (numpy order: rows, row length)."""
        row, shp = self.rows[il], self.shapes[il]
        g, u, d = self.raw(il, e)
        out = []
        for raw, t, (ne0, ne1) in ((g, row.gate_type, shp.gate), (u, row.up_type, shp.up), (d, row.down_type, shp.down)):
            out.append(dequantize_rows(raw.reshape(ne1, -1), t, ne0, name=f"blk.{il} expert {e}"))
        return out[0], out[1], out[2]

    def types(self, il: int) -> tuple[int, int, int]:
        """ggml types of layer ``il``'s gate, up and down experts."""
        r = self.rows[il]
        return r.gate_type, r.up_type, r.down_type

    def blob_bytes(self, il: int) -> int:
        """Source bytes of one expert of layer ``il`` (gate + up + down; differs per layer)."""
        return self.rows[il].blob_bytes


class ExpertCache(Protocol):
    """The resident set the hit path serves (GPU: VRAM slots; CPU: :class:`CpuExpertCache`)."""

    def resident(self, il: int, e: int) -> bool: ...

    def ffn(self, il: int, e: int, x: Any) -> Any: ...


class CpuExpertCache:
    """Resident experts dequantized to f32 once, at start-up (the CPU stand-in for the VRAM cache)."""

    def __init__(self, source: ShardExperts, pairs: Iterable[tuple[int, int]], act_quant: bool = False):
        self._w: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._source = source
        self._act_quant = act_quant
        for il, e in pairs:
            self._w[(il, e)] = source.weights(il, e)
        self.nbytes = sum(a.nbytes for w in self._w.values() for a in w)

    def __len__(self) -> int:
        return len(self._w)

    def resident(self, il: int, e: int) -> bool:
        return (il, e) in self._w

    def ffn(self, il: int, e: int, x: np.ndarray) -> np.ndarray:
        g, u, d = self._w[(il, e)]
        return layers.expert_ffn(np, g, u, d, x, self._source.types(il) if self._act_quant else None)


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


class ExpertPath:
    """The hit/miss split of one engine (see the module docstring).

    ``cache`` may be None (every expert a miss). ``counts`` accumulates over the run;
    ``take_step()`` returns and resets the per-layer counts since the last call (one position);
    ``reset_counts()`` starts both over. ``on_route`` (the routing hook, e.g. ``strata-engine
    profile``'s counter) sees every layer's selection ``(layer, expert ids)`` before it runs.
    """

    def __init__(self, source: ShardExperts, cache: ExpertCache | None, xp=np, act_quant: bool = False):
        self.source = source
        self.cache = cache
        self.xp = xp
        self.act_quant = act_quant
        self.counts = ExpertCounts()
        self._step: dict[int, list[int]] = {}
        self.on_route: Callable[[int, list[int]], None] | None = None

    def reset_counts(self) -> None:
        """Zero the run's counts and the current step's (e.g. after a warm-up step)."""
        self.counts = ExpertCounts()
        self._step = {}

    def miss_ffn(self, il: int, e: int, x):
        g, u, d = self.source.weights(il, e)
        return layers.expert_ffn(self.xp, g, u, d, x, self.source.types(il) if self.act_quant else None)

    def __call__(self, il: int, x, ids: list[int], weights) -> Any:
        """``sum_k weights[k] * expert_{ids[k]}(x)``, summed in selection order (k = 0, 1, ...)."""
        if self.on_route is not None:
            self.on_route(il, ids)
        y = None
        step = self._step.setdefault(il, [0, 0])
        for k, e in enumerate(ids):
            if self.cache is not None and self.cache.resident(il, e):
                ye = self.cache.ffn(il, e, x)
                self.counts.hits += 1
                step[0] += 1
            else:
                ye = self.miss_ffn(il, e, x)
                self.counts.misses += 1
                self.counts.per_layer_misses[il] = self.counts.per_layer_misses.get(il, 0) + 1
                step[1] += 1
            ye = ye * weights[k]
            y = ye if y is None else y + ye
        return y

    def take_step(self) -> dict[int, tuple[int, int]]:
        """Per MoE layer, (hits, misses) since the previous call (counts of routed experts)."""
        out = {il: (hm[0], hm[1]) for il, hm in sorted(self._step.items())}
        self._step = {}
        return out

    def step_counts(self) -> tuple[int, int]:
        """(hits, misses) since the previous call (summed over layers; resets like :meth:`take_step`)."""
        per = self.take_step()
        return sum(h for h, _ in per.values()), sum(m for _, m in per.values())
