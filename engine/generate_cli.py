"""``strata-engine generate`` below its click layer: what was asked besides the engine's options (the
prompt, sampling, the output: :class:`GenerateRequest`), its checks, and the run - streaming the text,
``--stats`` lines, the summary or the ``--json`` object (the click command is :mod:`strata.engine.cli`)."""

from __future__ import annotations

import codecs
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import click

from strata.packer.exits import interrupted

from .chat import chat_prompt
from .clikit import REFUSALS, check_pack_dir, fail
from .core import Engine
from .errors import GenerateError
from .generate import GenerationResult, StepStat, generate
from .sampling import Sampler


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


def prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt of ``-p/--prompt`` or ``-f/--file`` (``-``: standard input), as llama-cli takes it: a file's
    whole text, UTF-8, with ONE trailing newline removed (llama.cpp common/arg.cpp, ``-f``). A prompt of any
    size: the command line caps ``-p`` near 128 KiB (the kernel's MAX_ARG_STRLEN), a file has no cap.

    Raises:
        GenerateError: both or neither given; a file that is missing, a directory, unreadable, or not UTF-8
            (naming the file, the first bad byte and its offset).
    """
    if prompt is not None and prompt_file is not None:
        raise GenerateError(f"-p/--prompt and -f/--file {prompt_file}: give the prompt one way, not both")
    if prompt is not None:
        return prompt
    if prompt_file is None:
        raise GenerateError("no prompt: give -p/--prompt TEXT or -f/--file FILE (- for standard input)")
    where = "standard input" if prompt_file == "-" else prompt_file
    try:
        if prompt_file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(prompt_file, "rb") as f:
                data = f.read()
    except IsADirectoryError:
        raise GenerateError(f"-f/--file {where}: is a directory, not a text file") from None
    except FileNotFoundError:
        raise GenerateError(f"-f/--file {where}: no such file") from None
    except OSError as e:
        raise GenerateError(f"-f/--file {where}: cannot be read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerateError(
            f"-f/--file {where}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}"
        ) from None
    return text[:-1] if text.endswith("\n") else text


def check_request(
    *,
    n_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    min_p: float = 0.0,
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> str | None:
    """Sampling and length checks that need no pack (each refusal names the option), else None. The
    context's own check is the engine options' (:class:`strata.engine.options.EngineOptions`); the length
    against it is :meth:`GenerateRequest.check_positions`."""
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
    if seed < -1:
        return f"--seed {seed}: must be a non-negative integer, or -1 for a random seed"
    for name, v in (("--min-p", min_p), ("--repeat-penalty", repeat_penalty)):
        if not math.isfinite(v):
            return f"{name} {v}: not a finite number"
    for name, v in (("--presence-penalty", presence_penalty), ("--frequency-penalty", frequency_penalty)):
        if not math.isfinite(v):
            return f"{name} {v}: not a finite number"
    if not 0.0 <= min_p <= 1.0:
        return f"--min-p {min_p}: outside [0, 1] (0 = off)"
    if repeat_penalty <= 0:
        return f"--repeat-penalty {repeat_penalty}: must be > 0 (1.0 = off)"
    if repeat_last_n < -1:
        return f"--repeat-last-n {repeat_last_n}: must be >= -1 (-1 = the whole history, 0 = off)"
    if n_tokens < 1 and n_tokens != -1:
        return f"-n/--n-tokens {n_tokens}: must be >= 1, or -1 (until end of generation or the context is full)"
    return None


STATS_UNITS = (
    "stats: one line per position. Units: 'ms' = milliseconds; forward/sample/cpu-experts/wait are host "
    "wall-clock times, gpu is the device time between CUDA events at the step's start and end (it includes "
    "time the GPU sat idle waiting for the host); 'hits/misses' are COUNTS of routed experts (not ms), per "
    "MoE layer as layer:hits/CPU misses/PCIe misses. At the end, 'stats: window' sums the decode positions."
)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


class PromptProgress:
    """A one-line progress report of a long prompt on a terminal's stderr (issue 20 item 5): tokens done of
    ``total``, tok/s and ETA, redrawn in place at most every ``every`` seconds from ``delay`` seconds on, erased by
    :meth:`close`. (tqdm drew nothing on a pseudo-terminal without a window size; this writes plain ``\\r`` lines.)"""

    def __init__(self, total: int, out=None, *, delay: float = 0.5, every: float = 0.25):
        self.total, self.out, self.delay, self.every = total, out if out is not None else sys.stderr, delay, every
        self.done, self.t0, self.last, self.width = 0, time.perf_counter(), 0.0, 0

    def line(self, now: float) -> str:
        """The text of the line at ``now`` (perf_counter seconds): ``prompt: D/T tokens, R tok/s, ETA E s``."""
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return f"prompt: {self.done}/{self.total} tokens, {rate:.1f} tok/s, ETA {eta:.0f} s"

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.t0 >= self.delay and now - self.last >= self.every:
            text = self.line(now)[: self.columns() - 1]  # one screen line: a wrapped line would not be redrawn
            self.out.write("\r" + text.ljust(self.width))
            self.out.flush()
            self.last, self.width = now, max(self.width, len(text))

    def columns(self) -> int:
        """The terminal's width (columns; 80 when it cannot be read)."""
        import shutil

        return shutil.get_terminal_size((80, 24)).columns

    def close(self) -> None:
        """Erase the line (nothing when it was never drawn); safe to call twice."""
        if self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.out.flush()
            self.width = 0


def prompt_progress(engine: Engine, text: str, parse_special: bool, *, on: bool, least: int = 64):
    """The :class:`PromptProgress` of a prompt of at least ``least`` tokens (the positions before the one that gives
    the first token), or None when ``on`` is False (a pipe, --json, --stats) or the prompt is shorter. (It advances
    per position; a CPU prompt chunk reports its positions together when it ends: :func:`strata.engine.generate.
    decode`.)"""
    if not on:
        return None
    n = len(engine.tokenizer.encode(text, parse_special=parse_special))
    return PromptProgress(n - 1) if n >= least else None


def stats_line(s: StepStat, piece: Callable[[int], str] | None = None, gpu: bool = False, experts: bool = False) -> str:
    """One ``--stats`` line; every figure says its unit (ms = milliseconds, counts of experts)."""
    out = "" if s.token_out is None else f" -> {s.token_out}" + (f" {piece(s.token_out)!r}" if piece else "")
    line = (
        f"stats: pos {s.position:4d} {s.phase:6s} {s.token_in}{out} | forward {s.forward_ms:.2f} ms (wall"
        + (f", 1/{s.chunk} of a {s.chunk}-position chunk" if s.chunk > 1 else "")
        + f") | sample {s.sample_ms:.2f} ms (wall)"
    )
    if gpu:
        line += (
            f" | gpu {_ms(s.gpu_ms)} ms (event span) | gpu floor {_ms(s.busy_ms)} ms (device work alone) | "
            f"cpu-experts {_ms(s.cpu_expert_ms)} ms (wall) | wait {_ms(s.wait_ms)} ms (wall)"
        )
    if experts:
        per = " ".join(f"{il}:{v[0]}/{v[1] - v[2]}/{v[2]}" for il, v in sorted((s.expert_layers or {}).items()))
        line += (
            f" | experts {s.expert_hits} hits / {s.expert_misses} misses, {s.expert_pcie} of them over PCIe (counts), "
            f"{s.pcie_bytes / 2**20:.2f} MiB over PCIe; "
            f"per layer hits/CPU misses/PCIe misses (counts): {per}"
        )
    return line


def window_summary(steps: list[StepStat]) -> dict | None:
    """The decode window summed over the decode positions (phase "decode"; None without one): ``positions``
    (count); the means per position of ``forward_ms``, ``sample_ms``, ``gpu_ms``, ``busy_ms``, ``wait_ms``,
    ``cpu_expert_ms``
    (milliseconds; None where a step did not measure it) and ``pcie_mib`` (MiB read over PCIe); ``hits``,
    ``cpu_misses``, ``pcie_misses`` summed (counts of routed experts) and ``layers``: per MoE layer ``[hits, CPU
    misses, PCIe misses]`` summed (counts; the ``--json --stats`` object's ``stats_window``)."""
    dec = [s for s in steps if s.phase == "decode"]
    if not dec:
        return None
    n = len(dec)

    def mean(f: str) -> float | None:
        vals = [getattr(s, f) for s in dec]
        return None if any(v is None for v in vals) else sum(vals) / n

    layers: dict[int, list[int]] = {}
    for s in dec:
        for il, v in (s.expert_layers or {}).items():
            acc = layers.setdefault(il, [0, 0, 0])
            acc[0] += v[0]
            acc[1] += v[1] - v[2]
            acc[2] += v[2]
    return {
        "positions": n,
        **{f: mean(f) for f in ("forward_ms", "sample_ms", "gpu_ms", "busy_ms", "wait_ms", "cpu_expert_ms")},
        "pcie_mib": sum(s.pcie_bytes for s in dec) / n / 2**20,
        "hits": sum(s.expert_hits for s in dec),
        "cpu_misses": sum(s.expert_misses - s.expert_pcie for s in dec),
        "pcie_misses": sum(s.expert_pcie for s in dec),
        "layers": {il: layers[il] for il in sorted(layers)},
    }


def window_line(w: dict, gpu: bool = False, experts: bool = False) -> str:
    """:func:`window_summary` as one ``--stats`` line, every figure with its unit; the device timers with ``gpu``, the
    expert counts with ``experts`` (as :func:`stats_line`)."""
    n = w["positions"]
    line = (
        f"stats: window over {n} decode position{'' if n == 1 else 's'}, means per position: forward "
        f"{_ms(w['forward_ms'])} ms (wall) | sample {_ms(w['sample_ms'])} ms (wall)"
    )
    if gpu:
        line += (
            f" | gpu {_ms(w['gpu_ms'])} ms (event span) | gpu floor {_ms(w['busy_ms'])} ms (the device's own work: "
            f"the step with no host work) | wait {_ms(w['wait_ms'])} ms (wall) | cpu-experts "
            f"{_ms(w['cpu_expert_ms'])} ms (wall)"
        )
    if experts:
        per = " ".join(f"{il}:{h}/{c}/{p}" for il, (h, c, p) in w["layers"].items())
        line += (
            f" | {w['pcie_mib']:.2f} MiB over PCIe (misses read, cache swaps, prefetch copies); summed: experts "
            f"{w['hits']} hits / {w['cpu_misses']} CPU misses / "
            f"{w['pcie_misses']} PCIe misses (counts); per layer hits/CPU misses/PCIe misses (counts): {per}"
        )
    return line


def _summary(r: GenerationResult) -> str:
    tps = f"{r.tokens_per_second:.2f} tok/s" if r.tokens_per_second else "n/a (one token)"
    pps = f"{r.prompt_tokens_per_second:.2f} tok/s" if r.prompt_tokens_per_second else "n/a"
    n_after, n_prompt = r.n_output_tokens - 1, r.n_prompt_tokens
    line = (
        f"[{r.arch}, {r.device}] decode: {tps} ({n_after} token{'' if n_after == 1 else 's'} after the first in "
        f"{r.decode_seconds:.2f} s, batch 1) | prompt: {n_prompt} token{'' if n_prompt == 1 else 's'} in "
        f"{r.prompt_seconds:.2f} s ({pps}, incl. the first generated token) | stop: {r.stop_reason}"
    )
    if r.expert_hits or r.expert_misses:
        line += f" | experts: {r.expert_hits} hits / {r.expert_misses} misses, {r.expert_pcie} of them over PCIe"
        if r.prefetched:
            line += f" ({r.prefetch_read} copied ahead by the prefetch, which copied {r.prefetched})"
        line += " (counts)"
    return line


def _stage_summary(engine: Engine) -> dict | None:
    dec = engine.decoder
    if dec is None or not dec.stage_times.steps:
        return None
    return {
        "steps": dec.stage_times.steps,
        "grouped": dec.stage_times.grouped(),
        "per_stage": dec.stage_times.per_token(),
    }


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


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """What ``strata-engine generate`` was asked besides the engine's options (one field per click option
    of the same destination): the prompt (``--chat``: the user message of the chat template, ``system``
    before it), the length and sampling, the output (``as_json``, ``stats``, ``verbose``)."""

    pack: str
    prompt: str
    system: str | None = None
    chat: bool = False
    parse_special: bool = True
    n_tokens: int = 32
    ignore_eos: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    as_json: bool = False
    stats: bool = False
    verbose: bool = False

    def check(self) -> Sampler:
        """Generate's checks that need no engine, in the order they are reported (the text, --system and
        --chat, PACK, sampling and length), then the sampler.

        Raises:
            GenerateError: the first refusal, naming the option.
        """
        for opt, text in (("--prompt", self.prompt), ("--system", self.system)):
            if bad := not_utf8(opt, text):
                raise GenerateError(bad)
        if self.system is not None and not self.chat:
            raise GenerateError("--system needs --chat (the system message goes through the model's chat template)")
        if self.chat and not self.parse_special:
            raise GenerateError(
                "--no-parse-special with --chat would make the chat template's own markers plain text; "
                "llama.cpp always parses them in a chat prompt"
            )
        sampling = {f.name: getattr(self, f.name) for f in fields(Sampler) if f.init}  # the sampler's settings
        if bad := check_pack_dir(self.pack) or check_request(n_tokens=self.n_tokens, **sampling):
            raise GenerateError(bad)
        try:
            return Sampler(**sampling)
        except ValueError as e:
            raise GenerateError(str(e)) from None

    def check_positions(self, n_ctx: int | None) -> None:
        """Refuse ``-n`` beyond the context ``n_ctx`` as asked (None: the model's, checked once the prompt is
        tokenized: :func:`strata.engine.generate.generate`); the prompt has at least one token."""
        if n_ctx is not None and self.n_tokens > n_ctx:  # 1 + n - 1 positions (-1: what the context leaves)
            raise GenerateError(
                f"-n/--n-tokens {self.n_tokens} needs at least {self.n_tokens} positions (even a one-token prompt + "
                f"{self.n_tokens} new tokens - 1), more than --ctx {n_ctx}: raise --ctx to {self.n_tokens} or more, "
                f"or lower -n"
            )

    def text(self, engine: Engine) -> str:
        """What is tokenized (the chat template applied with --chat); first says the engine's notes once and
        with --stats the units and columns of its lines (stderr)."""
        for line in engine.notes:  # what the forward pass knowingly leaves out, said once
            click.echo(f"note: {line}", err=True)
        text = (
            chat_prompt(engine.tokenizer, self.prompt, self.system, where=str(self.pack)) if self.chat else self.prompt
        )
        if self.stats:
            click.echo(STATS_UNITS, err=True)
            cols = "stats: columns: pos phase token_in -> token_out | forward ms | sample ms"
            if engine.probe is not None:
                cols += " | gpu ms | cpu-experts ms | wait ms"
            if engine.experts is not None:
                cols += " | expert hits/misses (counts) total and per layer"
            click.echo(cols, err=True)
        return text

    def run(self, engine: Engine, text: str, sampler: Sampler) -> None:
        """Generate and print: text mode echoes the prompt at the first position (after generate's checks
        passed; not with --chat) and streams each token; --json prints one object at the end. A refusal
        exits 2; Ctrl-C keeps the tokens streamed (exit 130, :func:`strata.packer.exits.interrupted`)."""
        as_json, gpu, experts = self.as_json, engine.probe is not None, engine.experts is not None
        stream = TextStream(engine.tokenizer, frozenset() if self.ignore_eos else engine.tokenizer.eog_ids, not as_json)
        echoed = [as_json or self.chat]
        if self.seed == -1 and not as_json:  # --json reports it in "sampling"
            click.echo(f"seed: {sampler.seed} (--seed -1 drew it; --seed {sampler.seed} repeats this run)", err=True)
        tty = sys.stderr.isatty() and not (as_json or self.stats)
        bar = prompt_progress(engine, text, self.parse_special, on=tty)

        def on_step(st: StepStat) -> None:
            if bar is not None and st.phase == "prompt":
                bar.update(1)
                return
            if bar is not None:
                bar.close()  # the prompt is done: the line goes before the prompt's echo and the tokens
            if not echoed[0]:
                echoed[0] = True
                click.echo(self.prompt, nl=False)
                sys.stdout.flush()
            if self.stats:
                click.echo(stats_line(st, engine.tokenizer.piece, gpu, experts), err=True)
            if st.token_out is not None:
                stream(st.token_out)

        try:
            try:
                r = generate(
                    engine,
                    text,
                    self.n_tokens,
                    sampler=sampler,
                    ignore_eos=self.ignore_eos,
                    on_step=on_step,
                    stats=self.stats,
                    parse_special=self.parse_special,
                )
            finally:
                if bar is not None:
                    bar.close()  # a refusal or Ctrl-C during the prompt: the line does not stay
        except REFUSALS as e:
            if echoed[0] and not as_json and not self.chat:
                click.echo("")  # ends the echoed prompt's line
            fail(str(e), as_json=as_json)
        except KeyboardInterrupt as e:
            stream.finish()
            raise interrupted(
                e,
                f"stopped after {len(stream.ids)} generated token(s)" + ("" if as_json else " (printed above)"),
                {"output_ids": stream.ids, "text": engine.tokenizer.decode(stream.ids)},
            ) from None
        self.report(engine, r, stream)

    def report(self, engine: Engine, r: GenerationResult, stream: TextStream) -> None:
        """The end: the --json object (steps with --stats, the stage times with --stage-times), or the
        text's last characters and the summary line (and the stage times) on stderr."""
        st = _stage_summary(engine) if engine.options is not None and engine.options.stage_times else None
        if self.as_json:
            d = r.model_dump()
            if not self.stats:
                d.pop("steps")
            else:
                d["stats_window"] = window_summary(r.steps)
            if st is not None:
                d["stage_ms_per_token"] = st
            click.echo(json.dumps(d))
            return
        stream.finish()
        w = window_summary(r.steps) if self.stats else None
        if w is not None:
            click.echo(window_line(w, engine.probe is not None, engine.experts is not None), err=True)
        click.echo(_summary(r), err=True)
        if st is not None:
            click.echo(
                "stage times: device ms per position (CUDA events between stages, eager fused step; "
                "attn/ffn summed over layers): " + ", ".join(f"{k} {v:.3f} ms" for k, v in st["grouped"].items()),
                err=True,
            )


__all__ = [
    "STATS_UNITS",
    "GenerateRequest",
    "TextStream",
    "check_request",
    "not_utf8",
    "stats_line",
    "window_line",
    "window_summary",
]
