"""Routed experts on the synthetic qwen3moe fixture: the hit/miss split changes nothing.

docs/DESIGN.md "The hit path is all or nothing": a selected expert runs exactly once, as a hit (the
expert cache) or a miss (dequantized from the memory-mapped shard), and the outputs are summed
in selection order either way - so whichever experts are resident (all, half, none), every
step's logits are bit-identical and so are the tokens. Also: experts are read only by the
native_experts.txt offsets, only when selected.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_reference import load_fixture, synthetic_pack

from strata.engine import experts as X
from strata.engine import layers
from strata.engine.cpu import experts as CX
from strata.engine.generate import generate
from strata.engine.startup import load_engine

N_STEPS = 16


@pytest.fixture(scope="module")
def moe_pack(tmp_path_factory):
    return synthetic_pack(tmp_path_factory, "synthetic-qwen3moe")


def _run(pack, resident, numerics="f32"):
    eng = load_engine(pack, n_ctx=128, resident=resident, numerics=numerics)
    ref = load_fixture("synthetic-qwen3moe")
    results = [generate(eng, prompt_ids=p["prompt_ids"], n_tokens=N_STEPS, ignore_eos=True) for p in ref["prompts"]]
    return eng, results


@pytest.mark.parametrize("numerics", ["f32", "llamacpp"])
def test_tokens_and_logits_identical_whatever_is_resident(moe_pack, numerics):
    runs = {r: _run(moe_pack, r, numerics) for r in ("all", "half", "none")}
    base = runs["all"][1]
    for resident in ("half", "none"):
        for a, b in zip(base, runs[resident][1]):
            assert a.output_ids == b.output_ids
            for ta, tb in zip(a.top, b.top):  # bit-identical, not approximately equal
                assert [i for i, _ in ta] == [i for i, _ in tb]
                assert np.array_equal(
                    np.float32([v for _, v in ta]).view(np.uint32), np.float32([v for _, v in tb]).view(np.uint32)
                )
    # the split really differed: all hits, a mix, all misses
    hits = {r: sum(x.expert_hits for x in res) for r, (_, res) in runs.items()}
    misses = {r: sum(x.expert_misses for x in res) for r, (_, res) in runs.items()}
    assert misses["all"] == 0 and hits["all"] > 0
    assert hits["none"] == 0 and misses["none"] == hits["all"]
    assert hits["half"] > 0 and misses["half"] > 0 and hits["half"] + misses["half"] == hits["all"]


def test_every_selection_is_counted_once_per_layer(moe_pack):
    eng, res = _run(moe_pack, "half")
    g = eng.geometry
    n_sel = int(g["n_expert_used"]) * int(g["n_layer"])
    for r in res:
        positions = r.n_prompt_tokens + r.n_output_tokens - 1
        assert r.expert_hits + r.expert_misses == positions * n_sel
        for s in r.steps:
            assert s.expert_hits + s.expert_misses == n_sel  # counts per position (experts, not bytes)


def test_resident_pairs_policies():
    assert X.resident_pairs("all", [0, 2], 4) == [(0, 0), (0, 1), (0, 2), (0, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    assert X.resident_pairs("none", [0, 2], 4) == []
    half = X.resident_pairs("half", [0, 1], 4)
    assert half == [(0, 0), (0, 2), (1, 1), (1, 3)]  # every layer keeps half
    assert X.resident_pairs("0.25", [5], 8) == [(5, 0), (5, 1)]
    with pytest.raises(ValueError, match="expected all, none, half or a fraction"):
        X.resident_pairs("most", [0], 4)
    with pytest.raises(ValueError, match="outside"):
        X.resident_pairs(1.5, [0], 4)


def test_misses_read_only_the_selected_experts_by_offset(moe_pack, monkeypatch):
    eng = load_engine(moe_pack, n_ctx=64, resident="none")
    src = eng.experts.source
    read: list[tuple[int, int]] = []
    orig = X.ShardExperts.raw
    orig_locate = X.ShardExperts.locate

    def spy(self, il, e):
        read.append((il, e))
        return orig_locate(self, il, e)

    monkeypatch.setattr(X.ShardExperts, "locate", spy)  # the one place an expert's bytes are located
    selected: list[tuple[int, int]] = []
    # the routing hook sees every selection (a prompt chunk's too, replayed per position)
    eng.experts.on_route = lambda il, ids: selected.extend((il, e) for e in ids)
    generate(eng, prompt_ids=[1, 2, 3], n_tokens=2, ignore_eos=True)
    # every miss located exactly its expert, nothing else; once per expert (its addresses are kept; a chunk
    # locates a layer's experts in id order, one position in selection order)
    assert sorted(read) == sorted(set(selected)) and len(read) == len(set(read)) and len(selected) > len(read)
    # and the bytes are the ones native_experts.txt points at
    il, e = read[0]
    row = src.rows[il]
    g, _, _ = orig(src, il, e)
    with open(eng.plan.shard_paths[row.gate_shard], "rb") as f:
        f.seek(row.gate_off + e * row.gate_stride)
        assert f.read(row.gate_bytes) == g.tobytes()


def test_routing_softmax_topk_renormalised():
    logits = np.float32([0.0, 2.0, 1.0, 2.0, -1.0])
    ids, w = layers.route_topk(np, logits, 2)
    assert ids == [1, 3]  # a tie goes to the lower id
    assert w.dtype == np.float32 and abs(float(w.sum()) - 1.0) < 1e-6 and w[0] == w[1]
    ids, w = layers.route_topk(np, logits, 3, norm=False)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert ids == [1, 3, 2] and np.allclose(w, p[[1, 3, 2]])


# ------------------------------------------------------------------ ShardExperts.ffn_many (the batched CPU expert call)


@pytest.mark.parametrize("kernel", ["exact", "q8", "f32"])
def test_ffn_many_rows_are_each_expert_alone_bit_for_bit(moe_pack, kernel):
    from strata.engine.gpu import reference as R

    eng = load_engine(moe_pack, n_ctx=32)
    src = eng.experts.source
    il = src.layers[0]
    x = np.random.default_rng(5).standard_normal(src.shapes[il].gate[0]).astype(np.float32)
    ids = [3, 0, 7, 3, 5]  # any order, repeats allowed
    for silu in (None, R.silu_mul):
        Y = src.ffn_many(il, ids, x, kernel=kernel, silu_mul=silu, threads=2)
        assert Y.shape == (len(ids), src.shapes[il].down[1]) and Y.dtype == np.float32
        for k, e in enumerate(ids):
            y = src.ffn(il, e, x, kernel=kernel, silu_mul=silu, threads=1)
            assert np.array_equal(Y[k].view(np.uint32), y.view(np.uint32)), (kernel, e)
    if kernel == "exact":  # the GPU hit path's replica, bit for bit (what fused_moe's misses need)
        Y = src.ffn_many(il, ids, x, exact=True, silu_mul=R.silu_mul)
        for k, e in enumerate(ids):
            want = R.expert_ffn(src.types(il), *src.weights(il, e), x)
            assert np.array_equal(Y[k].view(np.uint32), want.view(np.uint32))
    assert src.ffn_many(il, [], x, kernel=kernel).shape == (0, src.shapes[il].down[1])
    with pytest.raises(ValueError, match="are not in shard"):
        src.ffn_many(il, [-1], x, kernel=kernel)


@pytest.mark.parametrize("kernel", ["q8", "q8-exact"])
def test_ffn_many_activation_made_in_c_equals_numpys(moe_pack, kernel, monkeypatch):
    """With the GPU's activation (reference.silu_mul) and a q8 down type, ffn_many makes the activation inside the
    down products' C region (cpukernels.call_many_silu): the same bits as NumPy's silu_mul passed to the kernels,
    on every MoE layer of the fixture (down types Q8_0, IQ4_NL, Q5_0: the fused call where a q8 kernel exists)."""
    from strata.engine.cpu import kernels as CK
    from strata.engine.gpu import reference as R

    src = load_engine(moe_pack, n_ctx=32).experts.source
    calls: list[int] = []
    real = CK.call_many_silu

    def counted(t, *a):  # the C activation really taken (not NumPy's twice)
        calls.append(t)
        return real(t, *a)

    monkeypatch.setattr(CK, "call_many_silu", counted)
    fused = 0
    for il in src.layers:
        x = np.random.default_rng(il).standard_normal(src.shapes[il].gate[0]).astype(np.float32) * 4
        ids = [6, 1, 1, 4]
        Y = src.ffn_many(il, ids, x, kernel=kernel, silu_mul=R.silu_mul, threads=3)
        Z = src.ffn_many(il, ids, x, kernel=kernel, silu_mul=lambda g, u: R.silu_mul(g, u), threads=2)
        assert np.array_equal(Y.view(np.uint32), Z.view(np.uint32)), il
        fused += CK.kernel_for(src.types(il)[2], kernel) == "q8"
    assert fused >= 2 and len(calls) == fused  # the fixture's Q8_0 and Q5_0 downs: the C activation, once a call


@pytest.mark.parametrize("numerics", ["f32", "llamacpp"])
def test_batched_cpu_expert_path_equals_one_at_a_time(moe_pack, numerics):
    eng = load_engine(moe_pack, n_ctx=32, resident="half", numerics=numerics)
    path = eng.experts
    assert isinstance(path, CX.CpuExpertPath)
    one = X.ExpertPath(path.source, path.cache, act_quant=path.act_quant, threads=path.threads, kernel=path.kernel)
    il = path.source.layers[1]
    x = np.random.default_rng(6).standard_normal(path.source.shapes[il].gate[0]).astype(np.float32)
    ids, w = [4, 1, 6], np.float32([0.5, 0.3, 0.2])
    a, b = path(il, x, ids, w), one(il, x, ids, w)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert path.take_step() == one.take_step()


def test_a_wrong_expert_offset_inside_the_shard_is_refused_at_load(moe_pack, tmp_path):
    """native_experts.txt with layer 1's gate_off moved 32 bytes (still inside the shard: it would decode to
    plausible garbage) is refused at load, naming the file, the column and both numbers - checked against
    the shard's own tensor table, as strata-budget check does."""
    import shutil

    from strata.engine.loader import LoadError

    bad = tmp_path / "pack"
    shutil.copytree(moe_pack, bad)
    lines = (bad / "native_experts.txt").read_text().split("\n")
    for i, ln in enumerate(lines):
        cols = ln.split(" ")
        if cols and cols[0] == "1":  # layer 1's row: column 7 is gate_off (packer/packfmt.py)
            old = int(cols[7])
            cols[7] = str(old + 32)
            lines[i] = " ".join(cols)
            break
    else:
        raise AssertionError("no layer-1 row")
    (bad / "native_experts.txt").write_text("\n".join(lines))
    with pytest.raises(
        LoadError,
        match=rf"native_experts\.txt: layer 1: gate_off {old + 32} disagrees with the shard's "
        rf"tensor table \({old}\)",
    ):
        load_engine(bad, n_ctx=32)


