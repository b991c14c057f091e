"""``strata-engine``: load a pack by byte offset and generate text; measure its memory; record its
expert routing as an expert profile (thin click layer over :mod:`strata.engine.startup`, :mod:`strata.engine.generate`,
:mod:`strata.engine.measure` and :mod:`strata.engine.routing`).

Exit codes (one contract for the three tools, :mod:`strata.packer.exits`): 0 success, 1 ``measure``
found a term that differs from the budget's prediction, 2 the pack or the request was refused (the
message names the file, tensor or numbers), 128 + N a signal (130 SIGINT, 143 SIGTERM; ``generate``
keeps the tokens it streamed), 141 stdout closed.
"""

from __future__ import annotations

import codecs
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import click

from strata.budget.options import (
    card_options,
    ctx_option,
    expert_cache_option,
    expert_profile_option,
    kv_option,
    parse_expert_cache,
    reserve_option,
)
from strata.layout.kv import ENGINE_KV_TYPES
from strata.packer.exits import StrataGroup, interrupted

from .chat import chat_prompt
from .clikit import REFUSALS, check_pack_dir, fail, print_checkpoint, warn
from .generate import GenerationResult, StepStat, generate
from .numerics import DEFAULT_NUMERICS, NUMERICS_MODES
from .sampling import Sampler
from .startup import Engine, EngineOptions, load_engine


