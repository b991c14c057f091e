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
RAM cannot hold it (the plan's warning says so) the engine computes the misses on the CPU, and so does the prediction
(with ``--cpu-expert-us``; ``--miss-tier pcie`` is refused there, as the engine refuses it). ``step_ms`` is the decode
step with every expert resident ON THIS CARD - measured, not derived: the step is bound by kernel latencies, not by
VRAM bandwidth (the Qwen3-30B-A3B geometry's step on an H200 is 4.3 ms where its ~2 GB of active weights take 0.4 ms at
the card's 4.8 TB/s: a bandwidth model would be ~10x fast). ``strata-engine generate`` on a card where every expert
fits gives it (1000 / its decode tok/s). Misses are charged to PCIe only: the engine's host tier (``--miss-tier pcie``,
the default where the tier fits host memory) reads a missed expert over PCIe inside the step - unless the CPU's rate is
given (``cpu_expert_us``, ``--cpu-expert-us``: microseconds an expert on the CPU with the engine's miss kernel and
threads, as ``strata-engine generate --verbose`` says it measured at start-up, ``cpu experts``). Then the misses are
charged as the engine serves them (:func:`split_misses`, the rule of ``engine/gpu/miss_split.py`` at start-up, one
definition):

    t_pcie          = miss bytes / misses / pcie_gbs          (us an expert over PCIe)
    one graph       = misses x t_pcie
    split           = MoE layers x HYBRID_LAYER_US + misses / c x max(t x t_pcie, (c - t) x t_cpu), in whole
                      experts: c = misses a layer (rounded, 1..n_expert_used), t = keep_table(share)[c] of them over
                      PCIe, share = t_cpu / (t_pcie + t_cpu) (rounded to 0.01, in [0.01, 0.99])
    ``--miss-tier auto``: the split where misses >= MoE layers and split <= SPLIT_GAIN x one graph, else one graph;
    ``--miss-tier cpu``: MoE layers x HYBRID_LAYER_US + misses x t_cpu; ``pcie`` (or a cache that learns): one graph.

How close the split's figure gets (H200, 30B-A3B, no expert resident, 2026-12-04 call s17c; the engine's start-up
measured t_cpu 58-61 us; step 3.84 ms, the 24G row of the README's table, another call): at ``--pcie-gbs`` 50 it
predicts 55.6 tok/s where the engine decoded 44.7-47.2 (+18-24%: the model lets both tiers read the host's memory
at their own rates, where they share its channels); at the rate the expert kernels reach (38.5 GB/s: the mapped-read
probe's 50 x the engine's ``KERNEL_READ_SHARE`` 0.77) 47.9-49.6 tok/s (+1-11%; 3 of 8 over PCIe, where the engine's
search settled too). Not yet checked with ``strata-engine measure`` on the device (no device time left that session).

How close it gets (H200, Qwen3-30B-A3B geometry with token-dependent routing, bench/results/h200-2026-12-02f-*):
``step_ms`` 4.33 (the 24G row, every expert resident, 230.8 tok/s), ``pcie_gbs`` 50 (PCIe 5.0 x16's nominal rate, not
fitted), 3,059,712 B a blob x 48 layers, 8 experts a token: predicted 213.5 / 88.4 / 35.9 tok/s at the measured hit
rates 98.5% / 70.3% / 0% (16G with and without a profile, no expert resident) against 202.6 / 86.4 / 33.1 measured:
+5.4%, +2.3%, +8.4% (the model leaves out the host work a miss adds). Qwen3-Next-80B-A3B at 24G
(h200-2026-12-02g-*; IQ2_XS experts, 909,312 B a blob, 10 a token): its every-resident step was not measured in that
run; taking the 99.7%-hit row (113.2 tok/s) less its own misses as the step, the model puts the 93.6% row at 106.8 tok/s
against 107.7 measured (-0.9%).

The model does not count the engine's prefetch (``strata.engine.gpu.prefetch``: the next layer's predicted misses
copied while the layer before runs, 62% of the misses at 98.5% hits): with it the 30B-A3B 16G row with a profile
(2026-12-04 call s18c, 2,106 misses over 376 tokens: 5.60 a token, 17.1 MB) is predicted at 241.8 tok/s from the
same call's 24G step (3.79 ms) at ``--pcie-gbs`` 50 and measured 240.8 (+0.4%); without it (call s18b,
``STRATA_PREFETCH=0``) 240.2 against 232.3 (+3.4%). At lower hit rates the misses a layer outrun the 2 staging
slots and the figure is the one above.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from strata.layout import experts as LX

from .cache_policy import class_refusal, learns
from .errors import PlanInputError
from .options import SPEED_RANGES, shown_number, speed_value_error

