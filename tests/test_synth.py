"""Tests of strata.testing: synthetic GGUF models, header-only files and broken files.

Sources of expected numbers: per-expert byte sizes of the qwen3next reference model from
docs/DESIGN.md "Expert sizes change per layer" (layer 0 473,600 + 473,600 + 921,600 = 1,868,800 B; layer 1
422,400 + 422,400 + 460,800 = 1,305,600 B; layer 1 starts at 512 x 1,868,800 = 956,825,600 in the expert
arena); split-shard keys and tensor shapes from llama.cpp (``tools/gguf-split/gguf-split.cpp``,
``src/models/*.cpp``; docs/FORMAT.md "Split shards"). Files are read back with gguf.GGUFReader (gguf 0.19.0)
and, where it cannot (type 42 = Q2_0, broken headers), with the small struct parser below.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from strata import testing as S
from strata.packer import quants

V = GGUFValueType

# ---------------------------------------------------------------------------------------------
# a tiny independent GGUF header parser (test helper; tolerant of broken tensor infos)
# ---------------------------------------------------------------------------------------------

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def parse_header(path: Path) -> dict:
    """magic, version, kv {key: (type, value)} (string arrays: (ARRAY, (STRING, count)) unless short),
    tensors [(name, ne, type, offset)], data_offset. Reads only the header."""
    with open(path, "rb") as f:  # mmap: the reference model's file is ~47 GB (sparse)
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string():
        nonlocal pos
        n = take("<Q")
        s = bytes(buf[pos : pos + n]).decode()
        pos += n
        return s

    magic = bytes(buf[:4])
    pos = 4
    version, n_tensors, n_kv = take("<IQQ")
    kv = {}
    for _ in range(n_kv):
        key = string()
        t = take("<I")
        if t == 8:
            kv[key] = (t, string())
        elif t == 9:
            st, n = take("<IQ")
            if st == 8:
                items = [string() for _ in range(n)]
                kv[key] = (t, (st, n, items if n <= 16 else None))
            else:
                fmt = _SCALAR[st]
                items = list(struct.unpack_from(f"<{n}{fmt[1]}", buf, pos))
                pos += n * struct.calcsize(fmt)
                kv[key] = (t, (st, n, items))
        else:
            kv[key] = (t, take(_SCALAR[t]))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        nd = take("<I")
        ne = tuple(struct.unpack_from(f"<{nd}Q", buf, pos))
        pos += 8 * nd
        typ, off = take("<IQ")
        tensors.append((name, ne, typ, off))
    align = kv.get("general.alignment", (4, 32))[1]
    return dict(
        magic=magic,
        version=version,
        kv=kv,
        tensors=tensors,
        header_end=pos,
        data_offset=(pos + align - 1) // align * align if align else None,
        size=len(buf),
    )


def _pad(n: int, a: int = 32) -> int:
    return (n + a - 1) // a * a


def _field(r: gguf.GGUFReader, key: str):
    f = r.fields[key]
    return f.types, f.contents()


# ---------------------------------------------------------------------------------------------
# 1. random blocks
# ---------------------------------------------------------------------------------------------

_GGUF_DEQUANT = [
    t
    for t in quants.QTYPES.values()
    if t.name not in ("Q8_1", "Q8_K", "Q1_0", "Q2_0", "I8", "I16", "I32", "I64", "F64")
]


@pytest.mark.parametrize("t", _GGUF_DEQUANT, ids=lambda t: t.name)
def test_random_blocks_decode_finite_and_small(t):
    n_blocks = 97
    raw = S.make_random_blocks(t.id, n_blocks * t.block_elems, np.random.default_rng(t.id))
    assert raw.dtype == np.uint8 and raw.ndim == 1
    assert raw.size == quants.tensor_nbytes(t.id, (n_blocks * t.block_elems,)) == n_blocks * t.block_bytes
    data = (
        raw.reshape(n_blocks, t.block_bytes)
        if t.block_elems > 1
        else raw.view({"F32": "<f4", "F16": "<f2"}.get(t.name, np.uint8))
    )
    x = gguf.quants.dequantize(data, GGMLQuantizationType(t.id))
    assert x.size == n_blocks * t.block_elems
    assert np.isfinite(x).all()
    assert np.abs(x).max() < 1.0
    assert np.abs(x).mean() > 1e-3  # not all zeros
    if t.fp16_scale_offsets and t.name not in S.GGUF_QUANTIZABLE:
        # random-byte types: every fp16 super-scale (d, dmin) was overwritten with a small positive value
        # (types gguf-py quantizes carry the quantizer's own, signed, d)
        blocks = raw.reshape(n_blocks, t.block_bytes)
        for o in t.fp16_scale_offsets:
            s = blocks[:, o : o + 2].copy().view("<f2").astype(np.float32)
            assert (s > 0).all() and (s <= 0.02).all(), (t.name, o)


@pytest.mark.parametrize("t", list(quants.QTYPES.values()), ids=lambda t: t.name)
def test_random_blocks_every_registry_type(t):
    raw = S.make_random_blocks(t.id, 3 * t.block_elems, np.random.default_rng(0))
    assert raw.dtype == np.uint8 and raw.size == 3 * t.block_bytes == quants.tensor_nbytes(t.id, (3 * t.block_elems,))


@pytest.mark.parametrize("name", ["Q1_0", "Q2_0"])
def test_random_blocks_q1_0_q2_0_scales(name):
    # gguf 0.19.0 cannot dequantize these; check the only fp16 field (d at byte 0) by hand:
    # Q2_0 decodes to (q-1)*d with q in 0..3, Q1_0 to +-d (ggml-quants.c dequantize_row_q2_0 / _q1_0).
    t = quants.by_name(name)
    raw = S.make_random_blocks(t.id, 50 * t.block_elems, np.random.default_rng(1)).reshape(50, t.block_bytes)
    d = raw[:, :2].copy().view("<f2").astype(np.float32)
    assert raw.shape == (50, 18)
    assert (d > 0).all() and (d <= 0.02).all()
    assert len(np.unique(raw[:, 2:])) > 200  # payload really random


def test_random_blocks_q8_k_bsums_consistent():
    raw = S.make_random_blocks("Q8_K", 4 * 256, np.random.default_rng(2)).reshape(4, 292)
    d = raw[:, :4].copy().view("<f4")
    qs = raw[:, 4:260].view(np.int8).astype(np.int32).reshape(4, 16, 16)
    bsums = raw[:, 260:].copy().view("<i2")
    assert (d > 0).all() and (d * 128 < 1).all()
    assert (bsums == qs.sum(axis=2)).all()


def test_random_blocks_deterministic_and_bf16_bit_exact():
    a = S.make_random_blocks("IQ2_XS", 1024, np.random.default_rng(5))
    b = S.make_random_blocks("IQ2_XS", 1024, np.random.default_rng(5))
    c = S.make_random_blocks("IQ2_XS", 1024, np.random.default_rng(6))
    assert (a == b).all() and not (a == c).all()
    x = np.random.default_rng(3).standard_normal(4096, dtype=np.float32) * 0.02
    ref = gguf.quants.quantize(x, GGMLQuantizationType.BF16).reshape(-1)
    assert (S.make_random_blocks("BF16", 4096, np.random.default_rng(3)) == ref).all()


def test_random_blocks_rejects_partial_block():
    with pytest.raises(quants.ShapeError):
        S.make_random_blocks("Q4_K", 300, np.random.default_rng(0))


# ---------------------------------------------------------------------------------------------
# 2. models written with GGUFWriter
# ---------------------------------------------------------------------------------------------

PRESETS = S.PRESETS  # preset name -> spec function, one per contract (llama twice: dense and Mixtral style)


@pytest.fixture(scope="module")
def preset_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("presets")
    return {name: S.write_model(d / f"{name}.gguf", f())[0] for name, f in PRESETS.items()}


def test_every_contract_has_a_preset():
    from strata.manifests.contract import known_archs

    assert sorted({f().arch for f in PRESETS.values()}) == known_archs() == sorted(S.ARCHS)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_reads_back(name, preset_files):
    spec = PRESETS[name]()
    arch = spec.arch
    plan = S.plan_tensors(spec)
    r = gguf.GGUFReader(preset_files[name])
    assert [t.name for t in r.tensors] == [p.name for p in plan]
    expect_off = r.data_offset
    for t, p in zip(r.tensors, plan):
        assert int(t.tensor_type) == p.type_id, t.name
        assert tuple(int(x) for x in t.shape) == p.ne, t.name  # ggml ne order
        assert t.n_bytes == quants.tensor_nbytes(p.type_id, p.ne) == p.nbytes
        assert t.data_offset == expect_off, t.name  # running padded sum, no gaps
        expect_off += _pad(t.n_bytes)
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            x = gguf.quants.dequantize(t.data, t.tensor_type)
            assert np.isfinite(x).all() and np.abs(x).max() < 1.0, t.name
    assert os.path.getsize(preset_files[name]) == expect_off
    # key types, given explicitly (gguf-py's writer infers INT32 for int lists): counts u32, token_type
    # i32 array, strings arrays
    assert _field(r, "general.architecture") == ([V.STRING], arch)
    assert _field(r, f"{arch}.block_count") == ([V.UINT32], spec.n_layers)
    assert _field(r, f"{arch}.embedding_length") == ([V.UINT32], 256)
    assert r.fields[f"{arch}.rope.freq_base"].types == [V.FLOAT32]
    assert r.fields["tokenizer.ggml.tokens"].types == [V.ARRAY, V.STRING]
    assert r.fields["tokenizer.ggml.token_type"].types == [V.ARRAY, V.INT32]
    assert r.fields["tokenizer.ggml.merges"].types == [V.ARRAY, V.STRING]
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 512
    assert r.tensors[0].name == "token_embd.weight" and tuple(r.tensors[0].shape) == (256, 512)
    assert r.fields["tokenizer.ggml.eos_token_id"].types == [V.UINT32]
    if S.moe_layers(spec):
        assert _field(r, f"{arch}.expert_count") == ([V.UINT32], 8)
        assert _field(r, f"{arch}.expert_used_count") == ([V.UINT32], 2)
        if "n_ff_exp" in S.spec_geometry(spec).manifest.params:
            assert _field(r, f"{arch}.expert_feed_forward_length") == ([V.UINT32], 256)
        else:  # llama (Mixtral): llama.cpp makes the experts feed_forward_length wide
            assert _field(r, f"{arch}.feed_forward_length") == ([V.UINT32], 256)
            assert f"{arch}.expert_feed_forward_length" not in r.fields


def _types(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in gguf.GGUFReader(path).tensors}


def test_qwen3moe_expert_types_differ_per_layer(preset_files):
    ty = _types(preset_files["qwen3moe"])
    want = [("Q4_K", "Q8_0"), ("IQ2_XS", "IQ4_NL"), ("Q6_K", "Q5_0")]
    for il, (gu, dn) in enumerate(want):
        assert ty[f"blk.{il}.ffn_gate_exps.weight"] == (gu, (256, 256, 8))
        assert ty[f"blk.{il}.ffn_up_exps.weight"] == (gu, (256, 256, 8))
        assert ty[f"blk.{il}.ffn_down_exps.weight"] == (dn, (256, 256, 8))
        assert ty[f"blk.{il}.ffn_gate_inp.weight"] == ("F32", (256, 8))
        assert ty[f"blk.{il}.attn_q.weight"] == ("Q8_0", (256, 256))
        assert ty[f"blk.{il}.attn_k.weight"] == ("Q8_0", (256, 128))
        assert ty[f"blk.{il}.attn_q_norm.weight"] == ("F32", (64,))
    assert len({ty[f"blk.{il}.ffn_down_exps.weight"][0] for il in range(3)}) == 3


def test_qwen3next_layers(preset_files):
    ty = _types(preset_files["qwen3next"])
    for il in (0, 1, 2):  # gated delta net: (il+1) % 4 != 0
        assert ty[f"blk.{il}.attn_qkv.weight"] == ("Q8_0", (256, 2 * 64 * 2 + 64 * 4))
        assert ty[f"blk.{il}.attn_gate.weight"] == ("Q8_0", (256, 256))
        assert ty[f"blk.{il}.ssm_conv1d.weight"] == ("F32", (4, 512))
        assert ty[f"blk.{il}.ssm_a"] == ("F32", (4,))
        assert ty[f"blk.{il}.ssm_ba.weight"] == ("Q8_0", (256, 8))
        assert ty[f"blk.{il}.ssm_norm.weight"] == ("F32", (64,))
        assert f"blk.{il}.attn_q.weight" not in ty
    assert ty["blk.3.attn_q.weight"] == ("Q8_0", (256, 2 * 4 * 64))  # query + output gate
    assert ty["blk.3.attn_output.weight"] == ("Q8_0", (256, 256))
    assert "blk.3.attn_qkv.weight" not in ty
    assert ty["blk.0.ffn_gate_exps.weight"] == ("IQ2_XS", (256, 256, 8))
    assert ty["blk.0.ffn_down_exps.weight"] == ("IQ4_NL", (256, 256, 8))
    assert ty["blk.1.ffn_gate_exps.weight"][0] == "IQ2_XXS"
    assert ty["blk.3.ffn_down_exps.weight"][0] == "Q6_K"
    assert ty["blk.2.ffn_gate_inp_shexp.weight"] == ("F32", (256,))
    assert ty["blk.2.ffn_down_shexp.weight"] == ("Q8_0", (256, 256))
    r = gguf.GGUFReader(preset_files["qwen3next"])
    assert _field(r, "qwen3next.ssm.inner_size") == ([V.UINT32], 256)
    assert _field(r, "qwen3next.ssm.time_step_rank") == ([V.UINT32], 4)
    assert _field(r, "qwen3next.full_attention_interval") == ([V.UINT32], 4)


def test_qwen3next_fused_gate_up(tmp_path):
    spec = S.qwen3next_spec(fused_gate_up=True, n_layers=2, expert_types=[("Q4_K", "Q8_0"), ("IQ2_XS", "Q2_0")])
    p = S.write_model(tmp_path / "fused.gguf", spec)[0]
    h = parse_header(p)  # Q2_0 (42): gguf 0.19.0 cannot read it
    t = {n: (ne, typ) for n, ne, typ, _ in h["tensors"]}
    assert t["blk.0.ffn_gate_up_exps.weight"] == ((256, 512, 8), 12)
    assert t["blk.1.ffn_gate_up_exps.weight"] == ((256, 512, 8), 17)
    assert t["blk.1.ffn_down_exps.weight"] == ((256, 256, 8), 42)
    assert not any("ffn_gate_exps" in n or "ffn_up_exps" in n for n in t)
    offs = [off for _, _, _, off in h["tensors"]]
    sizes = [quants.tensor_nbytes(typ, ne) for _, ne, typ, _ in h["tensors"]]
    assert offs == [sum(_pad(s) for s in sizes[:i]) for i in range(len(sizes))]
    assert h["data_offset"] + offs[-1] + _pad(sizes[-1]) == os.path.getsize(p)
    with pytest.raises(ValueError):  # gguf 0.19.0 has no type 42
        gguf.GGUFReader(p)


@pytest.mark.parametrize("empty_first", [True, False])
def test_split_shards(tmp_path, empty_first, preset_files):
    spec = S.qwen3moe_spec(n_shards=3, empty_first_shard=empty_first)
    paths = S.write_model(tmp_path / "moe.gguf", spec)
    assert [p.name for p in paths] == [f"moe-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    plan = S.plan_tensors(spec)
    readers = [gguf.GGUFReader(p) for p in paths]
    for i, r in enumerate(readers):
        assert _field(r, "split.no") == ([V.UINT16], i)
        assert _field(r, "split.count") == ([V.UINT16], 3)
        assert _field(r, "split.tensors.count") == ([V.INT32], len(plan))
        user_keys = {k for k in r.fields if not k.startswith("GGUF.")}
        if i == 0:
            assert "general.architecture" in user_keys and "tokenizer.ggml.tokens" in user_keys
        else:
            assert user_keys == {"split.no", "split.count", "split.tensors.count"}
        if r.tensors:
            assert r.tensors[0].data_offset == r.data_offset  # offsets restart per shard
    assert (len(readers[0].tensors) == 0) == empty_first
    assert all(len(r.tensors) > 0 for r in readers[1:])
    assert [t.name for r in readers for t in r.tensors] == [p.name for p in plan]
    # same seed: the shards hold exactly the bytes of the single-file preset
    single = {t.name: t.data for t in gguf.GGUFReader(preset_files["qwen3moe"]).tensors}
    for r in readers:
        for t in r.tensors:
            assert np.array_equal(np.asarray(t.data), np.asarray(single[t.name])), t.name


def test_write_model_deterministic(tmp_path):
    spec = S.qwen2_spec()
    a = S.write_model(tmp_path / "a.gguf", spec)[0].read_bytes()
    b = S.write_model(tmp_path / "b.gguf", spec)[0].read_bytes()
    c = S.write_model(tmp_path / "c.gguf", spec.model_copy(update={"seed": 1}))[0].read_bytes()
    assert hashlib.sha256(a).digest() == hashlib.sha256(b).digest()
    assert len(a) == len(c) and a != c
    # changing one tensor's type leaves the other tensors' bytes unchanged (per-name streams)
    r1 = gguf.GGUFReader(tmp_path / "a.gguf")
    d = S.write_model(tmp_path / "d.gguf", S.qwen2_spec(tensor_types={"ffn_down": "Q5_0", "attn_output": "Q8_0"}))[0]
    r2 = {t.name: t for t in gguf.GGUFReader(d).tensors}
    assert r2["blk.0.attn_output.weight"].tensor_type == GGMLQuantizationType.Q8_0
    assert np.array_equal(r1.tensors[1].data, r2[r1.tensors[1].name].data)


def test_spec_validation():
    with pytest.raises(ValueError, match="expert_types"):
        S.qwen3moe_spec(n_layers=2)
    with pytest.raises(ValueError, match="fused_gate_up"):
        S.qwen3moe_spec(fused_gate_up=True)
    with pytest.raises(ValueError, match="dense"):
        S.qwen2_spec(expert_types=[("Q4_K", "Q8_0")] * 2)
    with pytest.raises(ValueError, match="empty_first_shard"):
        S.qwen2_spec(empty_first_shard=True)
    with pytest.raises(quants.ShapeError, match="blk.0.ffn_down_exps.weight"):
        S.plan_tensors(S.qwen3moe_spec(dims={"n_ff_exp": 128}, expert_types=[("Q8_0", "Q6_K")] * 3))
    with pytest.raises(KeyError):
        S.qwen3moe_spec(dense_type="Q9_9")
    assert S.qwen3moe_spec(expert_types=[(12, 8), ("IQ2_XS", 20), ("Q6_K", "Q5_0")]).expert_types[1].down == 20


def test_tokenizer():
    tok = S.synth_tokenizer(512)
    assert tok.n_vocab == 512 == len(set(tok.tokens)) == len(tok.token_types)
    b2u = S.bytes_to_unicode()
    assert [tok.tokens[b] for b in range(256)] == [b2u[b] for b in range(256)]
    assert tok.tokens[ord("A")] == "A" and tok.tokens[ord(" ")] == "\u0120"
    vocab = set(tok.tokens)
    assert len(tok.merges) >= 200
    for m in tok.merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    assert tok.tokens[tok.eos_id] == "<|endoftext|>" and tok.token_types[tok.eos_id] == 3
    assert S.synth_tokenizer(300).n_vocab == 300


# ---------------------------------------------------------------------------------------------
# 3. own writer: header-only files
# ---------------------------------------------------------------------------------------------


def test_header_only_reads_back_with_gguf(tmp_path):
    kv = {
        "general.name": "hdr",
        "t.u32": 7,
        "t.i32": -5,
        "t.u16": S.KV(V.UINT16, 9),
        "t.f32": 0.5,
        "t.bool": True,
        "t.astr": ["a", "bb", ""],
        "t.ai32": [1, -2, 3],
        "t.af32": [0.25, 1.5],
        "t.au32": S.KV(V.ARRAY, [4, 5, 2**32 - 1], V.UINT32),
    }
    tensors = [
        ("big.weight", "F32", (4096, 4096)),
        ("q.weight", "Q4_K", (256, 64, 8)),
        ("n.weight", 0, (7,)),
        ("e.weight", "IQ2_XS", (512, 3, 4)),
        ("m.weight", "Q8_0", (96, 5)),
    ]
    lay = S.write_header_only(tmp_path / "h.gguf", "qwen3moe", kv, tensors, alignment=64)
    r = gguf.GGUFReader(tmp_path / "h.gguf")
    assert _field(r, "general.architecture") == ([V.STRING], "qwen3moe")
    assert _field(r, "general.alignment") == ([V.UINT32], 64) and r.alignment == 64
    assert _field(r, "t.u32") == ([V.UINT32], 7)
    assert _field(r, "t.i32") == ([V.INT32], -5)
    assert _field(r, "t.u16") == ([V.UINT16], 9)
    assert _field(r, "t.f32") == ([V.FLOAT32], 0.5)
    assert _field(r, "t.bool") == ([V.BOOL], True)
    assert _field(r, "t.astr") == ([V.ARRAY, V.STRING], ["a", "bb", ""])
    assert _field(r, "t.ai32") == ([V.ARRAY, V.INT32], [1, -2, 3])
    assert _field(r, "t.af32") == ([V.ARRAY, V.FLOAT32], [0.25, 1.5])
    assert _field(r, "t.au32") == ([V.ARRAY, V.UINT32], [4, 5, 2**32 - 1])
    assert r.data_offset == lay.data_offset and lay.data_offset % 64 == 0
    off = 0
    for t, (name, typ, ne), tl in zip(r.tensors, tensors, lay.tensors):
        tid = S.to_type_id(typ)
        assert (t.name, int(t.tensor_type), tuple(int(x) for x in t.shape)) == (name, tid, tuple(ne))
        assert t.n_bytes == quants.tensor_nbytes(tid, ne) == tl.nbytes
        assert t.data_offset == lay.data_offset + off == tl.abs_offset
        off += _pad(t.n_bytes, 64)
    st = os.stat(tmp_path / "h.gguf")
    assert st.st_size == lay.file_size == lay.data_offset + off
    assert st.st_size > 64 << 20 and st.st_blocks * 512 < 1 << 20  # the data section is a hole
    assert not np.asarray(r.tensors[0].data[:8]).any()  # holes read as zeros


def test_header_only_explicit_and_random_bytes(tmp_path):
    tensors = [("a.weight", "Q8_0", (64, 2)), ("b.weight", "F32", (8,)), ("c.weight", "Q4_K", (256, 1))]
    blob = S.make_random_blocks("Q8_0", 128, np.random.default_rng(0))
    S.write_header_only(tmp_path / "x.gguf", "qwen2", {}, tensors, data={"a.weight": blob.tobytes()})
    r = gguf.GGUFReader(tmp_path / "x.gguf")
    assert np.array_equal(r.tensors[0].data.reshape(-1), blob)
    assert not np.asarray(r.tensors[2].data).any()
    with pytest.raises(ValueError, match="needs 136"):
        S.write_header_only(tmp_path / "y.gguf", "qwen2", {}, tensors, data={"a.weight": b"\0" * 10})
    S.write_header_only(tmp_path / "z.gguf", "qwen2", {}, tensors, data="random")
    r = gguf.GGUFReader(tmp_path / "z.gguf")
    x = gguf.quants.dequantize(r.tensors[2].data, r.tensors[2].tensor_type)
    assert np.isfinite(x).all() and 0 < np.abs(x).max() < 1
    with pytest.raises(ValueError, match="duplicate"):
        S.write_header_only(tmp_path / "w.gguf", "qwen2", {}, tensors + [("a.weight", 0, (4,))])
    with pytest.raises(quants.ShapeError):
        S.write_header_only(tmp_path / "w.gguf", "qwen2", {}, [("a.weight", "Q4_K", (128,))])


def test_header_only_type_unknown_to_gguf(tmp_path):
    tensors = [("a.weight", 42, (640, 2560, 4)), ("b.weight", 0, (16,))]
    lay = S.write_header_only(tmp_path / "q2.gguf", "qwen3next", {}, tensors)
    with pytest.raises(ValueError):  # gguf 0.19.0 has no type 42
        gguf.GGUFReader(tmp_path / "q2.gguf")
    h = parse_header(tmp_path / "q2.gguf")
    assert h["tensors"][0] == ("a.weight", (640, 2560, 4), 42, 0)
    assert h["tensors"][1] == ("b.weight", (16,), 0, 640 * 2560 * 4 // 64 * 18)
    assert lay.file_size == h["data_offset"] + 460_800 * 4 + 64


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    p = tmp_path_factory.mktemp("docs") / "reference-qwen3next.gguf"
    lay = S.reference_model_header_only(p)
    return p, lay, parse_header(p)


def test_reference_model_expert_bytes(reference_model):
    _, lay, h = reference_model
    t = {n: (ne, typ, off) for n, ne, typ, off in h["tensors"]}
    per_expert = lambda n: quants.tensor_nbytes(t[n][1], t[n][0]) // t[n][0][2]  # noqa: E731
    assert t["blk.0.ffn_gate_exps.weight"][:2] == ((2560, 640, 512), 17)  # IQ2_XS
    assert t["blk.0.ffn_down_exps.weight"][:2] == ((640, 2560, 512), 20)  # IQ4_NL
    assert t["blk.1.ffn_up_exps.weight"][:2] == ((2560, 640, 512), 16)  # IQ2_XXS
    assert t["blk.1.ffn_down_exps.weight"][:2] == ((640, 2560, 512), 42)  # Q2_0
    l0 = [per_expert(f"blk.0.ffn_{k}_exps.weight") for k in ("gate", "up", "down")]
    l1 = [per_expert(f"blk.1.ffn_{k}_exps.weight") for k in ("gate", "up", "down")]
    assert l0 == [473_600, 473_600, 921_600] and sum(l0) == 1_868_800
    assert l1 == [422_400, 422_400, 460_800] and sum(l1) == 1_305_600
    # where layer 1 starts in the expert arena (docs/DESIGN.md "Expert sizes change per layer")
    assert 512 * sum(l0) == 956_825_600
    # the sizes are also what the offsets say (no gaps: next offset - offset = padded nbytes)
    names = [n for n, *_ in h["tensors"]]
    i = names.index("blk.0.ffn_gate_exps.weight")
    assert t[names[i + 1]][2] - t[names[i]][2] == 512 * 473_600
    blobs = {il: sum(per_expert(f"blk.{il}.ffn_{k}_exps.weight") for k in ("gate", "up", "down")) for il in range(48)}
    assert len(set(blobs.values())) >= 4  # "how big an expert is" changes per layer


def test_reference_model_geometry_and_disk(reference_model):
    path, lay, h = reference_model
    kv = h["kv"]
    assert kv["general.architecture"] == (8, "qwen3next")
    for key, val in [
        ("block_count", 48),
        ("embedding_length", 2560),
        ("expert_count", 512),
        ("expert_used_count", 8),
        ("expert_feed_forward_length", 640),
        ("attention.head_count", 24),
        ("attention.head_count_kv", 2),
        ("attention.key_length", 256),
        ("ssm.conv_kernel", 4),
        ("ssm.state_size", 128),
        ("ssm.group_count", 16),
        ("ssm.time_step_rank", 48),
        ("ssm.inner_size", 6144),
        ("full_attention_interval", 4),
    ]:
        assert kv[f"qwen3next.{key}"] == (4, val), key  # u32
    assert kv["tokenizer.ggml.tokens"][1][:2] == (8, 150_000)
    t = {n: (ne, typ) for n, ne, typ, _ in h["tensors"]}
    full = [il for il in range(48) if f"blk.{il}.attn_q.weight" in t]
    assert full == list(range(3, 48, 4))
    assert sum(f"blk.{il}.attn_qkv.weight" in t for il in range(48)) == 36
    assert t["blk.0.attn_qkv.weight"][0] == (2560, 10240) and t["blk.0.ssm_conv1d.weight"][0] == (4, 10240)
    assert t["blk.3.attn_q.weight"][0] == (2560, 2 * 24 * 256)
    assert t["blk.3.indexer.attn_k.weight"][0] == (2560, 128)  # ONE shared key head of 128
    assert t["token_embd.weight"][0] == (2560, 150_000)
    assert len(h["tensors"]) == lay.n_tensors == 891
    # offsets: running padded sum; the logical file is ~47 GB, the disk holds only the header
    sizes = [quants.tensor_nbytes(typ, ne) for _, ne, typ, _ in h["tensors"]]
    assert [off for *_, off in h["tensors"]] == [sum(_pad(s) for s in sizes[:i]) for i in range(len(sizes))]
    st = os.stat(path)
    assert st.st_size == h["data_offset"] + sum(_pad(s) for s in sizes) == lay.file_size > 40e9
    assert st.st_blocks * 512 < 10e6
    assert h["data_offset"] > 3e6  # the 150k-token vocabulary makes the KV section realistic


def test_big_dense_spec(scratch):
    spec = S.big_dense_spec()
    assert sum(t.nbytes for t in S.plan_tensors(spec)) >= 2 << 30
    assert sum(t.nbytes for t in S.plan_tensors(spec.model_copy(update={"n_layers": spec.n_layers - 1}))) < 2 << 30
    p = S.write_big_dense(scratch / "small_big.gguf", 64 << 20)
    st = os.stat(p)
    assert st.st_size >= 64 << 20 and st.st_blocks * 512 >= st.st_size  # real bytes, not a hole
    r = gguf.GGUFReader(p)
    w = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    assert w.tensor_type == GGMLQuantizationType.Q8_0 and tuple(w.shape) == (2048, 8192)
    x = gguf.quants.dequantize(w.data[:16], w.tensor_type)
    assert np.isfinite(x).all() and 0 < np.abs(x).max() < 1


@pytest.mark.slow
def test_big_dense_2gib(scratch):
    p = S.write_big_dense(scratch / "big.gguf")  # 2 GiB, removed when the test ends (conftest.scratch)
    st = os.stat(p)
    assert st.st_size >= 2 << 30 and st.st_blocks * 512 >= st.st_size
    r = gguf.GGUFReader(p)
    assert sum(t.n_bytes for t in r.tensors) >= 2 << 30


# ---------------------------------------------------------------------------------------------
# 4. broken files
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    p = tmp_path_factory.mktemp("broken") / "base.gguf"
    return p, S.write_broken_base(p)


def test_broken_base_is_valid(base):
    p, lay = base
    r = gguf.GGUFReader(p)
    assert [(t.name, t.tensor_type.name) for t in r.tensors] == [
        ("a.weight", "F32"),
        ("b.weight", "Q8_0"),
        ("c.weight", "F16"),
        ("d.weight", "Q4_K"),
    ]
    assert [t.data_offset for t in r.tensors] == [lay.data_offset + o for o in (0, 1024, 1312, 1504)]
    assert os.path.getsize(p) == lay.data_offset + 1504 + 288
    x = gguf.quants.dequantize(r.tensors[3].data, r.tensors[3].tensor_type)
    assert np.isfinite(x).all() and np.abs(x).max() < 1


def _tensors(h):
    return {n: (ne, typ, off) for n, ne, typ, off in h["tensors"]}


def _u64(path, pos):
    return struct.unpack_from("<Q", Path(path).read_bytes(), pos)[0]


# kind -> (gguf.GGUFReader raises?, check(path, parsed-or-None, base layout))
BROKEN_CHECKS = {
    "bad_magic": (True, lambda p, lay: Path(p).read_bytes()[:4] == b"GGUX"),
    "version_1": (True, lambda p, lay: parse_header(p)["version"] == 1),
    "version_4": (True, lambda p, lay: parse_header(p)["version"] == 4),
    "truncated_header": (True, lambda p, lay: os.path.getsize(p) == lay.tensor("b.weight").info_pos + 3),
    "truncated_data": (True, lambda p, lay: os.path.getsize(p) == lay.data_offset + 1504 + 144),
    "tensor_beyond_eof": (
        True,
        lambda p, lay: (
            (h := parse_header(p))["data_offset"] + _tensors(h)["d.weight"][2]
            > os.path.getsize(p)
            == os.path.getsize(lay.path)
        ),
    ),
    "overlapping_tensors": (False, lambda p, lay: _tensors(parse_header(p))["b.weight"][2] == 32),
    "nbytes_exceeds_span": (
        False,
        lambda p, lay: (
            (t := _tensors(parse_header(p)))["a.weight"][0] == (64, 5)
            and quants.tensor_nbytes(0, (64, 5)) > t["b.weight"][2] - t["a.weight"][2] == 1024
        ),
    ),
    "nbytes_below_span": (
        False,
        lambda p, lay: (
            (t := _tensors(parse_header(p)))["a.weight"][0] == (64, 2)
            and _pad(quants.tensor_nbytes(0, (64, 2))) < t["b.weight"][2] - t["a.weight"][2] == 1024
        ),
    ),
    "ne0_not_block_multiple": (True, lambda p, lay: _tensors(parse_header(p))["b.weight"][:2] == ((48, 4), 8)),
    "element_count_overflow": (True, lambda p, lay: math.prod(_tensors(parse_header(p))["a.weight"][0]) > 2**63 - 1),
    "unknown_type_4": (True, lambda p, lay: _tensors(parse_header(p))["b.weight"][1] == 4),
    "unknown_type_99": (True, lambda p, lay: _tensors(parse_header(p))["b.weight"][1] == 99),
    "duplicate_tensor_name": (
        True,
        lambda p, lay: [n for n, *_ in parse_header(p)["tensors"]] == ["a.weight", "a.weight", "c.weight", "d.weight"],
    ),
    "alignment_0": (True, lambda p, lay: parse_header(p)["kv"]["general.alignment"] == (4, 0)),
    "alignment_3": (True, lambda p, lay: parse_header(p)["kv"]["general.alignment"] == (4, 3)),
    "string_length_beyond_eof": (True, lambda p, lay: _u64(p, lay.kv_pos["general.name"] + 4) > os.path.getsize(p)),
    "array_length_beyond_eof": (
        True,
        lambda p, lay: _u64(p, lay.kv_pos["tokenizer.ggml.tokens"] + 8) > os.path.getsize(p),
    ),
    "misaligned_offset": (False, lambda p, lay: _tensors(parse_header(p))["c.weight"][2] % 32 == 8),
    "too_many_dims": (False, lambda p, lay: _tensors(parse_header(p))["a.weight"][0] == (64, 4, 1, 1, 1)),
    "name_too_long": (False, lambda p, lay: len(parse_header(p)["tensors"][0][0].encode()) >= 64),
    "bad_kv_type": (
        True,
        lambda p, lay: struct.unpack_from("<I", Path(p).read_bytes(), lay.kv_pos["general.name"])[0] == 13,
    ),
}


def test_broken_kinds_all_checked():
    assert set(BROKEN_CHECKS) == set(S.BROKEN_KINDS)


@pytest.mark.parametrize("kind", list(S.BROKEN_KINDS))
def test_broken_kind(kind, base, tmp_path):
    _, lay = base
    p = S.write_broken(tmp_path / f"{kind}.gguf", kind)
    assert p.read_bytes() != lay.path.read_bytes()
    raises, check = BROKEN_CHECKS[kind]
    assert check(p, lay), kind
    if raises:
        with pytest.raises((ValueError, IndexError)):
            gguf.GGUFReader(p)
    else:
        r = gguf.GGUFReader(p)  # gguf-py is lenient here; ggml's gguf.cpp is not
        assert len(r.tensors) == 4


def test_broken_unknown_kind(tmp_path):
    with pytest.raises(KeyError, match="bad_magic"):
        S.write_broken(tmp_path / "x.gguf", "nope")


# ---------------------------------------------------------------------------------------------
# llama.cpp accepts and runs the presets (live: skipped without llama-cpp-python, failed in CI)
# ---------------------------------------------------------------------------------------------


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "name", ["qwen3moe", "qwen3next", "llama", "llama_moe", "qwen3", "qwen2moe", "deepseek2", "gpt_oss"]
)
def test_llama_cpp_runs_preset(name, preset_files, llama_cpp):
    llm = llama_cpp.Llama(str(preset_files[name]), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    toks = llm.tokenize(b"The capital of France is", add_bos=True)
    assert toks == [280, 315, 263, 503, 312]  # the synthetic BPE's merges are used
    llm.eval(toks)
    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    llm.eval([nxt])
    scores = np.asarray(llm.scores[: llm.n_tokens])
    assert llm.n_vocab() == 512 and np.isfinite(scores).all() and scores.std() > 0
