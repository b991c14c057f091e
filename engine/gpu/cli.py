"""The GPU path's part of ``strata-engine``: the ``cuda`` device for ``generate``, ``audit``
(predicted vs measured VRAM per budget term) and ``profile`` (an expert-routing profile).

Hooked into :mod:`strata.engine.cli` by :func:`register_device` (adds ``cuda`` to its
``LOADERS`` table before ``generate`` is declared) and :func:`add_commands`. Importing this
module imports no CuPy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from pydantic import BaseModel, Field

from strata.budget import formulas as F

from ..generate import GenerateError
from .engine import DEFAULT_RESERVE_MIB, load_engine_cuda, load_engine_gpu


def register_device(loaders: dict) -> None:
    """Add ``cuda`` to ``strata.engine.cli.LOADERS``."""
    loaders["cuda"] = load_engine_cuda


def _expert_cache(value: str):
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter("expected auto or a slot count") from None
    if n < 0:
        raise click.BadParameter("a slot count cannot be negative")
    return n


# ---------------------------------------------------------------------------- audit

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


class GpuAudit(BaseModel):
    """``strata-engine audit``: predicted (strata.budget) vs measured (this engine on this device)."""

    pack: str
    device: str
    card_total_bytes: int
    context_bytes: int
    n_ctx: int
    slots: int
    terms: list[AuditTerm] = Field(default_factory=list)
    predicted_total_bytes: int = 0
    measured_total_bytes: int = 0  # cudaMemGetInfo used at the end of start-up
    measured_total_without_runtime_bytes: int = 0
    notes: list[str] = Field(default_factory=list)

    @property
    def total_ok(self) -> bool:
        d = abs(self.measured_total_bytes - self.predicted_total_bytes)
        return d <= max(0.005 * self.measured_total_bytes, 32 * F.MIB)


def run_audit(pack: str, *, n_ctx: int, expert_cache="auto", vram_reserve_mib: int = DEFAULT_RESERVE_MIB,
              device: str = "cuda", backend=None, resident="all") -> GpuAudit:
    """Load ``pack`` on the GPU path and compare every budget term with what was allocated."""
    from strata.budget.audit import audit_pack
    from strata.budget.cards import Card
    from strata.budget.plan import PlanOptions, make_plan

    eng = load_engine_gpu(pack, n_ctx=n_ctx, expert_cache=expert_cache, vram_reserve_mib=vram_reserve_mib,
                          device=device, backend=backend, resident=resident)
    g = eng.gpu
    marks = g.marks
    ctx = marks["pack"]["gpu_used_bytes"]
    total = marks["pack"]["gpu_total_bytes"]
    res = audit_pack(pack, bf16_scan=False)
    if res.facts is None:
        raise click.ClickException(f"{pack}: the budget audit found errors: {[e.message for e in res.errors][:3]}")
    facts = res.facts
    slots = g.slot_plan.slots if g.slot_plan else 0
    card = Card(name=f"measured ({g.device})", total_bytes=total, source="cudaMemGetInfo",
                cuda_context_bytes=ctx, cuda_context_source="measured: used before the first allocation")
    opts = PlanOptions(max_context=n_ctx, prefill=0, batch=1, vram_reserve_mib=vram_reserve_mib,
                       expert_cache=slots if facts.expert_layers else None,
                       embeddings_on_host=not facts.tied)
    plan = make_plan(facts, card, opts, suggest=False)
    pred = {t.name: t.bytes for t in plan.terms}
    a = GpuAudit(pack=str(pack), device=g.device, card_total_bytes=total, context_bytes=ctx, n_ctx=n_ctx, slots=slots)
    kv_detail = next((t.detail for t in plan.terms if t.name == "KV cache"), "")
    act_measured = (g.f32_vector_bytes + g.output_buffer_bytes + g.rope_bytes
                    + marks["prompt path"]["pool_used_bytes"] - marks["expert cache"]["pool_used_bytes"])
    rows = [
        ("CUDA context", ctx, "cudaMemGetInfo used before the first allocation", True),
        ("dense weights", g.weights_engine_bytes, "engine-form bytes uploaded (sum of buffer sizes)", True),
        ("output head", g.head_engine_bytes, "engine-form bytes of the head tensors", True),
        ("token embeddings", 0, "kept on the host (untied) or shared with the head", True),
        ("KV cache", g.kv_bytes, "KV arrays allocated (f32 K and V per layer)", True),
        ("recurrent state", 0, "no recurrent layers on this path", True),
        ("prefill/activations", act_measured,
         "f32 norm/bias copies + per-tensor matvec outputs + rope tables + pool growth of the warm-up step", False),
        ("expert cache", g.slot_plan.cache_bytes if g.slot_plan else 0, "slots x slot bytes (one allocation)", True),
    ]
    pp, ec = marks["prompt path"], marks["expert cache"]
    runtime = (pp["gpu_used_bytes"] - ec["gpu_used_bytes"]) - (pp["pool_total_bytes"] - ec["pool_total_bytes"])
    rows.append(("runtime at first use", runtime,
                 "device memory the warm-up step took outside the CuPy pool (kernel modules, cuBLAS handle and "
                 "workspace for the attention einsums); no budget term models it", False))
    for name, meas, how, exact in rows:
        a.terms.append(AuditTerm(term=name, predicted_bytes=pred.get(name, 0), measured_bytes=meas,
                                 measured_how=how, exact=exact))
    a.predicted_total_bytes = plan.used_bytes
    a.measured_total_bytes = marks["prompt path"]["gpu_used_bytes"]
    if "f16" in kv_detail and g.kv_bytes:
        a.notes.append("the budget's KV term is f16 (--kv f16|int8); this engine keeps K/V in f32, "
                       "so the measured KV cache is twice the f16 prediction")
    if g.slot_plan and g.slot_plan.slot_bytes != g.slot_plan.max_blob_engine:
        a.notes.append(f"slot stride {g.slot_plan.slot_bytes} B = largest engine-form blob "
                       f"{g.slot_plan.max_blob_engine} B with each part aligned to 256 B")
    a.notes.append("measured total = cudaMemGetInfo used after the warm-up step; it includes CuPy pool "
                   "rounding (512 B per block), the driver's allocation granularity and the runtime-at-first-use line")
    a.measured_total_without_runtime_bytes = a.measured_total_bytes - runtime
    return a


def _print_audit(a: GpuAudit) -> None:
    click.echo(f"audit {a.pack} on {a.device}: card {a.card_total_bytes / F.MIB:.0f} MiB, n_ctx {a.n_ctx}, "
               f"{a.slots} expert slots (bytes; MiB in brackets)")
    click.echo(f"{'term':22s} {'predicted':>16s} {'measured':>16s} {'diff':>12s}  kind")
    for t in a.terms:
        kind = "exact" if t.exact else "estimate"
        ok = "" if (not t.exact or t.diff_bytes == 0) else "  <-- differs"
        click.echo(f"{t.term:22s} {t.predicted_bytes:16d} {t.measured_bytes:16d} {t.diff_bytes:+12d}  {kind}{ok}")
    d = a.measured_total_bytes - a.predicted_total_bytes
    click.echo(f"{'total':22s} {a.predicted_total_bytes:16d} {a.measured_total_bytes:16d} {d:+12d}  "
               f"({d / F.MIB:+.1f} MiB; goal within 0.5% or 32 MiB: {'ok' if a.total_ok else 'MISSED'})")
    d2 = a.measured_total_without_runtime_bytes - a.predicted_total_bytes
    click.echo(f"{'total w/o runtime':22s} {a.predicted_total_bytes:16d} {a.measured_total_without_runtime_bytes:16d} "
               f"{d2:+12d}  ({d2 / F.MIB:+.1f} MiB)")
    for n in a.notes:
        click.echo(f"note: {n}")


# ---------------------------------------------------------------------------- profile

def run_profile(pack: str, prompts: list[str], *, n_tokens: int, n_ctx: int, device: str = "cpu") -> list[tuple[int, int, int]]:
    """Route ``prompts`` through the engine and count, per (layer, expert), how often it was
    selected (prompt positions and generated tokens alike). Returns ``(layer, expert, count)``
    rows sorted by layer, expert (pairs never selected are left out)."""
    from ..generate import generate, load_engine

    eng = load_engine(pack, n_ctx=n_ctx, resident="none") if device == "cpu" else \
        load_engine_gpu(pack, n_ctx=n_ctx, device=device, expert_cache=0)
    if eng.experts is None:
        raise click.ClickException(f"{pack}: {eng.pack.arch} has no routed experts; nothing to profile")
    counts: dict[tuple[int, int], int] = {}
    path = eng.experts
    orig = path.__call__

    class Counting(type(path)):  # count every selection, then defer to the real path
        def __call__(self, il, x, ids, weights):
            for e in ids:
                counts[(il, e)] = counts.get((il, e), 0) + 1
            return orig(il, x, ids, weights)

    path.__class__ = Counting
    for p in prompts:
        eng.state = eng.model.new_state(n_ctx)
        generate(eng, p, n_tokens, ignore_eos=True)
    return sorted((il, e, c) for (il, e), c in counts.items())


def write_profile(rows: list[tuple[int, int, int]], out: str) -> None:
    """Parquet with int columns ``layer``, ``expert``, ``count`` (read by strata.budget.plan.read_profile)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"layer": pa.array([r[0] for r in rows], pa.int32()),
                      "expert": pa.array([r[1] for r in rows], pa.int32()),
                      "count": pa.array([r[2] for r in rows], pa.int64())})
    pq.write_table(table, out)


