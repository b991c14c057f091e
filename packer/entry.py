"""Console-script entry point of ``strata-pack`` (``pyproject.toml`` ``[project.scripts]``), and the early
signal handlers the three tools' entry points share (``strata.budget.entry``, ``strata.engine.entry``).

Each installs a quiet SIGINT / SIGTERM / SIGHUP handler before importing its command line (NumPy,
gguf, pyarrow... take a few hundred ms to import): a Ctrl-C in that window exits 128 + N with one
``error: interrupted`` line, as the exit contract promises (:mod:`strata.packer.exits`), instead of a
``KeyboardInterrupt`` traceback from inside an import. The command line then installs its own handlers
(:func:`strata.packer.exits.signal_handlers`), which do the cleanup once there is something to clean up.
"""

from __future__ import annotations

import signal
import sys


def early_signals() -> None:
    """Exit 128 + N on SIGINT / SIGTERM / SIGHUP with one line, until the command line installs its own."""

    def quit_(signum, _frame):
        sys.stderr.write(f"error: interrupted by {signal.Signals(signum).name} while starting; nothing was done\n")
        sys.stderr.flush()
        raise SystemExit(128 + signum)  # through the import under way: no traceback

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(s, quit_)
        except (ValueError, OSError):  # not the main thread, or a platform without it
            pass


def finished() -> None:
    """Ignore SIGINT / SIGTERM / SIGHUP from here on: the command has answered (its exit status is set),
    and a signal while the interpreter shuts down must not turn that into a 'while starting' message."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(s, signal.SIG_IGN)
        except (ValueError, OSError):
            pass


def run(module: str) -> None:
    """Run the click command line ``main`` of ``module`` (e.g. ``"strata.engine.cli"``) between
    :func:`early_signals` (installed before the import) and :func:`finished`."""
    import importlib

    early_signals()
    main = importlib.import_module(module).main
    try:
        main()
    finally:
        finished()


def pack() -> None:
    """``strata-pack``."""
    run("strata.packer.cli")


__all__ = ["early_signals", "finished", "pack", "run"]