#: The hybrid step's own cost per MoE layer beyond the one-graph step's (microseconds): the host's spin on the
#: layer's flag, the launch of its next graph segment, ``moe_take_rows``, and the GPU's non-expert work that can no
#: longer overlap the experts. Measured on the H200 with 16 cores (2026-12-03, call g, the 30B-A3B geometry, no
#: expert resident, ``--miss-tier cpu``): 34.0 ms a token less 28.3 ms of CPU experts less the one-graph step's
#: non-expert ~3.4 ms = 2.3 ms over 48 layers, rounded up (100 us with the round trip a layer before, call z).
HYBRID_LAYER_US = 50.0
#: The split is taken when its predicted miss time is at most this fraction of the one graph's.
SPLIT_GAIN = 0.9


class TierSplit(BaseModel):
    """:func:`split_misses`' figures: ``share`` (the host tier's share of a layer's misses at the model's balance),
    ``one_us`` / ``split_us`` (microseconds a token of misses in one graph / split with the CPU), ``taken``, and
    the whole-expert split it charges: ``keep`` of ``per_layer`` misses a layer over PCIe."""

    share: float
    one_us: float
    split_us: float
    taken: bool
    keep: int = 0  # of ``per_layer`` misses a layer, how many the split reads over PCIe (whole experts)
    per_layer: int = 1


def keep_table(share: float, k: int) -> list[int]:
    """``keep[c]`` for ``c`` in 0..``k``: of the ``c`` selected experts of a layer that are in the host tier, how many
    the engine's ``moe_route`` leaves there (the first ones in selection order; the others go to the CPU). ``share``
    (in [0, 1]) is the tier's share at the model's balance, ``t_cpu / (t_pcie + t_cpu)`` (:func:`split_misses`), so
    with ``t`` in the tier the layer's misses take ``max(t x (1 - share), (c - t) x share)`` (times ``t_pcie +
    t_cpu``): ``keep[c]`` is the ``t`` that minimises it, the larger on a tie (one C call fewer). ``share`` 1:
    ``keep[c] = c`` (no split); 0: none in the tier.

    Raises:
        ValueError: ``share`` outside [0, 1] or ``k`` < 1."""
    if not 0 <= share <= 1 or k < 1:
        raise ValueError(f"miss split: share {share}, k {k}")
    out = []
    for c in range(k + 1):
        cost = [(max(t * (1 - share), (c - t) * share), -t) for t in range(c + 1)]
        out.append(-min(cost)[1])
    return out


def split_misses(t_pcie_us: float, t_cpu_us: float, misses: float, moe_layers: int, k: int) -> TierSplit:
    """The module docstring's split: ``t_pcie_us`` / ``t_cpu_us`` microseconds an expert over PCIe / on the CPU,
    ``misses`` a token (expected), ``moe_layers`` MoE layers, ``k`` experts a token a layer. The split is made in
    whole experts (:func:`keep_table`): a layer that misses ``c = round(misses / moe_layers)`` (in 1..k) keeps
    ``t = keep[c]`` in the tier, so the split costs ``moe_layers x HYBRID_LAYER_US + misses / c x max(t x t_pcie,
    (c - t) x t_cpu)``. Taken where ``misses >= moe_layers`` (fewer do not pay for a host point a layer), ``t < c``
    (a table that sends the CPU nothing is no split: e.g. k = 2 at a share above 2/3) and the split's time is at
    most :data:`SPLIT_GAIN` of the one graph's. The one rule of the budget's prediction and the engine's start-up
    (:func:`strata.engine.gpu.miss_split.choose`).

    Raises:
        ValueError: a time that is not positive, negative misses, or ``k`` < 1."""
    if not (t_pcie_us > 0 and t_cpu_us > 0) or misses < 0 or k < 1:
        raise ValueError(f"miss split: t_pcie {t_pcie_us} us, t_cpu {t_cpu_us} us, {misses} misses a token, k {k}")
    one = misses * t_pcie_us
    share = min(max(round(t_cpu_us / (t_pcie_us + t_cpu_us), 2), 0.01), 0.99)
    c = min(k, max(1, round(misses / moe_layers))) if moe_layers else 1
    t = keep_table(share, k)[c]
    split = moe_layers * HYBRID_LAYER_US + misses / c * max(t * t_pcie_us, (c - t) * t_cpu_us)
    taken = 0 < misses and moe_layers <= misses and t < c and split <= SPLIT_GAIN * one
    return TierSplit(share=share, one_us=one, split_us=split, taken=taken, keep=t, per_layer=c)


