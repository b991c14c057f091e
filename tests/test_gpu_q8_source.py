"""The GPU q8 kernels' per-type code (``engine/kernel_src/q8/<TYPE>.cuh``: ``lane_sums``, ``blk_scales``), checked
WITHOUT a GPU: compiled as C++ with g++ (``-ffp-contract=off``, NVRTC's ``--fmad=false``; ``dp4a`` and
``load_words`` have host twins in prelude.cuh) behind a driver that runs matvec_q8.cu's per-row work lane by
lane - every lane's integer share of a block, summed (integers: any order), then the float part in the kernel's
order - on an activation quantized by the CPU library. The rows must equal the CPU's ``"q8"`` kernel
(engine/cpu/cpu_q8_dots.c) BIT FOR BIT, for every q8 type on valid and wild blocks.

This catches layout, lane-split and scale-unpacking mistakes in CI; the device's own run of the kernels is
tests/test_gpu_q8.py. Also: the quantized activation's layout is one (engine/kernel_src/q8_layout.h): the C library's
``act_nbytes`` equals the layout's :func:`strata.layout.step.q8_act_bytes`. Skips without g++.
"""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
from test_gpu_kernel_source import compile_host
from test_gpu_kernels import _random_blocks, _wild_blocks

from strata.engine.cpu import kernels as cpukernels
from strata.engine.gpu import kernels as K
from strata.engine.kernel_src import assembly as A
from strata.layout.step import q8_act_bytes
from strata.packer import quants

Q8 = sorted(K.Q8_GPU_TYPES, key=lambda i: quants.qtype(i).name)
Q8_IDS = [quants.qtype(i).name for i in Q8]

# matvec_q8.cu's q8_rows (one row) with the 32 lanes run one after another: lane p of block b adds its integer
# share; the float part in the kernel's (and cpu_q8.c's) order.
_DRIVER = r"""
extern "C" void run_rows(const u8* base, i64 rows, int ne0, const u8* act, float* out) {
    const int nb = ne0 / QK;
    const float* scales = (const float*)base;
    const u8* payload = base + rows * nb * NF * 4;
    const i8* aq = (const i8*)act;
    const float* ad = (const float*)(act + act_d_off(ne0));
    const i16* as = (const i16*)(act + act_s_off(ne0));
    const i16* at = (const i16*)(act + act_t_off(ne0));
    for (i64 row = 0; row < rows; ++row) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sa = 0.0f, sm = 0.0f;
        for (int b = 0; b < nb; ++b) {
            const i64 blk = row * nb + b;
            int S = 0, M = 0;
            for (int p = 0; p < LPB; ++p) {
                int s, m;
                lane_sums(scales + blk * NF, payload + blk * PB, aq + (i64)b * QK, as + (i64)b * (QK / 16),
                          at + (i64)b * (QK / 32), p, &s, &m, true);
                S += s;
                M += m;
            }
            float dw, dm;
            blk_scales(scales + blk * NF, payload + blk * PB, &dw, &dm);
            const float dx = ad[b];
#if Q8_FMT == 1
            acc[b & 7] = acc[b & 7] + (dw * dx) * (float)S;
#else
            sa = sa + (dx * dw) * (float)S;
            sm = sm + (dx * dm) * (float)M;
#endif
        }
#if Q8_FMT == 1
        out[row] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
#elif HAS_MIN
        out[row] = sa - sm;
#else
        out[row] = sa;
#endif
    }
}
"""

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="needs g++ to compile the kernel source on the host"
)


@pytest.fixture(scope="module")
def host_q8(tmp_path_factory):
    d = tmp_path_factory.mktemp("q8_src")
    libs = {}

    def build(type_id: int):
        if type_id not in libs:
            libs[type_id] = compile_host(
                d, quants.qtype(type_id).name, K.q8_source_for(type_id, with_kernels=False) + _DRIVER
            )
        return libs[type_id]

    return build


def _activation(type_id: int, x: np.ndarray) -> np.ndarray:
    """x quantized by the CPU library, laid out as engine/kernel_src/q8_layout.h says (q, d, s, t planes)."""
    n = x.size
    q, d, s = cpukernels.quantize_activation(type_id, x)
    buf = np.zeros(q8_act_bytes(n), np.uint8)
    pad = lambda b: (b + 63) // 64 * 64  # noqa: E731
    doff = pad(n)
    soff = doff + pad(n // 32 * 4)
    toff = soff + pad(n // 16 * 2)
    buf[:n] = q.view(np.uint8)
    buf[doff : doff + 4 * d.size] = d.view(np.uint8)
    buf[soff : soff + 2 * s.size] = s.view(np.uint8)
    t = (s[0::2].astype(np.int32) + s[1::2]).astype(np.int16)
    buf[toff : toff + 2 * t.size] = t.view(np.uint8)
    return buf


@pytest.mark.parametrize("type_id", Q8, ids=Q8_IDS)
@pytest.mark.parametrize("kind", ["synth", "wild"])
def test_q8_lane_code_equals_the_cpu_q8_kernel(host_q8, type_id, kind):
    from strata.engine import engine_form as EF

    lib = host_q8(type_id)
    rng = np.random.default_rng(11 + type_id)
    qk = 256 if K.q8_act_format(type_id) == 2 else 32
    for rows, nblk in ((3, 1), (5, 3), (4, 14), (2, 74)):
        ne0 = nblk * qk
        raw = _random_blocks(type_id, rows * ne0, rng) if kind == "synth" else _wild_blocks(type_id, rows * ne0, rng)
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        ef = np.ascontiguousarray(EF.to_engine_form(raw, type_id, type_id, (ne0, rows)))
        x = (rng.standard_normal(ne0) * rng.choice([1e-3, 1.0, 30.0], ne0)).astype(np.float32)
        if ne0 >= 64:
            x[:32] = 0.0  # a zero block (Q8_0) / zeros inside a super-block
        act = _activation(type_id, x)
        got = np.full(rows, np.nan, np.float32)
        lib.run_rows(
            ctypes.c_void_p(ef.ctypes.data),
            ctypes.c_longlong(rows),
            ctypes.c_int(ne0),
            ctypes.c_void_p(act.ctypes.data),
            ctypes.c_void_p(got.ctypes.data),
        )
        want = cpukernels.matvec(type_id, raw, rows, ne0, x, kernel="q8", threads=1)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (quants.qtype(type_id).name, rows, ne0)


@pytest.mark.parametrize("n", [32, 64, 96, 256, 768, 2048, 2880, 3584, 18944])
def test_q8_activation_layout_is_one(n):
    """The C library's ``act_nbytes`` (engine/kernel_src/q8_layout.h) and the budget's formula are the same number."""
    assert int(cpukernels.library(quants.by_name("Q4_K").id).act_nbytes(n)) == q8_act_bytes(n)


def test_q8_types_have_their_files():
    """Every registry row with ``q8_kernel`` has its CUDA file, and no other type has one."""
    files = {p.stem for p in (A.SRC_DIR / "q8").glob("*.cuh")}
    assert files == {quants.qtype(i).name for i in K.Q8_GPU_TYPES}
    assert K.Q8_GPU_TYPES == cpukernels.Q8_TYPES
