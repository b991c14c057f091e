"""What every ``strata-engine`` command shares: the refusals it turns into exit 2, the one-line
``error: ...`` printer, the PACK argument check and the checkpoint printer."""

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


__all__ = ["REFUSALS", "check_pack_dir", "fail", "print_checkpoint", "warn"]
