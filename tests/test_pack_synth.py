"""strata-pack build on synthetic GGUFs (strata.testing): MoE tables, split shards, BF16, the worked
example of docs/DESIGN.md "Expert sizes change per layer", and every bad input refused with nothing
left behind."""

from __future__ import annotations

import builtins
import os
import shutil

import gguf
import numpy as np
import pytest

from strata import testing as synth
from strata.packer import quants
from strata.packer.build import build_pack
from strata.packer.gguf_file import GGUFError, open_model, read_header
from strata.packer.pack import open_pack
from strata.packer.pack_plan import BuildError
from strata.packer.verify import VerifyError, verify_pack


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# ----------------------------------------------------------------- bad input

# what each refusal must say (besides the file name): the field and the numbers
BROKEN_EXPECT = {
    "bad_magic": "bad magic b'GGUX'",
    "version_1": "unsupported GGUF version 1",
    "version_4": "unsupported GGUF version 4",
    "truncated_header": "truncated header",
    "truncated_data": "tensor 'd.weight' (Q4_K [256, 2], 288 bytes at",
    "tensor_beyond_eof": "tensor 'd.weight' (Q4_K [256, 2]) offset 1050368 leaves a gap",
    "overlapping_tensors": "tensor 'b.weight' (Q8_0 [64, 4]) offset 32 overlaps the previous tensor: expected 1024",
    "nbytes_exceeds_span": "tensor 'b.weight' (Q8_0 [64, 4]) offset 1024 overlaps the previous tensor: expected 1280",
    "nbytes_below_span": "tensor 'b.weight' (Q8_0 [64, 4]) offset 1024 leaves a gap after the previous tensor: "
    "expected 512",
    "ne0_not_block_multiple": "b.weight: ne[0]=48 is not a multiple of the Q8_0 block size 32",
    "element_count_overflow": "a.weight: element count 9223372041149743104",
    "unknown_type_4": "tensor 'b.weight' in",
    "unknown_type_99": "type id 99 is not a ggml type",
    "duplicate_tensor_name": "duplicate tensor name 'a.weight'",
    "alignment_0": "general.alignment 0 is not a power of two",
    "alignment_3": "general.alignment 3 is not a power of two",
    "string_length_beyond_eof": "value of 'general.name': string length",
    "array_length_beyond_eof": "key 'tokenizer.ggml.tokens': array of",
    "misaligned_offset": "tensor 'c.weight' offset 1320 is not a multiple of the alignment 32",
    "too_many_dims": "tensor 'a.weight' has 5 dims, allowed 1..4",
    "name_too_long": "is 70 bytes, max 63",
    "bad_kv_type": "key 'general.name': unknown value type 13",
}


def test_every_broken_kind_has_an_expectation():
    assert set(BROKEN_EXPECT) == set(synth.BROKEN_KINDS)


@pytest.mark.parametrize("kind", sorted(synth.BROKEN_KINDS))
def test_bad_input_refused_by_name_and_nothing_left(kind, tmp_path):
    src = synth.write_broken(tmp_path / f"{kind}.gguf", kind)
    out = tmp_path / "out" / "pack"
    with pytest.raises((GGUFError, quants.GGMLTypeError)) as ei:
        build_pack(src, out, progress=False)
    msg = str(ei.value)
    assert str(src) in msg and BROKEN_EXPECT[kind] in msg, msg
    assert not out.exists()
    assert not (tmp_path / "out").exists() or _leftovers(tmp_path / "out") == []
    if kind == "unknown_type_4":
        assert "type id 4 was removed from ggml" in msg


