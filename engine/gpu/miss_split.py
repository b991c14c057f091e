"""A layer's misses split between the host tier and the CPU (issue 19 item 2; the documents' ``pcie_frac``).

Where the VRAM cache does not hold a (layer, expert) pair, the fused decode step reads it from the host tier over
PCIe with the same kernel as a hit (one graph a token, :mod:`strata.engine.gpu.slots`), or the CPU computes it in the
hybrid step (the host stops at each MoE layer's routing: :mod:`strata.engine.gpu.fused_moe`). The two tiers are
separate bandwidths - the PCIe link and the host's memory channels - so when many experts miss, each layer's misses
are faster split between them: the host tier holds the first ``ceil(share x n)`` of each layer's ``n`` non-resident
pairs, the CPU computes the rest while the GPU reads the tier's.

The share is chosen at start-up from two measurements and a model of the step (no tuning run), all times per token:

- ``t_pcie`` (us an expert): the slot's bytes over the rate of :func:`probe_mapped_read` (a kernel reading pinned,
  mapped host memory as the expert matvecs do) times :data:`KERNEL_READ_SHARE` (what the expert kernels reach of it);
  ``t_cpu`` (us an expert): :func:`strata.engine.gpu.slots.probe_cpu_experts` (the hybrid step's miss call, its
  kernel and threads, on other layers' experts, the median);
- ``m``: misses a token, ``k x layers x (1 - hit rate)``: the profile fill's hit rate with ``--expert-profile``,
  else the resident fraction ``slots / pairs`` (routing taken as uniform - a profile, or the skew, does better);
- one graph: ``m x t_pcie``; split: ``layers x HYBRID_LAYER_US + m x t_pcie x t_cpu / (t_pcie + t_cpu)`` (both
  tiers busy at once, each given the share that makes them end together: ``share = t_cpu / (t_pcie + t_cpu)``);
- the split is taken when it predicts at most :data:`SPLIT_GAIN` of the one graph's time.

``STRATA_PCIE_SHARE`` (a number in [0.01, 1]) overrides the choice (a benchmark knob). The budget plans the whole host
tier's pinned bytes either way (a bound: a split pins less).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The hybrid step's own cost per MoE layer beyond the one-graph step's (microseconds): the host's spin on the
#: layer's flag, the launch of its next graph segment, ``moe_take_rows``, and the GPU's non-expert work that can no
#: longer overlap the experts. Measured on the H200 with 16 cores (2026-12-03, call g, the 30B-A3B geometry, no
#: expert resident, ``--miss-tier cpu``): 34.0 ms a token less 28.3 ms of CPU experts less the one-graph step's
#: non-expert ~3.4 ms = 2.3 ms over 48 layers, rounded up (100 us with the round trip a layer before, call z).
HYBRID_LAYER_US = 50.0
#: The expert kernels' reads of the host tier over the probe kernel's rate: the one-graph step with no expert resident
#: read 384 x 3,059,712 B a token in 30.7 ms more than every expert resident (38.3 GB/s) where
#: :func:`probe_mapped_read` measured 48.6-51.2 GB/s (H200, 30B-A3B, 2026-12-02, calls z and z2). With the probe's
#: rate alone the start-up chose 0.55-0.61 and the GPU's own work became the step's floor (23.8 ms of 30.7, --stats).
KERNEL_READ_SHARE = 0.77
#: The split is taken when its predicted miss time is at most this fraction of the one graph's.
SPLIT_GAIN = 0.9
#: Least bytes and timed launches of the mapped-read probe (after one untimed launch); it reads at least 4 times the
#: GPU's L2 cache, so no pass can be served from it.
PROBE_READ_BYTES, PROBE_READ_RUNS = 64 * 2**20, 4


@dataclass(frozen=True)
class MissSplit:
    """The host tier's share of each layer's non-resident pairs (``share`` in (0, 1]; 1: the one-graph step) and
    why (the start-up note)."""

    share: float
    why: str


def asked_share() -> float | None:
    """``STRATA_PCIE_SHARE`` when set and not empty (the host tier's share of each MoE layer's non-resident experts, in
    [0.01, 1]; a benchmark knob that overrides ``--miss-tier pcie`` and the start-up's choice), else None (chosen at
    start-up, :func:`choose`).

    Raises:
        ExpertCacheError: a value that is not a number in [0.01, 1], naming it.
    """
    import os

    from ..errors import ExpertCacheError

    raw = os.environ.get("STRATA_PCIE_SHARE", "")
    if not raw.strip():  # unset or empty: unset, as a shell's VAR= means
        return None
    try:
        share = float(raw)
    except ValueError:
        share = float("nan")
    if not 0.01 <= share <= 1.0:  # (NaN fails too)
        raise ExpertCacheError(
            f"STRATA_PCIE_SHARE={raw!r}: the host tier's share of a layer's misses: in [0.01, 1] (it overrides "
            f"--miss-tier pcie and the start-up's choice; unset it for those)"
        )
    return share


def refuse_share(share: float | None, miss_tier: str, cache_policy: str) -> None:
    """Refuse a ``STRATA_PCIE_SHARE`` below 1 (``share``, :func:`asked_share`) that the options leave nothing to split:
    ``--miss-tier cpu`` (no host tier) or ``--cache-policy class`` (it swaps experts with the tier: every miss there).

    Raises:
        ExpertCacheError: naming the variable, its value and the option."""
    from ..errors import ExpertCacheError

    if share is None or share >= 1:
        return
    opt = "--miss-tier cpu" if miss_tier == "cpu" else "--cache-policy class" if cache_policy == "class" else None
    if opt is not None:
        raise ExpertCacheError(
            f"STRATA_PCIE_SHARE={share}: a split of each layer's misses between the host tier and the CPU, but {opt} "
            f"leaves nothing to split ({'no host tier' if opt.startswith('--miss') else 'every miss in the tier'})"
        )


def split_tier_pairs(rest: list[tuple[int, int]], share: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``rest`` (the (layer, expert) pairs the VRAM cache does not hold) split into ``(tier, cpu)``: per layer the
    first ``ceil(share x n)`` of its ``n`` pairs by expert id for the host tier (at least one where ``share`` > 0:
    with few pairs a layer the pairs' share exceeds ``share``, :func:`tier_pairs` says by how much), the others for
    the CPU (with ``share`` 1 every pair in the tier). Order kept."""
    by_layer: dict[int, list[int]] = {}
    for il, e in rest:
        by_layer.setdefault(il, []).append(e)
    keep = {il: set(sorted(es)[: math.ceil(share * len(es) - 1e-9)]) for il, es in by_layer.items()}
    tier = [(il, e) for il, e in rest if e in keep[il]]
    return tier, [(il, e) for il, e in rest if e not in keep[il]]