class DecodeSpeed(BaseModel):
    """One prediction (the module docstring's model). Times in milliseconds, bandwidth in GB/s (1e9 B/s), bytes in
    bytes, ``misses_per_token`` a count of experts (fractional: an expectation), ``cpu_expert_us`` microseconds an
    expert on the CPU. ``share``: the misses' share charged over PCIe (1: every one, 0: every one on the CPU; a
    split's ``keep`` of ``per_layer`` a layer); ``note``: why a given ``--cpu-expert-us`` was not used, or empty."""

    tok_s: float
    ms_per_token: float
    step_ms: float
    miss_ms: float
    misses_per_token: float
    miss_bytes_per_token: float
    pcie_gbs: float | None
    hit_rate: float
    hit_basis: str  # where the hit rate comes from (the profile's prediction, the resident fraction, measured)
    cpu_expert_us: float | None = None
    share: float = 1.0
    keep: int = 0
    per_layer: int = 0
    note: str = ""

    def text(self) -> str:
        """One line for the terminal, every figure with its unit."""
        m, mib = self.misses_per_token, self.miss_bytes_per_token / 2**20
        if not m:
            misses = ""
        elif self.share == 1:
            misses = (
                f" + {m:.1f} misses a token = {mib:.1f} MiB over PCIe at {self.pcie_gbs:g} GB/s ({self.miss_ms:.2f} ms)"
            )
        else:
            how = (
                f"split {self.keep} of {self.per_layer} a layer over PCIe at {self.pcie_gbs:g} GB/s, "
                f"{self.per_layer - self.keep} on the CPU"
                if self.per_layer
                else "on the CPU"
            )
            misses = (
                f" + {m:.1f} misses a token = {mib:.1f} MiB, {how} at {self.cpu_expert_us:g} us an expert "
                f"({self.miss_ms:.2f} ms with {HYBRID_LAYER_US:g} us a layer for the hybrid step)"
            )
        rate = f"{self.tok_s:.1f}" if self.tok_s >= 0.1 else f"{self.tok_s:.3g}"
        return (
            f"decode (predicted): {rate} tok/s = step {self.step_ms:.2f} ms{misses}; hit rate "
            f"{self.hit_rate:.1%} ({self.hit_basis})" + (f"; {self.note}" if self.note else "")
        )


def predict_decode(
    *,
    step_ms: float,
    pcie_gbs: float | None,
    hit_rate: float,
    hit_basis: str,
    n_expert_used: int,
    blob_bytes: Sequence[int],
    cpu_expert_us: float | None = None,
    miss_tier: str = "auto",
    cpu_why: str = "--miss-tier cpu",
) -> DecodeSpeed:
    """The decode rate of the module docstring's model. ``blob_bytes``: one expert's engine-form bytes per MoE layer
    (what a miss reads); empty for a model without routed experts (then the step alone). ``cpu_expert_us``: the CPU's
    microseconds an expert (None: misses charged to PCIe only); ``miss_tier``: where the engine serves misses
    (``auto`` splits where :func:`split_misses` takes it, ``cpu`` puts every miss on the CPU, anything else - e.g.
    ``--miss-tier pcie``, said in the note where a CPU rate goes unused - keeps every miss over PCIe; ``cpu_why``:
    why the CPU, for the refusal).

    Raises:
        PlanInputError: ``step_ms``, (given) ``pcie_gbs`` or ``cpu_expert_us`` outside its range
            (:data:`strata.budget.options.SPEED_RANGES`), a hit rate outside [0, 1], or misses to charge with no
            ``pcie_gbs`` (``cpu_expert_us`` with ``--miss-tier cpu``): a figure the model would have to invent.
    """
    for option, value in (("--step-ms", step_ms), ("--pcie-gbs", pcie_gbs), ("--cpu-expert-us", cpu_expert_us)):
        if value is not None and (bad := speed_value_error(option, value)):
            lo, hi, unit = SPEED_RANGES[option]
            raise PlanInputError(bad, tensor=option, found=shown_number(value), required=f"{lo:g} to {hi:g} {unit}")
    if not 0.0 <= hit_rate <= 1.0:
        raise PlanInputError(f"hit rate {hit_rate}: outside [0, 1]", tensor="hit rate", found=str(hit_rate))
    miss_frac = (1.0 - hit_rate) * n_expert_used if blob_bytes else 0.0
    misses = miss_frac * len(blob_bytes)
    nbytes = miss_frac * float(sum(blob_bytes))
    on_cpu = miss_tier == "cpu"
    if nbytes and on_cpu and cpu_expert_us is None:
        raise PlanInputError(
            f"{cpu_why}: {misses:.1f} expert misses a token run on the CPU: give --cpu-expert-us (the CPU's "
            f"microseconds an expert: the 'cpu experts' note of strata-engine generate --verbose) to predict the rate",
            tensor="--cpu-expert-us",
            found="not given",
            required="microseconds an expert",
        )
    if nbytes and not on_cpu and pcie_gbs is None:
        raise PlanInputError(
            f"{misses:.1f} expert misses a token at a {hit_rate:.1%} hit rate cross PCIe: give --pcie-gbs (the link's "
            f"GB/s, e.g. 50 for PCIe 5.0 x16, 25 for 4.0 x16) to predict the decode rate",
            tensor="--pcie-gbs",
            found="not given",
            required="a bandwidth in GB/s",
        )
    share, miss_ms, keep, per_layer, note = 1.0, 0.0, 0, 0, ""
    if nbytes and on_cpu:
        share, miss_ms = 0.0, (len(blob_bytes) * HYBRID_LAYER_US + misses * cpu_expert_us) / 1000.0
    elif nbytes:
        miss_ms = nbytes / (pcie_gbs * 1e9) * 1000.0
        if cpu_expert_us is not None and miss_tier == "auto":
            t_pcie = nbytes / misses / (pcie_gbs * 1e3)
            sp = split_misses(t_pcie, cpu_expert_us, misses, len(blob_bytes), n_expert_used)
            if sp.taken:
                share, miss_ms, keep, per_layer = sp.keep / sp.per_layer, sp.split_us / 1000.0, sp.keep, sp.per_layer
            else:
                note = "--cpu-expert-us unused: the split does not pay here (the engine keeps every miss over PCIe)"
        elif cpu_expert_us is not None:
            note = f"--cpu-expert-us unused: {miss_tier} keeps every miss over PCIe"
    elif cpu_expert_us is not None:
        note = "--cpu-expert-us unused: " + ("no routed experts" if not blob_bytes else "no expert misses")
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
        cpu_expert_us=cpu_expert_us,
        share=share,
        keep=keep,
        per_layer=per_layer,
        note=note,
    )


