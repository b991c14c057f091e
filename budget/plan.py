"""The VRAM plan: what a card holds when the engine has started, term by term, and how many expert
slots are left - a model of what the engine allocates, built only from :mod:`strata.layout` and :mod:`.formulas`.

Terms, in the engine's start-up order (docs/DESIGN.md "Start-up order"): CUDA context; the CUDA runtime's first-use
memory (kernel modules: a measured constant, cards.toml); memory already in use (``--card measure`` only); dense
weights in engine form; the output head (before the cache: docs/DESIGN.md "The head before the cache"); token
embeddings (unless kept on the host or tied to the head); KV cache (attention layers only, sliding-window layers capped
at their window); recurrent state (per sequence x batch); engine buffers (the f32 vectors strata's engine preallocates:
GEMV outputs, f32 copies of non-F32 vectors, rope tables, the embedding row, the expert hit path); prefill / activation
buffers; then the expert cache gets ``floor((free - reserve) / max_blob)`` slots (docs/DESIGN.md "Slots after the
weights and the session"), or the ``--expert-cache N`` asked, which is refused with both numbers when it does not fit.
The reserve is never allocated.
"""

from __future__ import annotations

from collections.abc import Callable

from strata.layout import engine_form as LE
from strata.layout import experts as LX
from strata.layout import kv as LK

from . import cache_policy as CP
from . import engine_terms as ET
from . import formulas as F
from .cards import Card, check_mib
from .errors import PlanInputError
from .formulas import MIB
from .kv_check import kv_type_error
from .options import resolve_ctx
from .plan_model import DenseTensor, ExpertLayerFacts, ModelFacts  # noqa: F401  (the plan's inputs, re-exported)
from .plan_types import (  # noqa: F401  (the plan's types, re-exported: strata.budget.plan.Plan)
    DEFAULT_PREFILL_CHUNK,
    LOW_MIB,
    Plan,
    PlanOptions,
    ProfileReport,
    Suggestion,
    Term,
)
from .profile import check_profile_pairs, layer_span
from .tensor_terms import dense_types, engine_buffer_bytes


def _engine(facts: ModelFacts, name: str | None) -> int:
    for t in facts.dense:
        if t.name == name:
            return LE.engine_form(t.type, t.src_type, t.ne).engine
    return 0


