"""The q8 GPU kernels' launch shape (docs/DESIGN.md "Kernel launch shapes"): which types have q8 kernels and the
activation format each quantizes to, what a compiled q8 module is (:class:`Q8Kernels`), and how a product's rows are
laid over warps and CTAs (:func:`q8_launch`). Plain Python (no CuPy, no compiler): the budget-free part of
:mod:`strata.engine.gpu.kernels`, which re-exports every name here; tests/test_gpu_q8_launch.py checks it in CI.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from strata.packer import quants

from ..kernel_src import assembly as A

#: ggml type ids with q8 GPU kernels: the registry rows with ``q8_kernel`` (each has ``kernel_src/q8/<NAME>.cuh``; the
#: CPU's ``"q8"`` kernel covers the same set).
Q8_GPU_TYPES: frozenset[int] = frozenset(t.id for t in quants.QTYPES.values() if t.q8_kernel)


def q8_act_format(type_id: int) -> int:
    """The activation format a q8 product of ``type_id`` quantizes its input to (llama.cpp's
    ``vec_dot_type``): 1 = Q8_0 (blocks of 32, for the 32-value weight types), 2 = Q8_K (blocks of 256, K-quants).

    Raises:
        ValueError: a type without a q8 kernel (:data:`Q8_GPU_TYPES`).
    """
    if type_id not in Q8_GPU_TYPES:
        raise ValueError(
            f"{quants.qtype(type_id).name}: no q8 GPU kernel (have "
            f"{sorted(quants.qtype(i).name for i in Q8_GPU_TYPES)})"
        )
    return 1 if quants.qtype(type_id).block_elems == 32 else 2


@dataclass(frozen=True)
class Q8Kernels:
    """The compiled q8 kernels of one ggml type (``matvec_q8``, ``matvec_q8_batched``, ``matvec_q8_group``), with
    what their launch shape needs: ``qk`` (values per block), ``bpi`` (blocks per warp step: 32 / the lane code's
    ``LPB``) and ``terms`` (shared f32 terms per block: 2 for a Q8_K type with a min, else 1)."""

    type_id: int
    fmt: int
    matvec: object
    matvec_batched: object
    matvec_group: object
    qk: int = 32
    bpi: int = 8
    terms: int = 1


#: Warps per CTA of the q8 kernels (``Q8_WARPS`` in matvec_q8.cu; a power of two; it does not change the
#: arithmetic). ``STRATA_Q8_WARPS`` overrides it for benchmarks (bench/device_profile.sh). ``STRATA_Q8_SPLIT`` fixes
#: the warps per row (:func:`q8_launch`). Defaults: the fastest measured on the H200 (docs/DESIGN.md "Kernel launch
#: shapes").
Q8_WARPS = int(os.environ.get("STRATA_Q8_WARPS", "4"))
Q8_SPLIT = os.environ.get("STRATA_Q8_SPLIT", "auto")
#: Warp steps from which ``auto`` splits a row over every warp of the CTA (``STRATA_Q8_SPLIT_STEPS``).
Q8_SPLIT_STEPS = int(os.environ.get("STRATA_Q8_SPLIT_STEPS", "4"))
#: Dynamic shared memory a q8 launch may take without opting in (CUDA's default per-CTA limit), bytes.
Q8_SHMEM_MAX = 48 * 1024


@functools.cache
def q8_shape(type_id: int) -> tuple[int, int, int]:
    """``(qk, bpi, terms)`` of ``type_id``'s q8 kernels (:class:`Q8Kernels`), read from its lane code
    (``kernel_src/q8/<TYPE>.cuh``: ``LPB``, ``HAS_MIN``) without compiling it.

    Raises:
        ValueError: a type without a q8 kernel.
    """
    import re

    fmt = q8_act_format(type_id)
    src = A.q8_type_source(type_id)
    lpb = int(re.search(r"#define LPB (\d+)", src).group(1))
    has_min = int(re.search(r"#define HAS_MIN (\d+)", src).group(1))
    return quants.qtype(type_id).block_elems, 32 // lpb, 2 if fmt == 2 and has_min else 1


def q8_launch(k: Q8Kernels, rows: int, ne0: int, split: int | None = None) -> tuple[int, int, int, int]:
    """The launch shape of ``k``'s kernels for ``rows`` rows of ``ne0`` values: ``(grid_x, threads, shared_bytes,
    split)`` - a CTA of ``Q8_WARPS`` warps takes ``Q8_WARPS // split`` rows, ``split`` warps per row (matvec_q8.cu).
    ``split`` None: ``STRATA_Q8_SPLIT``, or (``auto``) ``Q8_WARPS`` when the row takes at least ``Q8_SPLIT_STEPS``
    warp steps (ceil(blocks / bpi)), else 1 (measured: docs/DESIGN.md "Kernel launch shapes"). The terms take 4 B
    x terms x blocks per row of the CTA of shared memory (none at split 1), at most ``Q8_SHMEM_MAX``.

    Raises:
        ValueError: a split that does not divide ``Q8_WARPS``, or a row whose terms do not fit even one row per CTA.
    """
    nb = ne0 // k.qk
    if split is None and Q8_SPLIT != "auto":
        split = int(Q8_SPLIT)
    if split is None:
        split = Q8_WARPS if -(-nb // k.bpi) >= Q8_SPLIT_STEPS else 1
    if split < 1 or Q8_WARPS % split:
        raise ValueError(f"q8 split {split}: must divide the {Q8_WARPS} warps of a CTA")
    per = Q8_WARPS // split
    shmem = per * nb * k.terms * 4 if split > 1 else 0
    if shmem > Q8_SHMEM_MAX:
        raise ValueError(f"q8 matvec: a row of {ne0} values needs {shmem} B of shared terms > {Q8_SHMEM_MAX} B")
    return -(-int(rows) // per), 32 * Q8_WARPS, shmem, split


__all__ = [
    "Q8_GPU_TYPES",
    "Q8_SHMEM_MAX",
    "Q8_SPLIT",
    "Q8_SPLIT_STEPS",
    "Q8_WARPS",
    "Q8Kernels",
    "q8_act_format",
    "q8_launch",
    "q8_shape",
]
