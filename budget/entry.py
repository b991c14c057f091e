"""Console-script entry point of ``strata-budget`` (:func:`strata.packer.entry.run`: quiet signal handlers
before the heavy imports, so a Ctrl-C while the tool starts exits 130 without a traceback)."""

from __future__ import annotations

from strata.packer.entry import run


def main() -> None:
    """``strata-budget``."""
    run("strata.budget.cli")


__all__ = ["main"]
