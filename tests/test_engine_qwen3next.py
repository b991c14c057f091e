"""qwen3next's forward pass beyond the llama.cpp fixtures (tests/test_engine_reference.py): the
recurrent state and KV cache the engine allocates are the budget's terms to the byte, the legacy
fused ``ssm_in`` projection computes what the ``attn_qkv`` + ``attn_gate`` pair computes, the
reference model's indexer is loaded and named as unused, the expert cache does not change the logits, and the
delta-net widths come from the manifest alone.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from strata import testing as synth
from strata.budget.audit import audit_pack
from strata.engine.generate import decode
from strata.engine.startup import load_engine
from strata.layout import kv as LK
from strata.manifests.contract import ManifestError, derived_value
from strata.packer.build import build_pack

PROMPT = [280, 315, 263, 503, 312, 281, 350]


@pytest.fixture(scope="module")
def q3n(tmp_path_factory):
    d = tmp_path_factory.mktemp("q3n")
    src = synth.write_model(d / "q3n.gguf", synth.qwen3next_spec(seed=3))[0]
    build_pack(src, d / "pack", progress=False)
    return src, d / "pack"


def _logits(pack, **kw) -> np.ndarray:
    eng = load_engine(pack, n_ctx=32, **kw)
    rows: list[np.ndarray] = []
    decode(eng.model, eng.state, PROMPT, 3, lambda r: rows.append(r.copy()) or int(np.argmax(r)))
    return np.asarray(rows)


def test_state_bytes_are_the_budget_terms(q3n):
    _, pack = q3n
    facts = audit_pack(pack).facts
    n_ctx = 48
    eng = load_engine(pack, n_ctx=n_ctx, kv="f16")
    # recurrent state: (d_conv - 1) x conv_dim + d_state x d_inner f32 per recurrent layer (3 of 4 layers)
    spec = synth.qwen3next_spec(seed=3)
    d = spec.dims
    per_layer = 4 * ((d.ssm_d_conv - 1) * d.ssm_conv_dim + d.ssm_d_state * d.ssm_d_inner)
    assert eng.state.recurrent.nbytes == LK.recurrent_state_bytes(facts.recurrent_layers, 1) == 3 * per_layer
    assert sorted(eng.state.recurrent.ssm) == [0, 1, 2]
    # KV cache: the one attention layer (3), n_ctx positions of n_head_kv x head_dim K and V in f16
    assert eng.state.cache.nbytes == LK.kv_cache_bytes(facts.kv_layers, n_ctx, LK.ENGINE_PREFILL_CHUNK, "f16", 1)
    assert eng.state.cache.nbytes == n_ctx * 2 * (d.n_head_kv * d.head_dim) * 2
    assert [L.layer for L in facts.kv_layers] == [3]


def test_delta_net_widths_have_one_definition(q3n):
    # the manifest's [derived] key_dim / value_dim / conv_dim: read by the engine (through the geometry) and
    # by the synthetic writer (derived_value), computed nowhere else
    _, pack = q3n
    d = load_engine(pack, n_ctx=32).model.delta_dims
    dims = synth.qwen3next_spec(seed=3).dims
    assert (d.key_dim, d.value_dim, d.conv_dim) == (dims.ssm_key_dim, dims.ssm_d_inner, dims.ssm_conv_dim)
    assert (d.key_dim, d.value_dim, d.conv_dim) == (64 * 2, 64 * 4, 2 * 64 * 2 + 64 * 4)
    with pytest.raises(ManifestError, match="no derived number 'conv'"):
        derived_value("qwen3next", "conv", {})


def test_recurrent_state_starts_over_at_position_zero(q3n):
    _, pack = q3n
    eng = load_engine(pack, n_ctx=32)
    first = []
    decode(eng.model, eng.state, PROMPT, 2, lambda r: first.append(r.copy()) or 7)
    again = []
    decode(eng.model, eng.state, PROMPT, 2, lambda r: again.append(r.copy()) or 7)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_expert_cache_does_not_change_the_logits(q3n):
    _, pack = q3n
    ref = _logits(pack, resident="all")
    for policy in ("none", "half"):
        assert np.array_equal(_logits(pack, resident=policy), ref), policy


def _legacy_copy(src, dst, n_layers: int, dims) -> None:
    """The same model with every delta-net layer's attn_qkv + attn_gate rows regrouped into the legacy
    ssm_in (per k head [q | k | v | z], llama.cpp qwen3next.cpp build_qkvz) - byte for byte."""
    r = gguf.GGUFReader(src)
    kv = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            kv[k] = synth.KV(vt, f.contents(), f.types[-1])
        else:
            kv[k] = synth.KV(vt, f.contents())
    s, nk, nv = dims.ssm_d_state, dims.ssm_n_group, dims.ssm_dt_rank
    rr = nv // nk
    tensors, data = [], {}
    by = {t.name: t for t in r.tensors}
    for t in r.tensors:
        ne = tuple(int(x) for x in t.shape)
        if t.name.endswith("attn_gate.weight"):
            continue
        if t.name.endswith("attn_qkv.weight"):
            il = t.name.split(".")[1]
            qkv = np.asarray(t.data).reshape(ne[1], -1)
            z = np.asarray(by[f"blk.{il}.attn_gate.weight"].data).reshape(nv * s, -1)
            q, k, v = qkv[: nk * s], qkv[nk * s : 2 * nk * s], qkv[2 * nk * s :]
            rows = []
            for g in range(nk):
                rows += [
                    q[g * s : (g + 1) * s],
                    k[g * s : (g + 1) * s],
                    v[g * s * rr : (g + 1) * s * rr],
                    z[g * s * rr : (g + 1) * s * rr],
                ]
            name = f"blk.{il}.ssm_in.weight"
            tensors.append((name, int(t.tensor_type), (ne[0], 2 * nk * s + 2 * nv * s)))
            data[name] = np.concatenate(rows).reshape(-1)
            continue
        tensors.append((t.name, int(t.tensor_type), ne))
        data[t.name] = np.asarray(t.data).view(np.uint8).reshape(-1)
    synth.write_header_only(dst, "qwen3next", kv, tensors, data=data)


def test_legacy_ssm_in_computes_what_the_pair_computes(q3n, tmp_path):
    src, pack = q3n
    spec = synth.qwen3next_spec(seed=3)
    _legacy_copy(src, tmp_path / "legacy.gguf", spec.n_layers, spec.dims)
    build_pack(tmp_path / "legacy.gguf", tmp_path / "legacy", progress=False)
    assert audit_pack(tmp_path / "legacy").errors == []
    a, b = _logits(pack), _logits(tmp_path / "legacy")
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()  # the same rows, multiplied in another matrix


def test_reference_model_indexer_is_loaded_and_named_unused(tmp_path):
    spec = synth.qwen3next_spec(seed=3, params={"indexer_n_head": 4, "indexer_head_dim": 64})
    src = synth.write_model(tmp_path / "idx.gguf", spec)[0]
    build_pack(src, tmp_path / "pack", progress=False)
    assert audit_pack(tmp_path / "pack").errors == []
    eng = load_engine(tmp_path / "pack", n_ctx=16)
    assert "blk.3.indexer.attn_k.weight" in eng.plan.dense
    assert eng.notes == [
        "the sparse-attention indexer (blk.N.indexer.*) is checked and loaded, but this forward pass "
        "does not use it: no public implementation defines its computation for qwen3next (4 tensors)"
    ]
