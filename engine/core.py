"""The engine's core types: the loaded engine, and what a device must do (the options it starts with:
:mod:`strata.engine.options`).

Below :mod:`strata.engine.startup` (which runs the stages) and the devices (:mod:`strata.engine.cpu.device`,
``strata.engine.gpu.device``), so that both import these without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from strata.manifests.contract import Geometry
from strata.packer.pack import Pack

from .checkpoints import Checkpoint
from .decoder import Decoder, State
from .experts import ExpertPath
from .loader import LoadPlan
from .options import ResolvedOptions
from .tokenizer import Tokenizer
from .weights import Weights


class StepProbe(Protocol):
    """Per-step timers a device supplies (``begin`` before the step, ``end`` after it returns
    ``gpu_ms``, ``cpu_expert_ms``, ``wait_ms``; values may be None where a device cannot measure)."""

    def begin(self) -> None: ...

    def end(self) -> dict[str, float | None]: ...


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
    options: ResolvedOptions | None = None  # what it was started with, every default decided

    @property
    def n_ctx(self) -> int:
        return self.state.n_ctx

    def check_files(self) -> None:
        """Before a step: every memory-mapped file the engine reads (the pool on the CPU, the expert shards) still
        has its start-up size (:mod:`strata.engine.mapped`).

        Raises:
            MappedFileChanged: a file truncated or rewritten in place, with both sizes.
        """
        source = getattr(self.experts, "source", None)
        for f in (*getattr(self.weights, "mapped_files", ()), *getattr(source, "mapped_files", ())):
            f.check()


class Device(Protocol):
    """What a device does at each start-up stage (see the module docstring). ``note`` is the stage's
    checkpoint notes; a device adds its figures there. ``configure`` hands it the resolved options once,
    in the ``pack`` stage, before any other stage's method; the others get the same object."""

    name: str

    def describe(self) -> str: ...
    def configure(self, opts: ResolvedOptions) -> None: ...
    def mark(self, stage: str, note: dict) -> None: ...
    def memory_available(self) -> tuple[int, str]: ...
    def make_weights(self, pack: Pack, plan: LoadPlan, nx) -> Weights: ...
    def make_experts(self, plan: LoadPlan, nx) -> ExpertPath: ...
    def load_weights(self, weights: Weights, names: list[str], stage: str, note: dict) -> None: ...
    def open_session(self, model: Decoder, opts: ResolvedOptions, note: dict) -> State: ...
    def prompt_path(self, model: Decoder, state: State, opts: ResolvedOptions, note: dict) -> Any: ...
    def open_expert_cache(self, experts: ExpertPath, geom: Geometry, opts: ResolvedOptions, note: dict) -> None: ...
    def load_drafter(self, pack: Pack, plan: LoadPlan, model: Decoder, note: dict) -> None: ...
    def bind_drafter(self, plan: LoadPlan, model: Decoder, opts: ResolvedOptions, note: dict) -> None: ...
    def finish(self, engine: Engine) -> None: ...


__all__ = ["Device", "Engine", "StepProbe"]
