"""GPU cards for the VRAM plan: presets from ``cards.toml`` (beside this module), an explicit size, or a
measurement of the local GPU.

A card size is never guessed: an unknown preset, a size of zero, or ``measure`` on a machine with
no GPU is a :class:`CardError` naming what was asked and what exists.
"""

from __future__ import annotations

import ctypes
import re
import tomllib
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from .errors import BudgetInputError
from .formulas import MIB

CARDS_FILE = Path(__file__).resolve().parent / "cards.toml"
#: The largest memory size any MiB option accepts (card total, CUDA context, runtime, reserve):
#: 16 TiB, far above any GPU (the largest hold 0.2 TiB), so a bigger number is a typo or a unit
#: mistake (bytes given as MiB), never a card.
MAX_MIB = 16 << 20


class CardError(BudgetInputError):
    """A card that cannot be planned for (unknown preset, zero or absurd size, no GPU to measure)."""


def check_mib(option: str, value: int, *, lo: int = 0, error: type[BudgetInputError] = CardError) -> None:
    """Refuse ``value`` MiB for ``option`` below ``lo`` or above :data:`MAX_MIB` (16 TiB), naming both.

    Raises:
        CardError (or ``error``): naming the option, the number and the allowed range.
    """
    if value < lo:
        what = "a positive number of MiB" if lo == 1 else f"at least {lo} MiB"
        raise error(
            f"{option} {value}: must be {what}", tensor=option, found=f"{value} MiB", required=f"{lo}..{MAX_MIB} MiB"
        )
    if value > MAX_MIB:
        raise error(
            f"{option} {value}: {value:,} MiB is more than 16 TiB ({MAX_MIB:,} MiB), larger than any GPU "
            f"(a size in bytes given as MiB?)",
            tensor=option,
            found=f"{value} MiB",
            required=f"{lo}..{MAX_MIB} MiB (16 TiB)",
        )


class CardPreset(BaseModel):
    """One row of cards.toml: the representative card, its CUDA-reported total and the source."""

    model_config = ConfigDict(extra="forbid")
    card: str
    total_mib: int
    total_bytes: int
    source: str
    cuda_context_mib: int | None = None

    @model_validator(mode="after")
    def _agree(self) -> CardPreset:
        if self.total_bytes <= 0 or round(self.total_bytes / MIB) != self.total_mib:
            raise ValueError(
                f"{self.card}: total_bytes {self.total_bytes} is {self.total_bytes / MIB:.2f} MiB, "
                f"total_mib says {self.total_mib}"
            )
        return self