def tier_pairs(rest: list[tuple[int, int]], share: float, note: dict) -> list[tuple[int, int]]:
    """The host tier's part of :func:`split_tier_pairs`; where the CPU keeps some, ``note["miss split"]`` says how
    many each tier holds (the share asked, and the share of the pairs that holds: per-layer counts are whole)."""
    tier, cpu = split_tier_pairs(rest, share)
    if cpu:
        note["miss split"] = (
            f"{len(tier)} pairs in the host tier (PCIe), {len(cpu)} on the CPU (share {share} asked, "
            f"{len(tier) / len(rest):.2f} of the pairs)"
        )
    return tier


def choose(t_pcie_us: float, t_cpu_us: float, misses: float, moe_layers: int) -> MissSplit:
    """The share of the module docstring's model: ``t_pcie_us`` / ``t_cpu_us`` microseconds an expert over PCIe /
    on the CPU, ``misses`` a token (expected), ``moe_layers`` MoE layers. Returns share 1 (the one graph) unless the
    split predicts at most :data:`SPLIT_GAIN` of the one graph's miss time; the share is rounded to 0.01 (in
    [0.01, 0.99]).

    Raises:
        ValueError: a time that is not positive, or negative misses."""
    if not (t_pcie_us > 0 and t_cpu_us > 0) or misses < 0:
        raise ValueError(f"miss split: t_pcie {t_pcie_us} us, t_cpu {t_cpu_us} us, {misses} misses a token")
    one = misses * t_pcie_us
    share = min(max(round(t_cpu_us / (t_pcie_us + t_cpu_us), 2), 0.01), 0.99)
    split = moe_layers * HYBRID_LAYER_US + misses * max(share * t_pcie_us, (1 - share) * t_cpu_us)
    basis = (
        f"{misses:.0f} misses a token x {t_pcie_us:.0f} us over PCIe = {one / 1000:.1f} ms in one graph; split "
        f"{share:.2f} with the CPU's {t_cpu_us:.0f} us an expert: {split / 1000:.1f} ms (+ {HYBRID_LAYER_US:.0f} us "
        f"a layer for the hybrid step)"
    )
    if misses > 0 and split <= SPLIT_GAIN * one:
        return MissSplit(share, f"split {share:.2f} PCIe / {1 - share:.2f} CPU: {basis}")
    return MissSplit(1.0, f"all over PCIe: {basis}")