# ---------------------------------------------------------------------------- commands

def add_commands(main: click.Group) -> None:
    """Add ``audit`` and ``profile`` to the ``strata-engine`` group."""

    @main.command("audit")
    @click.argument("pack", type=click.Path(file_okay=False))
    @click.option("--ctx", "n_ctx", default=1024, show_default=True, help="Positions the KV cache holds.")
    @click.option("--expert-cache", "expert_cache", default="auto", show_default=True,
                  callback=lambda c, p, v: _expert_cache(v), help="auto or a slot count.")
    @click.option("--vram-reserve-mib", default=DEFAULT_RESERVE_MIB, show_default=True)
    @click.option("--json", "as_json", is_flag=True)
    def audit_cmd(pack, n_ctx, expert_cache, vram_reserve_mib, as_json):
        """Load PACK on the GPU and print, per budget term, predicted bytes (strata.budget, on the
        measured card and context) next to the bytes this engine allocated."""
        try:
            a = run_audit(pack, n_ctx=n_ctx, expert_cache=expert_cache, vram_reserve_mib=vram_reserve_mib)
        except GenerateError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        if as_json:
            click.echo(json.dumps(a.model_dump()))
        else:
            _print_audit(a)

    @main.command("profile")
    @click.argument("pack", type=click.Path(file_okay=False))
    @click.option("--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False),
                  help="Text file, one prompt per line.")
    @click.option("-o", "--out", default="expert-profile.parquet", show_default=True)
    @click.option("-n", "--n-tokens", "n_tokens", default=16, show_default=True, help="Tokens generated per prompt.")
    @click.option("--ctx", "n_ctx", default=1024, show_default=True)
    @click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
    def profile_cmd(pack, prompts_file, out, n_tokens, n_ctx, device):
        """Write an expert profile (Parquet: layer, expert, count) from routing over --prompts."""
        prompts = [ln for ln in Path(prompts_file).read_text().splitlines() if ln.strip()]
        if not prompts:
            raise click.BadParameter(f"{prompts_file}: no prompts")
        rows = run_profile(pack, prompts, n_tokens=n_tokens, n_ctx=n_ctx, device=device)
        write_profile(rows, out)
        click.echo(f"profile: {len(rows)} (layer, expert) pairs, {sum(r[2] for r in rows)} selections "
                   f"(counts) from {len(prompts)} prompts -> {out}")
