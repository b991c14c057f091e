"""``python -m strata.packer``: ``strata-pack``, the same command line (where the environment's scripts are
not on PATH: the Makefile calls it so)."""

from .entry import pack

pack()
