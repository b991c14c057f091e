"""``strata-budget``: the semantic audit of a pack and its VRAM plan for a card (thin click layer
over :func:`strata.budget.audit.audit_pack` and :func:`strata.budget.plan.make_plan`)."""

from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path

import click

from strata.layout import kv as LK
from strata.manifests.contract import ManifestError
from strata.packer.exits import StrataGroup
from strata.packer.packfmt import PackFormatError

from . import formulas as F
from .audit import AuditError, AuditResult, audit_pack
from .cards import Card, card_from_options, host_ram_bytes, host_ram_warnings, short_source
from .errors import BudgetInputError
from .options import (
    ENGINE_ALIASES,
    AliasChoice,
    batch_size_option,
    cache_policy_option,
    card_options,
    ctx_option,
    expert_cache_option,
    expert_profile_option,
    kv_option,
    miss_tier_option,
    parse_expert_cache,
    reserve_option,
    source_dir_option,
    speed_option_error,
    speed_options,
    ubatch_plan_option,
    unused_options,
)
from .plan import DEFAULT_PREFILL_CHUNK, Plan, PlanOptions, make_plan
from .profile import check_profile_model, read_profile
from .speed import plan_decode_speed

EXIT_FITS, EXIT_NO_FIT, EXIT_SEMANTIC = 0, 1, 2
#: Errors a pack's geometry or numbers raise when evaluated (strata's readers raise ValueError): one ``error:``, exit 2.
EVALUATION_ERRORS = (ValueError, ArithmeticError, OSError)
#: Every key of the --json object, in order: a success, a semantic error and an input error carry each (or null).
JSON_KEYS = (
    "verdict",
    "verdict_line",
    "card_total_bytes",
    "terms",
    "free_bytes",
    "reserve_bytes",
    "max_blob",
    "slots",
    "kv_bytes_per_token",
    "recurrent_state_bytes_per_seq",
    "widened_scale_bytes",
    "bf16_saved_bytes",
    "errors",
    "audit_warnings",
    "card",
    "n_ctx",
    "used_bytes",
    "left_bytes",
    "max_blob_source",
    "slots_fit",
    "slots_cap",
    "expert_cache_bytes",
    "host_tier_bytes",
    "refused",
    "kv_bytes_per_token_window_layers",
    "dense_types",
    "profile",
    "warnings",
    "suggestions",
    "smallest_card",
    "host_ram_bytes",
    "host_terms",
    "decode_prediction",
    "options",
    "audit",
    "seconds",
)
#: Names shown per group of identical audit warnings in the table (--json lists every one).
WARNING_NAMES_SHOWN = 3


def _mib(b: int) -> str:
    return f"{F.mib(b):,.1f}"


class _BudgetGroup(StrataGroup):
    json_error = staticmethod(lambda msg: error_json(msg))  # an interruption: the --json error object of every failure


