"""The qwen3next reference model written with its data (strata.testing.write_reference_model): a scaled-down copy
of the geometry (4 layers, 8 experts, a 1,000-token vocabulary) built into a pack, and the full-size
header plan's worked numbers (docs/DESIGN.md "Expert sizes change per layer"). The full-size pair of
shards (~47 GB) is written on the GPU machine by bench/device_docs.sh, from the same plan."""

from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest

from strata import testing as S
from strata.budget import formulas as F
from strata.layout import experts as LX
from strata.packer import quants
from strata.packer.gguf_file import open_model
from strata.testing.blocks import make_random_blocks, pattern_chunks, pattern_fill, role_values, tensor_rng
from strata.testing.shards import RANDOM_MAX_BYTES, split_bounds, tensor_role

SMALL = dict(n_layer=4, n_expert=8, n_vocab=1000)
IQ2_XS, IQ2_XXS, IQ4_NL, Q2_0 = 17, 16, 20, 42


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    paths = S.write_reference_model(d / "docs.gguf", workers=2, **SMALL)
    return d, paths


def _tensor(paths, name):
    m = open_model(paths[0])
    shard, ti = m.tensors[name]
    return ti, np.fromfile(paths[shard], np.uint8, count=ti.nbytes, offset=ti.abs_offset)


def test_pattern_chunks_are_pattern_fill():
    for type_id, ne in ((IQ2_XS, (2560, 640, 8)), (Q2_0, (640, 2560, 3)), (0, (7,)), (8, (64, 3))):
        whole = pattern_fill(type_id, ne, tensor_rng(5, "t"))
        parts = [p.copy() for p in pattern_chunks(type_id, ne, tensor_rng(5, "t"), chunk_bytes=1 << 20)]
        assert max(p.size for p in parts) <= 1 << 20 or len(parts) == 1
        assert np.array_equal(np.concatenate(parts), whole)


