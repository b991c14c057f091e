"""``strata-engine measure``: the budget's prediction next to what the engine really allocates.

Loads a pack on the GPU path (``cuda``, or the ``sim`` backend in tests) and compares, per budget
term, the bytes :func:`strata.budget.plan.make_plan` predicts for this card, context and options with
the bytes the engine allocated (each a sum of buffer sizes, cross-checked against the CuPy pool's
growth per start-up stage). Deterministic terms must be equal to the byte; the total within 0.5% or
32 MiB. A planner's prediction checked by measurement is the point, so this module (and only it in
the engine) calls the planner.
"""

from __future__ import annotations

import click
from pydantic import BaseModel, Field

from strata.budget import formulas as F
from strata.budget.audit import audit_pack
from strata.budget.cards import Card, runtime_term
from strata.budget.plan import PlanOptions, make_plan

from .errors import GenerateError
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
    terms: list[AuditTerm] = Field(default_factory=list)
    predicted_total_bytes: int = 0
    measured_total_bytes: int = 0  # cudaMemGetInfo used at the end of start-up
    pool_checks: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @property
    def exact_ok(self) -> bool:
        return all(t.diff_bytes == 0 for t in self.terms if t.exact)

    @property
    def total_diff_bytes(self) -> int:
        return self.measured_total_bytes - self.predicted_total_bytes

    @property
    def total_ok(self) -> bool:
        return abs(self.total_diff_bytes) <= max(0.005 * self.measured_total_bytes, 32 * F.MIB)


def measure_pack(pack: str, *, n_ctx: int | None = F.DEFAULT_CTX, expert_cache="auto",
                 vram_reserve_mib: int = F.DEFAULT_RESERVE_MIB, kv: str = F.DEFAULT_KV, device: str = "cuda",
                 backend=None, resident="all") -> Measurement:
    """Load ``pack`` on the GPU path and compare every budget term with what was allocated.

    Predicted: :func:`strata.budget.plan.make_plan` on the pack's audit facts, for a card of the
    measured total with the measured context (used memory before the first allocation) and the
    cards.toml runtime term, the engine's options (``n_ctx``, ``kv``, one position per step, the
    untied embeddings on the host) and the slot count the engine chose. Measured: the bytes the
    engine allocated per term (each a sum of buffer sizes), cross-checked against the CuPy pool's
    growth per stage (``pool_checks``); the runtime and activation terms from ``cudaMemGetInfo`` and
    the pool around the warm-up; the total from ``cudaMemGetInfo`` at the end of start-up.
    """
    if backend is None and device == "cuda":
        from .gpu.kernels import gpu_available

        ok, why = gpu_available()
        if not ok:  # named for this command: measure has no --device option to change
            raise GenerateError(f"measure needs a CUDA GPU (it measures the device memory the engine allocates): {why}; "
                                f"on a machine without one, plan with strata-budget check PACK --card PRESET")
        # the context is measured as the memory used before this engine's first allocation: give
        # back what earlier engines of this process left cached in the pool (a no-op in a fresh
        # process, the intended use; kernel modules loaded earlier stay and then count as context)
        try:
            import gc

            import cupy as cp

            gc.collect()
            cp.get_default_memory_pool().free_all_blocks()
        except ImportError:
            pass  # load_engine_gpu refuses with the reason
    eng = load_engine(pack, device=device, backend=backend, n_ctx=n_ctx, expert_cache=expert_cache,
                      vram_reserve_mib=vram_reserve_mib, kv=kv, resident=resident)
    n_ctx = eng.n_ctx
    g = eng.gpu
    if g is None:
        raise GenerateError(f"measure: device {device!r} has no device memory to measure; use --device cuda")
    marks = g.marks
    ctx = marks["pack"]["gpu_used_bytes"]
    total = marks["pack"]["gpu_total_bytes"]
    res = audit_pack(pack, bf16_scan=False)
    if res.facts is None:
        raise GenerateError(f"{pack}: the budget audit found errors: {[e.message for e in res.errors][:3]}")
    facts = res.facts
    slots = g.slot_plan.slots if g.slot_plan else 0
    rt, rt_src = runtime_term()
    card = Card(name=f"measured ({g.device})", total_bytes=total, source="cudaMemGetInfo",
                cuda_context_bytes=ctx, cuda_context_source="measured: used before the first allocation",
                cuda_runtime_bytes=rt, cuda_runtime_source=rt_src)
    opts = PlanOptions(max_context=n_ctx, prefill=0, batch=1, vram_reserve_mib=vram_reserve_mib, kv=kv,
                       expert_cache=slots if facts.expert_layers else None,
                       embeddings_on_host=not facts.tied)
    plan = make_plan(facts, card, opts, suggest=False)
    pred = {t.name: t.bytes for t in plan.terms}
    a = Measurement(pack=str(pack), device=g.device, card_total_bytes=total, context_bytes=ctx, n_ctx=n_ctx, kv=kv,
                 slots=slots, slot_mode=g.slot_plan.mode if g.slot_plan else "")
    end = marks["expert cache"]
    cache_bytes = g.slot_plan.cache_bytes if g.slot_plan else 0
    exact_alloc = (g.weights_engine_bytes + g.head_engine_bytes + g.kv_bytes + g.recurrent_bytes + g.buffer_bytes
                   + cache_bytes)
    # everything on the device is the context, memory outside the CuPy pool (the runtime's modules)
    # or the pool's blocks: the exact terms, and the rest the warm-up's temporaries left cached
    # (pool figures relative to the start: blocks another engine of this process still holds count
    # in the context measured at "pack", not twice)
    pool_grew = end["pool_total_bytes"] - marks["pack"]["pool_total_bytes"]
    outside_pool = end["gpu_used_bytes"] - ctx - pool_grew
    pool_rest = pool_grew - exact_alloc
    rows = [
        ("CUDA context", ctx, "cudaMemGetInfo used before the first allocation (the card is planned with it)", True),
        ("CUDA runtime", outside_pool, "cudaMemGetInfo used - context - CuPy pool growth since the start (kernel "
                                       "modules); predicted: cards.toml cuda_runtime_mib", False),
        ("dense weights", g.weights_engine_bytes, "engine-form bytes uploaded (sum of buffer sizes)", True),
        ("output head", g.head_engine_bytes, "engine-form bytes of the head tensors", True),
        ("token embeddings", 0, "kept on the host (untied) or shared with the head", True),
        ("KV cache", g.kv_bytes, f"K and V arrays allocated ({kv}; sliding-window layers as rings)", True),
        ("recurrent state", g.recurrent_bytes, "conv + delta state arrays allocated (f32, one sequence)", True),
        ("engine buffers", g.buffer_bytes, "GEMV outputs + f32 vector copies + embedding row + rope tables + "
                                           "hit-path vectors (sum of buffer sizes)", True),
        ("prefill/activations", pool_rest, "CuPy pool growth - the exact terms above (the warm-up's temporaries "
                                           "cached in the pool, and the pool's 512 B rounding)", False),
        ("expert cache", cache_bytes, "slots x slot bytes (one allocation)", True),
    ]
    for name, meas, how, exact in rows:
        a.terms.append(AuditTerm(term=name, predicted_bytes=pred.get(name, 0), measured_bytes=meas,
                                 measured_how=how, exact=exact))
    a.predicted_total_bytes = plan.used_bytes
    a.measured_total_bytes = end["gpu_used_bytes"]
    assert sum(t.measured_bytes for t in a.terms) == a.measured_total_bytes
    # the counted bytes are what the device gave: per stage, the pool's used bytes grew by exactly the
    # engine's allocations, each rounded up to the pool's 512 B unit
    prev = "pack"
    for stage in (("weights", "head", "session", "expert cache") if g.backend == "cuda" else ()):
        grew = marks[stage]["pool_used_bytes"] - marks[prev]["pool_used_bytes"]
        asked = g.alloc_rounded[stage] - g.alloc_rounded[prev] + (g.session_rounded_bytes if stage == "session" else 0)
        a.pool_checks.append(f"{stage}: pool used +{grew} B, engine allocations rounded to 512 B: {asked} B "
                             f"({'equal' if grew == asked else 'DIFFER'})")
        prev = stage if stage != "session" else "prompt path"
    if g.slot_plan:
        sp = g.slot_plan
        a.notes.append(f"expert cache {sp.mode}: {sp.slots} slots of {sp.slot_bytes} B (budget.formulas.expert_slot_bytes; "
                       f"largest engine-form blob {sp.max_blob_engine} B) from {sp.free_bytes} B free at the checkpoint "
                       f"- {sp.reserve_bytes} B reserve" + (f", capped at {sp.cap} pairs" if sp.cap is not None else ""))
    a.notes.append(f"measured total = cudaMemGetInfo used at the end of start-up = the measured column's sum; "
                   f"the warm-up alone took {g.runtime_bytes} B outside the pool and grew it by {g.warmup_pool_bytes} B")
    return a


