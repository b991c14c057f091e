"""The CPU path's dequantization is gguf.quants.dequantize, bit for bit, for every type it accepts.

Blocks come from strata.packer.synth.make_random_blocks (valid scales, random payload), several
rows per tensor so the row chunking of strata.engine.dequant is exercised too.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gq

from strata.engine import dequant
from strata.packer import quants
from strata.packer.synth import make_random_blocks

ENGINE_TYPES = sorted(t.id for t in quants.QTYPES.values() if t.engine_supported)


@pytest.mark.parametrize("type_id", ENGINE_TYPES, ids=lambda t: quants.QTYPES[t].name)
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
