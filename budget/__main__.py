"""``python -m strata.budget``: ``strata-budget``, the same command line (where the environment's scripts are
not on PATH: the Makefile calls it so)."""

from .entry import main

main()
