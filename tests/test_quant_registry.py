"""The registry row is the one definition of each per-type fact (strata.packer.quants): the CPU
dequantizer it names exists where it says, the per-type kernel files under engine/kernel_src/types are
exactly the rows with ``gpu_kernel``, the kernels' QK/NF/PB defines come from the row, and the
CUDA and C files are declared as package data (so a non-editable install ships them)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from strata.engine import dequant
from strata.engine import engine_form as EF
from strata.engine.gpu import kernels as K
from strata.engine.kernel_src import assembly as A
from strata.packer import dequant_own, quants

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_dequant_column_matches_what_gguf_py_offers():
    for t in quants.QTYPES.values():
        has_gguf = dequant._gguf_class(t.id) is not None
        assert (t.cpu_dequant == "gguf") == has_gguf, t.name
        assert (t.cpu_dequant == "strata") == (t.own_dequantize is not None), t.name
    assert {t.name for t in quants.QTYPES.values() if t.cpu_dequant == "view"} == {"F32", "F16"}
    assert quants.by_name("Q1_0").own_dequantize is dequant_own.dequantize_q1_0
    assert quants.by_name("Q2_0").own_dequantize is dequant_own.dequantize_q2_0


def test_engine_supported_is_cpu_dequantizer_and_gpu_kernel():
    for t in quants.QTYPES.values():
        assert t.engine_supported == (t.gpu_kernel and t.cpu_dequant is not None), t.name
        assert t.engine_supported == dequant.supported(t.id), t.name


def test_act_format_column():
    by = {}
    for t in quants.QTYPES.values():
        by.setdefault(t.act_format, set()).add(t.name)
    assert by["q8_0"] == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q1_0", "Q2_0", "MXFP4", "NVFP4"}
    assert by["q8_K"] == {
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ1_S",
        "IQ1_M",
        "IQ4_XS",
        "TQ1_0",
        "TQ2_0",
    }
    assert by["f16"] == {"F16"} and by["bf16"] == {"BF16"}
    assert set(by) == {"q8_0", "q8_K", "f16", "bf16", "f32"}


def test_engine_geometry_of_the_row_is_the_engine_form_layout():
    for t in quants.QTYPES.values():
        assert t.engine_block_bytes == 4 * t.engine_scale_fields + t.engine_payload_bytes, t.name
        ne = (t.block_elems * 4, 3)
        lay = EF.engine_layout(t.id, t.id, ne)
        assert (lay.n_fields, lay.payload_block_bytes) == (t.engine_scale_fields, t.engine_payload_bytes), t.name


def test_gpu_kernel_files_are_exactly_the_gpu_kernel_rows():
    files = {p.stem for p in (A.SRC_DIR / "types").glob("*.cuh")}
    rows = {t.name for t in quants.QTYPES.values() if t.gpu_kernel}
    assert files == rows
    assert set(A.SUPPORTED_TYPES) == {quants.by_name(n).id for n in rows}


@pytest.mark.parametrize(
    "name,qk,nf,pb",
    [
        ("Q4_0", 32, 1, 16),
        ("Q4_1", 32, 2, 16),
        ("Q5_0", 32, 1, 20),
        ("Q5_1", 32, 2, 20),
        ("Q8_0", 32, 1, 32),
        ("IQ4_NL", 32, 1, 16),
        ("Q1_0", 128, 1, 16),
        ("Q2_0", 64, 1, 16),
        ("Q2_K", 256, 0, 84),
        ("Q3_K", 256, 0, 110),
        ("Q4_K", 256, 0, 144),
        ("Q5_K", 256, 0, 176),
        ("Q6_K", 256, 0, 210),
        ("IQ2_XXS", 256, 0, 66),
        ("IQ2_XS", 256, 0, 74),
        ("IQ2_S", 256, 0, 82),
        ("IQ3_XXS", 256, 0, 98),
        ("IQ4_XS", 256, 0, 136),
    ],
)
def test_kernel_defines_are_generated_from_the_row(name, qk, nf, pb):
    t = quants.by_name(name)
    assert A.type_defines(t.id) == f"#define QK {qk}\n#define NF {nf}\n#define PB {pb}\n"
    src = K.source_for(t.id)
    assert src.count("#define QK ") == 1 and A.type_defines(t.id) in src
    # the hand-written device code defines no block geometry of its own
    assert not re.search(r"#define\s+(QK|NF|PB)\b", A.source_file(f"types/{name}.cuh"))


def test_no_gpu_kernel_is_refused_with_the_list():
    with pytest.raises(NotImplementedError, match=r"no GPU kernel for IQ3_S \(type 21\); have \[.*'Q4_K'"):
        K.source_for(quants.by_name("IQ3_S").id)


def test_cuda_files_are_package_data():
    """Every file under engine/gpu/cuda ships in the wheel: its folder is a package of pyproject.toml
    (strata.engine.gpu.cuda, .cuda.types) whose package-data globs match it."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {
        pkg: (ROOT / d).resolve() for pkg, d in cfg["package-dir"].items() if pkg.startswith("strata.engine.gpu.cuda")
    }
    assert K.CUDA_DIR == dirs["strata.engine.gpu.cuda"] and set(dirs) <= set(cfg["packages"])
    files = [p for p in K.CUDA_DIR.rglob("*") if p.is_file()]
    assert files
    missing = []
    for p in files:
        pkg = next((k for k, d in dirs.items() if p.parent == d), None)
        if pkg is None or not any(fnmatch.fnmatch(p.name, g) for g in cfg["package-data"].get(pkg, [])):
            missing.append(p.relative_to(K.CUDA_DIR).as_posix())
    assert missing == []


