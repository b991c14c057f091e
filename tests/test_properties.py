"""Property tests: BF16 promotion round trip, and the pack text formats' writer/reader round trip."""

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.packer import quants
from strata.packer.packfmt import (
    ExpertLayer,
    IndexEntry,
    NativeExperts,
    PackIndex,
    read_experts,
    read_index,
    write_experts,
    write_index,
)


def test_bf16_f32_bf16_is_bit_exact_for_all_65536_patterns():
    u16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f32_bits = quants.bf16_to_f32_bits(u16)
    assert np.array_equal(quants.f32_to_bf16_rne(f32_bits), u16)
    f = f32_bits.view(np.float32)
    # the promoted values are the bf16 values: subnormals, 1e5-ish, inf and NaN included
    assert f[0x0001] == np.float32(2.0**-133)  # smallest bf16 subnormal
    assert f[0x47C3] == np.float32(99840.0)  # 1e5 rounds to 0x47C3 in bf16
    assert np.isinf(f[0x7F80]) and f[0x7F80] > 0 and np.isinf(f[0xFF80]) and f[0xFF80] < 0
    assert np.isnan(f[0x7FC0]) and np.isnan(f[0x7F81])  # quiet and signalling NaN survive bit-exactly
    assert np.count_nonzero(f32_bits & 0xFFFF) == 0


def test_rne_matches_gguf_reference_on_ordinary_floats():
    # gguf.quants.quantize(..., BF16) mirrors ggml_compute_fp32_to_bf16 (ggml/src/ggml-impl.h;
    # gguf-py gguf/quants.py class BF16)
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.standard_normal(4096).astype(np.float32) * 1e3, np.array([1e5, -1e-40, 3.0e38, 0.0, -0.0], np.float32)]
    )
    ref = gguf.quants.quantize(x, GGMLQuantizationType.BF16).view(np.uint16).ravel()
    ours = quants.f32_to_bf16_rne(x.view(np.uint32))
    assert np.array_equal(ours, ref)


names = st.from_regex(r"[a-z_]{1,8}(\.[0-9]{1,3})?\.[a-z_]{1,12}\.(weight|bias)", fullmatch=True)
u = st.integers(min_value=0, max_value=2**62)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            names,
            st.sampled_from(sorted(quants.QTYPES)),
            st.sampled_from(sorted(quants.QTYPES)),
            u,
            u,
            st.lists(st.integers(1, 2**20), min_size=4, max_size=4),
            st.integers(0, 9),
            u,
        ),
        unique_by=lambda t: t[0],
        max_size=20,
    ),
    st.sampled_from([16, 32, 64, 4096]),
    u,
    st.lists(st.tuples(st.from_regex(r"[A-Za-z0-9_.-]{1,20}\.gguf", fullmatch=True), u), min_size=1, max_size=4),
)
def test_index_round_trip(tmp_path_factory, rows, align, pool, sources):
    entries = [IndexEntry(n, t, s, o, nb, *ne, sh, so) for n, t, s, o, nb, ne, sh, so in rows]
    idx = PackIndex(sources, align, pool, entries)
    p = tmp_path_factory.mktemp("idx") / "index.txt"
    write_index(p, idx)
    back = read_index(p)
    assert back == idx


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(
            u, min_size=len(ExpertLayer.__dataclass_fields__) - 1, max_size=len(ExpertLayer.__dataclass_fields__) - 1
        ),
        max_size=12,
    ),
    st.integers(1, 4096),
    u,
    u,
)
def test_experts_round_trip(tmp_path_factory, rows, n_expert, total, max_blob):
    layers = []
    for il, r in enumerate(rows):
        r = list(r)
        r[5] = r[8] = r[11] = 0  # gate_shard, up_shard, down_shard (positions after "layer") -> shard 0
        layers.append(ExpertLayer(il * 3, *r))
    ne = NativeExperts(n_expert, total, max_blob, ["m-00001-of-00002.gguf"], layers)
    p = tmp_path_factory.mktemp("ex") / "native_experts.txt"
    write_experts(p, ne)
    assert read_experts(p) == ne
