"""The engine's core types: start-up options, the loaded engine, and what a device must do.

Below :mod:`strata.engine.startup` (which runs the stages) and the devices (:mod:`strata.engine.cpu.device`,
``strata.engine.gpu.device``), so that both import these without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from strata.budget import formulas as F
from strata.manifests.contract import Geometry
from strata.packer.pack import Pack

from .checkpoints import Checkpoint
from .decoder import Decoder, State
from .experts import ExpertPath
from .loader import LoadPlan
from .numerics import DEFAULT_NUMERICS
from .tokenizer import Tokenizer
from .weights import Weights


class StepProbe(Protocol):
    """Per-step timers a device supplies (``begin`` before the step, ``end`` after it returns
    ``gpu_ms``, ``cpu_expert_ms``, ``wait_ms``; values may be None where a device cannot measure)."""

    def begin(self) -> None: ...

    def end(self) -> dict[str, float | None]: ...


@dataclass
class EngineOptions:
    """Start-up options (one place for every device; a device ignores what it has no use for).

    Attributes:
        n_ctx: positions the KV cache holds; None = the model's trained context (``DEFAULT_CTX``).
        kv: KV cache type, ``f16`` (default, llama.cpp's) or ``f32``; ``sliding``: ``ring``
            (sliding-window layers keep their window only) or ``full`` (the reference for tests).
        numerics: CPU numerics mode (:mod:`strata.engine.numerics`).
        resident: without a profile, the experts the cache may hold (``all`` | ``none`` | ``half`` |
            fraction, :func:`strata.engine.experts.resident_pairs`).
        expert_cache: GPU slots, ``"auto"`` or N; ``profile``: ``(layer, expert, count)`` rows that
            fill the cache; ``vram_reserve_mib``: VRAM kept free; ``admit``: first-come admission of
            misses into free slots (default: on without a profile).
        exact: CPU products in the GPU kernels' summation order (bit-identical to the GPU; slower): the
            same as ``cpu_kernel="exact"``; ``cpu_kernel``: the CPU matvec kernels, ``"q8"`` (the default:
            llama.cpp's CPU numerics, activations quantized to Q8_0/Q8_K and integer dots), ``"exact"`` or
            ``"f32"`` (:mod:`strata.engine.cpu.kernels`); ``threads``: CPU kernel threads (default: the
            cores this process may use).
        graph / fused / stage_times / warmup: the GPU decode step (:mod:`strata.engine.gpu.fused`).
        card: a card to emulate on the GPU (``--card``, a :class:`strata.budget.cards.Card`): free memory,
            allocation failures and the automatic cache size as on that card (:mod:`strata.engine.gpu.card`).
        stage_order: the start-up stages after ``pack`` in another order (tests of docs/DESIGN.md
            "Start-up order", :func:`strata.engine.startup.stage_order`); None: the one order.
    """

    n_ctx: int | None = F.DEFAULT_CTX
    kv: str = F.DEFAULT_KV
    sliding: str = "ring"
    numerics: str = DEFAULT_NUMERICS
    resident: str | float = "all"
    expert_cache: str | int = "auto"
    profile: list[tuple[int, int, int]] | None = None
    vram_reserve_mib: int = F.DEFAULT_RESERVE_MIB
    admit: bool | None = None
    exact: bool = False
    cpu_kernel: str | None = None
    threads: int | None = None
    graph: bool = True
    fused: bool | None = None
    stage_times: bool = False
    warmup: bool = True
    card: Any = None
    stage_order: tuple[str, ...] | None = None


@dataclass
class Engine:
    """A loaded pack, ready to generate. ``experts`` is None for dense models; ``decoder`` is the
    GPU's fused step when it runs one (else None), ``gpu`` the GPU start-up's facts (None on the CPU)."""

    pack: Pack
    geometry: Geometry
    plan: LoadPlan
    weights: Weights
    model: Any  # a Decoder, or the GPU's FusedDecoder wrapping one
    tokenizer: Tokenizer
    state: State
    experts: ExpertPath | None
    checkpoints: list[Checkpoint] = field(default_factory=list)
    device: str = "cpu"
    kv: str = "f16"
    probe: StepProbe | None = None  # per-step device timers (GPU path; used with stats)
    decoder: Any = None  # strata.engine.gpu.fused.FusedDecoder when the GPU runs its fused step
    gpu: Any = None  # strata.engine.gpu.device.GpuInfo on a GPU device
    notes: list[str] = field(default_factory=list)  # what the forward pass knowingly leaves out (one line each)

    @property
    def n_ctx(self) -> int:
        return self.state.n_ctx


class Device(Protocol):
    """What a device does at each start-up stage (see the module docstring). ``note`` is the stage's
    checkpoint notes; a device adds its figures there."""

    name: str

    def describe(self) -> str: ...
    def check_options(self, opts: EngineOptions) -> None: ...
    def mark(self, stage: str, note: dict) -> None: ...
    def memory_available(self) -> tuple[int, str]: ...
    def make_weights(self, pack: Pack, plan: LoadPlan, nx) -> Weights: ...
    def make_experts(self, plan: LoadPlan, nx) -> ExpertPath: ...
    def load_weights(self, weights: Weights, names: list[str], stage: str, note: dict) -> None: ...
    def open_session(self, model: Decoder, opts: EngineOptions, n_ctx: int, note: dict) -> State: ...
    def prompt_path(self, model: Decoder, state: State, opts: EngineOptions, note: dict) -> Any: ...
    def open_expert_cache(self, experts: ExpertPath, geom: Geometry, opts: EngineOptions, note: dict) -> None: ...
    def load_drafter(self, pack: Pack, plan: LoadPlan, model: Decoder, note: dict) -> None: ...
    def bind_drafter(self, plan: LoadPlan, model: Decoder, opts: EngineOptions, n_ctx: int, note: dict) -> None: ...
    def finish(self, engine: Engine) -> None: ...


__all__ = ["Device", "Engine", "EngineOptions", "StepProbe"]
