"""``strata-engine measure``: the budget's prediction next to what the engine really allocates.

Loads a pack on the GPU path (``cuda``, or the ``sim`` backend in tests), optionally on an emulated card
(``--card 24G``: :mod:`strata.engine.gpu.card`), and compares, per budget term, the bytes
:func:`strata.budget.plan.make_plan` predicts for strata's engine (``engine="strata"``: the same plan as
``strata-budget check --card 24G``) with the bytes the engine allocated (each a sum of buffer sizes,
cross-checked against the CuPy pool's growth per start-up stage). Deterministic terms must be equal to
the byte; the total within 0.5% or 32 MiB; the reserve must still be free after start-up (measured).
It also sets the plan's automatic slot count beside the engine's, and with ``n_tokens`` generates that
many tokens and sets the hit rate measured during generation beside the profile's prediction. A
planner's prediction checked by measurement is the point, so this module (and only it in the engine)
calls the planner.
"""

from __future__ import annotations

import click
from pydantic import BaseModel, Field

from strata.budget import formulas as F
from strata.budget.audit import audit_pack
from strata.budget.cards import Card, runtime_term
from strata.budget.plan import make_plan

from .errors import GenerateError
from .options import EngineOptions
from .startup import load_engine


class AuditTerm(BaseModel):
    """One budget term: bytes the budget module predicts and bytes measured on the device."""

    term: str
    predicted_bytes: int
    measured_bytes: int
    measured_how: str
    exact: bool  # deterministic term: must match to the byte

    @property
    def diff_bytes(self) -> int:
        return self.measured_bytes - self.predicted_bytes


class Measurement(BaseModel):
    """``strata-engine measure``: predicted (strata.budget) vs measured (this engine on this device)."""

    pack: str
    device: str
    card_total_bytes: int
    context_bytes: int
    n_ctx: int
    kv: str
    slots: int
    slot_mode: str = ""
    card: str = ""  # the emulated card (--card), else the device measured
    physical_total_bytes: int | None = None
    decode_path: str = ""
    predicted_slots: int | None = None  # the plan's automatic value (strata-budget check), None for a fixed N
    reserve_bytes: int = 0
    free_after_bytes: int = 0  # free at the end of start-up, measured
    terms: list[AuditTerm] = Field(default_factory=list)
    predicted_total_bytes: int = 0
    measured_total_bytes: int = 0  # cudaMemGetInfo used at the end of start-up
    pool_checks: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    checkpoints_s: dict[str, float] = Field(default_factory=dict)
    stages: dict[str, dict[str, int]] = Field(default_factory=dict)  # per stage: used / pool / outside-pool growth
    generation: dict[str, float | int | str | None] = Field(default_factory=dict)
    #: the host tier (pinned host memory, bytes): the plan's at the engine's slots, and what the engine pinned
    #: (0 with ``--miss-tier cpu`` or where every expert is resident)
    host_tier_predicted_bytes: int = 0
    scratch_slots: int = 0  # cache slots kept as --cache-policy class's swap scratch (their pairs in the host tier)
    host_tier_bytes: int = 0
    miss_tier: str = ""

    @property
    def exact_ok(self) -> bool:
        tier_ok = self.miss_tier != "pcie" or self.host_tier_bytes == self.host_tier_predicted_bytes
        return tier_ok and all(t.diff_bytes == 0 for t in self.terms if t.exact)

    @property
    def total_diff_bytes(self) -> int:
        return self.measured_total_bytes - self.predicted_total_bytes

    @property
    def total_ok(self) -> bool:
        return abs(self.total_diff_bytes) <= max(0.005 * self.measured_total_bytes, 32 * F.MIB)

    @property
    def reserve_ok(self) -> bool:
        return self.free_after_bytes >= self.reserve_bytes

    @property
    def ok(self) -> bool:
        return self.exact_ok and self.total_ok and self.reserve_ok


def _free_cuda_pool() -> None:
    """Give back what earlier engines of this process left cached in CuPy's pool, so the context is
    measured as the memory used before this engine's first allocation (a no-op in a fresh process)."""
    try:
        import gc

        import cupy as cp

        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
    except ImportError:
        pass  # load_engine refuses with the reason


