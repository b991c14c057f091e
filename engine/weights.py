"""Weight access for the forward pass: the small interface the models are written against.

A model never touches pool bytes. It asks its :class:`Weights` for

- ``get(name)``: a small tensor as an f32 array (norm weights, biases, routers' vectors);
- ``matmul(name, x)``: ``W @ x`` for a weight of ggml shape ``[ne0 = len(x), ne1]`` (the result
  has ``ne1`` values) - the one place a device decides how a quantized weight meets an activation;
- ``rows(name, ids)``: rows of a matrix (embedding lookup), f32 ``[len(ids), ne0]``;
- ``has(name)``: whether an optional tensor (biases, fused qkv, output head) is in the pack.

Each device supplies its own store with these methods: the CPU's
:class:`strata.engine.cpu.weights.CpuWeights` (quantized kernels on the memory-mapped pool), the GPU's
:class:`strata.engine.gpu.weights.DeviceWeights` (engine form in VRAM, its own kernels); ``xp`` tells the
shared layers which array module the activations live in.
"""

from __future__ import annotations

from typing import Any, Protocol


class Weights(Protocol):
    """What a forward pass may ask of a weight store (see the module docstring)."""

    xp: Any
    # optional: ``nx`` (a strata.engine.numerics.Numerics); a store without it runs the f32 mode

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> Any: ...

    def matmul(self, name: str, x: Any) -> Any: ...

    def rows(self, name: str, ids: list[int]) -> Any: ...


class WeightError(ValueError):
    """Weight bytes that are not what the index says (e.g. a BF16-promoted tensor that is not bf16-exact)."""