def print_measurement(a: Measurement) -> None:
    click.echo(f"measure {a.pack} on {a.device}: card {a.card_total_bytes / F.MIB:.0f} MiB, n_ctx {a.n_ctx}, kv {a.kv}, "
               f"{a.slots} expert slots ({a.slot_mode or 'no experts'}); every figure in bytes")
    click.echo(f"{'term':22s} {'predicted':>16s} {'measured':>16s} {'diff':>12s}  kind")
    for t in a.terms:
        kind = "exact" if t.exact else "estimate"
        ok = "" if (not t.exact or t.diff_bytes == 0) else "  <-- differs"
        click.echo(f"{t.term:22s} {t.predicted_bytes:16d} {t.measured_bytes:16d} {t.diff_bytes:+12d}  {kind}{ok}")
    d = a.total_diff_bytes
    click.echo(f"{'total':22s} {a.predicted_total_bytes:16d} {a.measured_total_bytes:16d} {d:+12d}  "
               f"(diff {d / F.MIB:+.1f} MiB = {100 * d / max(a.measured_total_bytes, 1):+.2f}%; goal within 0.5% or "
               f"32 MiB: {'ok' if a.total_ok else 'MISSED'}; exact terms: {'all equal' if a.exact_ok else 'DIFFER'})")
    for c in a.pool_checks:
        click.echo(f"pool check: {c}")
    for n in a.notes:
        click.echo(f"note: {n}")


__all__ = ["AuditTerm", "Measurement", "measure_pack", "print_measurement"]