def measure_pack(
    pack: str,
    *,
    options: EngineOptions | None = None,
    backend=None,
    prompt: str = "The capital of France is",
    n_tokens: int = 0,
    step_ms: float | None = None,
    pcie_gbs: float | None = None,
    cpu_expert_us: float | None = None,
    **kw,
) -> Measurement:
    """Load ``pack`` on the GPU path (on the emulated ``card`` when given) and compare every budget term with what was
    allocated; with ``n_tokens`` > 0 then generate that many tokens after ``prompt`` (greedy, end-of-generation ignored)
    and report the expert hit rate measured beside the prediction, and with ``step_ms`` (and ``pcie_gbs``,
    ``cpu_expert_us``: else the rates the start-up measured) the decode rate measured beside
    :mod:`strata.budget.speed`'s prediction - at the predicted hit rate and at the measured one (the speed model
    alone). The engine's options come as ``options`` or as :class:`strata.engine.options.EngineOptions`
    keywords (``n_ctx``, ``kv``, ``vram_reserve_mib``, ``expert_cache``, ``card``, ``profile``, ...; ``device`` defaults
    to ``cuda`` here).

    Predicted: :func:`strata.budget.plan.make_plan` for strata's engine on the audit's facts - on ``card``
    as ``strata-budget check`` plans it (its CUDA context from cards.toml), or on a card of the measured
    total with the measured context - with the engine's resolved options
    (:meth:`strata.engine.options.ResolvedOptions.plan_options`: its context, KV type, reserve and profile).
    The term table uses the engine's slot count (so the expert cache compares bytes); the plan's
    automatic slot count and hit rate are reported beside it. Measured: the bytes the engine allocated
    per term (sums of buffer sizes), the CUDA runtime as what ``cudaMemGetInfo`` says is used beyond them
    and the context, the generic path's warm-up as the pool's growth at the prompt path.

    Raises:
        GenerateError: no CUDA GPU (``device="cuda"``), a device without device memory, a pack the
            audit finds errors in, or what the options or the start-up refuse.
    """
    opts = options if options is not None else EngineOptions(**{"device": "cuda"} | kw)
    device = opts.device
    if backend is None and device == "cuda":
        from .gpu.kernels import gpu_available

        ok, why = gpu_available()
        if not ok:  # named for this command: measure has no --device option to change
            raise GenerateError(
                f"measure needs a CUDA GPU (it measures the device memory the engine allocates): {why}; "
                f"on a machine without one, plan with strata-budget check PACK --card PRESET"
            )
        _free_cuda_pool()
    eng = load_engine(pack, backend=backend, options=opts)
    g = eng.gpu
    if g is None:
        raise GenerateError(f"measure: device {device!r} has no device memory to measure; use --device cuda")
    res = audit_pack(pack, bf16_scan=False, source_dir=opts.source_dir)
    if res.facts is None:
        raise GenerateError(f"{pack}: the budget audit found errors: {[e.message for e in res.errors][:3]}")
    a = _compare(pack, eng, res.facts)
    if n_tokens > 0:
        _generate(a, eng, prompt, n_tokens)
        if step_ms is not None:
            if pcie_gbs is None and g.pcie_gbs_measured is not None:  # the link measured at start-up
                pcie_gbs = g.pcie_gbs_measured
                a.generation["pcie_gbs_basis"] = f"measured at start-up: {pcie_gbs} GB/s (host tier -> VRAM copies)"
            us = getattr(getattr(eng.decoder, "moe", None), "cpu_probe_us", None)  # the CPU measured at start-up
            if cpu_expert_us is None and us is not None:
                cpu_expert_us = us
                a.generation["cpu_expert_us_basis"] = f"measured at start-up: {us:g} us an expert (cpu experts)"
            _speed(a, res.facts, step_ms, pcie_gbs, cpu_expert_us, _engine_tier(eng))
    return a


def _scratch_slots(eng) -> int:
    """Cache slots the engine keeps out of the cache (``--cache-policy class``'s swap scratch), 0 or 1."""
    cache = getattr(eng.experts, "cache", None)
    return int(getattr(cache, "n_slots", 0) - getattr(cache, "capacity", getattr(cache, "n_slots", 0)))