def _terms(facts: ModelFacts, card: Card, o: PlanOptions, n_ctx: int) -> list[Term]:
    strata = o.engine == "strata"
    head = _engine(facts, facts.head)
    on_host = o.embeddings_on_host or strata  # strata's engine looks untied embeddings up in the host pool
    embd = 0 if facts.tied or on_host else _engine(facts, facts.embeddings)
    special = {facts.head, facts.embeddings}
    dense = sum(
        LE.engine_form(t.type, t.src_type, t.ne).engine
        for t in facts.dense
        if t.name not in special and not facts.is_draft(t.name)
    )
    chunk = LK.ENGINE_PREFILL_CHUNK if strata else o.prefill
    kv = LK.kv_cache_bytes(facts.kv_layers, n_ctx, chunk, o.kv, o.batch, o.kv_resident)
    rec = LK.recurrent_state_bytes(facts.recurrent_layers, o.batch)
    if strata:
        act, act_detail, _exact = ET.activation_term(facts, n_ctx)
    elif o.prefill_model == "cpp":
        act = F.cpp_prefill_bytes(o.prefill)
        # formulas.cpp_prefill_bytes: the reference C++ engine (generate.cpp:2941-2960;
        # docs/DESIGN.md "The automatic slot count")
        act_detail = (
            f"prompt buffers of the reference C++ engine (measured): 160 MiB + {o.prefill} tokens x 680 KiB"
            if o.prefill > 0
            else "prompt buffers of the reference C++ engine: none without a prompt chunk"
        )
    else:
        act = F.activation_bytes(o.prefill, facts.act_per_token, facts.logits_per_token, o.logits_all, o.batch)
        rows = max(o.prefill, o.batch, 1)
        act_detail = (
            f"{rows} rows x {facts.act_per_token} f32 activations + "
            f"{rows if o.logits_all else o.batch} x {facts.logits_per_token} f32 logits"
        )
    n_full = sum(1 for L in facts.kv_layers if L.window is None)
    n_win = len(facts.kv_layers) - n_full
    rt, rt_detail = (
        ET.runtime_term(facts, card, n_ctx, o.kv, cublas=o.ubatch > 1 and o.cublas)
        if strata
        else (card.cuda_runtime_bytes, card.cuda_runtime_source)
    )
    terms = [
        Term(name="CUDA context", bytes=card.cuda_context_bytes, detail=card.cuda_context_source),
        Term(name="CUDA runtime", bytes=rt, detail=rt_detail),
    ]
    if card.in_use_bytes is not None:
        terms.append(Term(name="in use before start", bytes=card.in_use_bytes, detail="measured"))
    terms += [
        Term(
            name="dense weights", bytes=dense, detail=f"engine form, {len(facts.dense) - len(special - {None})} tensors"
        ),
        Term(
            name="output head",
            bytes=head,
            detail=(f"{facts.head} (tied to the embeddings)" if facts.tied else str(facts.head)),
        ),
        Term(
            name="token embeddings",
            bytes=embd,
            detail=(
                "shared with the output head"
                if facts.tied
                else "kept on the host"
                if on_host
                else str(facts.embeddings)
            ),
        ),
        Term(
            name="KV cache",
            bytes=kv,
            detail=(
                f"{o.kv}, {n_full} full-context + {n_win} sliding-window layers, "
                f"{n_ctx} tokens x {o.batch} seq" + (f", {o.kv_resident} resident" if o.kv_resident else "")
            ),
        ),
        Term(name="recurrent state", bytes=rec, detail=f"{len(facts.recurrent_layers)} layers, f32, x {o.batch} seq"),
        Term(
            name="engine buffers",
            bytes=engine_buffer_bytes(facts, n_ctx),
            detail=f"f32 GEMV outputs, non-F32 vectors as f32, {facts.rope_tables} rope table(s) of {n_ctx} x "
            f"{facts.rope_dim}, embedding row, expert hit path",
        ),
    ]
    if facts.draft_layers:
        terms.append(
            Term(
                name="draft head",
                bytes=ET.draft_weights_bytes(facts),
                detail=f"NextN blocks {_span(facts.draft_layers)}: weights in engine form (the drafter)",
            )
        )
    terms.append(Term(name="prefill/activations", bytes=act, detail=act_detail))
    if strata:
        nb, detail = ET.chunk_term(facts, o.ubatch, n_ctx)
        terms.append(Term(name="prompt chunk", bytes=nb, detail=detail))
    return terms


_span = layer_span  # one definition: strata.budget.profile


