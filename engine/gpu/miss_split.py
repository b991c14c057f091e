"""A layer's misses split between the host tier and the CPU (issue 19 item 2; the documents' ``pcie_frac``).

Where the VRAM cache does not hold a (layer, expert) pair, the fused decode step reads it from the host tier over
PCIe with the same kernel as a hit (one graph a token, :mod:`strata.engine.gpu.slots`), or the CPU computes it in the
hybrid step (the host stops at each MoE layer's routing: :mod:`strata.engine.gpu.fused_moe`). The two tiers are
separate bandwidths - the PCIe link and the host's memory channels - so when many experts miss, each layer's misses
are faster split between them. The split is made per token, by ``moe_route`` (cuda/fused.cu): the host tier holds
every non-resident pair, and of the ``c`` selected experts of a layer that are in the tier the first ``keep[c]`` (in
selection order) are read over PCIe, the others are marked -1 and the CPU computes them while the GPU reads the
tier's (:func:`keep_table`: the ``t`` that makes ``t x t_pcie`` and ``(c - t) x t_cpu`` end closest together).

Why per token and not a fixed set of pairs for each tier (sessions 13-16, measured: the 30B-A3B with no expert
resident at 0.93-1.11x llama.cpp's ``-ncmoe 48``): with a fixed set, the count of a token's 8 experts that falls in the
tier is binomial - at share 0.5 a layer's split is 4/4 only 27% of the time, and the expected larger side is 5.1
experts, not 4 (the layer waits for the slower tier: ~27% more expert time than a balanced split).
The share is first chosen at start-up from two measurements and a model of the step, all times per token (then the
decode steps are timed and the table moved to the fastest split: :class:`SplitTuner`):

- ``t_pcie`` (us an expert): the slot's bytes over the rate of :func:`probe_mapped_read` (a kernel reading pinned,
  mapped host memory as the expert matvecs do) times :data:`KERNEL_READ_SHARE` (what the expert kernels reach of it);
  ``t_cpu`` (us an expert): :func:`strata.engine.gpu.slots.probe_cpu_experts` (the hybrid step's miss call, its
  kernel and threads, on other layers' experts, the median);
- ``m``: misses a token, ``k x layers x (1 - hit rate)``: the profile fill's hit rate with ``--expert-profile``,
  else the resident fraction ``slots / pairs`` (routing taken as uniform - a profile, or the skew, does better);
- one graph: ``m x t_pcie``; split: ``layers x HYBRID_LAYER_US + m / c x max(t x t_pcie, (c - t) x t_cpu)``
  (both tiers busy at once; ``share = t_cpu / (t_pcie + t_cpu)`` makes them end together, ``t = keep_table(share)
  [c]`` of a layer's ``c`` misses in whole experts: :func:`strata.budget.speed.split_misses`, one rule with the
  budget's speed prediction);
- the split is taken when it sends the CPU some expert and predicts at most :data:`SPLIT_GAIN` of the one graph.

``STRATA_PCIE_SHARE`` (a number in [0.01, 1]) overrides the choice (a benchmark knob). The host tier pins every
non-resident pair whatever the share: the budget's host-tier term (``layout.experts.host_tier_bytes``) is exact with a
split too.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.budget import speed as SP

#: The hybrid step's own cost a MoE layer (us) and the split's gain threshold: the budget's (one definition).
HYBRID_LAYER_US, SPLIT_GAIN = SP.HYBRID_LAYER_US, SP.SPLIT_GAIN
#: The expert kernels' reads of the host tier over the probe kernel's rate: the one-graph step with no expert resident
#: read 384 x 3,059,712 B a token in 30.7 ms more than every expert resident (38.3 GB/s) where
#: :func:`probe_mapped_read` measured 48.6-51.2 GB/s (H200, 30B-A3B, 2026-12-02, calls z and z2). With the probe's
#: rate alone the start-up chose 0.55-0.61 and the GPU's own work became the step's floor (23.8 ms of 30.7, --stats).
KERNEL_READ_SHARE = 0.77
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


#: The per-token table (one definition with the budget's speed model: :func:`strata.budget.speed.keep_table`).
keep_table = SP.keep_table


class SplitTuner:
    """The split's ``keep[k]`` (of a layer's ``k`` selected experts in the host tier, how many stay there) chosen on
    the decode steps themselves, where the start-up's probes only guess it: the CPU probe's figure on the H200 host
    ranged 55-183 us an expert between processes of one call (2026-12-04, calls s17a-b: 144 us chose 5 of 8 over PCIe
    and decoded at 37.3 tok/s; 74 us chose 4 and decoded at 43.9; 3 decoded at 47.3), and both tiers' rates change
    once they share the host's memory channels. The tokens do not depend on the split (a miss is the same bits on
    either tier), so trying one costs only time.

    A local search over ``t`` in 0..``k - 1`` (``k``: the whole layer over PCIe is the one-graph step's job, chosen
    at start-up): the median of ``window`` step times (seconds, :meth:`observe`; the first step after each change
    dropped) at the current ``t``, then at each neighbour not yet timed; the best becomes current, until the current
    is the best of its neighbourhood (then held; timed anew after ``recheck`` steps). ``t0``: the start-up's choice.

    Raises:
        ValueError: ``k`` < 2 or ``t0`` outside 0..``k``."""

    def __init__(self, k: int, t0: int, window: int = 5, recheck: int = 512):
        if k < 2 or not 0 <= t0 <= k:
            raise ValueError(f"miss split tuner: k {k}, t0 {t0}")
        self.k, self.window, self.recheck = k, window, recheck
        self.t = min(t0, k - 1)
        self.start = self.t
        self.times: dict[int, float] = {}  # t -> median step seconds this round
        self._run: list[float] = []
        self._skip = 0  # steps not counted after a change (the first runs the new table cold)
        self._trying = self.t
        self._held = 0  # steps since the search settled (0: searching)

    def observe(self, seconds: float) -> int | None:
        """One step's time at the ``t`` last returned (or ``t0``); returns the ``t`` to apply before the next step
        (:func:`keep_table` of ``t / k``) when it changes, else None."""
        if self._held:
            self._held += 1
            if self._held <= self.recheck:
                return None
            self._held, self.times = 0, {}  # time the neighbourhood again
        if self._skip:
            self._skip -= 1
            return None
        self._run.append(seconds)
        if len(self._run) < self.window:
            return None
        self.times[self._trying] = sorted(self._run)[len(self._run) // 2]
        self._run = []
        self.t = min((self.times[n], n) for n in (self.t - 1, self.t, self.t + 1) if n in self.times)[1]
        todo = [n for n in (self.t - 1, self.t, self.t + 1) if 0 <= n < self.k and n not in self.times]
        if todo:
            return self._try(todo[0])
        self._held = 1  # the best of its neighbourhood
        return self._try(self.t) if self._trying != self.t else None

    def _try(self, t: int) -> int:
        self._trying, self._skip = t, 1
        return t

    def describe(self) -> str:
        """The search's state: the current ``t``, the start's, and the medians timed (ms)."""
        med = ", ".join(f"{n}: {1000 * v:.2f}" for n, v in sorted(self.times.items()))
        return f"keep {self.t} of {self.k} over PCIe (start-up's {self.start}; median step ms by keep: {med})"


def split_note(share: float, k: int, pairs: int) -> str:
    """The start-up's ``miss split`` note: the per-token rule (:func:`keep_table`) for ``k`` selected experts with
    ``pairs`` pairs in the host tier."""
    keep = keep_table(share, k)
    return (
        f"per token: of a layer's c selected experts in the host tier, keep[c] read over PCIe, the rest on the CPU "
        f"(share {share}; keep[0..{k}] = {keep}; the tier holds all {pairs} non-resident pairs)"
    )


def choose(t_pcie_us: float, t_cpu_us: float, misses: float, moe_layers: int, k: int) -> MissSplit:
    """The share of the module docstring's model: ``t_pcie_us`` / ``t_cpu_us`` microseconds an expert over PCIe /
    on the CPU, ``misses`` a token (expected), ``moe_layers`` MoE layers, ``k`` experts a token a layer. Returns
    share 1 (the one graph) unless the split is taken (:func:`strata.budget.speed.split_misses`, the rule the budget's
    speed prediction applies: at least one miss a layer, some sent to the CPU in whole experts, at most
    :data:`SPLIT_GAIN` of the one graph's miss time); the share is rounded to 0.01 (in [0.01, 0.99]).

    Raises:
        ValueError: a time that is not positive, or negative misses."""
    sp = SP.split_misses(t_pcie_us, t_cpu_us, misses, moe_layers, k)
    one, share, split = sp.one_us, sp.share, sp.split_us
    basis = (
        f"{misses:.0f} misses a token x {t_pcie_us:.0f} us over PCIe = {one / 1000:.1f} ms in one graph; split "
        f"{share:.2f} with the CPU's {t_cpu_us:.0f} us an expert: {split / 1000:.1f} ms (+ {HYBRID_LAYER_US:.0f} us "
        f"a layer for the hybrid step)"
    )
    if sp.taken:
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
    ``pairs`` (layer, expert) pairs): ``STRATA_PCIE_SHARE`` when set (1 where its :func:`keep_table` sends the CPU
    nothing: no split, said in ``note``); 1 with ``--miss-tier pcie`` (every miss over
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
    moe, layers = dev.decoder.moe, experts.source.layers
    if asked is not None and keep_table(asked, moe.K) == list(range(moe.K + 1)):  # it sends the CPU nothing
        note["miss split choice"] = f"none: STRATA_PCIE_SHARE={asked} keeps every one of {moe.K} experts in the tier"
        return 1.0
    if asked is not None:
        return asked
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
        t_pcie = slot_bytes / (gbs * KERNEL_READ_SHARE * 1e3)
        c = choose(t_pcie, cpu_experts_note(experts, moe, note), m, len(layers), moe.K)
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
    "SplitTuner",
    "keep_table",
    "split_note",
]
