"""GPU path of the strata engine (CuPy): kernels over engine form, VRAM residency, expert cache.

Importing this package never imports CuPy; :func:`strata.engine.gpu.kernels.gpu_available`
says whether CuPy and a CUDA device are usable (and why not).
"""
