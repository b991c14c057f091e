"""The settings ``strata-budget check`` and ``strata-engine`` share: one option name, one default and
one help text each, defined here and used by both command lines (the budget plans what the engine
does with the same value).

| setting | option | default |
|---|---|---|
| context length (positions per sequence) | ``--ctx`` (``--max-context``: the budget's earlier name) | the model's trained context |
| KV cache type | ``--kv`` | ``f16`` |
| VRAM kept free after the expert cache | ``--vram-reserve-mib`` | 700 |
| expert-cache slots | ``--expert-cache`` | automatic |
| expert profile (Parquet) | ``--expert-profile`` (``--profile``: the engine's earlier name) | none |
| the card | ``--card PRESET`` or ``--card-mib N`` (the budget also ``--card measure``) | budget: required; engine: the local GPU |
| decode speed inputs (``strata-budget check``, ``strata-engine measure``) | ``--step-ms``, ``--pcie-gbs``, ``--cpu-expert-us`` | none: no prediction |
"""  # noqa: E501 - a Markdown table: a row cannot be wrapped

from __future__ import annotations

import click

from . import formulas as F

CTX_HELP = (
    "Context length: positions the KV cache holds per sequence (prompt + generated - 1 must fit) "
    "[default: the model's trained context, like llama.cpp's -c 0]."
)
RESERVE_HELP = "VRAM kept free after the expert cache, in MiB (never allocated)."
EXPERT_CACHE_HELP = (
    "Expert-cache slots: auto = floor((free - reserve) / largest slot) at the expert-cache "
    "checkpoint, at most the (layer, expert) pairs that can fill them; N = exactly N, refused "
    "with N and the most that fit when it does not fit (never a smaller cache)."
)
EXPERT_PROFILE_HELP = (
    "Expert profile: Parquet with integer columns layer, expert, count (strata-engine profile "
    "writes it); fills the expert cache at start-up, ranked by count."
)


def resolve_ctx(n_ctx: int | None, n_ctx_train: int) -> int:
    """The context a run holds (positions per sequence): ``n_ctx`` as asked (``--ctx``), else - None, no
    ``--ctx`` - the model's trained context ``n_ctx_train`` (llama.cpp's ``-c 0``). The one rule of both
    tools: :func:`strata.budget.plan.make_plan` plans with it, :meth:`strata.engine.options.EngineOptions.resolve`
    loads with it."""
    return int(n_ctx) if n_ctx is not None else int(n_ctx_train)


def parse_expert_cache(value: str | int | None) -> tuple[int | None, str | None]:
    """``--expert-cache`` text -> ``(slots or None for auto, None)``, or ``(None, the refusal)`` for a
    value that is neither ``auto`` nor a slot count >= 0 (the command prints it as its one error line)."""
    if value is None or value == "auto":
        return None, None
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None, f"--expert-cache {value!r}: not an integer or 'auto'"
    if n < 0:
        return None, f"--expert-cache {n}: a slot count cannot be negative"
    return n, None


CARD_HELP = "Card preset from budget/cards.toml (80G, 48G, 32G, 24G, 16G, 12G, 8G, 6G; 24GB and 24GiB name the same)"
CARD_MIB_HELP = "Card total in MiB as CUDA reports it (instead of --card; 1 MiB to 16 TiB)."
ENGINE_CARD_HELP = (
    CARD_HELP + " to emulate on the GPU: free memory at every start-up checkpoint is that card's total "
    "minus what this process holds, an allocation past it fails, the automatic expert cache is sized "
    "as on that card [default: the local GPU as it is]."
)


def card_options(engine: bool = False):
    """``--card`` and ``--card-mib`` (``card_name``, ``card_mib``): the budget's card, or the card the
    engine emulates (``engine``)."""

    def deco(f):
        f = click.option("--card-mib", "card_mib", type=int, default=None, help=CARD_MIB_HELP)(f)
        return click.option(
            "--card",
            "card_name",
            metavar="PRESET" if engine else "PRESET|measure",
            default=None,
            help=ENGINE_CARD_HELP if engine else CARD_HELP + " or 'measure' (ask the local GPU).",
        )(f)

    return deco


def ctx_option(f):
    return click.option("--ctx", "--max-context", "n_ctx", type=int, default=F.DEFAULT_CTX, help=CTX_HELP)(f)