def _compare(pack, eng, facts) -> Measurement:
    g, marks, o = eng.gpu, eng.gpu.marks, eng.options
    card, n_ctx, kv = o.card, o.n_ctx, o.kv
    ctx = marks["pack"]["gpu_used_bytes"]
    total = marks["pack"]["gpu_total_bytes"]
    slots = g.slot_plan.slots if g.slot_plan else 0
    if card is None:
        rt, rt_src = runtime_term()
        card = Card(
            name=f"measured ({g.device})",
            total_bytes=total,
            source="cudaMemGetInfo",
            cuda_context_bytes=ctx,
            cuda_context_source="measured: used before the first allocation",
            cuda_runtime_bytes=rt,
            cuda_runtime_source=rt_src,
        )
        ctx_exact = True
    else:
        ctx_exact = False
    # cuBLAS's first use is charged where this start-up paid it (prompt chunks on CUDA, not used before in the process)
    blas = {"cublas": g.cublas_first_use}
    auto = (
        make_plan(facts, card, o.plan_options(o.expert_cache).model_copy(update=blas), suggest=False)
        if facts.expert_layers
        else None
    )
    plan = make_plan(
        facts, card, o.plan_options(slots if facts.expert_layers else None).model_copy(update=blas), suggest=False
    )
    pred = {t.name: t.bytes for t in plan.terms}
    a = Measurement(
        pack=str(pack),
        device=g.device,
        card_total_bytes=total,
        context_bytes=ctx,
        n_ctx=n_ctx,
        kv=kv,
        slots=slots,
        slot_mode=g.slot_plan.mode if g.slot_plan else "",
        card=card.name,
        physical_total_bytes=marks["pack"].get("physical_total_bytes"),
        decode_path=g.decode_path,
        predicted_slots=auto.slots if auto is not None and o.expert_cache is None else None,
        reserve_bytes=g.reserve_bytes,
        free_after_bytes=g.free_after_bytes,
        host_tier_predicted_bytes=plan.host_tier_bytes,  # (with --cache-policy class: its scratch slot's pair too)
        scratch_slots=_scratch_slots(eng),
        host_tier_bytes=g.host_tier_bytes,
        miss_tier=g.miss_tier,
    )
    end = marks[eng.checkpoints[-1].name]
    cache_bytes = g.slot_plan.cache_bytes if g.slot_plan else 0
    act = g.fused_buffer_bytes if g.fused else g.warmup_pool_bytes
    exact_sum = (
        g.weights_engine_bytes
        + g.head_engine_bytes
        + g.kv_bytes
        + g.recurrent_bytes
        + g.buffer_bytes
        + cache_bytes
        + g.draft_engine_bytes
        + g.draft_bind_bytes
        + (act if g.fused else 0)
        + g.chunk_bytes
    )
    runtime = end["gpu_used_bytes"] - ctx - exact_sum - (0 if g.fused else act) - g.host_tier_map_bytes
    rows = [
        (
            "CUDA context",
            ctx,
            "cudaMemGetInfo used before the first allocation"
            + ("" if ctx_exact else f"; predicted: {card.cuda_context_source[:60]}"),
            ctx_exact,
        ),
        (
            "CUDA runtime",
            runtime,
            "cudaMemGetInfo used - context - the engine's buffers (kernel modules, graphs, "
            "allocator rounding); predicted: budget/engine_terms.py",
            False,
        ),
        ("dense weights", g.weights_engine_bytes, "engine-form bytes uploaded (sum of buffer sizes)", True),
        ("output head", g.head_engine_bytes, "engine-form bytes of the head tensors", True),
        ("token embeddings", 0, "kept on the host (untied) or shared with the head", True),
        (
            "KV cache",
            g.kv_bytes,
            f"K and V arrays allocated ({kv}; sliding-window layers as rings; indexer keys)",
            True,
        ),
        ("recurrent state", g.recurrent_bytes, "conv + delta state arrays allocated (f32, one sequence)", True),
        (
            "engine buffers",
            g.buffer_bytes,
            "GEMV outputs + f32 vector copies + embedding row + rope tables + hit-path vectors (sum of buffer sizes)",
            True,
        ),
    ]
    if g.draft_engine_bytes or "draft head" in pred:
        rows.append(
            ("draft head", g.draft_engine_bytes, "the NextN draft head's engine-form bytes (stage drafter)", True)
        )
    rows.append(
        (
            "prefill/activations",
            act,
            "the fused step's device buffers (sum of buffer sizes)"
            if g.fused
            else "CuPy pool growth at the prompt path (the generic path's warm-up temporaries)",
            g.fused,
        )
    )
    rows.append(("prompt chunk", g.chunk_bytes, "the chunk path's tile + staging slots (sum of buffer sizes)", True))
    rows.append(("expert cache", cache_bytes, "slots x slot bytes (one allocation)", True))
    if g.host_tier_map_bytes or "host tier mapping" in pred:
        rows.append(
            (
                "host tier mapping",
                g.host_tier_map_bytes,
                "cudaMemGetInfo free before - after pinning and mapping the host tier (driver page tables)",
                False,
            )
        )
    if g.draft_bind_bytes or "draft head bind" in pred:
        rows.append(("draft head bind", g.draft_bind_bytes, "the draft head's bind buffers (stage bind)", True))
    for name, meas, how, exact in rows:
        a.terms.append(
            AuditTerm(term=name, predicted_bytes=pred.get(name, 0), measured_bytes=meas, measured_how=how, exact=exact)
        )
    a.predicted_total_bytes = plan.used_bytes
    a.measured_total_bytes = end["gpu_used_bytes"]
    assert sum(t.measured_bytes for t in a.terms) == a.measured_total_bytes
    a.checkpoints_s = {c.name: round(c.seconds, 3) for c in eng.checkpoints}
    prev = None
    for c in eng.checkpoints:
        d = marks[c.name]
        if prev is not None:
            used, pool = d["gpu_used_bytes"] - prev["gpu_used_bytes"], d["pool_total_bytes"] - prev["pool_total_bytes"]
            a.stages[c.name] = {
                "used": used,
                "pool": pool,
                "outside_pool": used - pool,
                "allocated_rounded": g.alloc_rounded.get(c.name, 0),
            }
        prev = d
    _pool_checks(a, g)
    _notes(a, g, plan, auto, facts)
    return a


