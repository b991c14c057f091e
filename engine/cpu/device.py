"""The CPU device (:class:`CpuDevice`, a :class:`strata.engine.core.Device`): what each start-up stage of
:func:`strata.engine.startup.load_engine` does on the CPU - the dense weights in the memory-mapped pool
(:class:`strata.engine.cpu.weights.CpuWeights`), the experts computed from the mapped shards
(:class:`strata.engine.cpu.experts.CpuExpertPath`), the kernels built before the first token.
"""

from __future__ import annotations

from strata.budget.cards import host_ram_bytes
from strata.manifests.contract import Geometry
from strata.packer.pack import Pack

from ..core import Engine
from ..decoder import Decoder, State
from ..experts import ExpertPath, ShardExperts, resident_pairs
from ..loader import LoadPlan
from ..options import ResolvedOptions
from .experts import CpuExpertCache, CpuExpertPath
from .weights import CpuWeights


class CpuDevice:
    """The NumPy path: dense weights held by :class:`strata.engine.cpu.weights.CpuWeights`, resident
    experts by :class:`strata.engine.cpu.experts.CpuExpertCache` (chosen by ``resident``), the rest
    computed from the memory-mapped shards, with the resolved options' ``kernel`` and ``threads``."""

    name = "cpu"

    def describe(self) -> str:
        return "CPU (NumPy)"

    def configure(self, opts: ResolvedOptions) -> None:
        # "q8" (llama.cpp's CPU numerics, the default), "exact" (the GPU's order) or "f32" (strata.engine.cpu.kernels)
        self.kernel, self.threads = opts.kernel, opts.threads

    def mark(self, stage: str, note: dict) -> None:
        pass

    def memory_available(self) -> tuple[int, str]:
        return host_ram_bytes(), "host RAM (SC_PHYS_PAGES x SC_PAGE_SIZE)"

    def make_weights(self, pack: Pack, plan: LoadPlan, nx) -> CpuWeights:
        return CpuWeights(pack, plan.dense, nx, threads=self.threads, kernel=self.kernel)

    def make_experts(self, plan: LoadPlan, nx) -> ExpertPath:
        return CpuExpertPath(ShardExperts(plan), None, act_quant=nx.act_quant, threads=self.threads, kernel=self.kernel)

    def load_weights(self, weights: CpuWeights, names: list[str], stage: str, note: dict) -> None:
        before = weights.nbytes_f32
        weights.load(names)
        note["f32 vector KiB"] = round((weights.nbytes_f32 - before) / 2**10, 1)
        what = {
            "q8": "llama.cpp numerics (Q8 activations, integer dots)",
            "exact": "GPU order (exact f32)",
            "f32": "f32 dot",
        }[self.kernel]
        note["kernels"] = f"quantized, {what}, {self.threads} threads"

    def open_session(self, model: Decoder, opts: ResolvedOptions, note: dict) -> State:
        state = model.new_state(opts.n_ctx, kv=opts.kv, sliding=opts.sliding)
        note["n_ctx"] = opts.n_ctx
        note["kv"] = f"{opts.kv}, {opts.sliding}"
        note["kv MiB"] = round(state.cache.nbytes / 2**20, 1)
        return state

    def prompt_path(self, model: Decoder, state: State, opts: ResolvedOptions, note: dict) -> Decoder:
        from .kernels import library

        types = set(model.w.types())
        if model.experts is not None:
            types |= {t for il in model.experts.source.layers for t in model.experts.source.types(il)}
        for t in sorted(types):
            library(t)  # build / load each type's kernels now, not at the first token
        note["decode path"] = (
            f"NumPy step over quantized kernels, one position per step; the prompt in chunks of {opts.ubatch} "
            "positions (-ub)"
            if opts.ubatch > 1 and getattr(model, "chunked", False)
            else "NumPy step over quantized kernels, one position per step (the prompt too)"
        )
        note["kernel types"] = len(types)
        return model

    def open_expert_cache(self, experts: ExpertPath, geom: Geometry, opts: ResolvedOptions, note: dict) -> None:
        n_expert = int(geom["n_expert"])
        pairs = resident_pairs(opts.resident, experts.source.layers, n_expert)
        experts.cache = CpuExpertCache(
            experts.source, pairs, act_quant=experts.act_quant, threads=experts.threads, kernel=experts.kernel
        )
        note["resident"] = f"{len(pairs)} of {len(experts.source.layers) * n_expert} experts ({opts.resident})"

    def load_drafter(self, pack: Pack, plan: LoadPlan, model: Decoder, note: dict) -> None:
        note["draft tensors"] = len(plan.draft)
        note["where"] = "kept in the memory-mapped pool (the CPU path does not run the draft head)"

    def bind_drafter(self, plan: LoadPlan, model: Decoder, opts: ResolvedOptions, note: dict) -> None:
        note["bind"] = "none on the CPU path"

    def finish(self, engine: Engine) -> None:
        pass


__all__ = ["CpuDevice"]