class CardDefaults(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cuda_context_mib: int
    cuda_context_source: str
    cuda_runtime_mib: int
    cuda_runtime_source: str
    # strata's engine: its runtime term derived from what it loads (budget/engine_terms.py)
    cuda_module_kib: int
    cuda_graph_kib: int
    cuda_generic_path_kib: int
    cuda_alloc_granularity_kib: int
    cuda_alloc_packed_max_kib: int
    cuda_runtime_model_source: str
    cuda_cublas_kib: int
    cuda_cublas_source: str


class Card(BaseModel):
    """The card a plan is made for (bytes).

    ``in_use_bytes`` is memory already taken when the card was measured (other processes, or this
    process's own CUDA context when it could not be told apart); None for presets and ``--card-mib``.
    """

    name: str
    total_bytes: int
    source: str
    cuda_context_bytes: int
    cuda_context_source: str
    cuda_runtime_bytes: int = 0
    cuda_runtime_source: str = "not charged"
    in_use_bytes: int | None = None
    # strata's engine (formulas_gpu.cuda_runtime_bytes): per kernel module, per CUDA graph, CuPy's kernels
    # of the generic path, the driver's page and the largest allocation it packs (bytes); None: cards.toml's.
    # ``cuda_runtime_fixed``: --cuda-runtime-mib was given: the constant above is used as it is.
    runtime_model: dict[str, int] | None = None
    cuda_runtime_fixed: bool = False


@lru_cache(maxsize=1)
def load_cards(path: Path = CARDS_FILE) -> tuple[CardDefaults, dict[str, CardPreset]]:
    """Read and validate cards.toml. Raises CardError naming the file and the bad entry."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    try:
        defaults = CardDefaults.model_validate(data.pop("defaults"))
        presets = {name: CardPreset.model_validate(v) for name, v in data.items()}
    except Exception as e:  # pydantic ValidationError or a missing [defaults]
        raise CardError(f"{path}: {e}") from None
    return defaults, presets


def known_cards() -> list[str]:
    return list(load_cards()[1])


def _context(defaults: CardDefaults, preset: CardPreset | None, override_mib: int | None) -> tuple[int, str]:
    if override_mib is not None:
        if override_mib < 0:
            raise CardError(
                f"--cuda-context-mib {override_mib} is negative",
                tensor="--cuda-context-mib",
                found=f"{override_mib} MiB",
                required=f"0..{MAX_MIB} MiB",
            )
        check_mib("--cuda-context-mib", override_mib)
        return override_mib * MIB, "--cuda-context-mib"
    if preset is not None and preset.cuda_context_mib is not None:
        return preset.cuda_context_mib * MIB, f"cards.toml ({preset.card})"
    return defaults.cuda_context_mib * MIB, "cards.toml [defaults]: " + " ".join(defaults.cuda_context_source.split())


def runtime_term(cuda_runtime_mib: int | None = None) -> tuple[int, str]:
    """(bytes, source) of the CUDA runtime's first-use memory: ``--cuda-runtime-mib`` or cards.toml [defaults]."""
    if cuda_runtime_mib is not None:
        if cuda_runtime_mib < 0:
            raise CardError(
                f"--cuda-runtime-mib {cuda_runtime_mib} is negative",
                tensor="--cuda-runtime-mib",
                found=f"{cuda_runtime_mib} MiB",
                required=f"0..{MAX_MIB} MiB",
            )
        check_mib("--cuda-runtime-mib", cuda_runtime_mib)
        return cuda_runtime_mib * MIB, "--cuda-runtime-mib"
    defaults, _ = load_cards()
    return defaults.cuda_runtime_mib * MIB, "cards.toml [defaults]: " + " ".join(defaults.cuda_runtime_source.split())


def card_from_options(
    name: str | None,
    mib: int | None,
    cuda_context_mib: int | None = None,
    cuda_runtime_mib: int | None = None,
    *,
    allow_measure: bool = True,
) -> Card:
    """The card of ``--card NAME|measure`` or ``--card-mib N`` (exactly one of them), as ``strata-budget
    check`` and ``strata-engine --card`` read them.

    Raises:
        CardError: both or neither given, an unknown preset, a bad size, ``measure`` where it is not
            allowed (``allow_measure`` False: the engine emulates a named card; the local GPU is the
            default) or without a GPU.
    """
    if name is not None and mib is not None:
        raise CardError("give --card or --card-mib, not both")
    if name is None and mib is None:
        raise CardError(
            f"no card: give --card ({', '.join(known_cards())}, measure) or --card-mib N; a size is never guessed"
        )
    if mib is not None:
        return card_from_mib(mib, cuda_context_mib, cuda_runtime_mib)
    if name.strip().lower() == "measure":
        if not allow_measure:
            raise CardError(
                "--card measure: the engine runs on the local GPU unless --card names a card to emulate "
                f"({', '.join(known_cards())}) or --card-mib gives its size; leave --card out for the local GPU",
                tensor="--card",
                found=name,
                required=f"one of {', '.join(known_cards())}",
            )
        return measure_card(cuda_context_mib=cuda_context_mib, cuda_runtime_mib=cuda_runtime_mib)
    try:
        return card_preset(name, cuda_context_mib, cuda_runtime_mib)
    except CardError as e:
        if allow_measure:
            raise
        # the engine emulates a named card: "--card measure" is not one of its choices
        raise CardError(
            str(e).replace(" (or --card-mib N, or --card measure)", " (or --card-mib N)"),
            tensor="--card",
            found=name,
            required=e.required.replace(", measure", ""),
        ) from None


def runtime_model() -> tuple[dict[str, int], str]:
    """cards.toml's constants of strata's engine's runtime term (bytes) and their source:
    ``module_bytes``, ``graph_bytes``, ``generic_path_bytes``, ``granularity``, ``packed_max``, ``cublas_bytes``
    (cuBLAS's first use: prompt chunks on the GPU)."""
    d, _ = load_cards()
    return (
        {
            "module_bytes": d.cuda_module_kib << 10,
            "graph_bytes": d.cuda_graph_kib << 10,
            "generic_path_bytes": d.cuda_generic_path_kib << 10,
            "granularity": d.cuda_alloc_granularity_kib << 10,
            "packed_max": d.cuda_alloc_packed_max_kib << 10,
            "cublas_bytes": d.cuda_cublas_kib << 10,
        },
        " ".join(d.cuda_runtime_model_source.split()) + " cuBLAS: " + " ".join(d.cuda_cublas_source.split()),
    )


def short_source(text: str, limit: int = 60) -> str:
    """First sentence-ish of a source note, for table cells (the full text stays in --json)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def preset_key(name: str) -> str:
    """``name`` as a preset key, upper case: ``24gb``, ``24 GiB``, ``24G`` all give ``24G`` (a card's size
    written with or without the byte unit names the same preset)."""
    key = "".join(name.split()).upper()
    m = re.fullmatch(r"(\d+)G(?:I?B)?", key)
    return f"{m.group(1)}G" if m else key


def card_preset(name: str, cuda_context_mib: int | None = None, cuda_runtime_mib: int | None = None) -> Card:
    """The preset ``name`` (``24G``, ``16G`` ... case-insensitive). Raises CardError listing the presets."""
    defaults, presets = load_cards()
    key = {k.upper(): k for k in presets}.get(preset_key(name))
    if key is None:
        raise CardError(
            f"unknown card {name!r}; presets: {', '.join(presets)} (or --card-mib N, or --card measure)",
            tensor="--card",
            found=name,
            required=f"one of {', '.join(presets)}, measure",
        )
    p = presets[key]
    ctx, ctx_src = _context(defaults, p, cuda_context_mib)
    rt, rt_src = runtime_term(cuda_runtime_mib)
    return Card(
        name=f"{key} ({p.card}, {p.total_mib} MiB)",
        total_bytes=p.total_bytes,
        source=" ".join(p.source.split()),
        cuda_context_bytes=ctx,
        cuda_context_source=ctx_src,
        cuda_runtime_bytes=rt,
        cuda_runtime_source=rt_src,
        cuda_runtime_fixed=cuda_runtime_mib is not None,
    )


def card_from_mib(total_mib: int, cuda_context_mib: int | None = None, cuda_runtime_mib: int | None = None) -> Card:
    """A card of ``total_mib`` MiB as CUDA reports it. Raises CardError for zero or negative sizes,
    and for sizes above :data:`MAX_MIB` (16 TiB: a typo or a unit mistake, never a card)."""
    if total_mib <= 0:
        raise CardError(
            f"--card-mib {total_mib}: a card size must be a positive number of MiB",
            tensor="--card-mib",
            found=f"{total_mib} MiB",
            required=f"1..{MAX_MIB} MiB",
        )
    check_mib("--card-mib", total_mib, lo=1)
    defaults, _ = load_cards()
    ctx, ctx_src = _context(defaults, None, cuda_context_mib)
    rt, rt_src = runtime_term(cuda_runtime_mib)
    return Card(
        name=f"{total_mib} MiB card",
        total_bytes=total_mib * MIB,
        source="--card-mib",
        cuda_context_bytes=ctx,
        cuda_context_source=ctx_src,
        cuda_runtime_bytes=rt,
        cuda_runtime_source=rt_src,
        cuda_runtime_fixed=cuda_runtime_mib is not None,
    )


# ----------------------------------------------------------------------------- measurement


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def nvml_memory(device: int = 0) -> tuple[int, int, str] | None:
    """NVML (through the driver's libnvidia-ml.so.1, no Python package needed): ``(total, used, name)``
    of ``device`` in bytes without creating a CUDA context; None when NVML or the device is not there."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    try:
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(device), ctypes.byref(handle)) != 0:
            return None
        mem = _NvmlMemory()
        if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            return None
        name = ctypes.create_string_buffer(96)
        lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(96))
        return int(mem.total), int(mem.used), name.value.decode(errors="replace")
    finally:
        lib.nvmlShutdown()