def _pool_checks(a: Measurement, g) -> None:
    """Per stage, the pool's used bytes grew by exactly the engine's allocations rounded to 512 B (CUDA)."""
    marks = g.marks
    names = list(marks)
    for i, stage in enumerate(names[1:] if g.backend == "cuda" else [], 1):
        if stage == "prompt path":  # its warm-up may leave temporaries in use until it returns; checked by growth
            continue
        prev = names[i - 1]
        grew = marks[stage]["pool_used_bytes"] - marks[prev]["pool_used_bytes"]
        asked = g.alloc_rounded[stage] - g.alloc_rounded[prev] + (g.session_rounded_bytes if stage == "session" else 0)
        a.pool_checks.append(
            f"{stage}: pool used +{grew} B, engine allocations rounded to 512 B: {asked} B "
            f"({'equal' if grew == asked else 'DIFFER'})"
        )


def _notes(a: Measurement, g, plan, auto, facts) -> None:
    if g.slot_plan:
        sp = g.slot_plan
        a.notes.append(
            f"expert cache {sp.mode}: {sp.slots} slots of {sp.slot_bytes} B (strata.layout.experts.expert_slot_bytes; "
            f"largest engine-form blob {sp.max_blob_engine} B) from {sp.free_bytes} B free at the checkpoint "
            f"- {sp.reserve_bytes} B reserve (with the draft head's bind bytes)"
            + (f", capped at {sp.cap} pairs" if sp.cap is not None else "")
        )
    if auto is not None and a.predicted_slots is not None:
        a.notes.append(
            f"slots: strata-budget check predicts {a.predicted_slots}, the engine took {a.slots} "
            f"({a.slots - a.predicted_slots:+d}; the estimate terms move the free figure)"
        )
    a.notes.append(
        f"reserve: {a.free_after_bytes} B free after start-up ({a.free_after_bytes / F.MIB:.1f} MiB), "
        f"{'at least' if a.reserve_ok else 'UNDER'} the {a.reserve_bytes / F.MIB:.0f} MiB reserve (measured)"
    )
    a.notes.append(f"decode path: {a.decode_path}; the budget reads it as {plan.decode_path}")
    if a.miss_tier == "pcie":
        same = "equal" if a.host_tier_bytes == a.host_tier_predicted_bytes else "DIFFERENT"
        a.notes.append(
            f"host tier (pinned host memory): the engine pinned {a.host_tier_bytes} B, strata-budget check plans "
            f"{a.host_tier_predicted_bytes} B at {a.slots} slots ({same}; exact"
            + ("; with the pair the cache policy's scratch slot leaves out" if a.scratch_slots else "")
            + ")"
        )
    elif a.miss_tier:
        a.notes.append(f"misses: {a.miss_tier}")
    a.notes.append(
        f"measured total = cudaMemGetInfo used at the end of start-up = the measured column's sum; "
        f"the warm-up took {g.runtime_bytes} B outside the pool and grew it by {g.warmup_pool_bytes} B"
    )


