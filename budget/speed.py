"""The decode speed a plan buys: tokens per second from the plan's hit rate, the card's measured step and the PCIe
bandwidth the misses cross (issue 19 item 7; no peer - llama.cpp's ``--fit``, gguf-parser-go - predicts speed).

The model (one definition, used by ``strata-budget check --step-ms --pcie-gbs`` and ``strata-engine measure``)::

    misses a token  = (1 - hit_rate) x n_expert_used x MoE layers
    miss bytes      = (1 - hit_rate) x n_expert_used x sum over MoE layers of one expert's blob (engine form: what the
                      host tier holds and the GPU kernels read over PCIe: gate + up + down)
    ms a token      = step_ms + miss bytes / (pcie_gbs x 1e9 B/s) x 1000
    tok/s           = 1000 / ms a token

The hit rate is one figure for every layer (the profile's prediction, or the resident fraction): a layer that misses
more than the mean moves the bytes by its blob's share. ``--miss-tier auto`` plans the host tier; where the machine's
RAM cannot hold it (the plan's warning says so) the engine computes the misses on the CPU and the prediction does not
apply. ``step_ms`` is the decode step with every expert resident ON THIS CARD - measured, not derived: the step is
bound by kernel latencies, not by VRAM bandwidth (the Qwen3-30B-A3B geometry's step on an H200 is 4.3 ms where its ~2
GB of active weights take 0.4 ms at the card's 4.8 TB/s: a bandwidth model would be ~10x fast). ``strata-engine
generate`` on a card where every expert fits gives it (1000 / its decode tok/s). Misses are charged to PCIe only: the
engine's host tier (``--miss-tier pcie``, the default where the tier fits host memory) reads a missed expert over PCIe
inside the step; the prediction refuses the CPU tier rather than guess a CPU's expert rate.

How close it gets (H200, Qwen3-30B-A3B geometry with token-dependent routing, bench/results/h200-2026-12-02f-*):
``step_ms`` 4.33 (the 24G row, every expert resident, 230.8 tok/s), ``pcie_gbs`` 50 (PCIe 5.0 x16's nominal rate, not
fitted), 3,059,712 B a blob x 48 layers, 8 experts a token: predicted 213.5 / 88.4 / 35.9 tok/s at the measured hit
rates 98.5% / 70.3% / 0% (16G with and without a profile, no expert resident) against 202.6 / 86.4 / 33.1 measured:
+5.4%, +2.3%, +8.4% (the model leaves out the host work a miss adds). Qwen3-Next-80B-A3B at 24G
(h200-2026-12-02g-*; IQ2_XS experts, 909,312 B a blob, 10 a token): its every-resident step was not measured in that
run; taking the 99.7%-hit row (113.2 tok/s) less its own misses as the step, the model puts the 93.6% row at 106.8 tok/s
against 107.7 measured (-0.9%).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from strata.layout import experts as LX

from .cache_policy import class_refusal, learns
from .errors import PlanInputError
from .options import SPEED_RANGES, speed_value_error


class DecodeSpeed(BaseModel):
    """One prediction (the module docstring's model). Times in milliseconds, bandwidth in GB/s (1e9 B/s), bytes in
    bytes, ``misses_per_token`` a count of experts (fractional: an expectation)."""

    tok_s: float
    ms_per_token: float
    step_ms: float
    miss_ms: float
    misses_per_token: float
    miss_bytes_per_token: float
    pcie_gbs: float | None
    hit_rate: float
    hit_basis: str  # where the hit rate comes from (the profile's prediction, the resident fraction, measured)

    def text(self) -> str:
        """One line for the terminal, every figure with its unit."""
        misses = (
            f" + {self.misses_per_token:.1f} misses a token = {self.miss_bytes_per_token / 2**20:.1f} MiB over PCIe at "
            f"{self.pcie_gbs:g} GB/s ({self.miss_ms:.2f} ms)"
            if self.misses_per_token
            else ""
        )
        return (
            f"decode (predicted): {self.tok_s:.1f} tok/s = step {self.step_ms:.2f} ms{misses}; hit rate "
            f"{self.hit_rate:.1%} ({self.hit_basis})"
        )


def predict_decode(
    *,
    step_ms: float,
    pcie_gbs: float | None,
    hit_rate: float,
    hit_basis: str,
    n_expert_used: int,
    blob_bytes: Sequence[int],
) -> DecodeSpeed:
    """The decode rate of the module docstring's model. ``blob_bytes``: one expert's engine-form bytes per MoE layer
    (what a miss reads); empty for a model without routed experts (then the step alone).

    Raises:
        PlanInputError: ``step_ms`` or (given) ``pcie_gbs`` outside its range (:data:`strata.budget.options.
            SPEED_RANGES`), a hit rate outside [0, 1], or misses to charge with no ``pcie_gbs`` (a figure the model
            would have to invent).
    """
    for option, value in (("--step-ms", step_ms), ("--pcie-gbs", pcie_gbs)):
        if value is not None and (bad := speed_value_error(option, value)):
            lo, hi, unit = SPEED_RANGES[option]
            raise PlanInputError(bad, tensor=option, found=f"{value:g}", required=f"{lo:g} to {hi:g} {unit}")
    if not 0.0 <= hit_rate <= 1.0:
        raise PlanInputError(f"hit rate {hit_rate}: outside [0, 1]", tensor="hit rate", found=str(hit_rate))
    miss_frac = (1.0 - hit_rate) * n_expert_used if blob_bytes else 0.0
    misses = miss_frac * len(blob_bytes)
    nbytes = miss_frac * float(sum(blob_bytes))
    if nbytes and pcie_gbs is None:
        raise PlanInputError(
            f"{misses:.1f} expert misses a token at a {hit_rate:.1%} hit rate cross PCIe: give --pcie-gbs (the link's "
            f"GB/s, e.g. 50 for PCIe 5.0 x16, 25 for 4.0 x16) to predict the decode rate",
            tensor="--pcie-gbs",
            found="not given",
            required="a bandwidth in GB/s",
        )
    miss_ms = nbytes / (pcie_gbs * 1e9) * 1000.0 if nbytes else 0.0
    ms = step_ms + miss_ms
    return DecodeSpeed(
        tok_s=1000.0 / ms,
        ms_per_token=ms,
        step_ms=step_ms,
        miss_ms=miss_ms,
        misses_per_token=misses,
        miss_bytes_per_token=nbytes,
        pcie_gbs=pcie_gbs,
        hit_rate=hit_rate,
        hit_basis=hit_basis,
    )


def plan_decode_speed(plan, facts, step_ms: float, pcie_gbs: float | None) -> DecodeSpeed:
    """:func:`predict_decode` for a plan (:class:`strata.budget.plan_types.Plan` of ``facts``): the hit rate is the
    profile fill's prediction when the plan has a profile, else the resident fraction (slots / pairs: with no profile
    the cache holds pairs the routing does not favour - measured 70.3% at 4,321 of 6,144 pairs on the 30B geometry);
    1 with every pair resident.

    Raises:
        PlanInputError: as :func:`predict_decode`; a plan for another engine (``--engine cpp``); the CPU miss tier
            (``--miss-tier cpu``: no CPU rate to charge).
    """
    layers = facts.trunk_experts
    pairs = len(layers) * facts.n_expert
    if plan.profile is not None:
        rate, basis = plan.profile.expected_hit_rate, "the profile's prediction, in-sample"
    elif pairs:  # the experts the slots hold: less the learning cache's swap scratch (a lower bound: it learns)
        learning = (  # the engine's rule (class_refusal): with fewer than 2 slots the fill stays, nothing learns
            plan.host_tier_bytes > 0
            and learns(plan.options.cache_policy, False)
            and plan.slots < pairs
            and class_refusal(True, plan.slots, pairs, "") is None
        )
        held = min(LX.expert_capacity(pairs, plan.slots, learning), pairs)
        rate = held / pairs
        basis = f"{held} of {pairs} pairs resident, no profile" + (
            " (a lower bound: the cache learns while decoding)" if learning else ""
        )
    else:
        rate, basis = 1.0, "no routed experts"
    if plan.options.engine != "strata":
        raise PlanInputError(
            f"--engine {plan.options.engine}: the prediction models strata's engine (its step, its host tier)",
            tensor="--engine",
            found=plan.options.engine,
            required="strata",
        )
    if rate < 1.0 and plan.options.miss_tier == "cpu":
        raise PlanInputError(
            "--miss-tier cpu: the prediction charges misses to PCIe only (the host tier); it has no CPU expert rate",
            tensor="--miss-tier",
            found="cpu",
            required="auto or pcie",
        )
    return predict_decode(
        step_ms=step_ms,
        pcie_gbs=pcie_gbs,
        hit_rate=rate,
        hit_basis=basis,
        n_expert_used=facts.n_expert_used,
        blob_bytes=[L.blob_engine_bytes for L in layers],
    )


__all__ = ["DecodeSpeed", "plan_decode_speed", "predict_decode"]