def host_ram_bytes() -> int:
    """This machine's physical host memory (bytes): ``SC_PHYS_PAGES x SC_PAGE_SIZE`` (POSIX sysconf). What the engine's
    CPU path holds a KV cache against, and what ``strata-budget check`` sets the plan's host terms beside."""
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_card(device: int = 0, cuda_context_mib: int | None = None, cuda_runtime_mib: int | None = None) -> Card:
    """Ask the local GPU: CUDA's (free, total) through CuPy, NVML's used memory before and after the
    CUDA context is created (the difference is the context's cost on this card and driver).

    - CuPy and NVML: total = CUDA's total; context = NVML used after - before; in use = the rest of
      what CUDA does not report free (other processes).
    - CuPy only: total and free from CUDA; in use = total - free, which includes this process's
      context (the context term is then 0 so it is not counted twice).
    - NVML only: NVML's total and used (NVML's total is the whole framebuffer, slightly more than
      CUDA reports); context from cards.toml.

    The runtime's first-use term cannot be measured before the engine runs: it comes from
    cards.toml (or ``--cuda-runtime-mib``) in every case.

    Raises:
        CardError: neither CuPy nor NVML can see a GPU (the message says what was tried).
    """
    card = _measure_card(device, cuda_context_mib)
    rt, rt_src = runtime_term(cuda_runtime_mib)
    return card.model_copy(
        update={
            "cuda_runtime_bytes": rt,
            "cuda_runtime_source": rt_src,
            "cuda_runtime_fixed": cuda_runtime_mib is not None,
        }
    )


