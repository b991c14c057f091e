"""The CPU path's dequantization is gguf.quants.dequantize, bit for bit, for every type it accepts
that gguf-py knows; Q1_0 and Q2_0 (gguf-py 0.19.0 lacks them) equal hand-computed blocks of ggml's
C definition (ggml/src/ggml-quants.c dequantize_row_q1_0 / dequantize_row_q2_0, llama.cpp as
vendored in llama-cpp-python 0.3.36, lines 419-456).

Blocks come from strata.testing.make_random_blocks (valid scales, random payload), several
rows per tensor so the row chunking of strata.engine.dequant is exercised too.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gq

from strata.engine import dequant
from strata.packer import quants
from strata.testing import make_random_blocks

ENGINE_TYPES = sorted(t.id for t in quants.QTYPES.values() if t.engine_supported)
GGUF_TYPES = [t for t in ENGINE_TYPES if t not in dequant.OWN_DEQUANTIZERS]
Q1_0, Q2_0 = quants.by_name("Q1_0").id, quants.by_name("Q2_0").id


def _block(d: float, qs: list[int]) -> np.ndarray:
    """One 18-byte block: fp16 d then the 16 bytes of qs."""
    b = np.zeros(18, np.uint8)
    b[0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    b[2 : 2 + len(qs)] = qs
    return b


def test_own_types_are_exactly_the_ones_gguf_lacks():
    plain = {quants.F32.id, quants.F16.id}
    lacking = {t for t in ENGINE_TYPES if t not in plain and dequant._gguf_class(t) is None}
    assert set(dequant.OWN_DEQUANTIZERS) == {Q1_0, Q2_0} == lacking
    assert dequant.supported(Q1_0) and dequant.supported(Q2_0)


def test_q1_0_hand_computed():
    # d = 0.5; byte 0 = 0b00000101: values 0 and 2 are +d, 1 and 3..7 are -d; byte 1 = 0x80: value 15
    # is +d; byte 15 = 0xFF: values 120..127 are +d; every other bit clear: -d (bit ? d : neg_d)
    qs = [0b101, 0x80] + [0] * 13 + [0xFF]
    want = np.full(128, -0.5, np.float32)
    want[[0, 2, 15]] = 0.5
    want[120:128] = 0.5
    got = dequant.dequantize_rows(_block(0.5, qs).reshape(1, 18), Q1_0, 128, name="q1")[0]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # a negative d flips every value; d = 0 gives +0 for set bits and -0 for clear ones (neg_d = -d)
    got = dequant.dequantize_rows(_block(-2.0, qs).reshape(1, 18), Q1_0, 128, name="q1")[0]
    assert np.array_equal(got, -4 * want)
    got = dequant.dequantize_rows(_block(0.0, qs).reshape(1, 18), Q1_0, 128, name="q1")[0]
    assert np.signbit(got[1]) and not np.signbit(got[0]) and np.all(got == 0)


def test_q2_0_hand_computed():
    # byte 0 = 0b11_10_01_00: values 0..3 have q = 0, 1, 2, 3 -> (q - 1) * d = -d, 0, d, 2d;
    # byte 1 = 0b00_00_00_11: value 4 has q = 3, values 5..7 q = 0; bytes 2..15 = 0: q = 0 -> -d
    d = 1.5
    got = dequant.dequantize_rows(_block(d, [0xE4, 0x03]).reshape(1, 18), Q2_0, 64, name="q2")[0]
    want = np.full(64, -d, np.float32)
    want[0:5] = [-d, 0.0, d, 2 * d, 2 * d]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # ((int)q - 1) * d with d < 0 and q = 1: the int 0 becomes +0.0f, times a negative d: -0.0
    got = dequant.dequantize_rows(_block(-0.25, [0xE4]).reshape(1, 18), Q2_0, 64, name="q2")[0]
    assert got[:4].tolist() == [0.25, 0.0, -0.25, -0.5] and np.signbit(got[1])
    # rows of several blocks, chunked: each block scaled by its own d
    raw = np.stack([np.concatenate([_block(1.0, [0x55] * 16), _block(-1.0, [0xAA] * 16)]) for _ in range(3)])
    got = dequant.dequantize_rows(raw, Q2_0, 128, name="q2")
    assert np.array_equal(got[:, :64], np.zeros((3, 64), np.float32))  # q = 1 everywhere: 0 * 1.0
    assert np.array_equal(got[:, 64:], np.full((3, 64), -1.0, np.float32))  # q = 2: 1 * -1.0


@pytest.mark.parametrize("type_id", [Q1_0, Q2_0], ids=["Q1_0", "Q2_0"])
def test_own_types_vectorised_equal_a_scalar_transcription_of_the_c(type_id):
    """Random blocks: the NumPy version equals a line-by-line Python transcription of ggml's loop."""
    raw = make_random_blocks(type_id, 1024, np.random.default_rng(type_id))
    t = quants.qtype(type_id)
    blocks = raw.reshape(-1, 18)
    want = []
    for b in blocks:
        d = np.float32(b[0:2].copy().view("<f2")[0])
        for j in range(t.block_elems):
            if type_id == Q1_0:
                bit = (int(b[2 + j // 8]) >> (j % 8)) & 1
                want.append(d if bit else np.float32(-d))
            else:
                q = (int(b[2 + j // 4]) >> ((j % 4) * 2)) & 3
                want.append(np.float32(np.float32(q - 1) * d))
    want = np.array(want, np.float32)
    got = dequant.dequantize_rows(raw.reshape(4, -1), type_id, 256, name="t").reshape(-1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("type_id", GGUF_TYPES, ids=lambda t: quants.QTYPES[t].name)
def test_dequantize_rows_is_gguf_bit_for_bit(type_id, monkeypatch):
    assert dequant.supported(type_id)
    ne0, rows = 512, 7
    raw = make_random_blocks(type_id, ne0 * rows, np.random.default_rng(type_id)).reshape(rows, -1)
    want = gq.dequantize(raw, GGMLQuantizationType(type_id)).reshape(rows, ne0).astype(np.float32)
    monkeypatch.setattr(dequant, "CHUNK_ELEMS", 2 * ne0)  # 2 rows per gguf call: chunk edges inside the tensor
    got = dequant.dequantize_rows(raw, type_id, ne0, name="t")
    assert got.dtype == np.float32 and got.shape == (rows, ne0)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_unsupported_type_is_refused_with_name():
    q8k = quants.by_name("Q8_K").id  # an activation-only type: no engine kernel
    assert not dequant.supported(q8k)
    with pytest.raises(dequant.DequantError, match=r"blk\.0\.x: ggml type Q8_K has no CPU dequantizer"):
        dequant.dequantize_rows(np.zeros((1, 292), np.uint8), q8k, 256, name="blk.0.x")


def test_row_size_mismatch_is_refused():
    q8 = quants.by_name("Q8_0").id
    with pytest.raises(dequant.DequantError, match=r"rows of \(35,\) bytes, Q8_0 x 32 needs 34"):
        dequant.dequantize_rows(np.zeros((2, 35), np.uint8), q8, 32, name="w")


def test_engine_supported_means_a_kernel_on_both_paths():
    """The registry's engine_supported is exactly the types with a CPU dequantizer and a GPU kernel
    (so the budget audit warns "no engine kernel" only for types the engine really cannot run)."""
    from strata.engine.kernel_src import assembly as A

    assert set(ENGINE_TYPES) == set(A.SUPPORTED_TYPES)
    assert all(dequant.supported(t) for t in ENGINE_TYPES)


def test_the_reference_model_types_all_have_engine_kernels():
    from strata.testing import REFERENCE_EXPERT_CYCLE, reference_model_plan

    _kv, tensors = reference_model_plan(n_vocab=1000)
    types = {ty for _n, ty, _ne in tensors} | {t for pair in REFERENCE_EXPERT_CYCLE for t in pair}
    assert {Q2_0, quants.by_name("IQ2_S").id} <= types
    missing = sorted(quants.qtype(t).name for t in types if not quants.qtype(t).engine_supported)
    assert missing == []
