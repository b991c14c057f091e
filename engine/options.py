"""The engine's options: one object, checked when it is made and resolved once per pack.

:class:`EngineOptions` holds what was asked - by ``strata-engine`` (:func:`options_from_cli`) or by a caller
of :func:`strata.engine.startup.load_engine` (its keywords) - and refuses, when it is made, every value that
is wrong without a pack (each refusal names the option): an options object is valid or does not exist.
:meth:`EngineOptions.resolve` then decides, once, every default that depends on the pack or the device: the
context (the model's trained context: :func:`strata.budget.options.resolve_ctx`, the budget's rule), the
kernels (per device), the CPU threads. Start-up and the devices read the :class:`ResolvedOptions` it returns
and resolve nothing again; :meth:`ResolvedOptions.plan_options` is the budget's view of the same run
(:class:`strata.budget.plan.PlanOptions`: the same setting names).

A setting is declared, checked and resolved here, in this order: a field of :class:`EngineOptions` (its
default, one line in the docstring), its check in :meth:`EngineOptions.__post_init__`, its per-pack or
per-device default in :meth:`EngineOptions.resolve`. A command line sets it with a click option whose
destination is the field's name (engine/cli.py): :func:`options_from_cli` hands such values through as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from strata.budget import formulas as F
from strata.budget.cache_policy import option_refusal
from strata.budget.options import CACHE_POLICIES, MISS_TIERS, parse_expert_cache, resolve_ctx
from strata.layout import chunk as LC
from strata.layout import kv as LK

from .errors import ExpertCacheError, GenerateError, StageTimesRefused
from .numerics import DEFAULT_NUMERICS

#: The devices the engine runs on (``--device``); ``cuda`` and ``sim`` (its NumPy stand-in) live in strata.engine.gpu.
DEVICES = ("cpu", "cuda", "sim")
#: The most CPU kernel threads (ggml's GGML_MAX_N_THREADS); ``-t/--threads`` takes 1..MAX_THREADS.
MAX_THREADS = 512
#: Prompt positions per chunk by default (llama.cpp's ``n_ubatch`` default, ``-ub 512``).
DEFAULT_UBATCH = LC.DEFAULT_UBATCH


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """Start-up options as asked (one object for every device; a device ignores what it has no use for).
    Made only valid (:meth:`__post_init__`); :meth:`resolve` decides the defaults that need the pack.

    Attributes:
        device: ``cpu`` (NumPy), ``cuda`` (CuPy) or ``sim`` (the GPU path on NumPy, tests).
        n_ctx: positions the KV cache holds (``--ctx``); None = the model's trained context.
        kv: KV cache type, ``f16`` (default, llama.cpp's) or ``f32``; ``sliding``: ``ring``
            (sliding-window layers keep their window only) or ``full`` (the reference for tests).
        numerics: CPU numerics mode (:mod:`strata.engine.numerics`).
        resident: without a profile, the experts the cache may hold (``all`` | ``none`` | ``half`` |
            fraction, :func:`strata.engine.experts.resident_pairs`).
        expert_cache: GPU slots, an int >= 0 or None for automatic (``"auto"`` and a digit string are taken
            and stored as None / the int); ``profile``: ``(layer, expert, count)`` rows that fill the cache;
            ``vram_reserve_mib``: VRAM kept free (MiB); ``admit``: first-come admission of misses into free
            slots (default: on without a profile).
        miss_tier: where the GPU path's cache misses run (``--miss-tier``, :data:`strata.budget.options.MISS_TIERS`):
            ``pcie`` (the experts the cache does not hold are copied once into pinned host memory, the host tier,
            and the GPU reads a miss from there with the kernel of a hit: the step never stops at the host),
            ``cpu`` (the host computes each layer's misses between graph segments), ``auto`` (``pcie`` where the
            host tier fits the host's available memory, else ``cpu``, said at start-up).
        cache_policy: what the GPU expert cache does at decode time (``--cache-policy``, :data:`CACHE_POLICIES`):
            ``fill`` (the start-up fill stays; first-come admission into free slots), ``class`` (the
            decayed-frequency rule of :mod:`strata.budget.cache_policy` with bypass: after the step a miss read from
            the host tier whose decayed count is above the coldest resident pair's is swapped into that pair's slot;
            needs the host tier, keeps one slot as the swap's scratch; a warning on the CPU, which has no cache),
            ``auto`` (the default: ``class`` without a profile where the host tier is on, else ``fill``:
            :func:`strata.budget.cache_policy.learns`).
        cpu_kernel: the matvec kernels asked (``--kernel``), ``"q8"`` (llama.cpp's CPU numerics: activations
            quantized to Q8_0/Q8_K, integer dots), ``"exact"`` (the exact GPU kernels' summation order) or
            ``"f32"`` (CPU only) (:mod:`strata.engine.cpu.kernels`); None = the device's default
            (:meth:`resolve`). ``threads``: CPU kernel threads, 1..:data:`MAX_THREADS` (None: the cores this
            process may use).
        ubatch: prompt positions that go through the layers together (``-ub``, llama.cpp's ``n_ubatch``, default
            :data:`DEFAULT_UBATCH`; 1 = one position at a time): :meth:`strata.engine.decoder.Decoder.forward` on
            the CPU, and on the GPU through the chunk path (:mod:`strata.engine.gpu.chunk`, its buffers the budget's
            "prompt chunk" term); generated tokens run one position per step either way.
        graph / fused / stage_times / warmup: the GPU decode step (:mod:`strata.engine.gpu.fused`).
        card: a card to emulate on the GPU (``--card``, a :class:`strata.budget.cards.Card`): free memory,
            allocation failures and the automatic cache size as on that card (:mod:`strata.engine.gpu.card`).
        source_dir: where the pack's source GGUF shards are now, when they moved since the build (``--source-dir``:
            another mount, a copied pack; :meth:`strata.packer.pack.Pack.source_path`); None: where the build
            recorded them.
        profile_source: the file ``profile`` was read from (``--expert-profile``): the model it records is checked
            against the pack at start-up (:func:`strata.budget.profile.check_profile_model`).
        stage_order: the start-up stages after ``pack`` in another order (tests of the start-up
            order's lessons, :func:`strata.engine.startup.stage_order`); None: the one order.
    """

    device: str = "cpu"
    n_ctx: int | None = F.DEFAULT_CTX
    kv: str = F.DEFAULT_KV
    sliding: str = "ring"
    numerics: str = DEFAULT_NUMERICS
    resident: str | float = "all"
    expert_cache: int | str | None = None
    profile: list[tuple[int, int, int]] | None = None
    vram_reserve_mib: int = F.DEFAULT_RESERVE_MIB
    admit: bool | None = None
    miss_tier: str = "auto"
    cache_policy: str = "auto"
    cpu_kernel: str | None = None
    threads: int | None = None
    ubatch: int = DEFAULT_UBATCH
    graph: bool = True
    fused: bool | None = None
    stage_times: bool = False
    warmup: bool = True
    card: Any = None
    source_dir: str | None = None
    profile_source: str | None = None
    stage_order: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        """Refuse what is wrong without a pack, in this order, each naming the option.

        Raises:
            GenerateError: a ``--source-dir`` that is not a directory, an unknown device, ``--ctx`` < 1, a KV type
                the engine does not store, threads outside 1..:data:`MAX_THREADS`, an unknown kernel or numerics mode or
                residency, a card on the CPU, ``--stage-times`` on the CPU, ``--kernel f32`` on a GPU.
            StageTimesRefused: ``--stage-times`` with the CUDA graph on (a timer inside a captured graph
                records nothing).
            ExpertCacheError: an expert cache that is neither automatic nor a slot count >= 0.
            CardError: a reserve below 0 or above 16 TiB (:func:`strata.budget.cards.check_mib`).
        """
        from strata.budget.cards import check_mib

        from .cpu.kernels import KERNELS
        from .experts import resident_pairs
        from .numerics import numerics as numerics_mode

        if self.source_dir is not None and not Path(self.source_dir).is_dir():
            raise GenerateError(f"--source-dir {self.source_dir}: no such directory")
        if self.device not in DEVICES:
            raise GenerateError(f"--device {self.device!r}: expected one of {', '.join(DEVICES)}")
        if self.n_ctx is not None and self.n_ctx < 1:
            raise GenerateError(f"--ctx {self.n_ctx}: must be >= 1")
        if self.kv not in LK.ENGINE_KV_TYPES:
            raise GenerateError(
                f"--kv {self.kv}: strata's engine stores K/V as {' or '.join(LK.ENGINE_KV_TYPES)} "
                f"({self.kv} is budgeted by strata-budget for other engines only)"
            )
        if self.threads is not None and not 1 <= int(self.threads) <= MAX_THREADS:
            raise GenerateError(f"threads {self.threads}: expected 1..{MAX_THREADS} (ggml's GGML_MAX_N_THREADS)")
        if isinstance(self.ubatch, bool) or not isinstance(self.ubatch, int) or self.ubatch < 1:
            raise GenerateError(f"--ubatch-size {self.ubatch}: must be >= 1 (1 = one prompt position at a time)")
        if self.cpu_kernel is not None and self.cpu_kernel not in KERNELS:
            raise GenerateError(f"cpu_kernel {self.cpu_kernel!r}: expected one of {', '.join(KERNELS)}")
        numerics_mode(self.numerics)  # ValueError naming the known numerics modes
        try:
            resident_pairs(self.resident, [], 1)
        except ValueError as e:
            raise GenerateError(str(e)) from None
        slots, bad = parse_expert_cache(self.expert_cache)
        if bad:
            raise ExpertCacheError(bad)
        object.__setattr__(self, "expert_cache", slots)
        check_mib("--vram-reserve-mib", self.vram_reserve_mib)
        if self.miss_tier not in MISS_TIERS:
            raise GenerateError(f"--miss-tier {self.miss_tier!r}: expected one of {', '.join(MISS_TIERS)}")
        if self.cache_policy not in CACHE_POLICIES:
            raise GenerateError(f"--cache-policy {self.cache_policy!r}: expected one of {', '.join(CACHE_POLICIES)}")
        gpu = self.device != "cpu"
        if gpu and (why := option_refusal(self.cache_policy, self.miss_tier)):
            raise GenerateError(why)
        if self.stage_times and self.graph and gpu:
            raise StageTimesRefused(
                "--stage-times: stage timers cannot measure inside a captured CUDA graph (events recorded between its "
                "launches record nothing); refusing rather than reporting zeros - add --no-graph"
            )
        if self.card is not None and not gpu:
            raise GenerateError(f"--card {self.card.name}: a card is emulated on the GPU path; add --device cuda")
        if self.stage_times and not gpu:
            raise GenerateError("--stage-times: per-stage device timers exist on --device cuda only")
        if self.cpu_kernel == "f32" and gpu:
            raise GenerateError(
                "--kernel f32 runs on the CPU only: on a GPU an expert missed by the cache would be "
                "computed in f32 while a hit runs the GPU's kernels, so the tokens would depend on "
                "the cache; use q8 (the default) or exact, both bit-identical on the two devices"
            )

    def resolve(self, n_ctx_train: int) -> ResolvedOptions:
        """Every default decided for a pack whose model was trained for ``n_ctx_train`` positions, on
        :attr:`device` - the one place a default is resolved (start-up's ``pack`` stage calls it once):

        - ``n_ctx``: as asked, else ``n_ctx_train`` (:func:`strata.budget.options.resolve_ctx`, the rule
          ``strata-budget check`` plans with);
        - ``kernel``: on the CPU the matvec kernels, ``cpu_kernel`` or ``"q8"``; on a GPU the fused step's
          numerics, ``"exact"`` when ``cpu_kernel`` is ``"exact"``, else ``"q8"`` (bit-identical to the CPU's
          ``q8`` kernel, :mod:`strata.engine.gpu.kernels`);
        - ``miss_kernel``: the CPU kernel of an expert the cache misses - on the CPU ``kernel``, on a GPU
          ``cpu_kernel`` or ``"exact"`` (the exact GPU kernels' order: a miss bit-identical to a hit; the
          fused q8 step picks its own, :meth:`strata.engine.gpu.fused_moe.MoeStep.miss_kernel`);
        - ``threads``: as asked, else the cores this process may use
          (:func:`strata.engine.cpu.kernels.default_threads`).

        Raises:
            ExpertCacheError: on a GPU, a bad ``STRATA_PCIE_SHARE``, or one below 1 with ``--miss-tier cpu`` or
            ``--cache-policy class`` (:func:`strata.engine.gpu.miss_split.refuse_share`).
        """
        from .cpu.kernels import default_threads

        if self.device == "cpu":
            kernel = miss = self.cpu_kernel or "q8"
        else:
            from .gpu.miss_split import asked_share, refuse_share

            refuse_share(asked_share(), self.miss_tier, self.cache_policy)  # refused before any weight is read
            kernel, miss = ("exact" if self.cpu_kernel == "exact" else "q8"), self.cpu_kernel or "exact"
        asked = {f.name: getattr(self, f.name) for f in fields(EngineOptions)}
        return ResolvedOptions(
            **asked
            | {
                "n_ctx": resolve_ctx(self.n_ctx, n_ctx_train),
                "threads": self.threads or default_threads(),
                "kernel": kernel,
                "miss_kernel": miss,
            }
        )


@dataclass(frozen=True, kw_only=True)
class ResolvedOptions(EngineOptions):
    """:class:`EngineOptions` with every default decided for one pack on one device
    (:meth:`EngineOptions.resolve`): what start-up and the devices read. ``n_ctx`` and ``threads`` are
    numbers; ``kernel`` is the CPU's matvec kernels or the GPU's fused step numerics (``"q8"`` |
    ``"exact"``, plus ``"f32"`` on the CPU); ``miss_kernel`` the CPU kernel of a cache miss."""

    n_ctx: int
    threads: int
    kernel: str
    miss_kernel: str

    @property
    def learns(self) -> bool:
        """Whether the GPU expert cache runs the decayed-frequency rule at decode time (where it can swap):
        :func:`strata.budget.cache_policy.learns` of ``cache_policy`` and whether a profile was given; ``auto`` also
        keeps the fill where ``--resident`` pins which experts are resident (not ``all``)."""
        from strata.budget.cache_policy import learns

        pinned = self.cache_policy == "auto" and self.resident != "all"
        return learns(self.cache_policy, self.profile is not None) and not pinned

    def plan_options(self, expert_cache: int | None):
        """The budget's options for this run: :class:`strata.budget.plan.PlanOptions` of ``strata-budget
        check --engine strata`` with the same context, KV type, reserve and profile, and ``expert_cache``
        slots (None: the plan sizes the cache itself, as ``--expert-cache auto``)."""
        from strata.budget.plan import PlanOptions

        return PlanOptions(
            engine="strata",
            n_ctx=self.n_ctx,
            kv=self.kv,
            vram_reserve_mib=self.vram_reserve_mib,
            profile_pairs=self.profile,
            expert_cache=expert_cache,
            miss_tier=self.miss_tier,
            # auto as this run resolves it (--resident pins the fill); auto stays auto where the class rule may run:
            # the budget then applies the engine's rule (no learning without 2 slots and a tier), as the engine does
            cache_policy=self.cache_policy if self.learns else "fill",
            ubatch=self.ubatch,
        )


def emulated_card(card_name: str | None, card_mib: int | None):
    """The card ``--card`` / ``--card-mib`` name for the engine to emulate (None: the local GPU as it is).

    Raises:
        CardError: an unknown preset, a bad size, both options, ``--card measure`` (the local GPU is the default).
    """
    if card_name is None and card_mib is None:
        return None
    from strata.budget.cards import card_from_options

    return card_from_options(card_name, card_mib, allow_measure=False)


def options_from_cli(
    *,
    expert_profile: str | None = None,
    card_name: str | None = None,
    card_mib: int | None = None,
    no_graph: bool = False,
    on_warning=None,
    **asked,
) -> EngineOptions:
    """The options of a ``strata-engine`` command line: ``asked`` are click values whose destination is an
    :class:`EngineOptions` field (handed through); the rest are read here - the ``--expert-profile`` file
    (read and checked on every device: it fills the GPU's cache), the ``--card`` / ``--card-mib`` preset,
    ``--no-graph``. On the CPU what only the GPU path uses is said (``on_warning``), not silently dropped.

    Raises:
        GenerateError: a missing profile file, or what :class:`EngineOptions` refuses.
        BudgetInputError: an unreadable profile, an unknown or bad card (CardError).
    """
    from strata.budget.profile import read_profile

    if expert_profile is not None and not Path(expert_profile).is_file():
        raise GenerateError(f"--expert-profile {expert_profile}: no such file")
    card = emulated_card(card_name, card_mib)
    profile = read_profile(expert_profile) if expert_profile else None
    opts = EngineOptions(card=card, profile=profile, profile_source=expert_profile, graph=not no_graph, **asked)
    if opts.threads is not None and on_warning is not None:
        from .cpu.kernels import default_threads

        cores = default_threads()
        if opts.threads > cores:
            on_warning(
                f"--threads {opts.threads}: more than the {cores} cores this process may run on "
                "(os.sched_getaffinity); the kernels' threads will share cores, which is usually slower"
            )
    if opts.device == "cpu" and on_warning is not None:
        share = os.environ.get("STRATA_PCIE_SHARE", "")
        if share.strip():
            on_warning(
                f"STRATA_PCIE_SHARE={share!r}: the CPU path has no expert cache, so no split of misses (it is the "
                "GPU path's, --device cuda); not used"
            )
        if profile is not None:
            on_warning(
                f"--expert-profile {expert_profile}: the CPU path has no expert cache; the profile was read and "
                "is not used (it fills the GPU's cache with --device cuda)"
            )
        if opts.expert_cache is not None:
            on_warning(
                f"--expert-cache {asked['expert_cache']}: the CPU path has no expert cache (it sizes the GPU's, "
                "--device cuda); not used"
            )
        if no_graph:
            on_warning("--no-graph: the CPU path has no CUDA graphs (--device cuda); not used")
        if opts.miss_tier != "auto":
            on_warning(
                f"--miss-tier {opts.miss_tier}: the CPU path has no expert cache, so no miss tier (it is the GPU "
                "path's, --device cuda); not used"
            )
        if opts.cache_policy != "auto":  # fill or class, asked: said, as --miss-tier is
            on_warning(
                f"--cache-policy {opts.cache_policy}: the CPU path has no expert cache (it is the GPU path's, "
                "--device cuda); not used"
            )
    return opts


__all__ = [
    "DEFAULT_UBATCH",
    "DEVICES",
    "MAX_THREADS",
    "EngineOptions",
    "ResolvedOptions",
    "emulated_card",
    "options_from_cli",
]