def _generate(a: Measurement, eng, prompt: str, n_tokens: int) -> None:
    """Generate after the start-up and set the expert hit rate measured during generation beside the
    profile's prediction (at the plan's slot count and at the engine's)."""
    from .generate import generate

    r = generate(eng, prompt, n_tokens, ignore_eos=True)
    sel = r.expert_hits + r.expert_misses
    steps = max(r.n_prompt_tokens + r.n_output_tokens - 1, 1)
    gen: dict = {
        "prompt_tokens": r.n_prompt_tokens,
        "tokens": r.n_output_tokens,
        "decode_tok_s": r.tokens_per_second,
        "prompt_s": round(r.prompt_seconds, 3),
        "decode_s": round(r.decode_seconds, 3),
        "expert_hits": r.expert_hits,
        "expert_misses": r.expert_misses,
        "expert_pcie": r.expert_pcie,
        "cpu_misses_per_token": round((r.expert_misses - r.expert_pcie) / steps, 2),
        "pcie_misses_per_token": round(r.expert_pcie / steps, 2),
        "prefetched": r.prefetched,
        "prefetch_read": r.prefetch_read,
        "hit_rate_measured": r.expert_hits / sel if sel else None,
    }
    profile = eng.options.profile
    if profile is not None and eng.gpu.slot_plan is not None:  # at the experts the slots hold (less a swap scratch)
        held = eng.gpu.slot_plan.slots - a.scratch_slots
        gen["hit_rate_predicted_engine_slots"] = F.fill_profile(profile, held).hit_rate
        if a.predicted_slots is not None:
            gen["hit_rate_predicted_plan"] = F.fill_profile(profile, a.predicted_slots - a.scratch_slots).hit_rate
    a.generation = gen


def _engine_tier(eng) -> str:
    """Where the engine serves misses, as :func:`strata.budget.speed.predict_decode` takes it: ``cpu`` (its host tier
    not built), ``auto`` (split with the CPU), else every miss over PCIe (named for the note)."""
    if (eng.gpu.miss_tier or "").startswith("cpu"):
        return "cpu"
    return "auto" if getattr(getattr(eng.decoder, "moe", None), "share", 1.0) < 1 else "the engine's one graph"


def _speed(
    a: Measurement, facts, step_ms: float, pcie_gbs: float | None, cpu_expert_us: float | None, tier: str
) -> None:
    """The decode rate :func:`strata.budget.speed.predict_decode` gives at the predicted hit rate (the profile's at
    the engine's slots, else the resident fraction) and at the measured one, set beside the measured rate; misses
    served as the engine serves them (``tier``: :func:`_engine_tier`). Misses computed on the CPU with no CPU rate
    (``cpu_expert_us`` None) are not in the model: with any, a note says so and no figure is set.

    Raises:
        GenerateError: the speed options are out of range, or misses to charge with no ``pcie_gbs``.
    """
    from strata.budget.errors import BudgetInputError
    from strata.budget.speed import predict_decode

    gn = a.generation
    if gn["cpu_misses_per_token"] and cpu_expert_us is None:
        a.notes.append(
            f"decode speed: {gn['cpu_misses_per_token']} misses a token ran on the CPU and no CPU rate was measured or "
            "given (--cpu-expert-us), so no prediction is given"
        )
        return
    layers = facts.trunk_experts
    pairs = len(layers) * facts.n_expert
    engine_rate = gn.get("hit_rate_predicted_engine_slots")
    if engine_rate is None:
        engine_rate = min(a.slots - a.scratch_slots, pairs) / pairs if pairs else 1.0
    blobs = [L.blob_engine_bytes for L in layers]
    try:
        for key, rate, basis in (
            ("decode_tok_s_predicted", engine_rate, "predicted"),
            ("decode_tok_s_predicted_at_measured_hits", gn["hit_rate_measured"], "measured"),
        ):
            if rate is not None:
                gn[key] = predict_decode(
                    step_ms=step_ms,
                    pcie_gbs=pcie_gbs,
                    hit_rate=rate,
                    hit_basis=basis,
                    n_expert_used=facts.n_expert_used,
                    blob_bytes=blobs,
                    cpu_expert_us=cpu_expert_us,
                    miss_tier=tier,
                ).tok_s
    except BudgetInputError as e:
        raise GenerateError(str(e)) from None


