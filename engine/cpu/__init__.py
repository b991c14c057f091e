"""The CPU device: its kernels (:mod:`strata.engine.cpu.kernels`, C compiled on first use from the shared per-type
code of :mod:`strata.engine.kernel_src` and the C sources of this folder, installed as package data).

Never imports :mod:`strata.engine.gpu` (tests/test_structure.py); the GPU path imports the CPU kernels where it
computes on the host (expert misses, the ``sim`` backend, host rows).
"""