def test_zero_byte_and_missing_file(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match=r"empty\.gguf: file is empty \(0 bytes\)"):
        build_pack(tmp_path / "empty.gguf", tmp_path / "p", progress=False)
    with pytest.raises(FileNotFoundError):
        build_pack(tmp_path / "nope.gguf", tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists()


def test_base_of_broken_files_matches_gguf_reader(tmp_path):
    p = tmp_path / "base.gguf"
    synth.write_broken_base(p)
    ours, ref = read_header(p), gguf.GGUFReader(p)
    assert [(t.name, t.type_id, list(t.ne), t.abs_offset) for t in ours.tensors] == [
        (t.name, int(t.tensor_type), [int(x) for x in t.shape], int(t.data_offset)) for t in ref.tensors
    ]


# ----------------------------------------------------------------- MoE, split shards


@pytest.fixture(scope="module")
def moe_split(tmp_path_factory):
    """qwen3moe preset in 3 shards, the first one tensor-less (gguf-split --no-tensor-first-split),
    with BF16 attention and F16 output."""
    d = tmp_path_factory.mktemp("moe")
    spec = synth.qwen3moe_spec(n_shards=3, empty_first_shard=True, tensor_types={"attn_q": "BF16", "output": "F16"})
    paths = synth.write_model(d / "moe.gguf", spec)
    return spec, paths


def test_split_reader_matches_gguf_reader_per_shard(moe_split):
    _, paths = moe_split
    model = open_model(paths[1])  # any shard finds its siblings
    assert [s.path for s in model.shards] == paths
    assert len(model.shards[0].tensors) == 0
    for s in model.shards:
        ref = gguf.GGUFReader(s.path)
        assert [(t.name, t.type_id, list(t.ne), t.abs_offset) for t in s.tensors] == [
            (t.name, int(t.tensor_type), [int(x) for x in t.shape], int(t.data_offset)) for t in ref.tensors
        ]
    assert model.kv["split.tensors.count"] == len(model.tensors)


def test_moe_pack_from_shard_two(moe_split, tmp_path):
    spec, paths = moe_split
    out = tmp_path / "pack"
    r = build_pack(paths[1], out, progress=False)
    pack = open_pack(out)
    model = open_model(paths[0])
    ex = pack.experts
    assert ex is not None and ex.n_expert == 8 and ex.n_layer == 3 and ex.shards == [p.name for p in paths]
    E, D, F = 8, spec.dims.n_embd, spec.dims.n_ff_exp
    arena = 0
    for il, row in enumerate(ex.layers):
        gu, dn = spec.expert_types[il].gate_up, spec.expert_types[il].down
        assert (row.gate_type, row.up_type, row.down_type) == (gu, gu, dn)
        g = quants.tensor_nbytes(gu, (D, F))
        d = quants.tensor_nbytes(dn, (F, D))
        assert (row.gate_bytes, row.up_bytes, row.down_bytes, row.blob_bytes) == (g, g, d, 2 * g + d)
        assert (row.gate_stride, row.up_stride, row.down_stride) == (g, g, d)
        assert row.arena_offset == arena
        arena += E * row.blob_bytes
        for part in ("gate", "up", "down"):
            k, t = model.tensors[f"blk.{il}.ffn_{part}_exps.weight"]
            assert (getattr(row, f"{part}_shard"), getattr(row, f"{part}_off")) == (k, t.abs_offset)
    assert ex.total == arena == r.expert_total_bytes
    assert ex.max_blob == max(layer.blob_bytes for layer in ex.layers)
    # per-layer types really differ: blob sizes are not a constant
    assert len({layer.blob_bytes for layer in ex.layers}) == 3
    # every tensor exactly once across index.txt and native_experts.txt
    dense = {e.name for e in pack.index.entries}
    experts = {f"blk.{layer.layer}.ffn_{p}_exps.weight" for layer in ex.layers for p in ("gate", "up", "down")}
    assert dense.isdisjoint(experts) and dense | experts == set(model.tensors)
    verify_pack(out)


def test_expert_offsets_decode_to_the_same_weights_as_gguf(moe_split, tmp_path):
    _, paths = moe_split
    out = tmp_path / "pack"
    build_pack(paths[2], out, progress=False)
    pack = open_pack(out)
    row = pack.experts.layers[1]  # IQ2_XS gate/up, IQ4_NL down
    ref = {t.name: t for p in paths for t in gguf.GGUFReader(p).tensors}
    for e in (0, 5, 7):
        for part, shard, off, nbytes in row.ranges(e):
            raw = np.fromfile(paths[shard], dtype=np.uint8, count=nbytes, offset=off)
            t = ref[f"blk.1.ffn_{part}_exps.weight"]
            ours = gguf.quants.dequantize(raw, t.tensor_type)
            want = gguf.quants.dequantize(t.data[e], t.tensor_type).ravel()
            assert np.array_equal(ours, want), (part, e)


def test_bf16_promoted_exactly_and_f16_unchanged(moe_split, tmp_path):
    _, paths = moe_split
    out = tmp_path / "pack"
    r = build_pack(paths[0], out, progress=False)
    pack = open_pack(out)
    ref = {t.name: t for p in paths for t in gguf.GGUFReader(p).tensors}
    bf = [e for e in pack.index.entries if e.src_type == quants.BF16.id]
    assert len(bf) == 3 == r.bf16_promoted  # attn_q on 3 layers
    pool = np.memmap(pack.pool_path, dtype=np.uint8, mode="r")
    for e in bf:
        assert e.type == quants.F32.id and e.nbytes == 4 * e.ne0 * e.ne1
        f32 = pool[e.offset : e.offset + e.nbytes].view("<u4")
        src = ref[e.name].data.view("<u2").ravel()
        assert np.array_equal(f32 >> 16, src) and not (f32 & 0xFFFF).any()
    out16 = pack.index.by_name()["output.weight"]
    assert (out16.type, out16.src_type, out16.nbytes) == (1, 1, 2 * out16.ne0 * out16.ne1)


def test_fused_gate_up_split_into_halves(tmp_path):
    spec = synth.qwen3next_spec(fused_gate_up=True)
    paths = synth.write_model(tmp_path / "next.gguf", spec)
    build_pack(paths[0], tmp_path / "pack", progress=False)
    pack = open_pack(tmp_path / "pack")
    model = open_model(paths[0])
    D, F = spec.dims.n_embd, spec.dims.n_ff_exp
    for il, row in enumerate(pack.experts.layers):
        t = model.tensors[f"blk.{il}.ffn_gate_up_exps.weight"][1]
        half = quants.tensor_nbytes(t.type_id, (D, F))
        assert (row.gate_off, row.up_off) == (t.abs_offset, t.abs_offset + half)
        assert (row.gate_stride, row.up_stride, row.gate_bytes, row.up_bytes) == (2 * half, 2 * half, half, half)
        # expert 3's up half, read by the table, equals rows F..2F-1 of expert 3 in the fused tensor
        ref = gguf.GGUFReader(paths[0]).get_tensor(model.shards[0].tensors.index(t))
        _, _, off, n = row.ranges(3)[1]
        raw = np.fromfile(paths[0], np.uint8, count=n, offset=off)
        assert np.array_equal(
            gguf.quants.dequantize(raw, ref.tensor_type).reshape(F, D),
            gguf.quants.dequantize(ref.data[3], ref.tensor_type)[F:],
        )
    verify_pack(tmp_path / "pack")


# ----------------------------------------------------------------- shard refusals


def _split(tmp_path, name="m", seed=0, n_shards=3):
    return synth.write_model(
        tmp_path / f"{name}.gguf", synth.qwen3moe_spec(n_shards=n_shards, empty_first_shard=True, seed=seed)
    )


def test_missing_shard(tmp_path):
    paths = _split(tmp_path)
    os.remove(paths[2])
    with pytest.raises(GGUFError, match=r"missing shard\(s\) of 3: .*m-00003-of-00003\.gguf"):
        build_pack(paths[0], tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists() and _leftovers(tmp_path) == []


def test_zero_byte_shard(tmp_path):
    paths = _split(tmp_path)
    open(paths[1], "wb").close()
    with pytest.raises(GGUFError, match=r"m-00002-of-00003\.gguf: file is empty \(0 bytes\)"):
        build_pack(paths[0], tmp_path / "p", progress=False)


def test_duplicated_shard(tmp_path):
    paths = _split(tmp_path)
    shutil.copy(paths[1], paths[2])  # shard 2 is a copy of shard 1
    with pytest.raises(GGUFError, match=r"m-00003-of-00003\.gguf: split\.no is 1 but the file name says shard 2"):
        build_pack(paths[0], tmp_path / "p", progress=False)


def test_foreign_shard(tmp_path):
    paths = _split(tmp_path)
    other = synth.write_model(
        tmp_path / "o.gguf",
        synth.qwen3moe_spec(n_shards=3, empty_first_shard=True, n_layers=2, expert_types=[("Q4_K", "Q8_0")] * 2),
    )
    shutil.copy(other[2], paths[2])  # right position, different model
    with pytest.raises(GGUFError, match=r"m-00003-of-00003\.gguf: split\.tensors\.count is \d+ but shard 0 says \d+"):
        build_pack(paths[0], tmp_path / "p", progress=False)


def test_mismatched_shard_count(tmp_path):
    paths = _split(tmp_path)
    four = synth.write_model(tmp_path / "f.gguf", synth.qwen3moe_spec(n_shards=4, empty_first_shard=True))
    shutil.copy(four[2], paths[2])
    with pytest.raises(GGUFError, match=r"split\.count is 4, expected 3"):
        build_pack(paths[0], tmp_path / "p", progress=False)


# ------------------------------------ worked example (docs/DESIGN.md "Expert sizes change per layer")


def test_worked_example_blob_bytes(tmp_path):
    """docs/DESIGN.md "Expert sizes change per layer": n_embd 2560, n_ff 640, 512 experts. Layer 0 IQ2_XS
    gate/up + IQ4_NL down: blob 1,868,800 B; layer 1 starts at 512 x 1,868,800 = 956,825,600; layer 1
    IQ2_XXS + Q2_0: 1,305,600 B. Header-only sparse file: ~1.5 GB logical, nothing on disk."""
    kv = {
        "qwen3moe.block_count": 2,
        "qwen3moe.context_length": 4096,
        "qwen3moe.embedding_length": 2560,
        "qwen3moe.attention.head_count": 24,
        "qwen3moe.attention.head_count_kv": 2,
        "qwen3moe.attention.key_length": 256,
        "qwen3moe.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3moe.expert_count": 512,
        "qwen3moe.expert_used_count": 8,
        "qwen3moe.expert_feed_forward_length": 640,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    tensors = []
    for il, (gu, dn) in enumerate([(17, 20), (16, 42)]):
        tensors += [
            (f"blk.{il}.ffn_gate_exps.weight", gu, (2560, 640, 512)),
            (f"blk.{il}.ffn_up_exps.weight", gu, (2560, 640, 512)),
            (f"blk.{il}.ffn_down_exps.weight", dn, (640, 2560, 512)),
        ]
    src = tmp_path / "doc.gguf"
    synth.write_header_only(src, "qwen3moe", kv, tensors)
    assert src.stat().st_blocks * 512 < 1 << 20  # sparse
    build_pack(src, tmp_path / "pack", progress=False)
    ex = open_pack(tmp_path / "pack").experts
    l0, l1 = ex.layers
    assert (l0.gate_bytes, l0.up_bytes, l0.down_bytes, l0.blob_bytes) == (473_600, 473_600, 921_600, 1_868_800)
    assert (l1.gate_bytes, l1.up_bytes, l1.down_bytes, l1.blob_bytes) == (422_400, 422_400, 460_800, 1_305_600)
    assert (l0.arena_offset, l1.arena_offset) == (0, 956_825_600)
    assert ex.total == 512 * (1_868_800 + 1_305_600) and ex.max_blob == 1_868_800
    assert (l1.down_type, quants.qtype(l1.down_type).name) == (42, "Q2_0")


# ----------------------------------------------------------------- atomicity, read-only sources


def test_failed_build_leaves_previous_pack_intact(moe_split, tmp_path, monkeypatch):
    _, paths = moe_split
    out = tmp_path / "pack"
    build_pack(paths[0], out, progress=False)
    before = (out / "index.txt").read_bytes()
    import strata.packer.build as b

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(b, "write_pool", boom)
    with pytest.raises(OSError, match="simulated"):
        build_pack(paths[0], out, force=True, progress=False)
    assert (out / "index.txt").read_bytes() == before and _leftovers(tmp_path) == []
    with pytest.raises(BuildError, match="already exists; pass --force"):
        build_pack(paths[0], out, progress=False)


def test_sources_opened_read_only(moe_split, tmp_path, monkeypatch):
    _, paths = moe_split
    srcs = {str(p.resolve()) for p in paths}
    seen = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file, mode="r", *a, **k):
        if str(os.path.realpath(file)) in srcs:
            seen.append(mode)
            assert mode in ("r", "rb"), f"source opened with mode {mode}"
        return real_open(file, mode, *a, **k)

    def spy_os_open(path, flags, *a, **k):
        if str(os.path.realpath(path)) in srcs:
            seen.append(flags)
            assert flags & (os.O_WRONLY | os.O_RDWR) == 0, f"source opened with flags {flags}"
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    before = [p.read_bytes() for p in paths]
    build_pack(paths[0], tmp_path / "pack", progress=False)
    verify_pack(tmp_path / "pack")
    assert seen and [p.read_bytes() for p in paths] == before


def test_verify_catches_wrong_expert_offset(moe_split, tmp_path):
    _, paths = moe_split
    out = tmp_path / "pack"
    build_pack(paths[0], out, progress=False)
    text = (out / "native_experts.txt").read_text().split("\n")
    row = text[-2].split(" ")
    row[7] = str(int(row[7]) + 2)  # gate_off of the last layer shifted by 2 bytes
    text[-2] = " ".join(row)
    (out / "native_experts.txt").write_text("\n".join(text))
    with pytest.raises(VerifyError, match=r"experts of layer 2: gate_off: pack \d+ source \d+"):
        verify_pack(out)


@pytest.mark.parametrize("alignment", [16, 64, 4096])
def test_custom_alignment(alignment, tmp_path):
    """general.alignment other than the default 32: offsets follow it, the pack is byte-exact."""
    src = tmp_path / "a.gguf"
    kv = {
        "qwen2.block_count": 1,
        "qwen2.context_length": 64,
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 2,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    # names of qwen2 roles (a tensor no role names is refused at build); shapes are the audit's, not the build's
    tensors = [
        ("output_norm.weight", "F32", (3,)),
        ("token_embd.weight", "Q8_0", (64, 2)),
        ("output.weight", "F16", (5, 1)),
    ]
    lay = synth.write_header_only(src, "qwen2", kv, tensors, alignment=alignment, data="random")
    h = read_header(src)
    assert h.alignment == alignment
    assert [t.rel_offset for t in h.tensors] == [
        0,
        alignment * (-(-12 // alignment)),
        alignment * (-(-12 // alignment)) + alignment * (-(-136 // alignment)),
    ]
    assert [t.abs_offset for t in h.tensors] == [lay.data_offset + t.rel_offset for t in h.tensors]
    build_pack(src, tmp_path / "p", progress=False)
    verify_pack(tmp_path / "p")


@pytest.mark.parametrize("damage", ["truncate", "delete", "other_vocab", "id", "extra_column", "string_tokens"])
def test_verify_checks_the_tokenizer_tables(moe_split, tmp_path, damage):
    """vocab.parquet truncated, deleted or holding another token list: verify exits with a mismatch (VerifyError)
    naming vocab.parquet - a pack whose tokenizer the engine would refuse is not 'ok'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, paths = moe_split
    out = tmp_path / "pack"
    build_pack(paths[0], out, progress=False)
    verify_pack(out)  # intact: ok
    v = out / "vocab.parquet"
    if damage == "truncate":
        v.write_bytes(v.read_bytes()[:1000])
        want = r"vocab\.parquet: unreadable"
    elif damage == "delete":
        v.unlink()
        want = r"vocab\.parquet: missing; the source has tokenizer\.ggml\.tokens"
    elif damage == "id":
        t = pq.read_table(v)
        ids = t.column("id").to_numpy().copy()
        ids[3] = 99999
        pq.write_table(t.set_column(0, "id", pa.array(ids, pa.int32())), v)
        want = r"vocab\.parquet: column id entry 3 is 99999, expected 3"
    elif damage == "extra_column":
        t = pq.read_table(v)
        pq.write_table(t.append_column("extra", pa.array([0] * t.num_rows, pa.int32())), v)
        want = r"vocab\.parquet: columns \[.*'extra'\], the source gives \["
    elif damage == "string_tokens":
        t = pq.read_table(v)
        i = t.column_names.index("token")
        pq.write_table(
            t.set_column(
                i, "token", pa.array([b.decode("utf-8", "replace") for b in t.column("token").to_pylist()], pa.string())
            ),
            v,
        )
        want = r"vocab\.parquet: column 'token' has type string, strata-pack build writes binary"
    else:
        t = pq.read_table(v)
        tokens = t.column("token").to_pylist()
        tokens[5] = b"zzz-not-the-source"
        pq.write_table(t.set_column(t.column_names.index("token"), "token", pa.array(tokens, pa.binary())), v)
        want = (
            r"vocab\.parquet: column token entry 5 is b'zzz-not-the-source', the source's tokenizer\.ggml\.tokens gives"
        )
    with pytest.raises(VerifyError, match=want):
        verify_pack(out)