def test_non_finite_logits_stop_generation_with_the_position(moe_pack, monkeypatch):
    """A step whose logits hold NaN is refused at that position (NonFiniteLogits, a GenerateError: exit 2
    on the CLI), never sampled."""
    from strata.engine.errors import NonFiniteLogits

    eng = load_engine(moe_pack, n_ctx=32)
    real = eng.model.step

    def step(tok, pos, state, logits=True):
        out = real(tok, pos, state, logits=logits)
        if logits and pos == 4:
            out = np.array(out, dtype=np.float32, copy=True)
            out[7] = np.nan
        return out

    monkeypatch.setattr(eng.model, "step", step)
    with pytest.raises(
        NonFiniteLogits, match=r"position 4: 1 of \d+ logits are NaN or infinite \(first at token id 7\)"
    ) as e:
        generate(eng, prompt_ids=[3, 4, 5], n_tokens=6, ignore_eos=True)
    # the advice says what verify cannot see (a byte flipped mid-expert passed it: 2026-12-02) and what to do then
    assert "only the first and last 256 B of each expert in the shards: if both pass, compare the shards' sha256" in (
        str(e.value)
    )


def test_silu_overflow_is_the_limit_not_a_warning():
    """silu of x below ~-88: exp(-x) overflows to inf and x / inf is -0, the formula's limit - no RuntimeWarning
    (it leaked into a refusal's output before the NaN check spoke)."""
    import warnings

    from strata.engine.layers import silu

    x = np.array([-1000.0, -100.0, -1.0, 0.0, 30.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = silu(np, x)
    assert y[:2].tolist() == [0.0, 0.0] and np.signbit(y[:2]).all() and y[3] == 0.0
    assert y[2] == np.float32(-1.0) / (np.float32(1.0) + np.exp(np.float32(1.0))) and y[4] == np.float32(30.0)


def test_shard_prefetch_maps_the_shards_and_changes_nothing(moe_pack, monkeypatch):
    """The expert cache stage starts the shards' page-table fill in the background (madvise MADV_POPULATE_READ,
    what llama.cpp's MAP_POPULATE does) when they fit in available memory, and says so; too little available
    memory skips it with both numbers; populated or not, a miss computes the same bits."""
    from strata.engine.startup import open_checked

    eng = load_engine(moe_pack, n_ctx=64)
    cp = {c.name: c for c in eng.checkpoints}
    src = eng.model.experts.source
    _, _, plan = open_checked(moe_pack)
    assert src.shard_bytes() == sum(p.stat().st_size for p in plan.shard_paths.values()) > 0
    mib = src.shard_bytes() / 2**20
    assert mib < 1024 and cp["expert cache"].extra["shard prefetch"] == f"started ({mib:.1f} MiB of shards)"
    il = src.layers[0]
    x = np.random.default_rng(0).standard_normal(src.shapes[il].gate[0]).astype(np.float32)
    before = src.ffn_many(il, [0, 1], x, kernel="q8", threads=1)
    assert src.populate() is True  # Linux >= 5.14 (the CI and GPU machines run 6.x)
    assert np.array_equal(src.ffn_many(il, [0, 1], x, kernel="q8", threads=1).view(np.uint32), before.view(np.uint32))
    monkeypatch.setattr(X, "mem_available", lambda: 1024)
    assert src.prefetch() == f"skipped: the shards ({mib:.1f} MiB) exceed available memory (0.0 MiB)"
    monkeypatch.setattr(X, "mem_available", lambda: None)
    assert src.prefetch() == "skipped: no /proc/meminfo"


def test_shard_experts_check_part_sizes_and_x_before_any_address_reaches_the_kernels(moe_pack):
    """ffn_many hands the C kernels raw addresses, so what they rely on is checked first: each layer's part bytes
    against rows x the row size of its type (at construction, both numbers named), an expert id inside its shard
    and x's length (per call)."""
    import dataclasses

    from strata.engine.startup import open_checked
    from strata.packer import quants

    _, _, plan = open_checked(moe_pack)
    src = X.ShardExperts(plan)
    il = src.layers[0]
    row, shp = plan.experts[il], plan.expert_shapes[il]
    need = quants.row_nbytes(row.down_type, shp.down[0]) * shp.down[1]
    bad = dataclasses.replace(plan, experts={**plan.experts, il: dataclasses.replace(row, down_bytes=need + 2)})
    t = quants.qtype(row.down_type).name
    with pytest.raises(
        ValueError,
        match=rf"blk\.{il} down experts: {need + 2} bytes per expert in native_experts\.txt, "
        rf"{t} x {shp.down[0]} x {shp.down[1]} is {need}",
    ):
        X.ShardExperts(bad)
    with pytest.raises(
        ValueError,
        match=rf"blk\.{il} experts: x has shape \(7,\), the gate and up rows have "
        rf"{shp.gate[0]} / {shp.up[0]} values",
    ):
        src.ffn_many(il, [0], np.zeros(7, np.float32))
    with pytest.raises(ValueError, match=rf"blk\.{il} expert -1: gate bytes .* are not in shard"):
        src.ffn_many(il, [-1], np.zeros(shp.gate[0], np.float32))
    far = 10**6
    shard = row.gate_shard
    end = row.gate_off + far * row.gate_stride
    size = src.shard_bytes() if len(plan.shard_paths) == 1 else plan.shard_paths[shard].stat().st_size
    with pytest.raises(
        ValueError,
        match=rf"blk\.{il} expert {far}: gate bytes {end}\.\.{end + row.gate_bytes} are not "
        rf"in shard {shard} \({size} bytes\)",
    ):
        src.addresses(il, far)