def plan_decode_speed(
    plan, facts, step_ms: float, pcie_gbs: float | None, cpu_expert_us: float | None = None
) -> DecodeSpeed:
    """:func:`predict_decode` for a plan (:class:`strata.budget.plan_types.Plan` of ``facts``): the hit rate is the
    profile fill's prediction when the plan has a profile, else the resident fraction (slots / pairs: with no profile
    the cache holds pairs the routing does not favour - measured 70.3% at 4,321 of 6,144 pairs on the 30B geometry);
    1 with every pair resident. The plan's ``--miss-tier``; a cache that learns is never split (the engine's rule:
    ``engine/gpu/miss_split.py`` ``decide``).

    Raises:
        PlanInputError: as :func:`predict_decode`; a plan for another engine (``--engine cpp``).
    """
    layers = facts.trunk_experts
    pairs = len(layers) * facts.n_expert
    learning = False
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
    tier, why = plan.options.miss_tier, "--miss-tier cpu"
    tier = "--miss-tier pcie" if tier == "pcie" else tier
    if rate < 1.0 and tier != "cpu" and not host_tier_fits(plan):  # the engine builds no tier (cards.host_ram_warnings)
        what = (
            f"the host tier ({plan.host_tier_bytes / 2**30:.2f} GiB pinned) does not fit this machine's RAM less 4 GiB"
        )
        if tier != "auto":
            raise PlanInputError(
                f"--miss-tier pcie: {what}: strata-engine refuses it (--miss-tier auto computes the misses on the CPU)",
                tensor="--miss-tier",
                found="pcie",
                required="auto or cpu",
            )
        tier, why = "cpu", f"--miss-tier auto: {what}"
    if tier == "auto" and (learning or plan.options.cache_policy == "class"):  # a learning cache is never split
        tier = "a cache that learns"
    return predict_decode(
        step_ms=step_ms,
        pcie_gbs=pcie_gbs,
        hit_rate=rate,
        hit_basis=basis,
        n_expert_used=facts.n_expert_used,
        blob_bytes=[L.blob_engine_bytes for L in layers],
        cpu_expert_us=cpu_expert_us,
        miss_tier=tier,
        cpu_why=why,
    )


def host_tier_fits(plan) -> bool:
    """Whether the plan's host tier fits this machine's RAM less :data:`strata.layout.experts.HOST_TIER_MARGIN_BYTES`
    (the rule :func:`strata.budget.cards.host_ram_warnings` warns by and the engine builds the tier by)."""
    from .cards import host_ram_bytes

    return plan.host_tier_bytes <= host_ram_bytes() - LX.HOST_TIER_MARGIN_BYTES


__all__ = [
    "keep_table",
    "HYBRID_LAYER_US",
    "SPLIT_GAIN",
    "DecodeSpeed",
    "TierSplit",
    "plan_decode_speed",
    "predict_decode",
    "split_misses",
]