@pytest.mark.parametrize("pkg", ["strata.engine.kernel_src", "strata.engine.cpu"])
def test_kernel_sources_are_package_data(pkg):
    """Every source file under engine/kernel_src (the per-type device code both devices compile) and engine/cpu
    (the CPU's C kernels) ships in the wheel: its folder is a package of pyproject.toml whose package-data globs
    match it, and it is the folder the source assembly reads."""
    from strata.engine.cpu import kernels as CK

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {p: (ROOT / d).resolve() for p, d in cfg["package-dir"].items() if p == pkg or p.startswith(pkg + ".")}
    assert set(dirs) <= set(cfg["packages"])
    assert {"strata.engine.kernel_src": A.SRC_DIR, "strata.engine.cpu": CK.HERE}[pkg] == dirs[pkg]
    files = [p for p in dirs[pkg].rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert files
    missing = []
    for p in files:
        owner = next((k for k, d in dirs.items() if p.parent == d), None)
        if owner is None or not any(fnmatch.fnmatch(p.name, g) for g in cfg["package-data"].get(owner, [])):
            missing.append(p.relative_to(dirs[pkg]).as_posix())
    assert missing == []


def test_fused_source_is_prelude_fused_file_and_logit_summary():
    from strata.engine.gpu import fused_ops as fused

    src = fused.fused_source()
    top = f"#define TOPK {fused.TOP_K}\n#define TOP_THREADS {fused.TOP_THREADS}\n"
    assert src == (
        A.source_file("prelude.cuh")
        + K.q8_quant_source()
        + K.cuda_file("fused.cu")
        + top
        + K.cuda_file("logit_top.cu")
        + K.cuda_file("prefetch.cu")
    )
    for name in fused.FUSED_KERNEL_NAMES:  # a kernel may declare its launch bounds (gdn_step's 512 threads)
        assert re.search(rf'extern "C" __global__ void (__launch_bounds__\(\w+\) )?{name}\(', src), name


def test_own_dequantizers_take_whole_blocks():
    rng = np.random.default_rng(3)
    for t in (quants.by_name("Q1_0"), quants.by_name("Q2_0")):
        blocks = rng.integers(0, 256, size=(5, t.block_bytes), dtype=np.uint8)
        blocks[:, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        y = t.own_dequantize(blocks)
        assert y.dtype == np.float32 and y.shape == (5, t.block_elems)
        assert np.array_equal(dequant.dequantize_blocks(blocks, t.id), y.reshape(-1))
