"""Every CUDA module the engine compiles, compiled WITHOUT a GPU: ``nvcc -ptx`` (the CUDA toolkit's compiler, when this
machine has it) on the exact sources NVRTC gets on the GPU machine (strata.engine.gpu.kernels.module_sources and the
fused step's), with NVRTC_OPTIONS, each kernel the engine looks up present as an entry of the PTX.

CI has no GPU, so the GPU tests skip there; this one catches a CUDA edit that does not compile (or renames a kernel)
before it reaches the GPU machine. It says nothing about the kernels' results (tests/test_gpu_*.py on the GPU
machine, and tests/test_gpu_q8_source.py / test_gpu_kernel_source.py for the lane code on the host). Skips without
nvcc.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from strata.engine.gpu import attn_rows as AR
from strata.engine.gpu import kernels as K
from strata.engine.gpu import moe_mm as MM
from strata.engine.gpu import rows_ops as RO
from strata.engine.gpu.fused_ops import FUSED_KERNEL_NAMES, fused_source

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit) to compile the kernel sources")


def _compile(label: str, source: str, names: tuple[str, ...], d) -> str | None:
    """None when ``source`` compiles to PTX with every kernel of ``names``, else what went wrong."""
    cu, ptx = d / f"{label.replace(' ', '_')}.cu", d / f"{label.replace(' ', '_')}.ptx"
    cu.write_text(source)
    p = subprocess.run(
        [NVCC, "-ptx", "-arch=sm_90", *K.NVRTC_OPTIONS, str(cu), "-o", str(ptx)], capture_output=True, text=True
    )
    if p.returncode != 0:
        return f"{label}: nvcc exit {p.returncode}: {p.stderr[-1500:]}"
    text = ptx.read_text()
    missing = [n for n in names if f".entry {n}(" not in text]
    return f"{label}: kernels not in the PTX: {missing}" if missing else None


def test_every_cuda_module_compiles(tmp_path):
    mods = dict(K.module_sources())
    mods["fused step"] = (fused_source(), FUSED_KERNEL_NAMES)
    mods |= MM.mm_sources() | AR.sources()
    mods["rows_ops"] = (RO.source(), RO.KERNEL_NAMES)
    assert len(mods) >= 59  # every GPU type, every q8 type, the quantizer, silu_mul, the fused step
    with ThreadPoolExecutor(2) as ex:
        errors = [e for e in ex.map(lambda kv: _compile(kv[0], *kv[1], tmp_path), mods.items()) if e]
    assert not errors, "\n".join(errors)
