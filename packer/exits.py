"""One exit-code and signal contract for every strata command (``strata-pack``, ``strata-budget``,
``strata-engine``): the codes, what 1 means per command, and the click classes that keep it.

A script reads the exit code alone:

- 0: done; the answer is yes (the pack matches, the plan fits, the measurement agrees).
- 1: done; the answer is no (:data:`NEGATIVE`: only the commands listed there have one).
- 2: refused: bad input (a usage error, a path that is not a pack, a GGUF given where a pack is
  expected, an unreadable source, an output that cannot be written, a pack the command cannot use).
- 128 + N: stopped by signal N (``SIGINT``/Ctrl-C 130, ``SIGTERM`` 143, ``SIGHUP`` 129), with one
  ``error: interrupted by SIG...`` line, no traceback, and nothing half-written: every output is
  written under a temporary name and renamed into place only when complete.
- 141: the reader of stdout went away (``| head``): nothing more is printed, no traceback.

Click's own handling would print ``Aborted!`` and exit 1 on Ctrl-C (and exit 1 on a closed pipe), and a
three-line usage block (``Usage: ...``, ``Try ...``, ``Error: ...``) for a bad option value;
:class:`StrataGroup` / :class:`StrataCommand` replace it (:func:`exit_contract`; a usage error is one
``error: ...`` line, exit 2, as every other refusal).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

#: click >= 8.2 raises this for a group run without arguments (it prints the group's help, exit 2)
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())

EXIT_OK, EXIT_NO, EXIT_REFUSED = 0, 1, 2
EXIT_SIGPIPE = 128 + signal.SIGPIPE
#: The signals a command turns into ``128 + N`` (after its cleanup).
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM

#: What exit 1 means, per command (commands not listed never exit 1).
NEGATIVE: dict[str, str] = {
    "strata-pack verify": "the pack differs from its sources, or one of its files is corrupt (named, with both "
    "numbers)",
    "strata-pack fetch": "the download or its sha256/size check failed (nothing is left in the cache)",
    "strata-budget check": "the plan does not fit the card, or --expert-cache N does not fit",
    "strata-engine measure": "a budget term differs from what the engine allocated, or the reserve was not free "
    "after start-up",
}
#: Every command, in the order of the README's table.
COMMANDS = (
    "strata-pack build",
    "strata-pack verify",
    "strata-pack inspect",
    "strata-pack fetch",
    "strata-budget check",
    "strata-engine generate",
    "strata-engine measure",
    "strata-engine profile",
)


#: What exit 2 means, per command (always one ``error: ...`` line; with ``--json`` an error object too).
REFUSED: dict[str, str] = {
    "strata-pack build": "not a GGUF, a foreign shard or a big-endian file, an unsupported tokenizer, a metadata key "
    "whose value strata does not implement (key and value named), an output that exists or "
    "cannot be written (the bytes needed and free when the disk is full)",
    "strata-pack verify": "not a pack (missing, empty, a GGUF file), a pack built by an older strata (rebuild it: "
    "the message budget and the engine give), a source shard moved (`--source-dir`) or unreadable: nothing compared",
    "strata-pack inspect": "neither a GGUF nor a pack, a `--parquet` file that cannot be written",
    "strata-pack fetch": "an unknown name, an unusable cache directory, not enough free space",
    "strata-budget check": "a semantic error in the pack (every failure listed), not a pack, a bad card, option or "
    "profile",
    "strata-engine generate": "not a pack, a pack the engine cannot load, a refused request (`--chat` without a chat "
    "template, prompt + tokens beyond `--ctx`, ...), a start that does not fit the card "
    "(`--card`: the numbers), a pack file or shard truncated or rewritten while it runs (found between steps; cut "
    "while a step reads it: 135, below)",
    "strata-engine measure": "no CUDA GPU, not a pack, a pack that cannot load, an option out of range",
    "strata-engine profile": "not a pack, a missing prompts file, an `-o` that cannot be written",
}
OK: dict[str, str] = {
    "strata-pack build": "the pack is written and re-read",
    "strata-pack verify": (
        "identical to its sources: dense tensors byte for byte; routed experts (read in place from the shards) "
        "by the build record's samples, the first and last 256 B of each expert"
    ),
    "strata-pack inspect": "the table is printed",
    "strata-pack fetch": "the verified model's path is printed",
    "strata-budget check": "the audit passes and the plan fits",
    "strata-engine generate": "the text is generated",
    "strata-engine measure": "every exact term equal, the total within tolerance, the reserve free",
    "strata-engine profile": "the profile is written",
}
SIGNALS_NOTE = (
    "Every command: **130** when interrupted by SIGINT (Ctrl-C), **143** by SIGTERM (128 + the signal "
    "number; 129 for SIGHUP), after its cleanup: one `error: interrupted by SIG...` line, no traceback, "
    "nothing half-written (outputs are written under a temporary name and renamed when complete; "
    "`generate` keeps the tokens it printed). **141** when the reader of stdout goes away (`| head`), "
    "silently.\n"
    '**135** (SIGBUS, "Bus error", no message): a pack file or shard truncated in place while a step of `generate` '
    "reads it - the engine maps its files and checks their sizes between steps (engine/mapped.py), and a step usually "
    "reads the cut pages first (a new-user test truncated `pool.bin` mid-run: 5 times 135, once the clean exit 2). "
    "Replace files by rename (a running engine keeps the old inode); never truncate a file an engine has open."
)


def exit_table() -> str:
    """The README's exit-code table (Markdown) and its note on signals, generated from :data:`COMMANDS`,
    :data:`OK`, :data:`NEGATIVE` and :data:`REFUSED` (``tests/test_exit_codes.py`` checks that the README
    holds exactly this text and produces every cell)."""
    rows = ["| command | 0 | 1 | 2 |", "|---|---|---|---|"]
    for c in COMMANDS:
        rows.append(f"| `{c}` | {OK[c]} | {NEGATIVE.get(c, '(never)')} | {REFUSED[c]} |")
    return "\n".join(rows) + "\n\n" + SIGNALS_NOTE


class Interrupted(KeyboardInterrupt):
    """A handled signal, raised in the main thread so ``finally``/``except BaseException`` cleanups
    run (temporary files removed). ``detail``: what the command says about its state."""

    def __init__(self, signum: int = signal.SIGINT, detail: str = "", json_fields: dict | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.detail = detail
        self.json_fields = json_fields or {}

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def interrupted(e: BaseException, detail: str, json_fields: dict | None = None) -> Interrupted:
    """``e`` (a KeyboardInterrupt) as an :class:`Interrupted` carrying ``detail`` and, for ``--json``,
    ``json_fields`` added to the error object (what was done before the signal); its signal kept."""
    return Interrupted(getattr(e, "signum", signal.SIGINT), detail, json_fields)


def _handler(signum, frame):
    # one signal is enough: the rest are ignored so a second Ctrl-C cannot cut the cleanup short
    for s in HANDLED_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


@contextmanager
def signal_handlers() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` while the block runs (previous handlers
    restored after it). Outside the main thread nothing is installed."""
    try:
        old = {s: signal.signal(s, _handler) for s in HANDLED_SIGNALS}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