def kv_option(choices):
    def deco(f):
        return click.option(
            "--kv",
            type=click.Choice(list(choices)),
            default=F.DEFAULT_KV,
            show_default=True,
            help="KV cache type: K and V stored as f16 (llama.cpp's default), f32"
            + (", or int8 (ggml Q8_0 blocks, llama.cpp's q8_0 cache)" if "int8" in choices else "")
            + "; the budget plans and the engine allocates the same bytes.",
        )(f)

    return deco


def source_dir_option(f):
    """``--source-dir DIR``: where a pack's source GGUF shards are now, if they moved since the build (another
    mount, a copied pack): ``strata-budget check`` and ``strata-engine generate`` / ``measure`` / ``profile``
    (``strata-pack verify`` has its own, the packer sits below the budget)."""
    return click.option(
        "--source-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Where the source shards are now, if they moved since the build (as strata-pack verify's).",
    )(f)


def reserve_option(f):
    return click.option(
        "--vram-reserve-mib",
        "vram_reserve_mib",
        type=int,
        default=F.DEFAULT_RESERVE_MIB,
        show_default=True,
        help=RESERVE_HELP,
    )(f)


def expert_cache_option(f):
    return click.option("--expert-cache", "expert_cache", default="auto", show_default=True, help=EXPERT_CACHE_HELP)(f)


#: Where strata's engine runs an expert-cache miss (``--miss-tier`` of strata-engine and of strata-budget check).
MISS_TIERS = ("auto", "pcie", "cpu")
MISS_TIER_HELP = (
    "strata's engine, MoE: where a cache miss runs. pcie: the experts the VRAM cache does not hold are copied once "
    "into pinned host memory (the host tier, a host-memory figure of strata-budget check; its device mapping is a "
    "VRAM term) and the GPU reads a miss from there with the kernel of a hit, so the decode step is one CUDA graph; "
    "cpu: the host computes each layer's misses; auto: pcie where the host tier fits the available host memory "
    "(less 4 GiB), else cpu - and where many experts miss a token (none resident, say), each layer's misses split "
    "between the two, the share from start-up probes of both (said in --verbose's notes)."
)


def _auto_choice_option(name: str, dest: str, choices, help_text: str):
    """A click option of ``choices`` whose default, shown, is ``auto`` (``--miss-tier``, ``--cache-policy``)."""
    return click.option(name, dest, type=click.Choice(list(choices)), default="auto", show_default=True, help=help_text)


def miss_tier_option(f):
    return _auto_choice_option("--miss-tier", "miss_tier", MISS_TIERS, MISS_TIER_HELP)(f)


#: ``--cache-policy`` values (strata's engine): the start-up fill kept, or the decayed-frequency rule.
CACHE_POLICIES = ("auto", "fill", "class")


def unused_options(engine: str, miss_tier: str, cache_policy: str) -> list[str]:
    """``strata-budget check``'s warnings for strata's engine's options asked of another engine's plan (``--engine
    cpp``): one line each for ``--miss-tier`` / ``--cache-policy`` set to other than their default - said, not
    dropped silently. Empty for ``--engine strata``."""
    if engine == "strata":
        return []
    return [
        f"{opt} {val}: an option of strata's engine (--engine strata); not used with --engine {engine}"
        for opt, val in (("--miss-tier", miss_tier), ("--cache-policy", cache_policy))
        if val != "auto"
    ]


def cache_policy_option(f):
    """``--cache-policy`` (:data:`CACHE_POLICIES`) into ``cache_policy``: ``strata-engine`` runs it, ``strata-budget
    check --engine strata`` plans it (its scratch slot: :func:`strata.layout.experts.expert_capacity`)."""
    return _auto_choice_option(
        "--cache-policy",
        "cache_policy",
        CACHE_POLICIES,
        "strata's engine on a GPU: what the expert cache does while decoding. fill: the start-up fill (a "
        "profile's, else layer order) stays. class: after each token a miss read from the host tier whose decayed "
        "count (0.95 a token) is above the coldest resident expert's is swapped into that expert's slot (the "
        "offline replay's 'class+bypass' policy, make bench-routing); needs the host tier (--miss-tier pcie / auto) "
        "and keeps one slot as the swap's scratch (its expert in the host tier). auto: class without "
        "--expert-profile where the host tier is on, else fill (measured: learning beats a layer-order fill, a "
        "profile's fill beats learning). The tokens do not change either way.",
    )(f)


