"""Console-script entry point of ``strata-engine`` (:func:`strata.packer.entry.run`: quiet signal handlers
before the heavy imports, so a Ctrl-C while the tool starts exits 130 without a traceback)."""

from __future__ import annotations

from strata.packer.entry import run


def main() -> None:
    """``strata-engine``."""
    run("strata.engine.cli")


__all__ = ["main"]