def print_measurement(a: Measurement) -> None:
    """The table (every figure in bytes), then the checks, slots, reserve, hit rate and notes."""
    phys = f" (physical {a.physical_total_bytes / F.MIB:.0f} MiB)" if a.physical_total_bytes else ""
    click.echo(
        f"measure {a.pack} on {a.device}: card {a.card_total_bytes / F.MIB:.0f} MiB{phys}, n_ctx {a.n_ctx}, "
        f"kv {a.kv}, {a.slots} expert slots ({a.slot_mode or 'no experts'}); every figure in bytes"
    )
    click.echo(f"{'term':22s} {'predicted':>16s} {'measured':>16s} {'diff':>12s}  kind")
    for t in a.terms:
        kind = "exact" if t.exact else "estimate"
        ok = "" if (not t.exact or t.diff_bytes == 0) else "  <-- differs"
        click.echo(f"{t.term:22s} {t.predicted_bytes:16d} {t.measured_bytes:16d} {t.diff_bytes:+12d}  {kind}{ok}")
    d = a.total_diff_bytes
    click.echo(
        f"{'total':22s} {a.predicted_total_bytes:16d} {a.measured_total_bytes:16d} {d:+12d}  "
        f"(diff {d / F.MIB:+.1f} MiB = {100 * d / max(a.measured_total_bytes, 1):+.2f}%; goal within 0.5% or "
        f"32 MiB: {'ok' if a.total_ok else 'MISSED'}; exact terms: {'all equal' if a.exact_ok else 'DIFFER'}; "
        f"reserve free after start-up: {'yes' if a.reserve_ok else 'NO'})"
    )
    if a.generation:
        gn = a.generation
        pred = gn.get("hit_rate_predicted_plan", gn.get("hit_rate_predicted_engine_slots"))
        rate = gn["hit_rate_measured"]
        click.echo(
            f"generation: {gn['tokens']} tokens after a {gn['prompt_tokens']}-token prompt, "
            f"{gn['decode_tok_s'] or 0:.2f} "
            f"tok/s decode; experts {gn['expert_hits']} hits / {gn['expert_misses']} misses (counts), "
            f"{gn['cpu_misses_per_token']} CPU and {gn['pcie_misses_per_token']} PCIe misses per position; hit rate "
            "measured "
            + (f"{rate:.2%}" if rate is not None else "n/a")
            + (f", predicted by the profile {pred:.2%}" if pred is not None else "")
            + (
                f" (at the engine's {a.slots} slots: {gn['hit_rate_predicted_engine_slots']:.2%})"
                if "hit_rate_predicted_engine_slots" in gn
                else ""
            )
        )
        if "decode_tok_s_predicted" in gn:
            at = gn.get("decode_tok_s_predicted_at_measured_hits")
            click.echo(
                f"decode speed: measured {gn['decode_tok_s'] or 0:.2f} tok/s, predicted "
                f"{gn['decode_tok_s_predicted']:.2f} tok/s at the predicted hit rate"
                + (f", {at:.2f} tok/s at the measured one" if at is not None else "")
                + " (strata.budget.speed"
                + (f"; PCIe {gn['pcie_gbs_basis']}" if "pcie_gbs_basis" in gn else "")
                + (f"; CPU {gn['cpu_expert_us_basis']}" if "cpu_expert_us_basis" in gn else "")
                + ")"
            )
    for c in a.pool_checks:
        click.echo(f"pool check: {c}")
    for n in a.notes:
        click.echo(f"note: {n}")


__all__ = ["AuditTerm", "Measurement", "measure_pack", "print_measurement"]
