"""``strata-engine profile``: count which routed experts the router selects over some prompts; and the
routing trace those counts are the sum of.

The engine's expert path has a routing hook (:attr:`strata.engine.experts.ExpertPath.on_route`):
every MoE layer's selection is seen as it is made, prompt positions and generated tokens alike.
:func:`record_trace` records them in order, per position (:class:`strata.budget.trace.RoutingTrace`,
replayed through cache policies by :mod:`strata.budget.replay`); :func:`profile_routing` sums them per
(layer, expert). The counts are written by :func:`strata.budget.profile.write_profile` (the one profile
format) and fill the expert cache of ``strata-budget check --expert-profile`` and ``strata-engine
generate --expert-profile``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from strata.budget.trace import RoutingTrace, trace_counts

from .errors import GenerateError
from .generate import generate
from .options import EngineOptions
from .startup import load_engine


def routing_engine(pack: str, options: EngineOptions | None = None, **kw):
    """The engine :func:`profile_routing` and :func:`trace_routing` route with (load it once to
    :func:`record_trace` several prompt sets): no expert resident (CPU) or an empty cache (GPU), so nothing
    but the router decides what is computed. The engine's options come as ``options`` or as
    :class:`strata.engine.options.EngineOptions` keywords (``n_ctx``, ``device``).

    Raises:
        GenerateError: a dense model (nothing to profile), what the options refuse.
    """
    opts = options if options is not None else EngineOptions(**kw)
    no_cache = {"resident": "none"} if opts.device == "cpu" else {"expert_cache": 0}
    eng = load_engine(pack, options=replace(opts, **no_cache))
    if eng.experts is None:
        raise GenerateError(f"{pack}: {eng.pack.arch} has no routed experts (a dense model); nothing to profile")
    return eng


def record_trace(eng, prompts: Sequence[str | Sequence[int]], *, n_tokens: int) -> RoutingTrace:
    """Route ``prompts`` (text, or token ids) through the loaded engine ``eng`` (``n_tokens`` generated after
    each, EOS ignored, a fresh KV cache per prompt) and record every selection: one row per routed expert,
    ``seq`` = the prompt's index, ``position`` = its position (prompt positions, then generated ones; the
    last generated token is not fed back, so ``len(prompt) + n_tokens - 1`` positions), ``layer``,
    ``expert`` in the router's order. The engine's routing hook is restored afterwards.

    Raises:
        GenerateError: what generation refuses (an empty prompt, an id outside the vocabulary, too long).
    """
    rows: list[tuple[int, int, int, int]] = []
    pending: list[tuple[int, list[int]]] = []
    seq = [0]  # the prompt being routed

    def route(il: int, ids) -> None:
        pending.append((int(il), [int(e) for e in ids]))

    def step(st) -> None:
        rows.extend((seq[0], st.position, il, e) for il, ids in pending for e in ids)
        pending.clear()

    prev = eng.experts.on_route
    eng.experts.on_route = route
    try:
        for i, p in enumerate(prompts):
            seq[0] = i
            # each prompt from position 0 on the session's own state: a position is written before it is read
            # and the recurrent state starts over at 0 (the fused GPU step is bound to this state)
            if isinstance(p, str):
                generate(eng, p, n_tokens, ignore_eos=True, on_step=step)
            else:
                generate(eng, prompt_ids=list(p), n_tokens=n_tokens, ignore_eos=True, on_step=step)
    finally:
        eng.experts.on_route = prev
    return RoutingTrace.from_rows(rows)


def trace_routing(
    pack: str, prompts: Sequence[str | Sequence[int]], *, n_tokens: int, options: EngineOptions | None = None, **kw
) -> RoutingTrace:
    """Load ``pack`` (no expert resident; options as :func:`routing_engine`) and :func:`record_trace`
    ``prompts`` through it.

    Raises:
        GenerateError: a dense model (nothing to trace), what the options or generation refuse.
    """
    return record_trace(routing_engine(pack, options, **kw), prompts, n_tokens=n_tokens)


def profile_routing(
    pack: str, prompts: list[str], *, n_tokens: int, options: EngineOptions | None = None, **kw
) -> list[tuple[int, int, int]]:
    """Route ``prompts`` through the engine (``n_tokens`` generated after each, EOS ignored, a fresh
    KV cache per prompt; options as :func:`routing_engine`) and count, per (layer, expert), how often it was
    selected. Returns ``(layer, expert, count)`` rows sorted by layer, expert (pairs never selected are left
    out): :func:`strata.budget.trace.trace_counts` of :func:`trace_routing`.

    Raises:
        GenerateError: a dense model (nothing to profile), what the options or generation refuse.
    """
    return trace_counts(trace_routing(pack, prompts, n_tokens=n_tokens, options=options, **kw))


__all__ = ["profile_routing", "record_trace", "routing_engine", "trace_routing"]
