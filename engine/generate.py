"""Load a pack and generate text: start-up in named checkpoints, then one decode loop.

Start-up (:func:`load_engine`), in this order, each stage timed and measured
(:mod:`strata.engine.checkpoints`, printed by ``--verbose``):

1. ``pack``: the strict readers (:func:`strata.packer.packfmt.open_pack`), the geometry from
   geometry.txt, and every load-time assertion (:func:`strata.engine.loader.check_pack`) - all
   before a weight byte is read;
2. ``weights``: the dense layer weights (f32 on the CPU path);
3. ``head``: the output head - before the expert cache, so that a cache sized from what is free
   cannot eat the head's memory (BRIEF.md, incident 1);
4. ``expert cache``: the resident experts (MoE models; :mod:`strata.engine.experts`);
5. ``prompt path``: tokenizer, KV cache (``kv``: f16 or f32; sliding-window layers as ring buffers
   of the budget's size, :class:`strata.engine.layers.KVCache`) and rope tables for ``n_ctx``
   positions (allocated once).

Generation (:func:`decode`) is one loop over positions: the prompt is teacher-forced through the
same step as generated tokens (BRIEF.md: prefill is the decode path one token at a time), the
first generated token comes from the last prompt position's logits, and no logits are computed
for the prompt positions before it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from pydantic import BaseModel, Field

from strata.budget import formulas as F
from strata.budget.formulas import ENGINE_KV_TYPES
from strata.manifests.contract import Geometry, geometry_from_params
from strata.packer.packfmt import POOL_FILE, Pack, open_pack

from .checkpoints import Checkpoint, Checkpoints
from .experts import CpuExpertCache, ExpertPath, ShardExperts, resident_pairs
from .layers import to_host
from .loader import LoadError, LoadPlan, check_pack
from .models import BaseModel as Model
from .models import State, model_class
from .numerics import DEFAULT_NUMERICS
from .numerics import numerics as get_numerics
from .sampling import Sampler, top_k_pairs
from .tokenizer import Tokenizer, load_tokenizer
from .weights import CpuWeights, Weights

DEFAULT_N_CTX = 1024
DEFAULT_KV = "f16"  # llama.cpp's default cache type; the budget's default --kv
TOP_K_RECORDED = 5


class GenerateError(ValueError):
    """A request the loaded engine cannot serve (e.g. prompt + tokens beyond n_ctx), with the numbers."""


@dataclass
class Engine:
    """A loaded pack, ready to generate. ``experts`` is None for dense models."""

    pack: Pack
    geometry: Geometry
    plan: LoadPlan
    weights: Weights  # CpuWeights here; the GPU path's DeviceWeights
    model: Model
    tokenizer: Tokenizer
    state: State
    experts: ExpertPath | None
    checkpoints: list[Checkpoint] = field(default_factory=list)
    device: str = "cpu"
    kv: str = "f16"
    probe: "StepProbe | None" = None  # per-step device timers (GPU path; used with stats)

    @property
    def n_ctx(self) -> int:
        return self.state.n_ctx



def open_checked(pack_dir: str | Path) -> tuple[Pack, Geometry, type[Model], LoadPlan]:
    """The "pack" start-up stage shared by the CPU and GPU engines: open the pack with the strict
    readers, rebuild its geometry through the manifest, pick the architecture's model class and
    assert every tensor's shape (:func:`loader.check_pack`).

    Raises:
        PackFormatError, ManifestError, LoadError, UnsupportedModel: as the callees do, before any
            weight is read.
    """
    pool = Path(pack_dir) / POOL_FILE
    if pool.exists() and not pool.is_file():
        raise LoadError(f"{pool}: not a file (a {'directory' if pool.is_dir() else 'special file'}); the dense "
                        f"weights pool must be a regular file")
    pack = open_pack(pack_dir)
    geom = geometry_from_params(pack.arch, pack.geometry_params)
    cls = model_class(pack.arch)
    return pack, geom, cls, check_pack(pack, geom)

def kv_cache_need_bytes(model: Model, n_ctx: int, kv: str, sliding: str = "ring") -> int:
    """Bytes the KV cache of ``model`` takes for ``n_ctx`` positions at ``kv``, from the budget's
    :func:`strata.budget.formulas.kv_cache_bytes` (the figure ``strata-budget`` plans; every layer of
    the engine's models holds K and V, sliding-window layers as rings unless ``sliding="full"``)."""
    h = model.hp
    windows = model.layer_windows() if sliding == "ring" else [None] * h.n_layer
    layers = [F.KVLayer(il, h.n_head_kv * h.head_dim, h.n_head_kv * h.head_dim_v, 0, w) for il, w in enumerate(windows)]
    return F.kv_cache_bytes(layers, n_ctx, F.ENGINE_PREFILL_CHUNK, kv, 1)


def host_ram_bytes() -> int:
    """Physical host memory: ``SC_PHYS_PAGES x SC_PAGE_SIZE``."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_ctx(model: Model, geom: Geometry, n_ctx: int, kv: str, available: int, what: str, sliding: str = "ring",
              on_warning: Callable[[str], None] | None = None) -> int:
    """Refuse an ``n_ctx`` whose KV cache does not fit in ``available`` bytes (``what`` names that
    memory), before any weight is loaded; warn (``on_warning``) past the model's ``n_ctx_train``.
    Returns the KV cache bytes.

    Raises:
        GenerateError: the KV cache alone needs more than ``available``.
    """
    need = kv_cache_need_bytes(model, n_ctx, kv, sliding)
    if need > available:
        raise GenerateError(f"--ctx {n_ctx}: the KV cache ({kv}) would need {need} bytes ({F.mib(need):.1f} MiB, "
                            f"strata.budget.formulas.kv_cache_bytes), more than the {available} bytes "
                            f"({F.mib(available):.1f} MiB) of {what}; lower --ctx")
    train = geom.get("n_ctx_train")
    if on_warning is not None and train and n_ctx > int(train):
        on_warning(f"--ctx {n_ctx} exceeds the model's training context n_ctx_train {int(train)} (geometry.txt); "
                   f"positions past it are outside what the model was trained on")
    return need


def load_engine(pack_dir: str | Path, *, n_ctx: int = DEFAULT_N_CTX, resident: str | float = "all",
                numerics: str = DEFAULT_NUMERICS, kv: str = DEFAULT_KV, sliding: str = "ring",
                on_checkpoint: Callable[[Checkpoint], None] | None = None,
                on_warning: Callable[[str], None] | None = None) -> Engine:
    """Open, check and load the pack at ``pack_dir`` for the CPU (NumPy) path.

    ``resident`` picks the experts the expert cache holds (:func:`strata.engine.experts.resident_pairs`):
    ``all``, ``none``, ``half`` or a fraction; ignored for dense models. ``numerics`` is a profile
    of :mod:`strata.engine.numerics` (``llamacpp``: llama.cpp's CPU activation roundings; ``f32``).
    ``kv``: the KV cache type (``f16``, llama.cpp's default, or ``f32``). ``sliding``: ``ring``
    (sliding-window layers keep their window only) or ``full`` (``n_ctx`` positions everywhere: the
    reference the ring is tested against).

    Raises:
        PackFormatError: a pack file that does not follow the format (file and line named).
        ManifestError: geometry.txt that does not satisfy the architecture's manifest.
        LoadError: a tensor or expert table that disagrees with the geometry (name, found, required).
        UnsupportedModel: an architecture or feature without a forward pass here.
        TokenizerError: tokenizer data that cannot be built.
    """
    if n_ctx < 1:
        raise GenerateError(f"n_ctx {n_ctx} < 1")
    check_kv(kv)
    nx = get_numerics(numerics)
    cps = Checkpoints(on_checkpoint)
    with cps.stage("pack") as note:
        pack, geom, cls, plan = open_checked(pack_dir)
        note["arch"] = pack.arch
        note["numerics"] = nx.name
        note["tensors checked"] = len(plan.dense)
        note["expert layers checked"] = len(plan.experts)

    weights = CpuWeights(pack, plan.dense, nx)
    experts = ExpertPath(ShardExperts(plan), None, act_quant=nx.act_quant) if plan.experts else None
    model = cls(geom, weights, experts, pack.metadata)
    check_ctx(model, geom, n_ctx, kv, host_ram_bytes(), "host RAM (SC_PHYS_PAGES x SC_PAGE_SIZE)", sliding, on_warning)
    head = set(model.head_tensors())
    rows_only = set(model.row_tensors())
    with cps.stage("weights") as note:
        weights.load([n for n in plan.dense if n not in head and n not in rows_only])
        note["f32 MiB"] = round(weights.nbytes_f32 / 2**20, 1)
        note["kept quantized (rows on demand)"] = ",".join(sorted(rows_only)) or "-"
    with cps.stage("head") as note:
        before = weights.nbytes_f32
        weights.load(sorted(head))
        note["tensor"] = model.head
        note["f32 MiB"] = round((weights.nbytes_f32 - before) / 2**20, 1)
    with cps.stage("expert cache") as note:
        if experts is not None:
            pairs = resident_pairs(resident, experts.source.layers, int(geom["n_expert"]))
            experts.cache = CpuExpertCache(experts.source, pairs, act_quant=nx.act_quant)
            note["resident"] = f"{len(pairs)} of {len(experts.source.layers) * int(geom['n_expert'])} experts ({resident})"
            note["f32 MiB"] = round(experts.cache.nbytes / 2**20, 1)
        else:
            note["resident"] = "none (dense model)"
    with cps.stage("prompt path") as note:
        tokenizer = load_tokenizer(pack)
        state = model.new_state(n_ctx, kv=kv, sliding=sliding)
        note["n_ctx"] = n_ctx
        note["kv"] = f"{kv}, {sliding}"
        note["kv MiB"] = round(state.cache.nbytes / 2**20, 1)
    return Engine(pack, geom, plan, weights, model, tokenizer, state, experts, cps.done, kv=kv)


def check_kv(kv: str) -> None:
    """Refuse a KV cache type strata's engine does not implement (names the ones it does)."""
    if kv not in ENGINE_KV_TYPES:
        raise GenerateError(f"--kv {kv}: strata's engine stores K/V as {' or '.join(ENGINE_KV_TYPES)} "
                            f"({kv} is budgeted by strata-budget for other engines only)")


# ------------------------------------------------------------------ results

class StepStat(BaseModel):
    """One position of the loop. Times in milliseconds; expert figures are counts of experts.

    With a probe (the GPU path with stats): ``gpu_ms`` = device time between CUDA events recorded
    at the start and the end of the step (the span on the device's clock, including time the device
    sat idle waiting for the host); ``cpu_expert_ms`` = host wall time computing missed experts;
    ``wait_ms`` = host wall time blocked in device->host copies (router choices, a missed expert's
    input, the logits: each waits for the kernels queued before it). ``expert_layers``: per MoE
    layer, ``[hits, misses]`` at this position (counts of routed experts)."""

    position: int
    phase: str  # "prompt" (teacher-forced, no logits), "first" (last prompt position), "decode"
    token_in: int
    token_out: int | None = None
    forward_ms: float
    sample_ms: float = 0.0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_layers: dict[int, list[int]] | None = None
    gpu_ms: float | None = None
    cpu_expert_ms: float | None = None
    wait_ms: float | None = None


class StepProbe(Protocol):
    """Per-step timers a device supplies (``begin`` before the step, ``end`` after it returns
    ``gpu_ms``, ``cpu_expert_ms``, ``wait_ms``; values may be None where a device cannot measure)."""

    def begin(self) -> None: ...

    def end(self) -> dict[str, float | None]: ...


class GenerationResult(BaseModel):
    """What ``strata-engine generate --json`` prints.

    ``top[s]`` is the 5 highest ``[id, logit]`` pairs of step ``s``; step 0 is the last prompt
    position (its choice is ``output_ids[0]``). ``tokens_per_second`` is the decode rate: generated
    tokens after the first over the wall time of their steps (forward + sampling, batch 1, one
    token per forward); ``prompt_tokens_per_second`` covers the prompt positions including the
    first generated token's.
    """

    pack: str
    arch: str
    device: str
    kv: str = "f16"
    prompt: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    stop_reason: str  # "length" | "eog"
    n_prompt_tokens: int
    n_output_tokens: int
    prompt_seconds: float
    decode_seconds: float
    tokens_per_second: float | None
    prompt_tokens_per_second: float | None
    tokens_per_second_basis: str = ("generated tokens after the first / wall seconds of their steps "
                                    "(forward + sampling, batch 1)")
    top: list[list[tuple[int, float]]]
    sampling: dict
    expert_hits: int = 0
    expert_misses: int = 0
    steps: list[StepStat] = Field(default_factory=list)
    checkpoints: list[Checkpoint] = Field(default_factory=list)


# ------------------------------------------------------------------ the loop

def decode(model: Model, state: State, prompt_ids: list[int], n_new: int, pick: Callable[[np.ndarray], int], *,
           stop_ids: frozenset[int] = frozenset(), experts: ExpertPath | None = None,
           on_step: Callable[[StepStat], None] | None = None, probe: StepProbe | None = None):
    """Teacher-force ``prompt_ids`` and generate up to ``n_new`` tokens, one position per step.

    ``probe`` (stats): device timers around every step; the step then ends synchronised, so
    ``forward_ms`` includes the device's work for prompt positions too.

    Returns ``(output_ids, top, steps, stop_reason, t_first_done, t_end)`` where ``top`` holds the
    5 best ``(id, logit)`` of every step that produced a token and the times are ``perf_counter``
    stamps (end of the last prompt position, end of the loop).
    """
    ids = list(prompt_ids)
    n_prompt = len(ids)
    out: list[int] = []
    top: list[list[tuple[int, float]]] = []
    steps: list[StepStat] = []
    stop = "length"
    t_first = None
    for pos in range(n_prompt + n_new - 1):
        emit = pos >= n_prompt - 1           # the last prompt position and every generated one
        t0 = time.perf_counter()
        if probe is not None:
            probe.begin()
        logits = model.step(ids[pos], pos, state, logits=emit)
        if emit:
            row = to_host(logits).astype(np.float32, copy=False)
        timers = probe.end() if probe is not None else {}
        t1 = time.perf_counter()
        st = StepStat(position=pos, phase="prompt" if not emit else ("first" if pos == n_prompt - 1 else "decode"),
                      token_in=ids[pos], forward_ms=(t1 - t0) * 1000, **timers)
        if emit:
            tok = pick(row)
            top.append(top_k_pairs(row, TOP_K_RECORDED))
            ids.append(tok)
            out.append(tok)
            st.token_out = tok
            st.sample_ms = (time.perf_counter() - t1) * 1000
        if experts is not None:
            per_layer = experts.take_step()
            st.expert_layers = {il: list(hm) for il, hm in per_layer.items()}
            st.expert_hits = sum(h for h, _ in per_layer.values())
            st.expert_misses = sum(m for _, m in per_layer.values())
        steps.append(st)
        if on_step:
            on_step(st)
        if emit and t_first is None:
            t_first = time.perf_counter()
        if emit and out[-1] in stop_ids:
            stop = "eog"
            break
    t_end = time.perf_counter()
    return out, top, steps, stop, t_first if t_first is not None else t_end, t_end


def generate(engine: Engine, prompt: str | None = None, n_tokens: int = 32, *, prompt_ids: list[int] | None = None,
             sampler: Sampler | Callable[[np.ndarray], int] | None = None, ignore_eos: bool = False,
             on_step: Callable[[StepStat], None] | None = None, stats: bool = False) -> GenerationResult:
    """Generate ``n_tokens`` tokens after ``prompt`` (or after ``prompt_ids``, already tokenized).

    Stops early at an end-of-generation token unless ``ignore_eos``. ``stats``: run the engine's
    per-step device timers (:class:`StepStat`'s ``gpu_ms``, ``cpu_expert_ms``, ``wait_ms``); they
    synchronise every step, so leave them off when measuring throughput.

    Raises:
        GenerateError: no prompt, an empty prompt, ``n_tokens < 1``, a token id outside the
            vocabulary, or prompt + tokens beyond the engine's ``n_ctx``.
    """
    if (prompt is None) == (prompt_ids is None):
        raise GenerateError("give exactly one of prompt (text) and prompt_ids")
    if n_tokens < 1:
        raise GenerateError(f"n_tokens {n_tokens} < 1")
    ids = engine.tokenizer.encode(prompt) if prompt is not None else [int(i) for i in prompt_ids]
    if not ids:
        raise GenerateError("the prompt is empty after tokenization (and the model adds no BOS); nothing to condition on")
    n_vocab = engine.model.hp.n_vocab
    bad = [i for i in ids if not 0 <= i < n_vocab]
    if bad:
        raise GenerateError(f"prompt token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    if len(ids) + n_tokens - 1 > engine.n_ctx:
        raise GenerateError(f"prompt of {len(ids)} tokens + {n_tokens} new tokens needs {len(ids) + n_tokens - 1} "
                            f"positions, the engine was loaded with n_ctx {engine.n_ctx} (use --ctx)")
    sampler = sampler or Sampler()
    stop_ids = frozenset() if ignore_eos else engine.tokenizer.eog_ids
    if engine.experts is not None:
        engine.experts.take_step()  # reset the per-step counters
    t0 = time.perf_counter()
    out, top, steps, stop, t_first, t_end = decode(engine.model, engine.state, ids, n_tokens, sampler,
                                                   stop_ids=stop_ids, experts=engine.experts, on_step=on_step,
                                                   probe=engine.probe if stats else None)
    prompt_s, decode_s = t_first - t0, t_end - t_first
    text_ids = out[:-1] if stop == "eog" else out
    return GenerationResult(
        pack=str(engine.pack.path), arch=engine.pack.arch, device=engine.device, kv=engine.kv, prompt=prompt, prompt_ids=ids,
        output_ids=out, text=engine.tokenizer.decode(text_ids), stop_reason=stop, n_prompt_tokens=len(ids),
        n_output_tokens=len(out), prompt_seconds=prompt_s, decode_seconds=decode_s,
        tokens_per_second=(len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        prompt_tokens_per_second=len(ids) / prompt_s if prompt_s > 0 else None,
        top=top, sampling=sampler.describe() if hasattr(sampler, "describe") else {"mode": "custom"},
        expert_hits=sum(s.expert_hits for s in steps), expert_misses=sum(s.expert_misses for s in steps),
        steps=steps, checkpoints=list(engine.checkpoints),
    )