def not_utf8(opt: str, text: str | None) -> str | None:
    """The refusal for an option's text that is not valid UTF-8 (on POSIX, Python hands undecodable argv bytes over
    as lone surrogates, U+DC80..U+DCFF), naming the first bad byte and its character position; None when it is."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"U+{ch:04X}"
        return f"{opt} is not valid UTF-8 text: {what} at character {e.start}"
    return None


def check_request(
    *, n_tokens: int, n_ctx: int | None, temperature: float, top_k: int, top_p: float, seed: int
) -> str | None:
    """Option checks that need no pack (each refusal names the option), else None."""
    if not math.isfinite(temperature):
        return f"--temperature {temperature}: not a finite number"
    if temperature < 0:
        return f"--temperature {temperature}: must be >= 0 (0 = greedy)"
    if not math.isfinite(top_p):
        return f"--top-p {top_p}: not a finite number"
    if not 0.0 < top_p <= 1.0:
        return f"--top-p {top_p}: outside (0, 1]"
    if top_k < 0:
        return f"--top-k {top_k}: must be >= 0 (0 = all)"
    if seed < 0:
        return f"--seed {seed}: must be a non-negative integer"
    if n_ctx is not None and n_ctx < 1:
        return f"--ctx {n_ctx}: must be >= 1"
    if n_tokens < 1:
        return f"-n/--n-tokens {n_tokens}: must be >= 1"
    if n_ctx is not None and n_tokens > n_ctx:  # the prompt has at least one token: 1 + n - 1 positions
        return (
            f"-n/--n-tokens {n_tokens} needs at least {n_tokens} positions (even a one-token prompt + {n_tokens} "
            f"new tokens - 1), more than --ctx {n_ctx}"
        )
    return None


def emulated_card(card_name: str | None, card_mib: int | None):
    """The card ``--card`` / ``--card-mib`` name for the engine to emulate (None: the local GPU as it is).

    Raises:
        CardError: an unknown preset, a bad size, both options, ``--card measure`` (the local GPU is the default).
    """
    if card_name is None and card_mib is None:
        return None
    from strata.budget.cards import card_from_options

    return card_from_options(card_name, card_mib, allow_measure=False)


def _resident(value: str) -> str:
    if value in ("all", "none", "half"):
        return value
    try:
        f = float(value)
    except ValueError:
        raise click.BadParameter("expected all, none, half or a fraction in [0, 1]") from None
    if not 0.0 <= f <= 1.0:
        raise click.BadParameter(f"fraction {f} is outside [0, 1]")
    return value


@click.group(cls=StrataGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata")
def main() -> None:
    """strata-engine: load a pack by byte offset and generate text (the pack's smoke test).

    \b
    Exit codes (the same for strata-pack and strata-budget):
      0    ok
      1    measure: a budget term differs from what the engine allocated
      2    the pack or the request was refused (one `error:` line naming the file or numbers)
      130  interrupted by SIGINT (Ctrl-C; generate keeps what it printed); 143 by SIGTERM
      141  stdout was closed (`| head`)
    """


STATS_UNITS = (
    "stats: one line per position. Units: 'ms' = milliseconds; forward/sample/cpu-experts/wait are host "
    "wall-clock times, gpu is the device time between CUDA events at the step's start and end (it includes "
    "time the GPU sat idle waiting for the host); 'hits/misses' are COUNTS of routed experts (not ms), per "
    "MoE layer as layer:hits/misses."
)


def _stats_header(engine: Engine) -> None:
    click.echo(STATS_UNITS, err=True)
    cols = "stats: columns: pos phase token_in -> token_out | forward ms | sample ms"
    if engine.probe is not None:
        cols += " | gpu ms | cpu-experts ms | wait ms"
    if engine.experts is not None:
        cols += " | expert hits/misses (counts) total and per layer"
    click.echo(cols, err=True)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def stats_line(s: StepStat, piece: Callable[[int], str] | None = None, gpu: bool = False, experts: bool = False) -> str:
    """One ``--stats`` line; every figure says its unit (ms = milliseconds, counts of experts)."""
    out = "" if s.token_out is None else f" -> {s.token_out}" + (f" {piece(s.token_out)!r}" if piece else "")
    line = (
        f"stats: pos {s.position:4d} {s.phase:6s} {s.token_in}{out} | forward {s.forward_ms:.2f} ms (wall) | "
        f"sample {s.sample_ms:.2f} ms (wall)"
    )
    if gpu:
        line += (
            f" | gpu {_ms(s.gpu_ms)} ms (event span) | cpu-experts {_ms(s.cpu_expert_ms)} ms (wall) | "
            f"wait {_ms(s.wait_ms)} ms (wall)"
        )
    if experts:
        per = " ".join(f"{il}:{h}/{m}" for il, (h, m) in sorted((s.expert_layers or {}).items()))
        line += (
            f" | experts {s.expert_hits} hits / {s.expert_misses} misses (counts); "
            f"per layer hits/misses (counts): {per}"
        )
    return line


def _stats_line(engine: Engine) -> Callable[[StepStat], None]:
    gpu, experts = engine.probe is not None, engine.experts is not None

    def show(s: StepStat) -> None:
        click.echo(stats_line(s, engine.tokenizer.piece, gpu, experts), err=True)

    return show


def _summary(r: GenerationResult) -> str:
    tps = f"{r.tokens_per_second:.2f} tok/s" if r.tokens_per_second else "n/a (one token)"
    pps = f"{r.prompt_tokens_per_second:.2f} tok/s" if r.prompt_tokens_per_second else "n/a"
    n_after = r.n_output_tokens - 1
    line = (
        f"[{r.arch}, {r.device}] decode: {tps} ({n_after} token{'' if n_after == 1 else 's'} after the first in "
        f"{r.decode_seconds:.2f} s, batch 1) | prompt: {r.n_prompt_tokens} tokens in {r.prompt_seconds:.2f} s "
        f"({pps}, incl. the first generated token) | stop: {r.stop_reason}"
    )
    if r.expert_hits or r.expert_misses:
        line += f" | experts: {r.expert_hits} hits / {r.expert_misses} misses (counts)"
    return line


class TextStream:
    """Prints generated tokens as they come (text mode): each token's bytes through an incremental
    UTF-8 decoder, so a character split over tokens is printed once complete. End-of-generation
    tokens are not printed (as they are left out of the text)."""

    def __init__(self, tok, skip: frozenset[int], echo: bool = True):
        self.tok, self.skip, self.echo = tok, skip, echo
        self.ids: list[int] = []
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token_id: int) -> None:
        if token_id in self.skip:
            return
        self.ids.append(int(token_id))
        if not self.echo:
            return
        text = self._dec.decode(self.tok.decode_bytes([token_id]))
        if text:
            click.echo(text, nl=False)
            sys.stdout.flush()

    def finish(self) -> None:
        if self.echo:
            click.echo(self._dec.decode(b"", final=True))


@main.command("generate")
@click.argument("pack", type=click.Path())
@click.option(
    "-p",
    "--prompt",
    required=True,
    help="Prompt text, tokenized as llama.cpp's llama-cli does: special "
    "tokens written in it (<|im_start|>, <start_of_turn>) are those tokens. With --chat: the user message.",
)
@click.option(
    "--chat",
    is_flag=True,
    help="Apply the model's chat template (tokenizer.chat_template of the GGUF, "
    "rendered with Jinja2 as Hugging Face does) to --prompt as a user message; prints only the reply.",
)
@click.option("--system", default=None, help="With --chat: a system message before the user message.")
@click.option(
    "--parse-special/--no-parse-special",
    "parse_special",
    default=True,
    show_default=True,
    help="Parse special-token text in the prompt as special tokens (llama.cpp's default), or keep it plain text.",
)
@click.option("-n", "--n-tokens", "n_tokens", default=32, show_default=True, help="Tokens to generate.")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy (argmax).")
@click.option(
    "--top-k", "top_k", default=0, show_default=True, help="Keep the k best logits before sampling (0 = all)."
)
@click.option("--top-p", "top_p", default=1.0, show_default=True, help="Nucleus mass to keep before sampling.")
@click.option("--seed", default=0, show_default=True, help="Seed of the sampler's generator.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-generation tokens.")
@ctx_option
@click.option(
    "--resident",
    default="all",
    show_default=True,
    callback=lambda c, p, v: _resident(v),
    help="MoE: experts held by the expert cache (all | none | half | fraction); the rest are misses.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="cpu: NumPy; cuda: CuPy on the local GPU (pip install -e '.[cuda]').",
)
@click.option(
    "--numerics",
    "numerics_",
    type=click.Choice(sorted(NUMERICS_MODES)),
    default=DEFAULT_NUMERICS,
    show_default=True,
    help="CPU: activation roundings beside the kernels' own. f32 = none (the default q8 kernel still "
    "quantizes the activations of the products it runs, as llama.cpp does); llamacpp = also f16 "
    "attention operands, the fp16 GELU table and Q8 activations for products the kernel does not cover.",
)
@click.option(
    "--kernel",
    "--cpu-kernel",
    "cpu_kernel",
    type=click.Choice(["q8", "exact", "f32"]),
    default=None,
    help="[default: q8] The matvec kernels. q8: llama.cpp's CPU numerics (activations quantized to "
    "Q8_0/Q8_K, integer block dots) on the CPU and, with --device cuda, on the GPU for every weight "
    "type that has a q8 kernel - bit-identical on both devices, so an expert computed on the CPU (a "
    "cache miss) equals a hit and the tokens do not depend on the cache; exact: f32 products in the "
    "exact kernels' summation order on both devices (also bit-identical, slower); f32 (CPU "
    "only): rows dequantized, a 16-way dot.",
)
@click.option(
    "-t",
    "--threads",
    type=click.IntRange(min=1, max=512),
    default=None,
    help="CPU kernel threads, 1-512 (ggml's GGML_MAX_N_THREADS; default: the cores this process may use).",
)
@kv_option(ENGINE_KV_TYPES)
@expert_cache_option
@expert_profile_option
@reserve_option
@card_options(engine=True)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (prompt_ids, output_ids, text, tokens_per_second, top, ...) instead of text.",
)
@click.option(
    "--stats",
    is_flag=True,
    help="Per-position timing on stderr (units on every line; cuda: gpu, "
    "cpu-experts and wait ms, and per-layer expert hits/misses; synchronises every step).",
)
@click.option(
    "--no-graph",
    "no_graph",
    is_flag=True,
    help="cuda: launch the fused dense step's kernels one by one "
    "instead of replaying it as a CUDA graph (same kernels, bit-identical logits).",
)
@click.option(
    "--stage-times",
    "stage_times",
    is_flag=True,
    help="cuda, with --no-graph: device ms per stage "
    "(embedding, each layer's attention and FFN, head) from CUDA events, printed at the end. Refused "
    "with the graph on: events between the launches of a captured graph record nothing.",
)
@click.option("-v", "--verbose", is_flag=True, help="Start-up checkpoints (time, memory) on stderr.")
def generate_cmd(
    pack,
    prompt,
    chat,
    system,
    parse_special,
    n_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    ignore_eos,
    n_ctx,
    resident,
    device,
    numerics_,
    cpu_kernel,
    threads,
    kv,
    expert_cache,
    expert_profile,
    vram_reserve_mib,
    card_name,
    card_mib,
    as_json,
    stats,
    no_graph,
    stage_times,
    verbose,
):
    """Generate text from PACK after --prompt and report tok/s.

    Text mode prints the prompt (not with --chat) and then each token as it is generated; Ctrl-C
    stops there (exit 130) keeping what was printed. --json prints one object at the end (on an
    interruption: {"ok": false, ...} with the tokens generated so far).
    """

    def refuse(msg: str) -> None:
        fail(msg, as_json=as_json)

    for opt, text in (("--prompt", prompt), ("--system", system)):
        bad = not_utf8(opt, text)
        if bad:
            refuse(bad)
    if system is not None and not chat:
        refuse("--system needs --chat (the system message goes through the model's chat template)")
    if chat and not parse_special:
        refuse(
            "--no-parse-special with --chat would make the chat template's own markers plain text; "
            "llama.cpp always parses them in a chat prompt"
        )

    bad = check_pack_dir(pack) or check_request(
        n_tokens=n_tokens, n_ctx=n_ctx, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    if bad:
        refuse(bad)
    try:
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValueError as e:
        refuse(str(e))
    if stage_times and device == "cpu":
        refuse("--stage-times: per-stage device timers exist on --device cuda only")
    ec, bad = parse_expert_cache(expert_cache)  # checked on the CPU path too, where it is not used
    if bad:
        refuse(bad)
    if expert_profile is not None and not Path(expert_profile).is_file():
        refuse(f"--expert-profile {expert_profile}: no such file")
    try:
        opts = EngineOptions(
            n_ctx=n_ctx,
            resident=resident,
            kv=kv,
            numerics=numerics_,
            stage_times=stage_times,
            card=emulated_card(card_name, card_mib),
            cpu_kernel=cpu_kernel,
            threads=threads,
        )
        from strata.budget.cards import check_mib
        from strata.budget.profile import read_profile

        check_mib("--vram-reserve-mib", vram_reserve_mib)  # on every device, as strata-budget check does
        # read and checked against the pack on every device (load_engine); it fills the GPU's cache
        opts.profile = read_profile(expert_profile) if expert_profile else None
        if device != "cpu":
            opts.expert_cache = "auto" if ec is None else ec
            opts.vram_reserve_mib, opts.graph = vram_reserve_mib, not no_graph
        else:  # what only the GPU path uses: said, not silently dropped
            if opts.profile is not None:
                warn(
                    f"--expert-profile {expert_profile}: the CPU path has no expert cache; the profile was read and "
                    "is not used (it fills the GPU's cache with --device cuda)"
                )
            if ec is not None:
                warn(
                    f"--expert-cache {expert_cache}: the CPU path has no expert cache (it sizes the GPU's, "
                    "--device cuda); not used"
                )
            if no_graph:
                warn("--no-graph: the CPU path has no CUDA graphs (--device cuda); not used")
        engine = load_engine(
            pack, device=device, options=opts, on_checkpoint=print_checkpoint if verbose else None, on_warning=warn
        )
        for line in engine.notes:  # what the forward pass knowingly leaves out, said once
            click.echo(f"note: {line}", err=True)
        text = chat_prompt(engine.tokenizer, prompt, system, where=str(pack)) if chat else prompt
        if stats:
            _stats_header(engine)
    except REFUSALS as e:
        refuse(str(e))
    stream = TextStream(engine.tokenizer, frozenset() if ignore_eos else engine.tokenizer.eog_ids, echo=not as_json)
    show_stats = _stats_line(engine) if stats else None

    echoed = [as_json or chat]  # the prompt is echoed at the first position: after generate's checks passed

    def on_step(st: StepStat) -> None:
        if not echoed[0]:
            echoed[0] = True
            click.echo(prompt, nl=False)
            sys.stdout.flush()
        if show_stats:
            show_stats(st)
        if st.token_out is not None:
            stream(st.token_out)

    try:
        r = generate(
            engine,
            text,
            n_tokens,
            sampler=sampler,
            ignore_eos=ignore_eos,
            on_step=on_step,
            stats=stats,
            parse_special=parse_special,
        )
    except REFUSALS as e:
        if echoed[0] and not as_json and not chat:
            click.echo("")  # ends the echoed prompt's line
        refuse(str(e))
    except KeyboardInterrupt as e:
        stream.finish()
        raise interrupted(
            e,
            f"stopped after {len(stream.ids)} generated token(s)" + ("" if as_json else " (printed above)"),
            {"output_ids": stream.ids, "text": engine.tokenizer.decode(stream.ids)},
        ) from None
    st = _stage_summary(engine) if stage_times else None
    if as_json:
        d = r.model_dump()
        if not stats:
            d.pop("steps")
        if st is not None:
            d["stage_ms_per_token"] = st
        click.echo(json.dumps(d))
        return
    stream.finish()
    click.echo(_summary(r), err=True)
    if st is not None:
        click.echo(
            "stage times: device ms per position (CUDA events between stages, eager fused step; "
            "attn/ffn summed over layers): " + ", ".join(f"{k} {v:.3f} ms" for k, v in st["grouped"].items()),
            err=True,
        )


def _stage_summary(engine: Engine) -> dict | None:
    dec = engine.decoder
    if dec is None or not dec.stage_times.steps:
        return None
    return {
        "steps": dec.stage_times.steps,
        "grouped": dec.stage_times.grouped(),
        "per_stage": dec.stage_times.per_token(),
    }


@main.command("measure")
@click.argument("pack", type=click.Path())
@ctx_option
@expert_cache_option
@expert_profile_option
@reserve_option
@kv_option(ENGINE_KV_TYPES)
@card_options(engine=True)
@click.option(
    "-n",
    "--n-tokens",
    "n_tokens",
    default=0,
    show_default=True,
    help="Then generate this many tokens (greedy, end-of-generation ignored) and report the expert hit rate "
    "measured during generation beside the expert profile's prediction.",
)
@click.option("-p", "--prompt", default="The capital of France is", show_default=True, help="The prompt of -n.")
@click.option(
    "--device",
    type=click.Choice(["cuda", "sim"]),
    default="cuda",
    hidden=True,
    help="sim: the NumPy stand-in of a card (dry runs of bench/device_docs.sh without a GPU).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def measure_cmd(
    pack,
    n_ctx,
    expert_cache,
    expert_profile,
    vram_reserve_mib,
    kv,
    card_name,
    card_mib,
    n_tokens,
    prompt,
    device,
    as_json,
):
    """Load PACK on the GPU (on an emulated card with --card) and print, per budget term, the bytes
    strata.budget predicts for strata's engine (the plan of strata-budget check --card ...) next to the
    bytes this engine allocated; the plan's slot count beside the engine's; the reserve measured free
    after start-up; with -n, the hit rate measured during generation beside the expert profile's prediction.

    Exit codes: 0 every exact term equal, the total within 0.5% or 32 MiB and the reserve free, 1 not,
    2 refused (no GPU, a pack that cannot load, an option out of range)."""
    from .measure import measure_pack, print_measurement

    ec, bad = parse_expert_cache(expert_cache)
    bad = check_pack_dir(pack) or bad or (f"--ctx {n_ctx}: must be >= 1" if n_ctx is not None and n_ctx < 1 else None)
    bad = bad or (f"-n/--n-tokens {n_tokens}: must be >= 0" if n_tokens < 0 else None)
    if expert_profile is not None and not Path(expert_profile).is_file():
        bad = bad or f"--expert-profile {expert_profile}: no such file"
    if bad:
        fail(bad, as_json=as_json)
    try:
        from strata.budget.profile import read_profile

        card = emulated_card(card_name, card_mib)
        profile = read_profile(expert_profile) if expert_profile else None
        a = measure_pack(
            pack,
            n_ctx=n_ctx,
            expert_cache="auto" if ec is None else ec,
            vram_reserve_mib=vram_reserve_mib,
            kv=kv,
            card=card,
            profile=profile,
            prompt=prompt,
            n_tokens=n_tokens,
            device=device,
        )
    except REFUSALS as e:
        fail(str(e), as_json=as_json)
    if as_json:
        d = a.model_dump()
        d.update(exact_ok=a.exact_ok, total_ok=a.total_ok, reserve_ok=a.reserve_ok, total_diff_bytes=a.total_diff_bytes)
        click.echo(json.dumps(d))
    else:
        print_measurement(a)
    sys.exit(0 if a.ok else 1)


# the command's earlier name (it measures; it does not audit the pack - strata-budget check does)
main.add_command(
    click.Command(
        "audit", callback=measure_cmd.callback, params=measure_cmd.params, hidden=True, help="Old name of `measure`."
    )
)


@main.command("profile")
@click.argument("pack", type=click.Path())
@click.option(
    "--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False), help="Text file, one prompt per line."
)
@click.option(
    "-o",
    "--out",
    default="expert-profile.parquet",
    show_default=True,
    help="Parquet file to write (layer, expert, count); a new file unless --force, never a pack's file or a GGUF.",
)
@click.option("--force", is_flag=True, help="Replace an existing -o file.")
@click.option("-n", "--n-tokens", "n_tokens", default=16, show_default=True, help="Tokens generated per prompt.")
@ctx_option
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the routing runs (the counts are the same).",
)
@click.option(
    "--trace",
    "trace_out",
    type=click.Path(dir_okay=False),
    help="Also write the routing trace (Parquet: seq, position, layer, expert) for offline cache-policy replay.",
)
def profile_cmd(pack, prompts_file, out, force, n_tokens, n_ctx, device, trace_out):
    """Write an expert profile (Parquet: layer, expert, count) from routing over --prompts: the input of
    strata-budget check --expert-profile and strata-engine generate --expert-profile."""
    from strata.budget.profile import write_profile
    from strata.budget.trace import trace_counts, write_trace

    from .routing import profile_routing, trace_routing

    bad = check_pack_dir(pack)
    if bad:
        fail(bad)
    parent = Path(out).resolve().parent
    if not parent.is_dir():
        fail(f"-o/--out {out}: the directory {parent} does not exist")
    if Path(out).is_dir():
        fail(f"-o/--out {out}: is a directory")
    from strata.packer.outputs import OutputError, check_overwrite

    try:
        check_overwrite(out, force=force, inputs=(prompts_file,))
    except OutputError as e:
        fail(f"-o/--out {e}")
    try:
        if trace_out:
            check_overwrite(trace_out, force=force, inputs=(prompts_file, out))
    except OutputError as e:
        fail(f"--trace {e}")
    if n_tokens < 1:
        fail(f"-n/--n-tokens {n_tokens}: must be >= 1")
    if n_ctx is not None and n_ctx < 1:
        fail(f"--ctx {n_ctx}: must be >= 1")
    if not Path(prompts_file).exists():
        fail(f"--prompts {prompts_file}: no such file")
    if not Path(prompts_file).is_file():
        fail(f"--prompts {prompts_file}: not a regular file (a text file, one prompt per line)")
    try:
        prompts = [ln for ln in Path(prompts_file).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except UnicodeDecodeError as e:
        fail(f"--prompts {prompts_file}: not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}")
    if not prompts:
        fail(f"--prompts {prompts_file}: no prompts")
    try:
        if trace_out:  # the profile is the trace summed per (layer, expert)
            trace = trace_routing(pack, prompts, n_tokens=n_tokens, n_ctx=n_ctx, device=device)
            rows = trace_counts(trace)
            write_trace(trace, trace_out, force=force, inputs=(prompts_file, out))
        else:
            rows = profile_routing(pack, prompts, n_tokens=n_tokens, n_ctx=n_ctx, device=device)
        write_profile(rows, out, force=force, inputs=(prompts_file,))
    except REFUSALS as e:
        fail(str(e))
    click.echo(
        f"profile: {len(rows)} (layer, expert) pairs, {sum(r[2] for r in rows)} selections "
        f"(counts) from {len(prompts)} prompts -> {out}"
    )


if __name__ == "__main__":
    main()