def _positions_option(short: str, long: str, dest: str, default: int, help_text: str):
    """A click option of prompt positions (>= 1, the default shown): ``-ub`` and ``-b`` alike."""
    return click.option(
        short, long, dest, type=click.IntRange(min=1), default=default, show_default=True, help=help_text
    )


def ubatch_option(help_text: str):
    """``-ub/--ubatch-size`` (llama.cpp's ``n_ubatch``, default :data:`strata.layout.chunk.DEFAULT_UBATCH`), >= 1,
    into the ``ubatch`` parameter; ``help_text`` says what it does for the command (the engine's commands and
    ``strata-budget check``)."""
    from strata.layout.chunk import DEFAULT_UBATCH

    return _positions_option("-ub", "--ubatch-size", "ubatch", DEFAULT_UBATCH, help_text)


def batch_size_option(f):
    """``-b/--batch-size`` (llama.cpp's logical batch ``n_batch``, default
    :data:`strata.layout.chunk.DEFAULT_BATCH`), >= 1, into the ``batch_size`` parameter: with one sequence a chunk
    is ``min(-b, -ub)`` positions (:func:`strata.layout.chunk.chunk_positions`), for the engine and the budget
    alike."""
    from strata.layout.chunk import DEFAULT_BATCH

    return _positions_option(
        "-b",
        "--batch-size",
        "batch_size",
        DEFAULT_BATCH,
        "Logical batch (llama.cpp's -b): with one sequence a prompt chunk is min(-b, -ub) positions (and at most the "
        "context).",
    )(f)


#: ``strata-budget check``'s ``-ub``: the GPU chunk path it plans.
ubatch_plan_option = ubatch_option(
    "strata's engine: prompt positions per chunk (strata-engine -ub; a chunk is min(-ub, -b, the context)): plans "
    "the GPU chunk path's tile, staging slots and grouped expert outputs ('prompt chunk') and cuBLAS's first use "
    "(in 'CUDA runtime', ~61 MiB); 1 = one position at a time, none of them."
)


STEP_MS_HELP = (
    "Decode speed: the decode step with every expert resident on this card, in ms per token, measured with "
    "--device cuda on that card (1000 / the decode tok/s of strata-engine generate on a run where every expert "
    "fits); with it the speed the plan buys is predicted for strata's engine (strata.budget.speed: + the misses over "
    f"PCIe at --pcie-gbs and, with --cpu-expert-us, on the CPU where the engine puts them). {1e-3:g} to {1e6:g}."
)
PCIE_GBS_HELP = (
    "Decode speed: the GB/s (1e9 B/s) the expert kernels read missed experts at over PCIe (e.g. 50 for PCIe 5.0 x16, "
    "25 for 4.0 x16, nominal; the engine's own start-up takes its mapped-read probe x 0.77); needed with --step-ms "
    "when misses cross PCIe (strata-engine measure: the rate its start-up measured when not given). 0.001 to 10000."
)
CPU_EXPERT_US_HELP = (
    "Decode speed: the CPU's microseconds an expert with the engine's miss kernel and threads (the 'cpu experts' "
    "note of strata-engine generate --verbose, where misses run on the CPU; strata-engine measure: the figure its "
    "start-up measured when not given); with it the misses are charged as the engine serves them - split between "
    "PCIe and the CPU where --miss-tier auto splits (in whole experts a layer), all on the CPU with --miss-tier cpu or "
    f"where the host tier does not fit RAM. {1e-2:g} to {1e6:g}."
)
#: The accepted ranges of ``--step-ms`` (ms), ``--pcie-gbs`` (GB/s) and ``--cpu-expert-us`` (us): a step under 1 us
#: or over 1,000 s a token, a link under 1 MB/s or over 10 TB/s, an expert under 10 ns or over a second on the CPU is
#: a typo, not a machine (refused: a prediction from it would be a plausible number from nothing).
STEP_MS_RANGE = (1e-3, 1e6)
PCIE_GBS_RANGE = (1e-3, 1e4)
CPU_EXPERT_US_RANGE = (1e-2, 1e6)


