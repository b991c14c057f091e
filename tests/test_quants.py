"""The quant-type registry against gguf-py 0.19.0 and the worked numbers of docs/DESIGN.md."""

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.packer import quants


def test_every_gguf_type_agrees_with_registry():
    # Q8_1 is the one known disagreement: the gguf 0.19.0 wheel says 40 B, ggml master's
    # block_q8_1 is 36 B (ggml-common.h: half2 ds + 32 int8). It never appears in model files.
    checked = 0
    for t, (be, bb) in GGML_QUANT_SIZES.items():
        row = quants.qtype(int(t))
        assert row.name == t.name
        assert row.block_elems == be
        if t.name == "Q8_1":
            assert (bb, row.block_bytes) == (40, 36)
            continue
        assert row.block_bytes == bb, t.name
        checked += 1
    assert checked == len(GGML_QUANT_SIZES) - 1 >= 33


def test_ids_beyond_the_wheel_are_known():
    assert "Q2_0" not in GGMLQuantizationType.__members__  # the reason this registry exists
    q2_0 = quants.qtype(42)
    assert (q2_0.name, q2_0.block_elems, q2_0.block_bytes, q2_0.fp16_scale_offsets) == ("Q2_0", 64, 18, (0,))
    assert (quants.qtype(41).name, quants.qtype(41).block_elems, quants.qtype(41).block_bytes) == ("Q1_0", 128, 18)
    assert (quants.qtype(40).name, quants.qtype(40).block_bytes, quants.qtype(40).fp16_scale_offsets) == (
        "NVFP4",
        36,
        (),
    )


@pytest.mark.parametrize("bad", [4, 5, 31, 36, 38, 43, 99, -1])
def test_unknown_or_removed_id_names_tensor_file_and_id(bad):
    with pytest.raises(quants.GGMLTypeError) as ei:
        quants.qtype(bad, tensor="blk.3.ffn_down_exps.weight", file="model.gguf")
    msg = str(ei.value)
    assert "blk.3.ffn_down_exps.weight" in msg and "model.gguf" in msg and f"type id {bad}" in msg
    if bad in (4, 5, 31, 36, 38):
        assert "removed" in msg


def test_widening_rule_of_the_worked_example():
    widened = sorted(t.name for t in quants.QTYPES.values() if t.widened)
    assert widened == sorted(["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q1_0", "Q2_0"])
    # engine-form block bytes = block bytes + 2 per fp16 field (docs/FORMAT.md "Quant types", column "engine block")
    expect = {
        "Q4_0": 20,
        "Q4_1": 24,
        "Q5_0": 24,
        "Q5_1": 28,
        "Q8_0": 36,
        "IQ4_NL": 20,
        "Q1_0": 20,
        "Q2_0": 20,
        "Q4_K": 144,
        "IQ2_XS": 74,
        "Q6_K": 210,
        "F32": 4,
    }
    for name, bb in expect.items():
        assert quants.by_name(name).engine_block_bytes == bb, name


def test_fp16_scale_offsets_match_formats_table():
    expect = {
        "Q2_K": (80, 82),
        "Q3_K": (108,),
        "Q4_K": (0, 2),
        "Q5_K": (0, 2),
        "Q6_K": (208,),
        "IQ2_XXS": (0,),
        "IQ3_XXS": (0,),
        "IQ4_XS": (0,),
        "TQ1_0": (52,),
        "TQ2_0": (64,),
        "Q8_K": (),
        "MXFP4": (),
        "IQ1_M": (),
    }
    for name, offs in expect.items():
        assert quants.by_name(name).fp16_scale_offsets == offs, name


def test_scale_offsets_really_hold_d_for_q8_0_and_q4_k():
    # Q8_0: quantize a known row and read d from byte 0; it must equal amax/127 as fp16
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(1, 32) * 3.0
    blk = gguf.quants.quantize(x, GGMLQuantizationType.Q8_0)
    off = quants.by_name("Q8_0").fp16_scale_offsets[0]
    d = blk[0, off : off + 2].view(np.float16)[0]
    assert d == np.float16(3.0 / 127)
    # Q4_K: a block with d=1, dmin=0, all scales 1 and nibbles 0..15 dequantizes to the nibbles
    b = np.zeros(144, np.uint8)
    b[0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    b[4:8] = 1  # scales 0..3 = 1 (6-bit), mins 0
    b[12 : 12 + 32] = 0x21  # low nibble 1, high nibble 2
    y = gguf.quants.dequantize(b.reshape(1, 144), GGMLQuantizationType.Q4_K).ravel()
    assert y[0] == 1.0 and y[32] == 2.0


def test_tensor_nbytes_worked_example():
    # docs/DESIGN.md "Expert sizes change per layer": IQ2_XS 2560x640 = 473,600 B; IQ4_NL 640x2560 =
    # 921,600 B; IQ2_XXS = 422,400; Q2_0 = 460,800
    assert quants.tensor_nbytes(17, (2560, 640)) == 473_600
    assert quants.tensor_nbytes(20, (640, 2560)) == 921_600
    assert quants.tensor_nbytes(16, (2560, 640)) == 422_400
    assert quants.tensor_nbytes(42, (640, 2560)) == 460_800


def test_shape_errors():
    with pytest.raises(quants.ShapeError, match="ne\\[0\\]=100 is not a multiple of the Q4_K block size 256"):
        quants.tensor_nbytes(12, (100, 4), tensor="x")
    with pytest.raises(quants.ShapeError, match="overflows int64"):
        quants.tensor_nbytes(0, (2**32, 2**32))


def test_engine_nbytes():
    assert quants.engine_nbytes(0, 30, (64, 3)) == 2 * 64 * 3  # BF16 held as 16 bits
    assert quants.engine_nbytes(8, 8, (64, 2)) == 4 * 36  # Q8_0: 4 blocks x (34 + 2)
    assert quants.engine_nbytes(12, 12, (256, 2)) == 2 * 144
    assert quants.widened_extra_nbytes(20, (640, 2560)) == 640 * 2560 // 32 * 2
    assert quants.widened_extra_nbytes(17, (2560, 640)) == 0
