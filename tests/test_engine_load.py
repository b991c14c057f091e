"""Load-time refusals of strata-engine, each with the message content, and the start-up order.

Every refusal happens in :func:`strata.engine.generate.load_engine` before the first token (and
before any weight is dequantized: the 'pack' checkpoint), naming the file / tensor and the
numbers: a wrong shape (name, shape found, shape required), a missing tensor, a bad index line
(file:line), an unread tensor, a disallowed type, an expert table that disagrees with the
geometry or runs past its shard.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_engine_reference import synthetic_pack

from strata.engine.cli import main
from strata.engine.loader import LoadError
from strata.engine.models import UnsupportedModel
from strata.engine.startup import load_engine
from strata.packer.packfmt import PackFormatError


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return {
        "qwen2": synthetic_pack(tmp_path_factory, "synthetic-qwen2"),
        "moe": synthetic_pack(tmp_path_factory, "synthetic-qwen3moe"),
        "gemma3": synthetic_pack(tmp_path_factory, "synthetic-gemma3"),
    }  # BF16 weights, promoted to F32


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_index(pack: Path, fn) -> None:
    p = pack / "index.txt"
    lines = p.read_text().split("\n")
    p.write_text("\n".join(fn(lines)))


def _set_fields(line: str, **cols) -> str:
    names = ("name", "type", "src_type", "offset", "nbytes", "ne0", "ne1", "ne2", "ne3", "shard", "src_offset")
    tok = line.split(" ")
    for k, v in cols.items():
        tok[names.index(k)] = str(v)
    return " ".join(tok)


def test_wrong_shape_names_tensor_found_and_required(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    # attn_k is [n_embd 256, kv_dim 128]; claim [128, 256] (same bytes, so only the shape is wrong)
    _edit_index(
        pack, lambda ls: [_set_fields(x, ne0=128, ne1=256) if x.startswith("blk.1.attn_k.weight ") else x for x in ls]
    )
    with pytest.raises(LoadError) as ei:
        load_engine(pack)
    msg = str(ei.value)
    assert "index.txt: tensor blk.1.attn_k.weight has shape [128, 256], the qwen2 contract requires [256, 128]" in msg


def test_missing_tensor_is_named(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")

    def drop(lines):
        out = [x for x in lines if not x.startswith("blk.1.ffn_norm.weight ")]
        return [
            re.sub(r"tensors (\d+)$", lambda m: f"tensors {int(m.group(1)) - 1}", x) if x.startswith("# align") else x
            for x in out
        ]

    _edit_index(pack, drop)
    with pytest.raises(
        LoadError,
        match=r"tensor blk\.1\.ffn_norm\.weight is missing; the qwen2 contract requires it "
        r"with shape \[256\]",
    ):
        load_engine(pack)


def test_missing_choice_member_is_named(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")

    def drop(lines):
        out = [x for x in lines if not x.startswith("blk.0.attn_v.bias ")]
        return [
            re.sub(r"tensors (\d+)$", lambda m: f"tensors {int(m.group(1)) - 1}", x) if x.startswith("# align") else x
            for x in out
        ]

    _edit_index(pack, drop)
    with pytest.raises(LoadError, match=r"tensor blk\.0\.attn_v\.bias is missing"):
        load_engine(pack)


def test_bad_index_line_names_file_and_line(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    _edit_index(pack, lambda ls: [x + " 7" if x.startswith("blk.0.attn_q.weight ") else x for x in ls])
    with pytest.raises(PackFormatError, match=r"index\.txt:\d+: 12 fields, expected 11: 'blk\.0\.attn_q\.weight "):
        load_engine(pack)


def test_bad_columns_line_is_refused(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    _edit_index(
        pack, lambda ls: [x.replace(" nbytes ne0", " ne0 nbytes") if x.startswith("# columns") else x for x in ls]
    )
    with pytest.raises(PackFormatError, match=r"index\.txt:\d+: columns are .* this reader needs exactly"):
        load_engine(pack)


def test_tensor_the_forward_pass_does_not_read_is_refused(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    _edit_index(pack, lambda ls: [x.replace("blk.1.ffn_norm.weight ", "blk.1.ffn_nrom.weight ") for x in ls])
    with pytest.raises(LoadError, match=r"tensor blk\.1\.ffn_nrom\.weight is not in the qwen2 contract"):
        load_engine(pack)


def test_disallowed_type_is_refused(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    # a norm weight claimed to be F16 (the manifest allows F32 only); bytes halved to stay consistent
    _edit_index(
        pack,
        lambda ls: [
            _set_fields(x, type=1, src_type=1, nbytes=512) if x.startswith("blk.0.attn_norm.weight ") else x for x in ls
        ],
    )
    with pytest.raises(
        LoadError, match=r"tensor blk\.0\.attn_norm\.weight has type F16, manifests/qwen2\.toml allows only F32"
    ):
        load_engine(pack)


def test_byte_count_disagreeing_with_type_and_shape(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    _edit_index(
        pack, lambda ls: [_set_fields(x, type=2, src_type=2) if x.startswith("blk.0.ffn_up.weight ") else x for x in ls]
    )  # Q8_0 bytes labelled Q4_0
    # the pool layout (packfmt.pool_layout_findings, shared with the budget audit) refuses it when the pack is opened
    with pytest.raises(
        PackFormatError, match=r"tensor blk\.0\.ffn_up\.weight has \d+ bytes, Q4_0 x \[256, 512\] is 73728 bytes"
    ):
        load_engine(pack)


def _edit_experts(pack: Path, fn) -> None:
    p = pack / "native_experts.txt"
    p.write_text("\n".join(fn(p.read_text().split("\n"))))


def test_expert_bytes_disagreeing_with_geometry(packs, tmp_path):
    pack = _copy(packs["moe"], tmp_path / "p")

    def bump(lines):
        out = []
        for x in lines:
            tok = x.split(" ")
            if tok[0] == "1":  # layer 1: gate_bytes (column 16) one block short
                tok[15] = str(int(tok[15]) - 74)
            out.append(" ".join(tok))
        return out

    _edit_experts(pack, bump)
    with pytest.raises(
        LoadError,
        match=r"native_experts\.txt: layer 1 gate \(column gate_bytes\): found 18870 bytes per "
        r"expert, required IQ2_XS x \[256, 256\] \(ggml ne of one expert of "
        r"blk\.1\.ffn_gate_exps\.weight, from geometry\.txt\) = 18944 bytes",
    ):
        load_engine(pack)


def test_expert_range_past_the_shard_is_refused(packs, tmp_path):
    pack = _copy(packs["moe"], tmp_path / "p")
    src = pack / "metadata.txt"
    text = src.read_text()
    src_dir = re.search(r"strata\.source_dir str (\S+)", text).group(1)
    gguf = next(Path(src_dir).glob("*.gguf"))
    short = tmp_path / "src"
    short.mkdir()
    data = gguf.read_bytes()
    (short / gguf.name).write_bytes(data[:-4096])  # the last expert of the last tensor is cut
    src.write_text(text.replace(src_dir, str(short)))
    n = len(data)
    want = rf"^{re.escape(str(short / gguf.name))}: expert shard 0 is {n - 4096} bytes, the pack was built from {n} "
    with pytest.raises(LoadError, match=want + r"\(index\.txt's sources\): the file was changed or truncated since"):
        load_engine(pack)


def test_expert_offset_past_the_shard_is_refused(packs, tmp_path):
    pack = _copy(packs["moe"], tmp_path / "p")

    def shift(lines):
        out = []
        for x in lines:
            tok = x.split(" ")
            if tok[0] == "2":  # layer 2: down_off (column 14) moved 1 MB further
                tok[13] = str(int(tok[13]) + (1 << 20))
            out.append(" ".join(tok))
        return out

    _edit_experts(pack, shift)
    with pytest.raises(
        LoadError,
        match=r"native_experts\.txt: layer 2 down: expert 7 ends at byte \d+, past the end of "
        r"shard .*synthetic-qwen3moe\.gguf \(\d+ bytes\)",
    ):
        load_engine(pack)


def test_missing_native_experts_file(packs, tmp_path):
    pack = _copy(packs["moe"], tmp_path / "p")
    (pack / "native_experts.txt").unlink()
    with pytest.raises(LoadError, match=r"native_experts\.txt: missing; the qwen3moe contract has routed experts"):
        load_engine(pack)


def test_bf16_promoted_tensor_that_is_not_bf16_exact_is_refused(packs, tmp_path):
    from strata.engine.weights import WeightError
    from strata.packer.pack import open_pack

    pack = _copy(packs["gemma3"], tmp_path / "p")
    e = open_pack(pack).index.by_name()["blk.0.attn_q.weight"]
    assert (e.type, e.src_type) == (0, 30)  # F32 in the pool, BF16 in the GGUF
    with open(pack / "pool.bin", "r+b") as f:
        f.seek(e.offset + 4 * 17)
        f.write(b"\x01")  # low byte of value 17
    with pytest.raises(
        WeightError,
        match=r"tensor blk\.0\.attn_q\.weight: pool F32 promoted from BF16 has non-zero low "
        r"16 bits \(1 values\)",
    ):
        load_engine(pack)


def test_rope_scaling_is_refused_not_ignored(packs, tmp_path):
    # YaRN: not implemented, refused by the manifest's [keys] rule (linear scaling is honoured:
    # tests/test_metadata_keys.py)
    pack = _copy(packs["qwen2"], tmp_path / "p")
    with open(pack / "metadata.txt", "a") as f:
        f.write("qwen2.rope.scaling.type str yarn\n")
    with pytest.raises(
        UnsupportedModel,
        match=r"metadata key qwen2\.rope\.scaling\.type = 'yarn' is refused: strata "
        r"implements rope unscaled or scaled linearly",
    ):
        load_engine(pack)


def test_refusal_happens_before_any_weight_is_loaded(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    _edit_index(
        pack, lambda ls: [_set_fields(x, ne0=128, ne1=256) if x.startswith("blk.1.attn_k.weight ") else x for x in ls]
    )
    seen = []
    with pytest.raises(LoadError):
        load_engine(pack, on_checkpoint=lambda c: seen.append(c.name))
    assert seen == []  # not even the 'pack' stage completed; no weights stage ran


def test_cli_refusal_exit_code_and_message(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    _edit_index(
        pack, lambda ls: [_set_fields(x, ne0=128, ne1=256) if x.startswith("blk.1.attn_k.weight ") else x for x in ls]
    )
    r = CliRunner().invoke(main, ["generate", str(pack), "-p", "hi", "-n", "2"])
    assert r.exit_code == 2
    assert "error:" in r.output and "blk.1.attn_k.weight has shape [128, 256]" in r.output


def test_checkpoints_in_order_head_before_expert_cache(packs):
    names = []
    eng = load_engine(packs["moe"], n_ctx=32, on_checkpoint=lambda c: names.append(c.name))
    assert names == ["pack", "weights", "head", "session", "prompt path", "expert cache"]
    assert [c.name for c in eng.checkpoints] == names
    cps = {c.name: c for c in eng.checkpoints}
    assert cps["pack"].extra["tensors checked"] == len(eng.plan.dense)
    assert cps["expert cache"].extra["resident"].startswith("24 of 24 experts")
    assert all(c.seconds >= 0 and c.rss_bytes > 0 for c in eng.checkpoints)


# ---------------------------------------------------------------- review fixes: shards, expert rows, pack paths


def _edit_expert_col(pack: Path, layer: int, col: str, fn) -> None:
    from strata.packer.packfmt import EXPERT_COLUMNS

    i = EXPERT_COLUMNS.index(col)

    def edit(lines):
        out = []
        for x in lines:
            tok = x.split(" ")
            if tok[0] == str(layer):
                tok[i] = str(fn(int(tok[i])))
            out.append(" ".join(tok))
        return out

    _edit_experts(pack, edit)


def _shard_copy(pack: Path, tmp_path: Path, mutate) -> None:
    src = pack / "metadata.txt"
    text = src.read_text()
    src_dir = re.search(r"strata\.source_dir str (\S+)", text).group(1)
    gguf = next(Path(src_dir).glob("*.gguf"))
    d = tmp_path / "src"
    d.mkdir()
    (d / gguf.name).write_bytes(mutate(gguf.read_bytes()))
    src.write_text(text.replace(src_dir, str(d)))


def test_expert_shard_without_gguf_magic_is_refused(packs, tmp_path):
    pack = _copy(packs["moe"], tmp_path / "p")
    _shard_copy(pack, tmp_path, lambda b: b"XXXX" + b[4:])  # same size, wrong magic
    with pytest.raises(
        LoadError,
        match=r"native_experts\.txt: expert shard 0 .*synthetic-qwen3moe\.gguf: first 4 bytes "
        r"are b'XXXX', a GGUF file starts with b'GGUF'",
    ):
        load_engine(pack)


def test_blob_bytes_not_the_sum_of_parts_is_refused(packs, tmp_path):
    pack = _copy(packs["moe"], tmp_path / "p")
    # the last row, so that the arena offsets of the rows after it stay consistent
    from strata.packer.pack import open_pack

    rows = open_pack(pack).experts.layers
    last = rows[-1]
    _edit_expert_col(pack, last.layer, "blob_bytes", lambda v: v + 256)
    total = last.gate_bytes + last.up_bytes + last.down_bytes
    with pytest.raises(
        LoadError,
        match=rf"layer {last.layer} column blob_bytes: found {total + 256}, required gate_bytes "
        rf"\+ up_bytes \+ down_bytes = {last.gate_bytes} \+ {last.up_bytes} \+ "
        rf"{last.down_bytes} = {total}",
    ):
        load_engine(pack)


def test_arena_offset_not_the_running_sum_is_refused(packs, tmp_path):
    pack = _copy(packs["moe"], tmp_path / "p")
    from strata.packer.pack import open_pack

    rows = open_pack(pack).experts.layers
    want = rows[0].arena_offset + 8 * rows[0].blob_bytes
    _edit_expert_col(pack, rows[1].layer, "arena_offset", lambda v: v + 4096)
    with pytest.raises(
        LoadError,
        match=rf"layer {rows[1].layer} column arena_offset: found {want + 4096}, required "
        rf"{want} \(the running sum of n_expert x blob_bytes",
    ):
        load_engine(pack)


def test_corrupt_or_empty_vocab_parquet_is_refused_exit_2(packs, tmp_path):
    for name, data in (
        ("vocab.parquet", b""),
        ("vocab.parquet", b"PAR1 garbage, not parquet"),
        ("merges.parquet", b"junk"),
    ):
        pack = _copy(packs["qwen2"], tmp_path / f"p{len(data)}{name}")
        (pack / name).write_bytes(data)
        r = CliRunner().invoke(main, ["generate", str(pack), "-p", "hi", "-n", "2"])
        assert r.exit_code == 2, r.output
        assert f"error: {pack / name}: not a valid Parquet file ({len(data)} bytes)" in r.stderr
        assert "Traceback" not in r.output


def test_pack_that_is_a_file_is_refused_like_a_missing_path(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for p in (f, tmp_path / "missing"):
        r = CliRunner().invoke(main, ["generate", str(p), "-p", "hi"])
        assert r.exit_code == 2, r.output
        assert r.stderr.strip() == f"error: {p}: not a pack directory"


def test_pool_bin_that_is_a_directory_is_refused(packs, tmp_path):
    pack = _copy(packs["qwen2"], tmp_path / "p")
    (pack / "pool.bin").unlink()
    (pack / "pool.bin").mkdir()
    r = CliRunner().invoke(main, ["generate", str(pack), "-p", "hi", "-n", "2"])
    assert r.exit_code == 2, r.output
    assert f"error: {pack / 'pool.bin'}: not a file (a directory)" in r.stderr


def test_a_pack_from_an_older_strata_missing_a_geometry_param_says_to_rebuild(tmp_path_factory, tmp_path):
    """geometry.txt without a param the manifest now has (a pack built before rope_dim was added) is refused
    naming the file, the param and the way out; the generate CLI exits 2 with the same line."""
    pack = tmp_path / "p"
    shutil.copytree(synthetic_pack(tmp_path_factory, "synthetic-qwen2"), pack)
    g = pack / "geometry.txt"
    lines = g.read_text().splitlines(keepends=True)
    assert any(ln.startswith("rope_dim ") for ln in lines)
    g.write_text("".join(ln for ln in lines if not ln.startswith("rope_dim ")))
    want = (
        "geometry.txt: param 'rope_dim' of qwen2 is missing (a pack built by an older strata? rebuild it from its GGUF"
    )
    from strata.manifests.expr import ManifestError

    with pytest.raises(ManifestError, match=re.escape(want)):
        load_engine(pack, n_ctx=32)
    r = CliRunner().invoke(main, ["generate", str(pack), "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and want in r.stderr


@pytest.mark.parametrize(
    "param, edited, held",
    [("rope_base", "500000.0", "1000000.0"), ("n_expert_used", "1", "2")],
)
def test_geometry_txt_that_disagrees_with_metadata_is_refused_at_load(packs, tmp_path, param, edited, held):
    """The engine runs from geometry.txt: an edited value there (another rope base, fewer experts a token) would
    generate other tokens with exit 0 while strata-budget check refuses the same pack. Both apply one rule
    (strata.packer.pack_geometry): the load is refused naming the file, the param and both values, and the CLI
    exits 2 with that line; the budget's audit names the same param with the same two values."""
    from strata.budget.audit import audit_pack

    pack = _copy(packs["moe"], tmp_path / "p")
    g = pack / "geometry.txt"
    text = g.read_text()
    assert f"\n{param} {held}\n" in text
    g.write_text(text.replace(f"\n{param} {held}\n", f"\n{param} {edited}\n"))
    want = (
        f"{pack / 'geometry.txt'}: geometry.txt param {param} disagrees with the metadata: geometry.txt holds "
        f"{edited if param != 'n_expert_used' else int(edited)}, metadata.txt gives {held}"
    )
    with pytest.raises(LoadError, match=re.escape(want)):
        load_engine(pack, n_ctx=32)
    r = CliRunner().invoke(main, ["generate", str(pack), "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and want in r.stderr
    errs = [e for e in audit_pack(pack).errors if e.tensor == f"geometry.txt:{param}"]
    assert [(e.found, e.required.split(" ")[0]) for e in errs] == [(edited, held)]


def test_metadata_txt_whose_defaults_do_not_evaluate_is_refused_not_a_traceback(packs, tmp_path):
    """metadata.txt without qwen3moe's feed_forward_length keys: the manifest's default over the missing value cannot
    evaluate; the load is a LoadError naming metadata.txt and the way out (was a TypeError traceback, exit 1)."""
    pack = _copy(packs["moe"], tmp_path / "p")
    m = pack / "metadata.txt"
    text = m.read_text()
    assert "qwen3moe.feed_forward_length int 512\n" in text
    m.write_text("".join(ln for ln in text.splitlines(keepends=True) if "feed_forward_length" not in ln))
    want = f"{m}: a default of the qwen3moe manifest does not evaluate (a key it reads is missing from metadata.txt)"
    with pytest.raises(LoadError, match=re.escape(want)):
        load_engine(pack, n_ctx=32)
    r = CliRunner().invoke(main, ["generate", str(pack), "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and want in r.stderr and "rebuild it with strata-pack build" in r.stderr


def test_missing_vocab_parquet_is_named_not_blamed_on_metadata(packs, tmp_path):
    pack = _copy(packs["moe"], tmp_path / "p")
    (pack / "vocab.parquet").unlink()
    with pytest.raises(LoadError, match=re.escape(f"{pack / 'vocab.parquet'}: missing: the pack has no tokenizer")):
        load_engine(pack, n_ctx=32)


def test_an_edited_n_layer_names_the_param_before_the_key_refusal_it_causes(packs, tmp_path):
    """geometry.txt n_layer 3 -> 2 on the MoE pack: refused naming n_layer with both values (the disagreement is
    reported before any metadata key refusal it could cause)."""
    pack = _copy(packs["moe"], tmp_path / "p")
    g = pack / "geometry.txt"
    g.write_text(g.read_text().replace("\nn_layer 3\n", "\nn_layer 2\n"))
    want = "geometry.txt param n_layer disagrees with the metadata: geometry.txt holds 2, metadata.txt gives 3"
    with pytest.raises(LoadError, match=re.escape(want)):
        load_engine(pack, n_ctx=32)