def speed_options(f):
    """``--step-ms``, ``--pcie-gbs`` and ``--cpu-expert-us`` (``step_ms``, ``pcie_gbs``, ``cpu_expert_us``; floats,
    None when not given): the inputs of :func:`strata.budget.speed.plan_decode_speed`, on ``strata-budget check`` and
    ``strata-engine measure``."""
    f = click.option("--cpu-expert-us", "cpu_expert_us", type=float, default=None, help=CPU_EXPERT_US_HELP)(f)
    f = click.option("--pcie-gbs", "pcie_gbs", type=float, default=None, help=PCIE_GBS_HELP)(f)
    return click.option("--step-ms", "step_ms", type=float, default=None, help=STEP_MS_HELP)(f)


#: The decode-speed inputs: option -> (lowest, highest, unit).
SPEED_RANGES = {
    "--step-ms": (*STEP_MS_RANGE, "ms"),
    "--pcie-gbs": (*PCIE_GBS_RANGE, "GB/s"),
    "--cpu-expert-us": (*CPU_EXPERT_US_RANGE, "us"),
}


def shown_number(v: float) -> str:
    """``v`` as ``:g`` writes it where that is exact, else in full (a refused 1000000.5 is not shown as 1e+06)."""
    short, full = f"{v:g}", repr(float(v))
    return short if float(short) == v else full.removesuffix(".0")


def speed_value_error(option: str, value: float) -> str | None:
    """The refusal of ``value`` for ``option`` (a key of :data:`SPEED_RANGES`) outside its :data:`SPEED_RANGES`
    range (nan and inf included), naming the option, the value and the range; None when it is inside. The one check
    of both the command lines (:func:`speed_option_error`) and :func:`strata.budget.speed.predict_decode`."""
    lo, hi, unit = SPEED_RANGES[option]
    return None if lo <= value <= hi else f"{option} {shown_number(value)}: outside {lo:g} to {hi:g} {unit}"


def speed_option_error(step_ms: float | None, pcie_gbs: float | None, cpu_expert_us: float | None = None) -> str | None:
    """The refusal of a ``--step-ms`` / ``--pcie-gbs`` / ``--cpu-expert-us`` outside its range
    (:func:`speed_value_error`) or of either rate without ``--step-ms`` (nothing to predict from), else None - checked
    before anything is planned, whatever the plan."""
    given = (("--step-ms", step_ms), ("--pcie-gbs", pcie_gbs), ("--cpu-expert-us", cpu_expert_us))
    for name, v in given:
        if v is not None and (bad := speed_value_error(name, v)):
            return bad
    for name, v in given[1:]:
        if v is not None and step_ms is None:
            return f"{name} {shown_number(v)} without --step-ms: the prediction needs the card's every-resident step"
    return None


def expert_profile_option(f):
    return click.option(
        "--expert-profile", "--profile", "expert_profile", type=click.Path(), default=None, help=EXPERT_PROFILE_HELP
    )(f)


#: Old names of ``--engine`` / ``--prefill-model`` values, still accepted on input (command line and
#: :class:`strata.budget.plan.PlanOptions`) and read as the new name; never listed in ``--help``
#: (docs/DESIGN.md "The qwen3next reference model").
ENGINE_ALIASES: dict[str, str] = {"documents": "cpp"}


class AliasChoice(click.Choice):
    """A :class:`click.Choice` that also takes old names of its values (``aliases``: old -> new), read as
    the new name and never listed in ``--help`` or in the invalid-choice message."""

    def __init__(self, choices, aliases: dict[str, str], case_sensitive: bool = True):
        super().__init__(choices, case_sensitive=case_sensitive)
        self.aliases = dict(aliases)

    def convert(self, value, param, ctx):
        return super().convert(self.aliases.get(value, value), param, ctx)


__all__ = [
    "CACHE_POLICIES",
    "cache_policy_option",
    "unused_options",
    "MISS_TIERS",
    "MISS_TIER_HELP",
    "miss_tier_option",
    "batch_size_option",
    "ubatch_option",
    "ubatch_plan_option",
    "PCIE_GBS_HELP",
    "PCIE_GBS_RANGE",
    "STEP_MS_HELP",
    "STEP_MS_RANGE",
    "SPEED_RANGES",
    "shown_number",
    "CPU_EXPERT_US_HELP",
    "speed_option_error",
    "speed_value_error",
    "speed_options",
    "AliasChoice",
    "CARD_HELP",
    "CTX_HELP",
    "ENGINE_ALIASES",
    "card_options",
    "ctx_option",
    "expert_cache_option",
    "expert_profile_option",
    "kv_option",
    "parse_expert_cache",
    "reserve_option",
    "resolve_ctx",
]