def make_plan(facts: ModelFacts, card: Card, options: PlanOptions, *, suggest: bool = True) -> Plan:
    """Plan ``facts`` on ``card`` with ``options``.

    ``--expert-cache N`` is refused (``refused`` set, ``fits`` False) whenever N is more than the
    automatic value could ever be: more than fits in memory after the reserve, or more than the
    (layer, expert) pairs that can fill a slot (the profile's pairs when a profile is given, else
    every pair of the model) - the same cap the automatic value takes, so the refusal's "at most M
    slots" is the automatic value. A silently capped cache would make later numbers incomparable.

    Raises:
        PlanInputError: a non-positive batch or context, a negative reserve / chunk / cache, a
            reserve above 16 TiB, a KV cache type whose blocks do not divide the model's K/V rows,
            ``--expert-cache N`` or a profile for a model without routed experts, or a profile row
            naming a layer without experts or an expert id out of range.
    """
    o = options
    for name, v, lo in (
        ("--batch", o.batch, 1),
        ("--prefill", o.prefill, 0),
        ("--vram-reserve-mib", o.vram_reserve_mib, 0),
        ("--ctx", o.n_ctx, 1),
        ("--kv-resident", o.kv_resident, 1),
        ("--expert-cache", o.expert_cache, 0),
    ):
        if v is not None and v < lo:
            raise PlanInputError(
                f"{name} {v}: must be at least {lo}", tensor=name, found=str(v), required=f"at least {lo}"
            )
    check_mib("--vram-reserve-mib", o.vram_reserve_mib, error=PlanInputError)
    if (e := kv_type_error(facts, o.kv)) is not None:
        raise e
    if o.engine == "strata":  # what strata's engine does not do is refused by name, never planned
        for bad, why in (
            (o.batch != 1, f"--batch {o.batch}: strata's engine decodes one sequence"),
            (
                o.kv_resident is not None,
                f"--kv-resident {o.kv_resident}: strata's engine keeps every KV position in VRAM (it streams none "
                "from the host)",
            ),
            (
                o.kv not in LK.ENGINE_KV_TYPES,
                f"--kv {o.kv}: strata's engine stores K/V as {' or '.join(LK.ENGINE_KV_TYPES)}",
            ),
        ):
            if bad:
                raise PlanInputError(
                    why + " (plan the reference C++ engine with --engine cpp)",
                    tensor="--engine",
                    found="strata",
                    required="--batch 1, --kv f16 or f32, no --kv-resident",
                )
    src = o.profile_path or "expert profile"
    if o.profile_pairs is not None:
        if not facts.expert_layers:
            raise PlanInputError(
                f"--expert-profile {src}: this {facts.arch} model has no routed experts, so there is no expert cache "
                f"for its {len(o.profile_pairs)} (layer, expert) pairs to fill; drop --expert-profile",
                tensor=src,
                found=f"a profile of {len(o.profile_pairs)} pairs",
                required="a model with routed experts",
            )
        _check_profile(facts, o.profile_pairs, src)
    if o.expert_cache and not facts.expert_layers:
        raise PlanInputError(
            f"--expert-cache {o.expert_cache}: this {facts.arch} model has no routed experts",
            tensor="--expert-cache",
            found=str(o.expert_cache),
            required="0 (no routed experts)",
        )
    n_ctx = resolve_ctx(o.n_ctx, facts.n_ctx_train)
    if o.kv_resident is not None and o.kv_resident > n_ctx:
        raise PlanInputError(
            f"--kv-resident {o.kv_resident}: more positions than the context ({n_ctx}); at most {n_ctx}",
            tensor="--kv-resident",
            found=str(o.kv_resident),
            required=f"at most {n_ctx}",
        )
    terms = _terms(facts, card, o, n_ctx)
    before = sum(t.bytes for t in terms)
    free = card.total_bytes - before
    reserve = o.vram_reserve_mib * MIB
    bind = ET.draft_bind(facts, n_ctx, o.kv)  # reserved beside the reserve, allocated after the cache
    blob = facts.max_slot_bytes
    profile = None
    cap, cap_what = None, ""
    if facts.expert_layers:
        cap, cap_what = facts.expert_pairs, f"the model's {facts.expert_pairs} (layer, expert) pairs"
        # strata's engine: a profile orders the fill and never makes the cache smaller than what fits (the slots
        # past its pairs are filled by admission at decode time); the C++ engine caps the cache at the profile's
        # pairs (generate.cpp:2941-2960)
        if o.profile_pairs is not None and o.engine != "strata":
            cap, cap_what = len(o.profile_pairs), f"the profile's {len(o.profile_pairs)} (layer, expert) pairs"
    # strata's engine on the fused path with a host tier: the tier's device mapping is reserved beside the reserve
    tier_on = o.engine == "strata" and o.miss_tier != "cpu" and bool(facts.expert_layers)
    tier_on = tier_on and ET.decode_path(facts) == "fused"
    tier_size, map_bytes, scratch = None, 0, CP.learns(o.cache_policy, o.profile_pairs is not None)  # swap scratch
    if tier_on:  # None: the mapping does not fit above the reserve - no tier, misses on the CPU (the engine's rule)
        tier_size, _reserved, map_bytes = F.size_with_host_tier(
            free, reserve + bind, blob, cap, o.expert_cache, facts.expert_pairs, cap_what=cap_what, scratch=scratch
        )
        tier_on = tier_size is not None
        map_bytes = map_bytes if tier_on else 0
    size = tier_size or F.size_expert_cache(free, reserve + bind, blob, cap, o.expert_cache, cap_what=cap_what)
    slots_fit, refused = size.slots_fit, size.refused
    slots = size.slots if refused is None else o.expert_cache
    if o.engine == "strata" and (why := CP.option_refusal(o.cache_policy, o.miss_tier)):  # as the engine's options
        raise PlanInputError(why, tensor="--cache-policy", found=o.cache_policy, required="fill")
    why = CP.class_refusal(tier_on, slots, facts.expert_pairs, f"--miss-tier {o.miss_tier}" if o.miss_tier == "cpu"
                           else "the host tier's mapping does not fit, or the decode path has none")  # fmt: skip
    if o.engine == "strata" and o.cache_policy == "class" and refused is None and why is not None:  # as the engine
        raise PlanInputError(f"--cache-policy class {why}", tensor="--cache-policy", found="class", required="fill")
    warnings: list[str] = []
    if o.engine == "strata" and o.cache_policy == "class" and facts.expert_layers and slots >= facts.expert_pairs:
        warnings.append(f"--cache-policy class: nothing to learn ({slots} slots hold all {facts.expert_pairs} pairs)")
    if o.profile_pairs is not None:
        fill = F.fill_profile(o.profile_pairs, LX.expert_capacity(facts.expert_pairs, slots, scratch and tier_on))
        profile = ProfileReport(
            pairs=fill.pairs,
            slots=slots,
            filled=fill.used,
            expected_hit_rate=fill.hit_rate,
            layers=[
                dict(layer=L.layer, range=L.range, filled=L.filled, hit_count=L.hit_count, total_count=L.total_count)
                for L in fill.layers
            ],
        )
    cache = slots * blob
    detail = f"{slots} slots x {blob} B (largest expert, engine form)" if facts.expert_layers else "no routed experts"
    terms.append(Term(name="expert cache", bytes=cache, detail=detail))
    if tier_on:
        terms.append(
            Term(
                name="host tier mapping",
                bytes=map_bytes,
                detail=(
                    "the driver's page tables of the host tier (pinned host memory of the experts the cache does not "
                    "hold, read over PCIe): 8 B per 4 KiB page, 2 MiB units (strata.layout.experts; measured)"
                    if map_bytes
                    else "no host tier: every expert has a slot"
                ),
            )
        )
    if facts.draft_layers:
        terms.append(
            Term(
                name="draft head bind",
                bytes=bind,
                detail=(
                    "the draft head's GEMV outputs, f32 vectors, K/V cache and eh_proj row: reserved when the cache is "
                    "sized (the C++ engine's reserve + draft-head bind bytes), allocated after it"
                ),
            )
        )
    used = before + cache + bind + map_bytes
    fits = free - reserve - bind >= 0 and refused is None
    if o.n_ctx is None:
        warnings.append(f"--ctx not given: budgeted at the model's maximum context, {facts.n_ctx_train} tokens")
    elif n_ctx > facts.n_ctx_train:
        warnings.append(f"--ctx {n_ctx} is beyond the model's trained context {facts.n_ctx_train}")
    if o.vram_reserve_mib < LOW_MIB:
        # 30 MiB left -> the driver paged, a request stalled; the C++ engine's serve check calls under
        # 256 MiB free LOW (docs/DESIGN.md "The head before the cache" and "The reserve and the prompt
        # buffers")
        warnings.append(
            f"--vram-reserve-mib {o.vram_reserve_mib} is under {LOW_MIB} MiB, where a serving engine's "
            f"memory check reports LOW: allocations the plan does not see (driver, other processes, "
            f"fragmentation) can make the driver page and requests stall"
        )
    if o.engine == "strata":  # the C++ engine's options: said, not silently dropped
        unused = [
            name
            for name, given in (
                (f"--prefill {o.prefill}", o.prefill != DEFAULT_PREFILL_CHUNK),
                (f"--prefill-model {o.prefill_model}", o.prefill_model != "geometry"),
                ("--logits-all", o.logits_all),
                ("--embeddings-on-host", o.embeddings_on_host),
            )
            if given
        ]
        if unused:
            warnings.append(
                f"{', '.join(unused)}: the reference C++ engine's option(s), not used for strata's engine (the prompt "
                f"through the decode path one position per step, untied embeddings on the host); plan the C++ engine "
                f"with --engine cpp"
            )
    full = [L for L in facts.kv_layers if L.window is None]
    types = dense_types(facts)
    plan = Plan(
        card=card,
        options=o,
        n_ctx=n_ctx,
        terms=terms,
        free_bytes=free,
        reserve_bytes=reserve,
        max_blob=blob,
        draft_bind_bytes=bind,
        decode_path=ET.decode_path(facts) if o.engine == "strata" else "",
        max_blob_source=facts.max_blob_source,
        slots=slots,
        slots_fit=slots_fit,
        slots_cap=cap,
        expert_cache_bytes=cache,
        host_tier_bytes=LX.host_tier_bytes(LX.host_tier_pairs(facts.expert_pairs, slots, scratch), blob)
        if tier_on
        else 0,
        used_bytes=used,
        left_bytes=card.total_bytes - used,
        fits=fits,
        refused=refused,
        kv_bytes_per_token=sum(LK.kv_bytes_per_token(L, o.kv) for L in full),
        kv_bytes_per_token_window_layers=sum(
            LK.kv_bytes_per_token(L, o.kv) for L in facts.kv_layers if L.window is not None
        ),
        recurrent_state_bytes_per_seq=LK.recurrent_state_bytes_per_seq(facts.recurrent_layers),
        widened_scale_bytes=sum(r.widened_extra_bytes for r in types),
        bf16_saved_bytes=sum(r.bf16_saved_bytes for r in types),
        types=types,
        profile=profile,
        warnings=warnings,
    )
    plan.host_terms = host_terms(facts, plan.host_tier_bytes)
    plan.host_ram_bytes = sum(t.bytes for t in plan.host_terms)
    if suggest and not fits:
        plan.suggestions = suggestions(facts, card, o, plan)
        plan.smallest_card = smallest_card(facts, o, card.total_bytes)
    return plan


