"""The per-type kernel sources both devices compile, and their assembly (:mod:`strata.engine.kernel_src.assembly`).

One definition of each ggml type's device code, shared by the CPU (:mod:`strata.engine.cpu.kernels`, compiled
by the host's C compiler behind stubs for the CUDA keywords) and the GPU (:mod:`strata.engine.gpu.kernels`,
compiled by NVRTC): ``prelude.cuh`` (typedefs, loads, ``h2f``, ``scale_min_k4``), ``types/<TYPE>.cuh``
(``deq_chunk`` / ``load_w``), ``q8_layout.h`` (the quantized activation's layout), and the q8 lane code
(``q8_lane.cuh``, ``q8/<TYPE>.cuh``; the GPU's q8 kernels, compiled on the host by the tests). The kernels
themselves are each device's own (``engine/cpu/*.c``, ``engine/gpu/cuda/*.cu``). Installed as package data.

Imports neither :mod:`strata.engine.cpu` nor :mod:`strata.engine.gpu` (tests/test_structure.py).
"""
