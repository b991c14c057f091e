"""Generate text from a loaded engine: one decode loop over positions, and its results.

The engine comes from :func:`strata.engine.startup.load_engine` (the start-up checkpoints). The loop
(:func:`decode`) teacher-forces the prompt - in chunks of ``-ub`` positions where the model takes chunks (the CPU:
docs/DESIGN.md "Prompts in chunks"), else through the same one-position step as generated tokens (docs/DESIGN.md
"The prompt goes through the decode path") - takes the first generated token from the last prompt position's
logits (that position runs as one step), and computes no logits for the prompt positions before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from pydantic import BaseModel, Field

from strata.layout import step as LS

from .checkpoints import Checkpoint
from .core import Engine, StepProbe
from .decoder import State
from .errors import GenerateError, NonFiniteLogits
from .experts import ExpertPath
from .layers import to_host
from .sampling import Sampler, top_k_pairs

#: Best (id, logit) pairs recorded per generated token: the size of the fused GPU step's logit summary
#: (strata.layout.step.LOGIT_TOP_K), so a greedy decode there reads the pairs instead of the row.
TOP_K_RECORDED = LS.LOGIT_TOP_K


# ------------------------------------------------------------------ results


class StepStat(BaseModel):
    """One position of the loop. Times in milliseconds; expert figures are counts of experts. With a probe (the GPU path
    with stats): ``gpu_ms`` = device time between CUDA events recorded at the start and the end of the step (the span
    on the device's clock, including time the device sat idle waiting for the host); ``busy_ms`` = the device's own
    work in that span (the floor with no host work: the span of a one-graph step, the sum of a hybrid step's graph
    segments); ``cpu_expert_ms`` = host wall time computing missed experts; ``wait_ms`` = host wall time blocked in
    device->host copies (router choices, a missed expert's input, the logits: each waits for the kernels queued
    before it). ``expert_layers``: per MoE layer, ``[hits, misses, of the misses those read over PCIe]`` at this
    position (counts of routed experts); ``expert_pcie``: of the misses, those the GPU read from the host tier over
    PCIe (the rest ran on the CPU), ``pcie_bytes`` their bytes (engine form)."""

    position: int
    phase: str  # "prompt" (teacher-forced, no logits), "first" (last prompt position), "decode"
    token_in: int
    token_out: int | None = None
    forward_ms: float
    sample_ms: float = 0.0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_pcie: int = 0
    pcie_bytes: int = 0
    expert_layers: dict[int, list[int]] | None = None
    gpu_ms: float | None = None
    busy_ms: float | None = None
    cpu_expert_ms: float | None = None
    wait_ms: float | None = None
    chunk: int = 1  # positions that went through the layers together (a prompt chunk); forward_ms is its share


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
    tokens_per_second_basis: str = (
        "generated tokens after the first / wall seconds of their steps (forward + sampling, batch 1)"
    )
    top: list[list[tuple[int, float]]]
    sampling: dict
    expert_hits: int = 0
    expert_misses: int = 0
    expert_pcie: int = 0
    pcie_bytes: int = 0
    #: the fused step's prefetch (strata.engine.gpu.prefetch): experts copied ahead, and of those read (counts)
    prefetched: int = 0
    prefetch_read: int = 0
    steps: list[StepStat] = Field(default_factory=list)
    checkpoints: list[Checkpoint] = Field(default_factory=list)


# ------------------------------------------------------------------ the loop


def decode(
    model,
    state: State,
    prompt_ids: list[int],
    n_new: int,
    pick: Callable[[np.ndarray], int],
    *,
    stop_ids: frozenset[int] = frozenset(),
    experts: ExpertPath | None = None,
    on_step: Callable[[StepStat], None] | None = None,
    probe: StepProbe | None = None,
    ubatch: int = 1,
    guard: Callable[[], None] | None = None,
):
    """Teacher-force ``prompt_ids`` and generate up to ``n_new`` tokens: generated tokens one position per step,
    the prompt in chunks where ``ubatch`` and the model allow (below).

    ``ubatch`` > 1 and a model that takes chunks (``model.chunked``: :meth:`strata.engine.decoder.Decoder.
    forward`): the prompt positions before the last go through the layers ``ubatch`` at a time (llama.cpp's
    ``-ub``); each still gets its :class:`StepStat` (``chunk`` = the chunk's size, ``forward_ms`` its share of
    the chunk's time, its own expert counts), and the last prompt position runs as one step, which gives the
    first token. ``guard``: called before every step and chunk (:meth:`strata.engine.core.Engine.check_files`: a
    mapped file changed under the engine is refused there, not met as SIGBUS). ``probe`` (stats): device timers
    around every step; the step then ends synchronised, so ``forward_ms`` includes the device's work for prompt
    positions too (one-position steps only).

    Returns ``(output_ids, top, steps, stop_reason, t_first_done, t_end)`` where ``top`` holds the
    5 best ``(id, logit)`` of every step that produced a token and the times are ``perf_counter``
    stamps (end of the last prompt position, end of the loop).
    """
    ids = list(prompt_ids)
    n_prompt = len(ids)
    # a greedy pick from the device's logit summary (the fused GPU step ranks the row itself: FusedDecoder.
    # logit_summary): the same token and top pairs as argmax / top_k_pairs on the row, without reading it
    summary = getattr(model, "logit_summary", None) if getattr(pick, "greedy", False) is True else None
    out: list[int] = []
    top: list[list[tuple[int, float]]] = []
    steps: list[StepStat] = []
    stop = "length"
    t_first = None

    def finish(st: StepStat) -> None:
        if experts is not None:
            per_layer = experts.take_step()
            st.expert_layers = {il: list(v) for il, v in per_layer.items()}
            st.expert_hits = sum(v[0] for v in per_layer.values())
            st.expert_misses = sum(v[1] for v in per_layer.values())
            st.expert_pcie, st.pcie_bytes = experts.take_pcie()
        steps.append(st)
        if on_step:
            on_step(st)

    start = 0
    if ubatch > 1 and getattr(model, "chunked", False) is True:
        while start < n_prompt - 1:
            end = min(n_prompt - 1, start + ubatch)
            if guard is not None:
                guard()
            t0 = time.perf_counter()
            model.forward(ids[start:end], start, state, logits=False)
            ms = (time.perf_counter() - t0) * 1000 / (end - start)
            for t, pos in enumerate(range(start, end)):
                if experts is not None:
                    experts.replay(t)
                finish(StepStat(position=pos, phase="prompt", token_in=ids[pos], forward_ms=ms, chunk=end - start))
            start = end
    # launch ahead (model.launch_ahead: the fused GPU step off the hybrid path, no probe): the next position's step is
    # queued as soon as its token is known, before this one is counted and reported - the device runs meanwhile.
    # Only a step the plain loop would run is queued (never past the last position or a stop token); a step's counts
    # are taken by its wait(), or - its routing record, where settle() exists - after the next step is queued and
    # before the step is reported, so each step's report holds its own counts.
    ahead = probe is None and getattr(model, "launch_ahead", False) is True
    # a step's routing record counted after the next step is queued (off the device's critical path), before its report
    settle = getattr(model, "settle", None) if ahead else None
    held = {"settle": False} if settle is not None else {}
    last = n_prompt + n_new - 1  # positions run: start .. last - 1
    queued_at = None  # perf_counter when the step of position pos was queued ahead, else None

    def queue(pos: int) -> float:
        if guard is not None:
            guard()
        t = time.perf_counter()
        model.launch(ids[pos], pos, state, logits=pos >= n_prompt - 1)
        return t

    try:
        for pos in range(start, last):
            emit = pos >= n_prompt - 1  # the last prompt position and every generated one
            if queued_at is not None:
                t0, queued_at = queued_at, None
                logits = model.wait(**held)
            elif ahead:
                t0 = queue(pos)
                logits = model.wait(**held)
            else:
                if guard is not None:
                    guard()
                t0 = time.perf_counter()
                if probe is not None:
                    probe.begin()
                logits = model.step(ids[pos], pos, state, logits=emit)
            pairs = None
            if emit and summary is not None:
                bad, pairs = summary()
                if bad:
                    raise NonFiniteLogits(pos, to_host(logits).astype(np.float32, copy=False))
            elif emit:
                row = to_host(logits).astype(np.float32, copy=False)
                if not np.isfinite(row).all():
                    raise NonFiniteLogits(pos, row)
            timers = probe.end() if probe is not None else {}
            t1 = time.perf_counter()
            st = StepStat(
                position=pos,
                phase="prompt" if not emit else ("first" if pos == n_prompt - 1 else "decode"),
                token_in=ids[pos],
                forward_ms=(t1 - t0) * 1000,
                **timers,
            )
            if emit:
                if pairs is not None:
                    tok = pairs[0][0]
                else:
                    # a sampler with penalties reads the history (the prompt and the tokens so far)
                    tok = pick(row, ids) if getattr(pick, "penalized", False) is True else pick(row)
                    pairs = top_k_pairs(row, TOP_K_RECORDED)
                top.append(pairs)
                ids.append(tok)
                out.append(tok)
                st.token_out = tok
                st.sample_ms = (time.perf_counter() - t1) * 1000
            if ahead and pos + 1 < last and not (emit and out[-1] in stop_ids):
                try:
                    queued_at = queue(pos + 1)
                except BaseException:  # guard() refused the next step: this one is still reported first
                    if settle is not None:
                        settle()
                    finish(st)
                    raise
            if settle is not None:
                settle()
            finish(st)
            if emit and t_first is None:
                t_first = time.perf_counter()
            if emit and out[-1] in stop_ids:
                stop = "eog"
                break
    finally:  # an exception (a report that raised, ^C) leaves no step queued for the next run to count
        if queued_at is not None:
            model.wait()
        if settle is not None:
            settle()
    t_end = time.perf_counter()
    return out, top, steps, stop, t_first if t_first is not None else t_end, t_end


def generate(
    engine: Engine,
    prompt: str | None = None,
    n_tokens: int = 32,
    *,
    prompt_ids: list[int] | None = None,
    sampler: Sampler | Callable[[np.ndarray], int] | None = None,
    ignore_eos: bool = False,
    on_step: Callable[[StepStat], None] | None = None,
    stats: bool = False,
    parse_special: bool = True,
) -> GenerationResult:
    """Generate ``n_tokens`` tokens after ``prompt`` (or after ``prompt_ids``, already tokenized).

    ``prompt`` is tokenized as llama.cpp's llama-cli does: special tokens in the text (``<|im_start|>``,
    ``<start_of_turn>``) are parsed as those tokens; ``parse_special=False`` keeps them plain text.
    ``on_step`` sees every position as it ends (its ``token_out`` as soon as it is chosen: what the
    command line streams).

    Stops early at an end-of-generation token unless ``ignore_eos``. ``stats``: run the engine's
    per-step device timers (:class:`StepStat`'s ``gpu_ms``, ``cpu_expert_ms``, ``wait_ms``); they
    synchronise every step, so leave them off when measuring throughput.

    Raises:
        GenerateError: no prompt, an empty prompt, ``n_tokens < 1`` (but -1: until end of generation or the context
            is full - strata shifts no context), a token id outside the
            vocabulary, or prompt + tokens beyond the engine's ``n_ctx``.
    """
    if (prompt is None) == (prompt_ids is None):
        raise GenerateError("give exactly one of prompt (text) and prompt_ids")
    if n_tokens < 1 and n_tokens != -1:
        raise GenerateError(f"n_tokens {n_tokens} < 1 (-1: until end of generation or the context is full)")
    ids = (
        engine.tokenizer.encode(prompt, parse_special=parse_special)
        if prompt is not None
        else [int(i) for i in prompt_ids]
    )
    if not ids:
        raise GenerateError(
            "the prompt is empty after tokenization (and the model adds no BOS); nothing to condition on"
        )
    n_vocab = engine.model.hp.n_vocab
    bad = [i for i in ids if not 0 <= i < n_vocab]
    if bad:
        raise GenerateError(f"prompt token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    if n_tokens == -1:  # llama-cli's -n -1: until end of generation, here also until the context is full
        n_tokens = max(engine.n_ctx - len(ids) + 1, 1)
    if len(ids) + n_tokens - 1 > engine.n_ctx:
        raise GenerateError(
            f"prompt of {len(ids)} tokens + {n_tokens} new tokens needs {len(ids) + n_tokens - 1} "
            f"positions, the engine was loaded with n_ctx {engine.n_ctx} (use --ctx)"
        )
    sampler = sampler or Sampler()
    stop_ids = frozenset() if ignore_eos else engine.tokenizer.eog_ids
    if engine.experts is not None:
        engine.experts.reset_counts()
    t0 = time.perf_counter()
    out, top, steps, stop, t_first, t_end = decode(
        engine.model,
        engine.state,
        ids,
        n_tokens,
        sampler,
        stop_ids=stop_ids,
        experts=engine.experts,
        on_step=on_step,
        probe=engine.probe if stats else None,
        ubatch=engine.options.ubatch if engine.options is not None else 1,
        guard=engine.check_files,
    )
    prompt_s, decode_s = t_first - t0, t_end - t_first
    text_ids = out[:-1] if stop == "eog" else out
    return GenerationResult(
        pack=str(engine.pack.path),
        arch=engine.pack.arch,
        device=engine.device,
        kv=engine.kv,
        prompt=prompt,
        prompt_ids=ids,
        output_ids=out,
        text=engine.tokenizer.decode(text_ids),
        stop_reason=stop,
        n_prompt_tokens=len(ids),
        n_output_tokens=len(out),
        prompt_seconds=prompt_s,
        decode_seconds=decode_s,
        tokens_per_second=(len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        prompt_tokens_per_second=len(ids) / prompt_s if prompt_s > 0 else None,
        top=top,
        sampling=sampler.describe() if hasattr(sampler, "describe") else {"mode": "custom"},
        expert_hits=sum(s.expert_hits for s in steps),
        expert_misses=sum(s.expert_misses for s in steps),
        expert_pcie=sum(s.expert_pcie for s in steps),
        pcie_bytes=sum(s.pcie_bytes for s in steps),
        prefetched=engine.experts.counts.prefetched if engine.experts is not None else 0,
        prefetch_read=engine.experts.counts.prefetch_read if engine.experts is not None else 0,
        steps=steps,
        checkpoints=list(engine.checkpoints),
    )