def host_terms(facts: ModelFacts, tier_bytes: int) -> list[Term]:
    """Host memory of a run (bytes): the dense pool (pack form: :func:`strata.packer.quants.tensor_nbytes` of every
    dense tensor's pool type; read once at start-up, then page cache), the routed experts in the shards (source form,
    every pair; page cache - what a miss on the CPU reads, so evicting it makes misses read the disk) and the host
    tier (pinned, ``tier_bytes``: :func:`strata.layout.experts.host_tier_bytes`)."""
    from strata.packer import quants

    pool = sum(quants.tensor_nbytes(t.type, t.ne) for t in facts.dense)
    shards = sum(L.blob_bytes for L in facts.expert_layers) * facts.n_expert
    out = [Term(name="dense pool (page cache)", bytes=pool, detail="pool.bin, read at start-up; reclaimable")]
    if facts.expert_layers:
        out.append(
            Term(
                name="routed experts (page cache)",
                bytes=shards,
                detail="the experts in the GGUF shards (source form): what a CPU miss reads; reclaimable",
            )
        )
        out.append(
            Term(
                name="host tier (pinned)",
                bytes=tier_bytes,
                detail="the experts without a slot in engine form, read by the GPU over PCIe; locked, not reclaimable"
                if tier_bytes
                else "none (every expert has a slot, or --miss-tier cpu)",
            )
        )
    return out


