"""The VRAM plan's types: the options of ``strata-budget check`` (:class:`PlanOptions`) and what a plan says
(:class:`Plan`, its :class:`Term` rows, :class:`Suggestion` and :class:`ProfileReport`); built by
:func:`strata.budget.plan.make_plan`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from strata.layout import chunk as LC

from .cards import Card
from .formulas import DEFAULT_RESERVE_MIB
from .options import ENGINE_ALIASES
from .speed import DecodeSpeed
from .tensor_terms import TypeRow

#: The C++ engine's prompt path chunk (docs/DESIGN.md "The reserve and the prompt buffers").
DEFAULT_PREFILL_CHUNK = 256
#: The C++ engine's serve check calls less than this free LOW: a shrunk reserve is never suggested
#: below it (docs/DESIGN.md "The reserve and the prompt buffers").
LOW_MIB = 256


class PlanOptions(BaseModel):
    """The knobs of ``strata-budget check`` (None = the default described on each)."""

    model_config = ConfigDict(extra="forbid")
    n_ctx: int | None = None  # --ctx; None: the model's n_ctx_train (options.resolve_ctx), flagged
    kv_resident: int | None = None
    kv: Literal["f16", "int8", "f32"] = "f16"
    batch: int = 1
    prefill: int = DEFAULT_PREFILL_CHUNK
    logits_all: bool = False
    prefill_model: Literal["geometry", "cpp"] = "geometry"
    embeddings_on_host: bool = False
    vram_reserve_mib: int = DEFAULT_RESERVE_MIB
    expert_cache: int | None = None  # None: automatic
    profile_pairs: list[tuple[int, int, int]] | None = None  # (layer, expert, count)
    profile_path: str | None = None  # where profile_pairs came from (named in errors)
    # the engine planned for: "strata" = this repository's engine (one position per step, untied embeddings
    # on the host, its activation and runtime terms from what it allocates and loads: engine_terms.py;
    # --prefill, --prefill-model, --logits-all and --embeddings-on-host do not apply), "cpp" = the
    # reference C++ engine (a prompt chunk, embeddings in VRAM, the measured constants of cards.toml)
    engine: Literal["strata", "cpp"] = "cpp"
    # strata's engine: where cache misses run (strata-engine --miss-tier): "auto" / "pcie" plan the host tier
    # (pinned host memory, and its device mapping beside the reserve when the cache is sized), "cpu" does not
    miss_tier: Literal["auto", "pcie", "cpu"] = "auto"
    # strata's engine: what its cache does at decode time (strata-engine --cache-policy): "class" (and "auto" without a
    # profile: cache_policy.learns) keeps one slot as its swap scratch wherever something can miss
    # (strata.layout.experts.host_tier_pairs: one pair more in the tier)
    cache_policy: Literal["auto", "fill", "class"] = "auto"
    # strata's engine: prompt positions per chunk (strata-engine -ub); > 1 plans the GPU chunk path's tile and
    # staging slots ("prompt chunk", strata.layout.chunk), 1 plans none
    ubatch: int = Field(default=LC.DEFAULT_UBATCH, ge=1)
    # strata's engine with -ub > 1: charge cuBLAS's first use in the process ("CUDA runtime"); False only where it
    # was already paid before the engine started (strata-engine measure in a process that used cuBLAS before)
    cublas: bool = True

    @field_validator("engine", "prefill_model", mode="before")
    @classmethod
    def _old_names(cls, v):
        """An old value name (:data:`ENGINE_ALIASES`) reads as the new one."""
        return ENGINE_ALIASES.get(v, v) if isinstance(v, str) else v


class Term(BaseModel):
    name: str
    bytes: int
    detail: str = ""


class Suggestion(BaseModel):
    option: str
    value: str
    saves_bytes: int
    fits_alone: bool
    text: str


class ProfileReport(BaseModel):
    pairs: int
    slots: int
    filled: int
    expected_hit_rate: float
    layers: list[dict]


class Plan(BaseModel):
    """A VRAM plan for one card (bytes; ``fits`` decides exit code 0 or 1)."""

    card: Card
    options: PlanOptions
    n_ctx: int
    terms: list[Term]
    free_bytes: int  # what cudaMemGetInfo would say when the expert cache is opened
    reserve_bytes: int
    draft_bind_bytes: int = 0  # reserved with the reserve when the cache is sized, allocated after it
    decode_path: str = ""  # strata's engine: "fused" | "generic"
    max_blob: int  # engine form: what one slot holds
    max_blob_source: int
    slots: int
    slots_fit: int  # the most slots that fit (= slots when automatic)
    slots_cap: int | None
    expert_cache_bytes: int
    #: strata's engine: pinned host memory of the host tier (the pairs the slots do not hold, one slot each:
    #: strata.layout.experts.host_tier_bytes; what ``--miss-tier pcie`` / ``auto`` pins; 0 for the C++ engine)
    host_tier_bytes: int = 0
    used_bytes: int  # sum of the terms, expert cache included
    left_bytes: int  # card - used (>= reserve when the plan fits)
    fits: bool
    refused: str | None = None
    kv_bytes_per_token: int  # full-context layers, one sequence
    kv_bytes_per_token_window_layers: int
    recurrent_state_bytes_per_seq: int
    widened_scale_bytes: int
    bf16_saved_bytes: int
    types: list[TypeRow]
    profile: ProfileReport | None = None
    warnings: list[str] = Field(default_factory=list)
    suggestions: list[Suggestion] = Field(default_factory=list)
    #: host memory the run needs beside the VRAM terms (bytes; strata's engine): the dense pool read at start-up
    #: (page cache, reclaimable), the routed experts in the shards (page cache: what a miss on the CPU reads), the
    #: host tier (pinned: never reclaimable); ``host_ram_bytes`` their sum
    host_terms: list[Term] = Field(default_factory=list)
    host_ram_bytes: int = 0
    #: when the plan does not fit: the smallest card preset (budget/cards.toml) on which the same plan fits, or
    #: "none" when it fits none of them; None when it fits or was not asked (suggest=False)
    smallest_card: str | None = None
    #: the decode rate the plan buys (strata.budget.speed), when ``--step-ms`` was given; None otherwise
    decode: DecodeSpeed | None = None

    def term(self, name: str) -> int:
        return next(t.bytes for t in self.terms if t.name == name)