def probe_mapped_read(nbytes: int = PROBE_READ_BYTES) -> tuple[float, int]:
    """The host tier's link as the decode kernels read it (``cuda/probe.cu``'s ``read_mapped`` over ``nbytes`` - at
    least 4 times the GPU's L2 cache - of pinned, mapped host memory: cudaHostAlloc with
    :data:`strata.engine.gpu.slots.HOST_ALLOC_FLAGS`), timed by CUDA events over :data:`PROBE_READ_RUNS` launches
    after one untimed: ``(GB/s (1e9 B/s), the bytes read a launch)``. CUDA only.

    Raises:
        RuntimeError: the launches took no measurable time (no figure rather than a made-up one)."""
    import cupy as cp
    import numpy as np

    from . import kernels as K
    from .slots import HOST_ALLOC_FLAGS

    kern = K.load_module(K.cuda_file("probe.cu"), ("read_mapped",))["read_mapped"]
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    nbytes = max(nbytes, -(-4 * int(props.get("l2CacheSize", 0)) // 16) * 16)
    mem = cp.cuda.PinnedMemory(nbytes, HOST_ALLOC_FLAGS)
    host = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, nbytes)
    host[:] = 1  # touched: the pages exist before they are read
    dev = int(cp.cuda.runtime.pointerGetAttributes(mem.ptr).devicePointer)
    out = cp.zeros(1, cp.uint32)
    sms = props["multiProcessorCount"]
    st = cp.cuda.get_current_stream()
    args = (np.uint64(dev), np.int64(nbytes // 16), out)
    kern((4 * sms,), (256,), args)
    t0, t1 = cp.cuda.Event(), cp.cuda.Event()
    t0.record(st)
    for _ in range(PROBE_READ_RUNS):
        kern((4 * sms,), (256,), args)
    t1.record(st)
    t1.synchronize()
    ms = cp.cuda.get_elapsed_time(t0, t1)
    del host
    if ms <= 0:
        raise RuntimeError(f"mapped-read probe: {PROBE_READ_RUNS} reads of {nbytes} B took {ms} ms")
    return PROBE_READ_RUNS * nbytes / (ms / 1000) / 1e9, nbytes


#: The sim's link (GB/s) for tests of the choice's wiring; None: the sim has no link, so no split is chosen there.
SIM_LINK_GBS: float | None = None


def decide(dev, experts, opts, slots: int, pairs: int, slot_bytes: int, note: dict) -> float:
    """The host tier's share for the cache being opened (``dev``: the :class:`~strata.engine.gpu.device.GpuDevice`,
    ``experts`` its :class:`~strata.engine.gpu.slots.GpuExpertPath`, ``slots`` VRAM slots of ``slot_bytes`` B for
    ``pairs`` (layer, expert) pairs): ``STRATA_PCIE_SHARE`` when set; 1 with ``--miss-tier pcie`` (every miss over
    PCIe, as asked), a cache that learns (``--cache-policy class``, or ``auto`` without a profile where the class rule
    can run: it swaps experts with the tier, and the split's miss count would be the fill's, before any learning),
    fewer expected misses a token than MoE layers, no link to measure (the sim), or a probe that fails (said in
    ``note``); else :func:`choose` on the two probes, each said in ``note`` (``pcie read``, ``cpu experts``,
    ``miss split choice``).

    Raises:
        ExpertCacheError: a bad ``STRATA_PCIE_SHARE`` (:func:`asked_share`)."""
    from strata.budget import cache_policy as CP
    from strata.budget import formulas as F

    from .slots import cpu_experts_note

    asked = asked_share()
    if asked is not None:
        return asked
    moe, layers = dev.decoder.moe, experts.source.layers
    if opts.miss_tier != "auto" or opts.cache_policy == "class":
        return 1.0
    if opts.learns and slots < pairs and CP.class_refusal(True, slots, pairs, "") is None:
        note["miss split choice"] = "none: the cache learns (the class rule swaps misses in from the host tier)"
        return 1.0
    hit = F.fill_profile(opts.profile, slots).hit_rate if opts.profile is not None else None
    m = expected_misses(moe.K, len(layers), slots, pairs, hit)
    gbs = SIM_LINK_GBS if dev.bk.name != "cuda" else None
    if m < len(layers) or (dev.bk.name != "cuda" and gbs is None):
        return 1.0
    try:
        if gbs is None:
            gbs, nbytes = probe_mapped_read()
            note["pcie read"] = (
                f"{gbs:.1f} GB/s read by a kernel from mapped host memory (measured: {nbytes} B x {PROBE_READ_RUNS})"
            )
        c = choose(slot_bytes / (gbs * KERNEL_READ_SHARE * 1e3), cpu_experts_note(experts, moe, note), m, len(layers))
    except Exception as e:  # a probe that cannot measure (CUDA, memory, a zero time): no split rather than a guess
        note["miss split choice"] = f"all over PCIe (a probe failed, no split chosen: {type(e).__name__}: {e})"
        return 1.0
    note["miss split choice"] = c.why
    return c.share


def expected_misses(k: int, moe_layers: int, slots: int, pairs: int, profile_hit_rate: float | None) -> float:
    """Misses a token the cache is expected to leave: ``k x moe_layers x (1 - hit rate)``, the hit rate the profile
    fill's (``profile_hit_rate``, in-sample) or else ``min(slots / pairs, 1)`` (routing taken as uniform)."""
    hit = profile_hit_rate if profile_hit_rate is not None else min(slots / pairs, 1.0) if pairs else 1.0
    return k * moe_layers * (1.0 - hit)


__all__ = [
    "HYBRID_LAYER_US",
    "KERNEL_READ_SHARE",
    "PROBE_READ_BYTES",
    "PROBE_READ_RUNS",
    "SIM_LINK_GBS",
    "SPLIT_GAIN",
    "MissSplit",
    "asked_share",
    "choose",
    "decide",
    "expected_misses",
    "probe_mapped_read",
    "refuse_share",
    "split_tier_pairs",
    "tier_pairs",
]
