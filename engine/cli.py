"""``strata-engine``: load a pack by byte offset and generate text; measure its memory; record its
expert routing as an expert profile. A thin click layer: each command parses, builds the engine's options
(:func:`strata.engine.options.options_from_cli`: checked and later resolved there, once), loads and runs -
over :mod:`strata.engine.generate_cli` (generate's request, checks and output), :mod:`strata.engine.startup`,
:mod:`strata.engine.measure` and :mod:`strata.engine.routing`. The benchmark switches are listed apart in
``generate --help`` (:class:`strata.engine.clikit.DevCommand`).

Exit codes (one contract for the three tools, :mod:`strata.packer.exits`): 0 success, 1 ``measure``
found a term that differs from the budget's prediction, 2 the pack or the request was refused (the
message names the file, tensor or numbers), 128 + N a signal (130 SIGINT, 143 SIGTERM; ``generate``
keeps the tokens it streamed), 141 stdout closed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

import click

from strata.budget.options import (
    batch_size_option,
    cache_policy_option,
    card_options,
    ctx_option,
    expert_cache_option,
    expert_profile_option,
    kv_option,
    miss_tier_option,
    reserve_option,
    source_dir_option,
    speed_option_error,
    speed_options,
    ubatch_option,
)
from strata.layout.kv import ENGINE_KV_TYPES
from strata.packer.exits import StrataGroup

from .clikit import REFUSALS, DevCommand, check_pack_dir, dev_option, fail, print_checkpoint, warn
from .errors import GenerateError
from .generate_cli import GenerateRequest, prompt_text
from .numerics import DEFAULT_NUMERICS, NUMERICS_MODES
from .options import MAX_THREADS, EngineOptions, options_from_cli
from .startup import load_engine


def _resident(value: str) -> str:
    if value in ("all", "none", "half"):
        return value
    try:
        f = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected all, none, half or a fraction in [0, 1]") from None
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


@main.command("generate", cls=DevCommand)
@click.argument("pack", type=click.Path())
@click.option(
    "-p",
    "--prompt",
    default=None,
    help="Prompt text, tokenized as llama.cpp's llama-cli does: special "
    "tokens written in it (<|im_start|>, <start_of_turn>) are those tokens. With --chat: the user message.",
)
@click.option(
    "-f",
    "--file",
    "prompt_file",
    default=None,
    metavar="FILE",
    help="Read the prompt from FILE instead (- for standard input): UTF-8, one trailing newline removed, "
    "as llama-cli's -f; for prompts longer than a command line can hold.",
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
@click.option(
    "-n",
    "--n-tokens",
    "n_tokens",
    default=32,
    show_default=True,
    help="Tokens to generate; -1 = until end of generation or the context is full (llama-cli's -n -1).",
)
@click.option("--temperature", "--temp", "temperature", default=0.0, show_default=True, help="0 = greedy (argmax).")
@click.option(
    "--top-k", "top_k", default=0, show_default=True, help="Keep the k best logits before sampling (0 = all)."
)
@click.option(
    "--top-p",
    "top_p",
    default=1.0,
    show_default=True,
    help="Nucleus mass to keep (of the softmax before the temperature, as llama.cpp's chain).",
)
@click.option(
    "--min-p", "min_p", default=0.0, show_default=True, help="Keep tokens at least this times the best's probability."
)
@click.option("--repeat-penalty", "repeat_penalty", default=1.0, show_default=True, help="1.0 = off (llama.cpp's).")
@click.option(
    "--repeat-last-n",
    "repeat_last_n",
    default=64,
    show_default=True,
    help="Tokens of the history (prompt included) the penalties see; -1 = all, 0 = off.",
)
@click.option("--presence-penalty", "presence_penalty", default=0.0, show_default=True, help="0.0 = off.")
@click.option("--frequency-penalty", "frequency_penalty", default=0.0, show_default=True, help="0.0 = off.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    help="Seed of the sampler's generator; -1 = a random one (reported in --json's sampling).",
)
@click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-generation tokens.")
@ctx_option
@source_dir_option
@dev_option(
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
@dev_option(
    "--numerics",
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
    type=click.IntRange(min=1, max=MAX_THREADS),
    default=None,
    help=f"CPU kernel threads, 1-{MAX_THREADS} (ggml's GGML_MAX_N_THREADS; default: the cores this process may use).",
)
@ubatch_option(
    "Prompt positions that go through the layers together (llama.cpp's -ub; 1 = one at a time), on the CPU and "
    "the GPU (its chunk buffers: the budget's 'prompt chunk' term); generated tokens run one position per step."
)
@batch_size_option
@kv_option(ENGINE_KV_TYPES)
@expert_cache_option
@expert_profile_option
@miss_tier_option
@cache_policy_option
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
    help="Per-position timing on stderr (units on every line; cuda: gpu, cpu-experts and wait ms; with routed "
    "experts per layer hits / CPU misses / PCIe misses as counts; cuda synchronises every step), then a "
    "'stats: window' line of the decode positions' means and sums (--json: stats_window).",
)
@dev_option(
    "--no-graph",
    "no_graph",
    is_flag=True,
    help="cuda: launch the fused dense step's kernels one by one "
    "instead of replaying it as a CUDA graph (same kernels, bit-identical logits).",
)
@dev_option(
    "--stage-times",
    "stage_times",
    is_flag=True,
    help="cuda, with --no-graph: device ms per stage "
    "(embedding, each layer's attention and FFN, head) from CUDA events, printed at the end. Refused "
    "with the graph on: events between the launches of a captured graph record nothing.",
)
@click.option("-v", "--verbose", is_flag=True, help="Start-up checkpoints (time, memory) on stderr.")
def generate_cmd(pack, **kw):
    """Generate text from PACK after --prompt (or -f FILE) and report tok/s.

    Text mode prints the prompt (not with --chat) and then each token as it is generated; Ctrl-C
    stops there (exit 130) keeping what was printed. --json prints one object at the end (on an
    interruption: {"ok": false, ...} with the tokens generated so far).
    """
    try:
        kw["prompt"] = prompt_text(kw["prompt"], kw.pop("prompt_file"))
    except REFUSALS as e:
        fail(str(e), as_json=kw["as_json"])
    kw["ubatch"] = min(kw["ubatch"], kw.pop("batch_size"))  # one sequence: a chunk is min(-b, -ub) positions
    req = GenerateRequest(pack=pack, **{f.name: kw.pop(f.name) for f in fields(GenerateRequest) if f.name in kw})
    try:
        sampler = req.check()
        opts = options_from_cli(on_warning=warn, **kw)  # the rest are the engine's options
        req.check_positions(opts.n_ctx)
        on_checkpoint = print_checkpoint if req.verbose else None
        engine = load_engine(pack, options=opts, on_checkpoint=on_checkpoint, on_warning=warn)
        if engine.experts is None and str(opts.resident) != "all":  # refused by name, as an --expert-profile is
            raise GenerateError(f"--resident {opts.resident}: this model has no routed experts to hold some of")
        text = req.text(engine)
    except REFUSALS as e:
        fail(str(e), as_json=req.as_json)
    req.run(engine, text, sampler)


@main.command("measure")
@click.argument("pack", type=click.Path())
@ctx_option
@source_dir_option
@expert_cache_option
@expert_profile_option
@miss_tier_option
@cache_policy_option
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
    "measured during generation beside the expert profile's prediction (and with --step-ms the decode rate beside "
    "the predicted one).",
)
@click.option("-p", "--prompt", default="The capital of France is", show_default=True, help="The prompt of -n.")
@ubatch_option("Prompt positions per chunk the engine is started for, as generate's: its 'prompt chunk' buffers.")
@batch_size_option
@click.option(
    "--device",
    type=click.Choice(["cuda", "sim"]),
    default="cuda",
    hidden=True,
    help="sim: the NumPy stand-in of a card (dry runs of bench/device_docs.sh without a GPU).",
)
@speed_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def measure_cmd(pack, n_tokens, prompt, as_json, step_ms, pcie_gbs, cpu_expert_us, **kw):
    """Load PACK on the GPU (on an emulated card with --card) and print, per budget term, the bytes
    strata.budget predicts for strata's engine (the plan of strata-budget check --card ...) next to the
    bytes this engine allocated; the plan's slot count beside the engine's; the reserve measured free
    after start-up; with -n, the hit rate measured during generation beside the expert profile's prediction.

    Exit codes: 0 every exact term equal, the total within 0.5% or 32 MiB and the reserve free, 1 not,
    2 refused (no GPU, a pack that cannot load, an option out of range)."""
    from .measure import measure_pack, print_measurement

    try:
        if bad := (
            check_pack_dir(pack)
            or (f"-n/--n-tokens {n_tokens}: must be >= 0" if n_tokens < 0 else None)
            or speed_option_error(step_ms, pcie_gbs, cpu_expert_us)
            or (
                "--step-ms needs -n N: the decode rate is measured while generating"
                if step_ms and not n_tokens
                else None
            )
        ):
            raise GenerateError(bad)
        kw["ubatch"] = min(kw["ubatch"], kw.pop("batch_size"))  # as generate's: a chunk is min(-b, -ub) positions
        a = measure_pack(
            pack,
            options=options_from_cli(**kw),
            prompt=prompt,
            n_tokens=n_tokens,
            step_ms=step_ms,
            pcie_gbs=pcie_gbs,
            cpu_expert_us=cpu_expert_us,
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
@click.option("--force", is_flag=True, help="Replace an existing -o file (and --trace file).")
@click.option("-n", "--n-tokens", "n_tokens", default=16, show_default=True, help="Tokens generated per prompt.")
@ctx_option
@source_dir_option
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the routing runs (the same counts up to router near-ties, where float rounding decides).",
)
@ubatch_option("Prompt positions per chunk, as generate's (1 = one position at a time, the decode step's routing).")
@click.option(
    "--trace",
    "trace_out",
    type=click.Path(dir_okay=False),
    help="Also write the routing trace (Parquet: seq, position, layer, expert) for offline cache-policy replay.",
)
def profile_cmd(pack, prompts_file, out, force, n_tokens, n_ctx, source_dir, device, ubatch, trace_out):
    """Write an expert profile (Parquet: layer, expert, count) from routing over --prompts: the input of
    strata-budget check --expert-profile and strata-engine generate --expert-profile."""
    from strata.budget.profile import model_identity, write_profile
    from strata.budget.trace import trace_counts, write_trace
    from strata.packer.pack import open_pack

    from .routing import profile_routing, trace_routing

    bad = check_pack_dir(pack)
    if bad:
        fail(bad)
    for option, path in (("-o/--out", out), ("--trace", trace_out)):  # both refused before the routing runs
        if path is None:
            continue
        if not path.strip():
            fail(f"{option} {path!r}: an empty path; give a file name for the output")
        parent = Path(path).resolve().parent
        if not parent.is_dir():
            fail(f"{option} {path}: the directory {parent} does not exist")
        if Path(path).is_dir():
            fail(f"{option} {path}: is a directory")
    if trace_out is not None and Path(trace_out).resolve() == Path(out).resolve():
        fail(f"--trace {trace_out}: the same file as -o/--out {out}; give the trace and the profile two paths")
    from strata.packer.outputs import OutputError, check_overwrite

    try:
        check_overwrite(out, force=force, inputs=(prompts_file,))
    except OutputError as e:
        fail(f"-o/--out {e}")
    try:
        if trace_out is not None:
            check_overwrite(trace_out, force=force, inputs=(prompts_file, out))
    except OutputError as e:
        fail(f"--trace {e}")
    if n_tokens < 1:
        fail(f"-n/--n-tokens {n_tokens}: must be >= 1")
    try:
        opts = EngineOptions(device=device, n_ctx=n_ctx, source_dir=source_dir, ubatch=ubatch)
    except REFUSALS as e:
        fail(str(e))
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
        if trace_out is not None:  # the profile is the trace summed per (layer, expert)
            trace = trace_routing(pack, prompts, n_tokens=n_tokens, options=opts)
            rows = trace_counts(trace)
            write_trace(trace, trace_out, force=force, inputs=(prompts_file, out))
        else:
            rows = profile_routing(pack, prompts, n_tokens=n_tokens, options=opts)
        write_profile(rows, out, force=force, inputs=(prompts_file,), model=model_identity(open_pack(pack, source_dir)))
    except REFUSALS as e:
        fail(str(e))
    click.echo(
        f"profile: {len(rows)} (layer, expert) pairs, {sum(r[2] for r in rows)} selections "
        f"(counts) from {len(prompts)} prompts -> {out}"
        + (f"; trace: {len(trace.seq)} rows (seq, position, layer, expert) -> {trace_out}" if trace_out else "")
    )


if __name__ == "__main__":
    main()
