"""What every ``strata-engine`` command shares: the refusals it turns into exit 2, the one-line
``error: ...`` printer, the PACK argument check, the checkpoint printer, and the help section that keeps
the benchmark switches out of the user's way (:func:`dev_option`, :class:`DevCommand`)."""

from __future__ import annotations

import json
import sys

import click

from strata.budget.errors import BudgetInputError
from strata.manifests.contract import ManifestError
from strata.packer.outputs import OutputError
from strata.packer.pack import not_a_pack
from strata.packer.packfmt import PackFormatError

from .checkpoints import Checkpoint
from .dequant import DequantError
from .errors import GenerateError
from .loader import LoadError
from .models import UnsupportedModel
from .tokenizer import TokenizerError
from .weights import WeightError

#: Exceptions a command reports as a refusal (exit 2, one line naming the file, tensor or numbers).
REFUSALS = (
    PackFormatError,
    ManifestError,
    LoadError,
    UnsupportedModel,
    TokenizerError,
    GenerateError,
    DequantError,
    WeightError,
    BudgetInputError,
    FileNotFoundError,
    PermissionError,
    OutputError,
)


def fail(msg: str, code: int = 2, as_json: bool = False) -> None:
    """One-line ``error: ...`` on stderr (and with ``--json`` a ``{"ok": false, "error": ...}`` object
    on stdout), then exit ``code`` (2: refused)."""
    msg = " ".join(str(msg).split("\n")) if msg else "refused"
    if as_json:
        click.echo(json.dumps({"ok": False, "error": msg}))
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)


def warn(msg: str) -> None:
    """``warning: ...`` on stderr."""
    click.echo(f"warning: {msg}", err=True)


def check_pack_dir(pack: str) -> str | None:
    """The refusal for a PACK argument that is not a pack directory (missing, a file, a GGUF file:
    :func:`strata.packer.pack.not_a_pack`), else None."""
    return not_a_pack(pack)


def print_checkpoint(cp: Checkpoint) -> None:
    """One ``--verbose`` start-up line on stderr."""
    click.echo(cp.line(), err=True)


#: The ``--help`` section of the options marked :func:`dev_option`.
DEV_SECTION = "Developer options (benchmarks)"


class DevOption(click.Option):
    """An option for benchmarks and debugging: it works as any other, and ``--help`` lists it under
    :data:`DEV_SECTION` (:class:`DevCommand`)."""

    developer = True


def dev_option(*decls: str, **kw):
    """``click.option`` for a developer switch (:class:`DevOption`)."""
    return click.option(*decls, cls=DevOption, **kw)


class DevCommand(click.Command):
    """A command whose ``--help`` lists the user's options under "Options" and the :class:`DevOption` ones
    after them, under :data:`DEV_SECTION`."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[bool, list[tuple[str, str]]] = {False: [], True: []}
        for param in self.get_params(ctx):
            rv = param.get_help_record(ctx)
            if rv is not None and not isinstance(param, click.Argument):
                sections[getattr(param, "developer", False)].append(rv)
        for dev, title in ((False, "Options"), (True, DEV_SECTION)):
            if sections[dev]:
                with formatter.section(title):
                    formatter.write_dl(sections[dev])


__all__ = [
    "DEV_SECTION",
    "REFUSALS",
    "DevCommand",
    "DevOption",
    "check_pack_dir",
    "dev_option",
    "fail",
    "print_checkpoint",
    "warn",
]