@click.group(cls=_BudgetGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata")
def main() -> None:
    """strata-budget: does every tensor of a pack mean what the kernels assume, and what fits on a card.

    \b
    Exit codes of `check` (the same contract as strata-pack and strata-engine):
      0    the plan fits
      1    it does not fit (or --expert-cache N was refused)
      2    a semantic error in the pack or bad input (unknown card, not a pack, unreadable
           expert profile), printed as one `error: ...` line (with --json: the same object as a
           success, verdict "error")
      130  interrupted by SIGINT (Ctrl-C); 143 by SIGTERM
      141  stdout was closed (`| head`)
    """


@main.command()
@click.argument("pack", type=click.Path())
@card_options()
@click.option(
    "--cuda-context-mib", type=int, help="CUDA context cost in MiB [default: the card preset's / cards.toml's]."
)
@click.option(
    "--cuda-runtime-mib",
    type=int,
    help="CUDA runtime first-use memory in MiB, replacing the whole derived term (kernel modules, graphs, rounding "
    "and, with -ub > 1, cuBLAS) [default: derived from cards.toml's constants].",
)
@ctx_option
@click.option("--kv-resident", type=int, help="Tokens of KV kept in VRAM per full-context layer (the rest streams).")
@kv_option(LK.KV_CACHE_TYPES)
@click.option(
    "--batch",
    type=int,
    default=1,
    show_default=True,
    help="Sequences decoded at once (KV, recurrent state, decode rows).",
)
@click.option(
    "--prefill",
    "prefill",
    type=int,
    default=DEFAULT_PREFILL_CHUNK,
    show_default=True,
    help="Prompt chunk in tokens (0: the decode path, one token at a time).",
)
@click.option("--logits-all", is_flag=True, help="Every chunk position emits logits (logits buffer = chunk x vocab).")
@click.option(
    "--engine",
    "engine",
    type=AliasChoice(["strata", "cpp"], ENGINE_ALIASES),
    default="strata",
    show_default=True,
    help="The engine planned for: strata's own (prompt chunks of -ub, one position per generated token, untied "
    "embeddings on the host, "
    "activation and runtime terms from what it allocates and loads; the --prefill, --prefill-model, "
    "--logits-all and --embeddings-on-host options do not apply) or the reference C++ engine (cpp).",
)
@click.option(
    "--prefill-model",
    type=AliasChoice(["geometry", "cpp"], ENGINE_ALIASES),
    default="geometry",
    show_default=True,
    help="Activation buffers from the geometry (manifest act_per_token), or the reference C++ engine's "
    "measured prompt-path reserve, 160 MiB + 680 KiB per chunk token.",
)
@click.option("--embeddings-on-host", is_flag=True, help="Keep token embeddings on the host (not charged to VRAM).")
@reserve_option
@expert_cache_option
@expert_profile_option
@miss_tier_option
@cache_policy_option
@ubatch_plan_option
@batch_size_option
@click.option(
    "--bf16-scan/--no-bf16-scan", default=True, show_default=True, help="Scan every BF16-source value in pool.bin."
)
@source_dir_option
@speed_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def check(
    pack,
    card_name,
    card_mib,
    cuda_context_mib,
    cuda_runtime_mib,
    n_ctx,
    kv_resident,
    kv,
    batch,
    prefill,
    logits_all,
    engine,
    prefill_model,
    embeddings_on_host,
    vram_reserve_mib,
    expert_cache,
    expert_profile,
    miss_tier,
    cache_policy,
    ubatch,
    batch_size,
    bf16_scan,
    source_dir,
    step_ms,
    pcie_gbs,
    cpu_expert_us,
    as_json,
):
    """Audit PACK and plan its VRAM on a card. PACK may also be a GGUF file (any shard of a split model): the
    plan before the download or the build, from the headers, with the terms its pack would give.

    \b
    Exit codes:
      0  the pack passes the audit and the plan fits the card
      1  the plan does not fit (the output says which terms to shrink and by how much),
         or --expert-cache N does not fit (refused with N and the most that fits)
      2  semantic error in the pack (every failure listed: tensor, found, required),
         or bad input (unknown, zero or > 16 TiB card size, no GPU for --card measure, a speed option out of
         range or that cannot be predicted from, unreadable pack, bad expert profile, one for a model without
         routed experts, a --kv type the model's K/V heads cannot be stored in): one line `error: ...`
    """
    t0 = time.perf_counter()
    expert_cache, bad = parse_expert_cache(expert_cache)
    bad = bad or speed_option_error(step_ms, pcie_gbs, cpu_expert_us)
    if bad:
        _fail(bad, as_json, t0)
    try:
        card = _card(card_name, card_mib, cuda_context_mib, cuda_runtime_mib)
        pairs = read_profile(expert_profile) if expert_profile else None
    except BudgetInputError as e:
        _fail(e, as_json, t0)
    if source_dir is not None and not Path(source_dir).is_dir():
        _fail(f"--source-dir {source_dir}: no such directory; nothing was audited", as_json, t0)
    if not Path(pack).exists():
        _fail(
            f"{pack}: no such file or directory (a pack directory, or a GGUF file to plan before packing)", as_json, t0
        )
    gguf = Path(pack) if Path(pack).is_file() else None
    tmp = None
    try:
        if gguf is not None:  # a plan before the pack: the tables the build would write, from the GGUF headers
            pack, tmp = _header_pack(gguf, as_json, t0)
            bf16_scan = False  # nothing reads pool bytes the build has not copied
        audit = _audit(pack, bf16_scan, source_dir, expert_profile, as_json, t0)
    finally:
        if tmp is not None:
            tmp.cleanup()  # the header pack is read: facts and identity are in memory
    plan = None
    if audit.facts is not None:
        opts = PlanOptions(
            n_ctx=n_ctx,
            kv_resident=kv_resident,
            kv=kv,
            batch=batch,
            prefill=prefill,
            logits_all=logits_all,
            prefill_model=prefill_model,
            embeddings_on_host=embeddings_on_host,
            vram_reserve_mib=vram_reserve_mib,
            expert_cache=expert_cache,
            profile_pairs=pairs,
            profile_path=expert_profile,
            engine=engine,
            miss_tier=miss_tier,
            cache_policy=cache_policy,
            ubatch=min(ubatch, batch_size),  # as the engine's: a chunk is min(-b, -ub) positions
        )
        try:
            plan = make_plan(audit.facts, card, opts)
            if step_ms is not None and audit.ok and plan.fits:  # no speed for a plan that does not run
                plan.decode = plan_decode_speed(plan, audit.facts, step_ms, pcie_gbs, cpu_expert_us)
        except EVALUATION_ERRORS as e:
            # a pack that failed the audit is reported by its failures (its numbers may not plan);
            # a pack that passed cannot be planned only for bad input
            if audit.ok:
                _fail(e if isinstance(e, BudgetInputError) else f"{pack}: cannot plan the pack: {e}", as_json, t0)
    if plan is not None:
        plan.warnings += host_ram_warnings(plan, host_ram_bytes()) + unused_options(engine, miss_tier, cache_policy)
    if gguf is not None:
        audit.pack = str(gguf)
        audit.planned_from = "gguf header"
    seconds = time.perf_counter() - t0
    code = EXIT_SEMANTIC if not audit.ok else (EXIT_FITS if plan is not None and plan.fits else EXIT_NO_FIT)
    verdict = _verdict(audit, plan)
    if as_json:
        click.echo(json.dumps(to_json(audit, plan, verdict, seconds), indent=1))
    else:
        _print(audit, plan, verdict, seconds)
        if not audit.ok:  # the plan above was computed from a broken pack: the failure also as one stderr line
            click.echo(f"error: {verdict}", err=True)
    sys.exit(code)


def _audit(pack, bf16_scan: bool, source_dir, expert_profile, as_json: bool, t0: float) -> AuditResult:
    """The audit of ``pack`` and the check that an expert profile was recorded on its model; a refusal exits 2."""
    try:
        audit = audit_pack(pack, bf16_scan=bf16_scan, source_dir=source_dir)
    except (PackFormatError, ManifestError) as e:
        _fail(e, as_json, t0)
    except EVALUATION_ERRORS as e:
        _fail(f"{pack}: cannot audit the pack: {e}", as_json, t0)
    if expert_profile:  # recorded on this model, not another (the profile file says which)
        from strata.packer.pack import read_pack

        try:
            check_profile_model(expert_profile, read_pack(pack, source_dir=source_dir))
        except BudgetInputError as e:
            _fail(e, as_json, t0)
    return audit


def _header_pack(gguf: Path, as_json: bool, t0: float):
    """``strata-budget check FILE.gguf``: the pack's tables written from the GGUF headers into a temporary directory
    (:func:`strata.packer.build.header_pack`: the router weights alone copied), removed by the caller once it is
    read. Returns ``(pack directory, the TemporaryDirectory)``; a source the build would refuse is refused here,
    exit 2."""
    import tempfile

    from strata.packer.build import header_pack
    from strata.packer.cli import INPUT_ERRORS

    tmp = tempfile.TemporaryDirectory(prefix="strata-plan-")
    try:
        return header_pack(gguf, Path(tmp.name) / "pack"), tmp
    except INPUT_ERRORS as e:
        tmp.cleanup()
        msg = str(e).removeprefix(f"{gguf}: ")  # the path once
        _fail(f"{gguf}: cannot plan from this GGUF: {msg}", as_json, t0)


def _card(name: str | None, mib: int | None, ctx: int | None, runtime: int | None = None) -> Card:
    return card_from_options(name, mib, ctx, runtime)


def error_json(error: BudgetInputError | Exception | str, seconds: float | None = None) -> dict:
    """The --json object of an input error: every key of a success (:data:`JSON_KEYS`), null where it
    does not apply, ``verdict`` "error" and ``errors`` holding ``{tensor, found, required, message}``."""
    entry = (
        error.as_error()
        if isinstance(error, BudgetInputError)
        else {"tensor": "", "found": "", "required": "", "message": _one_line(error)}
    )
    d: dict = dict.fromkeys(JSON_KEYS)
    d.update(verdict="error", verdict_line=f"error: {entry['message']}", errors=[entry], seconds=seconds)
    return d


def _one_line(e: BaseException | str) -> str:
    return " ".join(str(e).split())


def _fail(error: BudgetInputError | Exception | str, as_json: bool, t0: float | None = None) -> None:
    """One ``error: ...`` line on stderr (and the error object on stdout with --json), exit 2."""
    if as_json:
        click.echo(json.dumps(error_json(error, None if t0 is None else time.perf_counter() - t0), indent=1))
    click.echo(f"error: {_one_line(error)}", err=True)
    sys.exit(EXIT_SEMANTIC)


def _verdict(audit: AuditResult, plan: Plan | None) -> str:
    if not audit.ok:
        return f"semantic error: {len(audit.errors)} failure(s) in {audit.pack}; first: {audit.errors[0].message}"
    assert plan is not None
    c = plan.card
    if plan.refused:
        return f"does not fit: {plan.refused}"
    if not plan.fits:
        short = plan.reserve_bytes + plan.draft_bind_bytes - plan.free_bytes
        first = next((s for s in plan.suggestions if s.fits_alone), None)  # safest first (plan.suggestions)
        where = (
            f"the smallest card preset the same plan fits is {plan.smallest_card}"
            if plan.smallest_card not in (None, "none")
            else "the same plan fits none of the card presets (up to 80G)"
            if plan.smallest_card == "none"
            else ""
        )
        change = (
            f"e.g. {s_text(first)}"
            if first
            else "no single change fits on its own: combine the suggestions"
            if plan.suggestions
            else ""
        )
        hint = "".join(f"; {x}" for x in (change, where) if x)
        return (
            f"does not fit: {c.name}: the terms leave {_mib(plan.free_bytes)} MiB, "
            f"{_mib(short)} MiB short of the {plan.options.vram_reserve_mib} MiB reserve{hint}"
        )
    slots = (
        f"{plan.slots} expert slot{'' if plan.slots == 1 else 's'} ({_mib(plan.expert_cache_bytes)} MiB"
        + (f", expected hit rate {plan.profile.expected_hit_rate:.1%} in-sample" if plan.profile else "")
        + ")"
        + (
            f", {'the other' if plan.slots else 'every'} expert{'s' if plan.slots else ''} in a "
            f"{_mib(plan.host_tier_bytes)} MiB host tier (pinned host memory)"
            if plan.host_tier_bytes
            else ""
        )
        if plan.max_blob
        else "no routed experts"
    )
    return (
        f"fits: {c.name}: {_mib(plan.used_bytes)} MiB planned, {slots}, "
        f"{_mib(plan.left_bytes - plan.reserve_bytes)} MiB left for use after the "
        f"{plan.options.vram_reserve_mib} MiB reserve"
    )


def s_text(s) -> str:
    return f"{s.option} {s.value}".strip() + f" ({s.text})"


def to_json(audit: AuditResult, plan: Plan | None, verdict: str, seconds: float) -> dict:
    """The --json object: every key of :data:`JSON_KEYS` (null where it does not apply)."""
    d: dict = dict.fromkeys(JSON_KEYS)
    d |= {
        "verdict": "semantic error" if not audit.ok else ("fits" if plan and plan.fits else "does not fit"),
        "verdict_line": verdict,
        "card_total_bytes": plan.card.total_bytes if plan else None,
        "terms": [{"name": t.name, "bytes": t.bytes, "detail": t.detail} for t in plan.terms] if plan else None,
        "free_bytes": plan.free_bytes if plan else None,
        "reserve_bytes": plan.reserve_bytes if plan else None,
        "max_blob": plan.max_blob if plan else None,
        "slots": plan.slots if plan else None,
        "kv_bytes_per_token": plan.kv_bytes_per_token if plan else None,
        "recurrent_state_bytes_per_seq": plan.recurrent_state_bytes_per_seq if plan else None,
        "widened_scale_bytes": plan.widened_scale_bytes if plan else None,
        "bf16_saved_bytes": plan.bf16_saved_bytes if plan else None,
        "errors": [e.model_dump() for e in audit.errors],
        "audit_warnings": [e.model_dump() for e in audit.warnings],
    }
    if plan:
        d.update(
            {
                "card": plan.card.model_dump(),
                "n_ctx": plan.n_ctx,
                "used_bytes": plan.used_bytes,
                "left_bytes": plan.left_bytes,
                "max_blob_source": plan.max_blob_source,
                "slots_fit": plan.slots_fit,
                "slots_cap": plan.slots_cap,
                "expert_cache_bytes": plan.expert_cache_bytes,
                "host_tier_bytes": plan.host_tier_bytes,
                "refused": plan.refused,
                "kv_bytes_per_token_window_layers": plan.kv_bytes_per_token_window_layers,
                "dense_types": [r.model_dump() for r in plan.types],
                "profile": plan.profile.model_dump() if plan.profile else None,
                "warnings": plan.warnings,
                "suggestions": [s.model_dump() for s in plan.suggestions],
                "smallest_card": plan.smallest_card,
                "host_ram_bytes": plan.host_ram_bytes,
                "host_terms": [{"name": t.name, "bytes": t.bytes, "detail": t.detail} for t in plan.host_terms],
                "decode_prediction": plan.decode.model_dump() if plan.decode else None,
                "options": plan.options.model_dump(exclude={"profile_pairs"}),
            }
        )
    d["audit"] = {
        "pack": audit.pack,
        "arch": audit.arch,
        "dense_tensors": audit.dense_tensors,
        "expert_layers": audit.expert_layers,
        "checks": len(audit.checks),
        "checks_failed": sum(1 for c in audit.checks if not c.ok),
        "bf16_tensors": audit.bf16_tensors,
        "bf16_values_scanned": audit.bf16_values_scanned,
        "planned_from": audit.planned_from,
        "seconds": audit.seconds,
    }
    d["seconds"] = seconds
    assert tuple(d) == JSON_KEYS, "every --json key is listed in JSON_KEYS, in order"
    return d


def group_warnings(warnings: list[AuditError]) -> list[tuple[str, list[AuditError]]]:
    """Identical warnings about different tensors, grouped: ``(text without the tensor, [warnings])``
    in first-seen order (the table prints one line per group, --json every warning)."""
    groups: dict[str, list[AuditError]] = {}
    for w in warnings:
        text = w.message
        if w.tensor:
            text = text.removeprefix(f"tensor {w.tensor}: ").replace(w.tensor, "the tensor")
        groups.setdefault(text, []).append(w)
    return list(groups.items())


def warning_lines(warnings: list[AuditError], shown: int = WARNING_NAMES_SHOWN) -> list[str]:
    """One line per group of :func:`group_warnings`: a lone warning as it is, a group as
    ``N tensors: TEXT: a, b, c and K more (all in --json)``."""
    out = []
    for text, ws in group_warnings(warnings):
        if len(ws) == 1:
            out.append(ws[0].message)
            continue
        more = f" and {len(ws) - shown} more (all in --json)" if len(ws) > shown else ""
        out.append(f"{len(ws)} tensors: {text}: {', '.join(w.tensor for w in ws[:shown])}{more}")
    return out


def _print(audit: AuditResult, plan: Plan | None, verdict: str, seconds: float) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own exits 1, which is "does not fit" here: the closed pipe goes on to the exit
            # contract instead (strata.packer.exits.exit_contract: 141, silently)
            raise BrokenPipeError(errno.EPIPE, "stdout was closed")

    con = _Console(width=None if sys.stdout.isatty() else 160)
    if audit.errors:
        t = Table(title=f"semantic audit of {audit.pack}: {len(audit.errors)} failure(s)", show_lines=False)
        for c in ("tensor", "found", "required", "message"):
            t.add_column(c, overflow="fold")
        for e in audit.errors:
            t.add_row(escape(e.tensor), escape(e.found), escape(e.required), escape(e.message))
        con.print(t)
    else:
        con.print(
            f"audit: {audit.dense_tensors} dense tensors, {audit.expert_layers} expert layers, "
            f"{len(audit.checks)} budget terms derived twice and equal, {audit.bf16_tensors} BF16 tensors "
            f"({audit.bf16_values_scanned} values scanned{'' if audit.bf16_scan else ', scan skipped'}): ok"
        )
    if audit.planned_from == "gguf header":
        con.print(
            f"planned from the GGUF header of {escape(audit.pack)}: the tables strata-pack build would write, no pack "
            "written (the BF16 value scan runs on a built pack)"
        )
    for line in warning_lines(audit.warnings):
        con.print(f"[yellow]audit warning:[/yellow] {escape(line)}")
    if plan is not None:
        t = Table(
            title=f"VRAM plan: {plan.card.name}, context {plan.n_ctx}, {plan.options.kv} KV, batch {plan.options.batch}"
        )
        t.add_column("term")
        t.add_column("bytes", justify="right")
        t.add_column("MiB", justify="right")
        t.add_column("detail", overflow="fold")
        for term in plan.terms:
            t.add_row(term.name, f"{term.bytes:,}", _mib(term.bytes), escape(short_source(term.detail, 90)))
        t.add_row("= planned", f"{plan.used_bytes:,}", _mib(plan.used_bytes), "")
        t.add_row("reserve (kept free)", f"{plan.reserve_bytes:,}", _mib(plan.reserve_bytes), "--vram-reserve-mib")
        t.add_row(
            "card total",
            f"{plan.card.total_bytes:,}",
            _mib(plan.card.total_bytes),
            escape(short_source(plan.card.source, 90)),
        )
        con.print(t)
        d = Table(title="dense weights by type (bytes): pack form -> engine form")
        for c in ("type", "tensors", "pack", "engine", "payload", "f32 scales", "widened +", "bf16 saved"):
            d.add_column(c, justify="left" if c == "type" else "right")
        for r in plan.types:
            d.add_row(
                r.type,
                str(r.tensors),
                f"{r.pack_bytes:,}",
                f"{r.engine_bytes:,}",
                f"{r.payload_bytes:,}",
                f"{r.scales_f32_bytes:,}",
                f"{r.widened_extra_bytes:,}",
                f"{r.bf16_saved_bytes:,}",
            )
        con.print(d)
        con.print(
            f"KV per token (one sequence): {plan.kv_bytes_per_token:,} B on full-context layers, "
            f"{plan.kv_bytes_per_token_window_layers:,} B on sliding-window layers; recurrent state "
            f"{plan.recurrent_state_bytes_per_seq:,} B per sequence; free when the expert cache opens "
            f"{plan.free_bytes:,} B; max_blob {plan.max_blob:,} B engine form ({plan.max_blob_source:,} B source)"
        )
        if plan.host_terms:
            con.print(
                f"host memory: {_mib(plan.host_ram_bytes)} MiB = "
                + " + ".join(f"{t.name} {_mib(t.bytes)} MiB" for t in plan.host_terms)
            )
        if plan.profile:
            p = plan.profile
            con.print(
                f"profile fill (ranked by count, per-layer ranges, a full layer skips only its own pairs): "
                f"{p.filled} of {p.pairs} pairs in {p.slots} slots, expected hit rate {p.expected_hit_rate:.2%} "
                f"(in-sample: the profile's own prompts; bench/bench_routing.py checks it on held-out ones)"
            )
        if plan.decode:
            con.print(escape(plan.decode.text()))
        for w in plan.warnings:
            con.print(f"[yellow]warning:[/yellow] {escape(w)}")
        if plan.suggestions:
            s = Table(title="to fit, shrink one of")
            for c in ("option", "value", "saves MiB", "fits alone", "why"):
                s.add_column(c)
            for x in plan.suggestions:
                s.add_row(x.option, x.value, _mib(x.saves_bytes), "yes" if x.fits_alone else "no", escape(x.text))
            con.print(s)
    style = "green" if audit.ok and plan is not None and plan.fits else "red"
    con.print(f"[{style}]{escape(verdict)}[/{style}]  ({seconds:.2f} s)")


if __name__ == "__main__":
    main()