def smallest_card(facts: ModelFacts, o: PlanOptions, above_bytes: int) -> str:
    """The smallest card preset of budget/cards.toml larger than ``above_bytes`` (bytes) on which the plan with the
    same options fits (its name as the card table gives it), or ``"none"``."""
    from .cards import card_preset, known_cards

    for c in sorted((card_preset(n) for n in known_cards()), key=lambda c: c.total_bytes):
        if c.total_bytes > above_bytes and make_plan(facts, c, o, suggest=False).fits:
            return c.name
    return "none"


def _check_profile(facts: ModelFacts, pairs: list[tuple[int, int, int]], src: str = "expert profile") -> None:
    """:func:`strata.budget.profile.check_profile_pairs` against the pack's MoE layers and expert count."""
    check_profile_pairs(pairs, {L.layer for L in facts.expert_layers}, facts.n_expert, src)


# ----------------------------------------------------------------------------- shrinking


def _margin(facts: ModelFacts, card: Card, o: PlanOptions) -> int:
    """Bytes left after the terms, the reserve and an asked expert cache (>= 0: fits)."""
    p = make_plan(facts, card, o, suggest=False)
    need = p.expert_cache_bytes if o.expert_cache is not None else 0
    return p.free_bytes - p.reserve_bytes - p.draft_bind_bytes - need


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Largest v in [lo, hi] with ok(v), for ok monotone (true then false); None if ok(lo) is false."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def suggestions(facts: ModelFacts, card: Card, o: PlanOptions, plan: Plan) -> list[Suggestion]:
    """Which terms to shrink, and by how much, for a plan that does not fit, safest first.

    Every knob is treated alike: it is listed when moving it as far as it goes saves memory; with the least
    change that fits on its own (found with the plan itself, so it is exact) when one exists, else at its
    limit with what it saves there (``fits_alone`` False). Order: an asked ``--expert-cache`` (the refused
    number itself), ``--ctx``, ``--kv``, ``--batch``, ``--prefill``, ``-ub`` (strata's engine: prompts one position at
    a time), ``--embeddings-on-host``,
    ``--kv-resident`` (streams KV from the host), and the reserve last, never below :data:`LOW_MIB` (a
    shrunk reserve is what stalled requests:
    docs/DESIGN.md "The head before the cache" and "The reserve and the prompt buffers").
    An ``--expert-cache N`` above the pairs that can fill it is fixed by N alone, so it is then the only
    suggestion."""
    out: list[Suggestion] = []
    if o.expert_cache is not None and plan.refused:
        out.append(
            Suggestion(
                option="--expert-cache",
                value=str(plan.slots_fit),
                saves_bytes=(o.expert_cache - plan.slots_fit) * plan.max_blob,
                fits_alone=plan.free_bytes >= plan.reserve_bytes,
                text=f"at most {plan.slots_fit} slots fit (the automatic value): ask for that many or "
                f"leave it automatic",
            )
        )
        if plan.slots_cap is not None and o.expert_cache > plan.slots_cap:
            return out
    base = _margin(facts, card, o)

    def with_(**kw) -> PlanOptions:
        return o.model_copy(update=kw)

    def knob(
        option: str,
        limit,
        to: Callable[[object], PlanOptions],
        search: Callable[[], object] | None,
        fit_text: Callable[[object], str],
        limit_text: str,
    ) -> None:
        """``limit``: the knob moved as far as it goes; ``search()``: the least change that fits (or None)."""
        m = _margin(facts, card, to(limit))
        if m <= base:
            return  # saves nothing
        if m < 0:
            out.append(
                Suggestion(option=option, value=str(limit), saves_bytes=m - base, fits_alone=False, text=limit_text)
            )
            return
        value = search() if search is not None else None
        value = limit if value is None else value
        mv = _margin(facts, card, to(value))
        out.append(
            Suggestion(option=option, value=str(value), saves_bytes=mv - base, fits_alone=mv >= 0, text=fit_text(value))
        )

    if plan.n_ctx > 1:
        knob(
            "--ctx",
            1,
            lambda c: with_(n_ctx=c),
            lambda: _largest(1, plan.n_ctx - 1, lambda c: _margin(facts, card, with_(n_ctx=c)) >= 0),
            lambda c: (
                f"the largest context that fits is {c} tokens"
                + (
                    f", above the model's trained context of {facts.n_ctx_train} tokens (it was not trained for "
                    f"more; --ctx {facts.n_ctx_train} fits too)"
                    if c > facts.n_ctx_train
                    else ""
                )
            ),
            "not enough on its own, even at a 1-token context",
        )
    smaller_kv = {"f32": "f16", "f16": "int8" if o.engine != "strata" else None}.get(o.kv)
    if facts.kv_layers and smaller_kv and kv_type_error(facts, smaller_kv) is None:
        why = (
            "f16 KV cache: 2 B per value instead of 4"
            if smaller_kv == "f16"
            else "int8 (Q8_0) KV cache: 34 B per 32 values instead of 64 (llama.cpp's q8_0 cache; strata's own engine "
            "stores f16 or f32)"
        )
        knob("--kv", smaller_kv, lambda k: with_(kv=k), None, lambda _k: why, why + ": not enough on its own")
    if o.batch > 1:
        knob(
            "--batch",
            1,
            lambda b: with_(batch=b),
            lambda: _largest(1, o.batch - 1, lambda b: _margin(facts, card, with_(batch=b)) >= 0),
            lambda b: f"the largest batch that fits is {b}",
            "not enough on its own, even at batch 1",
        )
    if o.prefill > 0:
        knob(
            "--prefill",
            0,
            lambda c: with_(prefill=c),
            lambda: _largest(0, o.prefill - 1, lambda c: _margin(facts, card, with_(prefill=c)) >= 0),
            lambda c: (
                f"the largest prompt chunk that fits is {c} tokens" + (" (0: one token at a time)" if c == 0 else "")
            ),
            "not enough on its own, even at 0 (one prompt token at a time)",
        )
    if o.engine == "strata" and o.ubatch > 1:  # the GPU chunk path: its tile, staging slots and cuBLAS
        knob(
            "-ub",
            1,
            lambda u: with_(ubatch=u),
            None,
            lambda _u: "prompts one position at a time: no chunk tile, staging slots nor cuBLAS (slower prompts)",
            "prompts one position at a time (no chunk tile, staging slots nor cuBLAS): not enough on its own",
        )
    if not o.embeddings_on_host and not facts.tied and facts.embeddings:
        knob(
            "--embeddings-on-host",
            "",
            lambda _v: with_(embeddings_on_host=True),
            None,
            lambda _v: "look token embeddings up on the host",
            "look token embeddings up on the host: not enough on its own",
        )
    if any(L.window is None for L in facts.kv_layers) and o.engine != "strata":  # strata streams no KV
        top = min(o.kv_resident or plan.n_ctx, plan.n_ctx)
        if top > 1:
            knob(
                "--kv-resident",
                1,
                lambda r: with_(kv_resident=r),
                lambda: _largest(1, top - 1, lambda r: _margin(facts, card, with_(kv_resident=r)) >= 0),
                lambda r: (
                    f"keep {r} tokens of KV per full-context layer in VRAM and stream older ones from the host (slower)"
                ),
                "not enough on its own, even with 1 resident token",
            )
    if o.vram_reserve_mib > LOW_MIB:

        def reserve_search():
            new = o.vram_reserve_mib - (-base + MIB - 1) // MIB
            return new if new >= LOW_MIB else None

        knob(
            "--vram-reserve-mib",
            LOW_MIB,
            lambda r: with_(vram_reserve_mib=r),
            reserve_search,
            lambda r: (
                f"the last resort: a {r} MiB reserve fits, but the reserve is the room for allocations the plan "
                f"does not see (driver, other processes); never below {LOW_MIB} MiB"
            ),
            f"not enough on its own, even at {LOW_MIB} MiB: a smaller reserve is never suggested (under {LOW_MIB} MiB "
            f"free a serving engine reports memory LOW and the driver may page)",
        )
    return out