def test_split_bounds_balance_bytes():
    assert split_bounds([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert split_bounds([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert split_bounds([1, 1, 1, 100], 2) == [range(0, 3), range(3, 4)]
    assert [len(r) for r in split_bounds([5] * 3, 3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="2 tensors cannot fill 3"):
        split_bounds([1, 1], 3)
    assert tensor_role("blk.12.nextn.eh_proj.weight") == "nextn.eh_proj.weight"
    assert tensor_role("output.weight") == "output.weight"


def test_small_copy_is_two_shards_with_the_worked_expert_bytes(small):
    d, paths = small
    assert [p.name for p in paths] == ["docs-00001-of-00002.gguf", "docs-00002-of-00002.gguf"]
    m = open_model(paths[0])
    # shard 0: every tensor but the routed experts; shard 1: the experts, layer by layer
    assert {tensor_role(n) for n, (s, _) in m.tensors.items() if s == 1} == {
        "ffn_gate_exps.weight",
        "ffn_up_exps.weight",
        "ffn_down_exps.weight",
    }
    assert m.kv["qwen3next.block_count"] == 4 and m.kv["qwen3next.expert_count"] == 8
    assert m.kv["split.count"] == 2 and m.kv["split.tensors.count"] == len(m.tensors)
    per = {}
    for il in (0, 1):
        for part in ("gate", "up", "down"):
            _, ti = m.tensors[f"blk.{il}.ffn_{part}_exps.weight"]
            per[il, part] = ti.nbytes // 8
    assert (per[0, "gate"], per[0, "up"], per[0, "down"]) == (473_600, 473_600, 921_600)
    assert (per[1, "gate"], per[1, "up"], per[1, "down"]) == (422_400, 422_400, 460_800)
    # the data: weights above 4 MiB are the tiled pattern of their own stream, smaller ones (routers) random
    # blocks, norms near 1, ssm_a negative
    ti, raw = _tensor(paths, "blk.0.ffn_down_exps.weight")
    assert ti.nbytes > RANDOM_MAX_BYTES and np.array_equal(raw, pattern_fill(IQ4_NL, ti.ne, tensor_rng(0, ti.name)))
    ti, raw = _tensor(paths, "blk.1.ffn_gate_inp.weight")
    assert ti.nbytes <= RANDOM_MAX_BYTES
    assert np.array_equal(raw, make_random_blocks(ti.type_id, 2560 * 8, tensor_rng(0, ti.name)))
    _, norm = _tensor(paths, "blk.0.attn_norm.weight")
    assert np.array_equal(norm.view("<f4"), role_values("norm", 2560, tensor_rng(0, "blk.0.attn_norm.weight")))
    _, a = _tensor(paths, "blk.0.ssm_a")
    assert (a.view("<f4") < 0).all()


def test_small_copy_packs_with_the_worked_numbers(small, tmp_path):
    from strata.budget.audit import audit_pack
    from strata.packer.build import build_pack
    from strata.packer.pack import open_pack

    d, paths = small
    build_pack(paths[0], tmp_path / "pack", progress=False)
    pk = open_pack(tmp_path / "pack")
    rows = {r.layer: r for r in pk.experts.layers}
    assert (rows[0].gate_type, rows[0].up_type, rows[0].down_type) == (IQ2_XS, IQ2_XS, IQ4_NL)
    assert (rows[1].gate_type, rows[1].down_type) == (IQ2_XXS, Q2_0)
    assert rows[0].blob_bytes == 1_868_800 and rows[1].blob_bytes == 1_305_600
    assert rows[1].arena_offset == 8 * 1_868_800  # 512 x 1,868,800 = 956,825,600 at full size
    res = audit_pack(tmp_path / "pack")
    assert res.errors == [], [e.message for e in res.errors[:3]]
    # the engine-form blobs the cache sizes its slots from (docs/DESIGN.md "Expert sizes change per layer")
    assert LX.expert_blob_bytes(IQ2_XS, IQ2_XS, IQ4_NL, 2560, 640, engine=True) == 1_971_200


def test_full_size_plan_gives_the_worked_numbers():
    """The plan device_docs.sh writes at full size (the same function), checked without writing it."""
    kv, tensors = S.reference_model_plan()
    t = {n: (ty, ne) for n, ty, ne in tensors}
    blob = {
        il: sum(quants.tensor_nbytes(*t[f"blk.{il}.ffn_{p}_exps.weight"]) for p in ("gate", "up", "down")) // 512
        for il in range(48)
    }
    assert blob[0] == 1_868_800 and blob[1] == 1_305_600
    assert 512 * blob[0] == 956_825_600  # layer 1's arena offset
    experts = sum(512 * b for b in blob.values())
    total = sum(quants.tensor_nbytes(ty, ne) for ty, ne in t.values())
    assert experts == 44_145_049_600 and 46e9 < total < 48e9  # the cycle's experts; the file ~47 GB
    assert kv["qwen3next.block_count"] == 48 and "qwen3next.nextn_predict_layers" not in kv


def test_draft_head_variant_rewrites_only_shard_0(tmp_path):
    """A bigger draft head changes dense tensors only: the experts' shard is byte-identical (linked)."""
    kw = dict(SMALL, nextn=1, workers=1)
    a = S.write_reference_model(tmp_path / "a.gguf", draft_head_type="Q1_0", **kw)
    b = S.write_reference_model(tmp_path / "b.gguf", draft_head_type="Q4_K", only={0}, **kw)
    os.link(a[1], b[1])
    assert filecmp.cmp(
        S.write_reference_model(tmp_path / "c.gguf", draft_head_type="Q4_K", **kw)[1], b[1], shallow=False
    )
    ma, mb = open_model(a[0]), open_model(b[0])
    assert ma.kv["qwen3next.block_count"] == 5 and ma.kv["qwen3next.nextn_predict_layers"] == 1
    ha, hb = (m.tensors["blk.4.nextn.shared_head_head.weight"][1] for m in (ma, mb))
    assert (ha.type_id, hb.type_id) == (quants.by_name("Q1_0").id, quants.by_name("Q4_K").id)
    # at the full vocabulary: 54,000,000 -> 216,000,000 B, 154.5 MiB larger (the C++ engine's 110-180 MiB)
    full = {ty: quants.tensor_nbytes(quants.by_name(ty).id, (2560, 150_000)) for ty in ("Q1_0", "Q4_K")}
    assert full == {"Q1_0": 54_000_000, "Q4_K": 216_000_000}
    assert round((full["Q4_K"] - full["Q1_0"]) / F.MIB, 1) == 154.5
    for n in (
        "nextn.eh_proj.weight",
        "nextn.enorm.weight",
        "nextn.hnorm.weight",
        "attn_q.weight",
        "ffn_gate_exps.weight",
    ):
        assert f"blk.4.{n}" in ma.tensors
    assert "blk.4.ssm_a" not in ma.tensors and "blk.4.indexer.attn_k.weight" not in ma.tensors
