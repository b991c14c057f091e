"""Console-script entry point of ``strata-budget``: quiet signal handlers first, then the command line
(:func:`strata.packer.entry.early_signals`: a Ctrl-C while the heavy imports run exits 130, no traceback)."""

from __future__ import annotations

from strata.packer.entry import early_signals, finished


def main() -> None:
    """``strata-budget``."""
    early_signals()
    from strata.budget.cli import main as cli

    try:
        cli()
    finally:
        finished()


__all__ = ["main"]