def _measure_card(device: int, cuda_context_mib: int | None) -> Card:
    before = nvml_memory(device)
    why = []
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime
    except ImportError as e:
        runtime = None
        why.append(f"CuPy is not importable ({e})")
    if runtime is not None:
        try:
            runtime.setDevice(device)
            free, total = runtime.memGetInfo()
            props = runtime.getDeviceProperties(device)
            name = props["name"].decode(errors="replace") if isinstance(props["name"], bytes) else str(props["name"])
        except Exception as e:  # cupy raises CUDARuntimeError without a device or driver
            runtime = None
            why.append(f"CUDA through CuPy found no device {device} ({e})")
    if runtime is not None:
        after = nvml_memory(device)
        if before is not None and after is not None and cuda_context_mib is None:
            ctx = max(0, after[1] - before[1])
            in_use = max(0, total - free - ctx)
            return Card(
                name=f"measured: {name} (GPU {device})",
                total_bytes=int(total),
                source="cudaMemGetInfo through CuPy; context = NVML used after - before creating it",
                cuda_context_bytes=ctx,
                cuda_context_source=f"measured (NVML {before[1]} -> {after[1]} B used)",
                in_use_bytes=in_use,
            )
        if cuda_context_mib is not None:
            ctx = cuda_context_mib * MIB
            return Card(
                name=f"measured: {name} (GPU {device})",
                total_bytes=int(total),
                source="cudaMemGetInfo through CuPy",
                cuda_context_bytes=ctx,
                cuda_context_source="--cuda-context-mib",
                in_use_bytes=max(0, total - free - ctx),
            )
        return Card(
            name=f"measured: {name} (GPU {device})",
            total_bytes=int(total),
            source="cudaMemGetInfo through CuPy (NVML unavailable)",
            cuda_context_bytes=0,
            cuda_context_source="included in the measured in-use memory",
            in_use_bytes=int(total - free),
        )
    if before is not None:
        total, used, name = before
        defaults, _ = load_cards()
        ctx, ctx_src = _context(defaults, None, cuda_context_mib)
        return Card(
            name=f"measured: {name} (GPU {device})",
            total_bytes=total,
            source="NVML nvmlDeviceGetMemoryInfo (whole framebuffer; CuPy unavailable)",
            cuda_context_bytes=ctx,
            cuda_context_source=ctx_src,
            in_use_bytes=used,
        )
    why.append("NVML (libnvidia-ml.so.1) is not loadable or sees no device")
    raise CardError("--card measure: no GPU to measure: " + "; ".join(why) + ". Use --card PRESET or --card-mib N.")


def host_ram_warnings(plan, ram: int) -> list[str]:
    """What the plan's (:class:`strata.budget.plan_types.Plan`) host terms mean on a machine of ``ram`` bytes: a pinned
    host tier above ``ram`` less :data:`strata.layout.experts.HOST_TIER_MARGIN_BYTES` is not built (strata-engine keeps
    the misses on the CPU), and host terms above ``ram`` leave the experts to the disk (a CPU miss reads it)."""
    from strata.layout.experts import HOST_TIER_MARGIN_BYTES

    out, gib = [], 2**30
    if plan.host_tier_bytes > ram - HOST_TIER_MARGIN_BYTES:
        out.append(
            f"host tier: {plan.host_tier_bytes / gib:.2f} GiB of pinned memory do not fit this machine's "
            f"{ram / gib:.2f} GiB of RAM less 4 GiB: strata-engine computes the misses on the CPU (--miss-tier auto; "
            f"it refuses --miss-tier pcie)"
        )
    if plan.host_ram_bytes > ram:
        out.append(
            f"host memory: the run needs {plan.host_ram_bytes / gib:.2f} GiB (the host terms), this machine has "
            f"{ram / gib:.2f} GiB of RAM: the page cache cannot hold the model, so CPU misses read the disk"
        )
    return out
