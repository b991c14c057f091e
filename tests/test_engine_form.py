"""Engine form (strata.engine.engine_form): byte counts equal the registry's engine_nbytes, the
split into an f32 scale plane + payload plane is exact and invertible, BF16 re-rounding is exact
for every pattern, and dequantizing engine form equals gguf-py on the native blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from strata.engine import engine_form as EF
from strata.packer import quants

# Every registry type whose shape arithmetic works (all of them), several shapes each.
ALL = sorted(quants.QTYPES)
WIDENED = [i for i in ALL if quants.QTYPES[i].widened]


def _ne_list(t):
    be = t.block_elems
    return [(be,), (be * 3, 5), (be * 8, 7, 2), (be * 2, 1, 3, 2)]


@pytest.mark.parametrize("type_id", ALL, ids=[quants.QTYPES[i].name for i in ALL])
def test_engine_nbytes_matches_registry(type_id):
    t = quants.QTYPES[type_id]
    for ne in _ne_list(t):
        lay = EF.engine_layout(type_id, type_id, ne)
        assert lay.nbytes == quants.engine_nbytes(type_id, type_id, ne)
        assert lay.scales_nbytes + lay.payload_nbytes == lay.nbytes
        assert lay.payload_offset == lay.scales_nbytes and lay.payload_offset % 4 == 0
        if t.widened:
            assert lay.kind == "widened"
            assert lay.scales_nbytes == 4 * len(t.fp16_scale_offsets) * lay.n_blocks
            assert lay.nbytes - quants.tensor_nbytes(type_id, ne) == quants.widened_extra_nbytes(type_id, ne)
        else:
            assert lay.kind == "native" and lay.nbytes == quants.tensor_nbytes(type_id, ne)
    # BF16 promoted to F32 in the pool: 2 bytes per element in engine form
    lay = EF.engine_layout(quants.F32.id, quants.BF16.id, (64, 3))
    assert lay.kind == "bf16" and lay.nbytes == 2 * 64 * 3 == quants.engine_nbytes(0, 30, (64, 3))


def test_widened_extra_bytes_worked_example():
    """docs/DESIGN.md "Pack form and engine form": widening adds 2 bytes per fp16 field per block, e.g. the
    the reference model's Q2_0 expert down 640x2560 = 460,800 B native -> 460,800 + 25,600 * 2 = 512,000 B in engine
    form."""
    q2_0 = quants.by_name("Q2_0").id
    ne = (640, 2560)
    assert quants.tensor_nbytes(q2_0, ne) == 460_800
    assert EF.engine_layout(q2_0, q2_0, ne).nbytes == 460_800 + 2 * (640 * 2560 // 64) == 512_000


def _blocks(t, n_blocks, rng):
    b = rng.integers(0, 256, size=(n_blocks, t.block_bytes), dtype=np.uint8)
    for o in t.fp16_scale_offsets:
        h = rng.integers(0, 0x7C00, size=n_blocks, dtype=np.uint16) | (
            rng.integers(0, 2, size=n_blocks, dtype=np.uint16) << 15
        )
        b[:, o : o + 2] = h.astype("<u2").view(np.uint8).reshape(-1, 2)
    return b


@pytest.mark.parametrize("type_id", WIDENED, ids=[quants.QTYPES[i].name for i in WIDENED])
def test_widened_split_is_exact_and_invertible(type_id):
    t = quants.QTYPES[type_id]
    rng = np.random.default_rng(type_id)
    blocks = _blocks(t, 97, rng)
    ne = (t.block_elems * 97,)
    ef = EF.to_engine_form(blocks.reshape(-1), type_id, type_id, ne)
    lay = EF.engine_layout(type_id, type_id, ne)
    assert ef.dtype == np.uint8 and ef.size == lay.nbytes
    scales = ef[: lay.scales_nbytes].view("<f4").reshape(97, len(t.fp16_scale_offsets))
    for k, o in enumerate(t.fp16_scale_offsets):
        want = blocks[:, o : o + 2].copy().view("<f2")[:, 0].astype(np.float32)
        assert np.array_equal(scales[:, k].view("<u4"), want.view("<u4"))
    payload = ef[lay.payload_offset :].reshape(97, t.payload_block_bytes)
    keep = [i for i in range(t.block_bytes) if all(not (o <= i < o + 2) for o in t.fp16_scale_offsets)]
    assert np.array_equal(payload, blocks[:, keep])
    assert np.array_equal(EF.from_engine_form(ef, type_id, type_id, ne), blocks.reshape(-1))


def test_native_types_are_unchanged():
    rng = np.random.default_rng(3)
    for name in ("Q4_K", "Q6_K", "IQ2_XXS", "IQ4_XS", "F16", "F32"):
        t = quants.by_name(name)
        raw = _blocks(t, 9, rng).reshape(-1)
        ne = (t.block_elems * 9,)
        assert np.array_equal(EF.to_engine_form(raw, t.id, t.id, ne), raw)


def test_bf16_reround_exact_for_every_pattern():
    u16 = np.arange(1 << 16, dtype=np.uint32).astype("<u2")
    pool = quants.bf16_to_f32_bits(u16).astype("<u4").view(np.uint8)
    ef = EF.to_engine_form(pool, quants.F32.id, quants.BF16.id, (1 << 16,))
    assert np.array_equal(ef.view("<u2"), u16)
    assert np.array_equal(EF.from_engine_form(ef, quants.F32.id, quants.BF16.id, (1 << 16,)), pool)


def test_bf16_refuses_values_that_are_not_bf16():
    pool = np.array([1.0, 1.0 + 2**-20], dtype="<f4").view(np.uint8)
    with pytest.raises(EF.EngineFormError, match="blk.0.attn_norm.weight.*low 16 bits"):
        EF.to_engine_form(pool, quants.F32.id, quants.BF16.id, (2,), name="blk.0.attn_norm.weight")


def test_wrong_byte_count_names_tensor():
    with pytest.raises(EF.EngineFormError, match="output.weight: 34 bytes given"):
        EF.to_engine_form(np.zeros(34, np.uint8), 2, 2, (64,), name="output.weight")


GGUF_DEQ = [
    quants.by_name(n).id
    for n in ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q6_K", "IQ2_XS")
]


@pytest.mark.parametrize("type_id", GGUF_DEQ, ids=[quants.QTYPES[i].name for i in GGUF_DEQ])
def test_dequantize_engine_form_equals_gguf(type_id):
    t = quants.QTYPES[type_id]
    rng = np.random.default_rng(type_id + 100)
    rows, ne0 = 3, t.block_elems * 4 if t.block_elems > 1 else 40
    if t.block_elems == 1:
        raw = (rng.standard_normal(rows * ne0) * 0.1).astype("<f4" if t.name == "F32" else "<f2").view(np.uint8)
    else:
        raw = _blocks(t, rows * ne0 // t.block_elems, rng).reshape(-1)
        for o in t.fp16_scale_offsets:  # keep scales small so nothing overflows
            raw.reshape(-1, t.block_bytes)[:, o : o + 2] = np.float16(0.01).tobytes()[0], np.float16(0.01).tobytes()[1]
    ne = (ne0, rows)
    ef = EF.to_engine_form(raw, type_id, type_id, ne)
    got = EF.dequantize_engine_form(ef, type_id, type_id, ne)
    want = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType(type_id))
    assert got.shape == (rows, ne0)
    assert np.array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))
