"""``strata-engine profile``: count which routed experts the router selects over some prompts.

The engine's expert path has a routing hook (:attr:`strata.engine.experts.ExpertPath.on_route`):
every MoE layer's selection is counted as it is made, prompt positions and generated tokens alike.
The counts are written by :func:`strata.budget.profile.write_profile` (the one profile format) and
fill the expert cache of ``strata-budget check --expert-profile`` and ``strata-engine generate
--expert-profile``.
"""

from __future__ import annotations

from dataclasses import replace

from .errors import GenerateError
from .generate import generate
from .options import EngineOptions
from .startup import load_engine


def profile_routing(
    pack: str, prompts: list[str], *, n_tokens: int, options: EngineOptions | None = None, **kw
) -> list[tuple[int, int, int]]:
    """Route ``prompts`` through the engine (``n_tokens`` generated after each, EOS ignored, a fresh
    KV cache per prompt) and count, per (layer, expert), how often it was selected. Returns
    ``(layer, expert, count)`` rows sorted by layer, expert (pairs never selected are left out).
    The engine's options come as ``options`` or as :class:`strata.engine.options.EngineOptions` keywords
    (``n_ctx``, ``device``); no expert is resident (every selection runs the expert path's miss side).

    Raises:
        GenerateError: a dense model (nothing to profile), what the options or generation refuse.
    """
    opts = options if options is not None else EngineOptions(**kw)
    no_cache = {"resident": "none"} if opts.device == "cpu" else {"expert_cache": 0}
    eng = load_engine(pack, options=replace(opts, **no_cache))
    if eng.experts is None:
        raise GenerateError(f"{pack}: {eng.pack.arch} has no routed experts (a dense model); nothing to profile")
    counts: dict[tuple[int, int], int] = {}

    def count(il: int, ids: list[int]) -> None:
        for e in ids:
            counts[(il, e)] = counts.get((il, e), 0) + 1

    eng.experts.on_route = count
    for p in prompts:
        # each prompt from position 0 on the session's own state: a position is written before it is read
        # and the recurrent state starts over at 0 (the fused GPU step is bound to this state)
        generate(eng, p, n_tokens, ignore_eos=True)
    return sorted((il, e, c) for (il, e), c in counts.items())


__all__ = ["profile_routing"]