@contextmanager
def exit_contract(as_json: bool = False, json_error: Callable[[str], dict] | None = None) -> Iterator[None]:
    """Turn an interruption into ``128 + N`` with one ``error:`` line (and a JSON error object on
    stdout with ``--json``), and a closed stdout into 141, silently."""
    try:
        yield
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except KeyboardInterrupt as e:
        sig = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        detail = getattr(e, "detail", "")
        msg = f"interrupted by {sig.signal_name}" + (f"; {detail}" if detail else "")
        try:
            if as_json:
                obj = (
                    json_error(msg)
                    if json_error
                    else {"ok": False, "error": msg, "signal": sig.signal_name, "exit_code": sig.exit_code}
                )
                obj.update(getattr(e, "json_fields", None) or {})
                click.echo(json.dumps(obj))
            if sys.stderr.isatty() and not detail.endswith("(printed above)"):
                click.echo("", err=True)  # past the terminal's ^C (generate has ended its line already)
            click.echo(f"error: {msg}", err=True)
        except OSError:
            pass
        sys.exit(sig.exit_code)
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        _quiet_stdout()
        sys.exit(EXIT_SIGPIPE)


class _Contract:
    """What :class:`StrataGroup` and :class:`StrataCommand` share."""

    #: ``message -> the --json object`` printed on an interruption (default ``{"ok": false, "error": ...}``)
    json_error: Callable[[str], dict] | None = None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        self._as_json = "--json" in argv
        self._standalone = standalone_mode
        for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 prints as its bytes, not a traceback
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="surrogateescape")
        with signal_handlers():
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)

    def _refuse(self, e: click.ClickException) -> None:
        """A usage error click found (an option value out of range or not a choice, a missing or unknown
        option, argument or command) as every other refusal: one ``error: ...`` line on stderr (with ``--json``
        also one error object on stdout), exit ``e.exit_code`` (2), instead of click's usage block. Outside
        standalone mode, and for a bare group (its help is the answer), the exception goes on to click."""
        if not getattr(self, "_standalone", False) or isinstance(e, _NO_ARGS_IS_HELP):
            raise e
        msg = " ".join(e.format_message().split("\n"))
        if getattr(self, "_as_json", False):
            click.echo(json.dumps(self.json_error(msg) if self.json_error else {"ok": False, "error": msg}))
        click.echo(f"error: {msg}", err=True)
        sys.exit(e.exit_code)

    def make_context(self, info_name, args, parent=None, **extra):
        try:  # the command's (or the group's) own options and arguments
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as e:
            self._refuse(e)

    def invoke(self, ctx):
        with exit_contract(getattr(self, "_as_json", False), self.json_error):
            try:  # a group's subcommand is resolved and parsed here
                return super().invoke(ctx)
            except click.ClickException as e:
                self._refuse(e)


class StrataGroup(_Contract, click.Group):
    """A click group keeping the exit-code contract (module docstring) for all its commands."""


class StrataCommand(_Contract, click.Command):
    """A click command run on its own (``python -m strata.packer.fetch``) keeping the same contract."""


__all__ = [
    "COMMANDS",
    "EXIT_NO",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_SIGINT",
    "EXIT_SIGPIPE",
    "EXIT_SIGTERM",
    "HANDLED_SIGNALS",
    "Interrupted",
    "NEGATIVE",
    "OK",
    "REFUSED",
    "SIGNALS_NOTE",
    "StrataCommand",
    "StrataGroup",
    "exit_contract",
    "exit_table",
    "interrupted",
    "signal_handlers",
]
