"""Metadata keys: honoured or refused, never ignored.

Every GGUF metadata key llama.cpp's loader reads for an architecture (tests/fixtures/llamacpp_keys.json,
written from the vendored source by tools/make_llamacpp_keys.py: src/llama-model.cpp load_hparams, the
architecture's src/models/<arch>.cpp, load_swa_pattern) is listed in the manifest's ``[keys]`` section
(strata.manifests.keys) as honoured, refused or inert. The tests below walk that list:

- the list is exactly llama.cpp's (plus keys strata refuses although llama.cpp does not read them,
  which must exist in llama-arch.cpp), and every param that reads one of those keys is listed with it;
- every refused key, with a value strata does not implement, written into a synthetic GGUF, makes
  ``strata-pack build`` exit 2 naming the file, the key and the value; the same rule refuses it in
  ``metadata.txt`` at ``strata-budget check`` and at engine load;
- honoured keys with non-default values change what the budget and the engine compute: per-layer
  arrays collapse to their one value (bit-identical logits), gemma3's rope.dimension_count below the
  head size rotates only those dims and rope.scaling.factor scales linearly, as llama.cpp does
  (reference fixtures synthetic-gemma3-rope / synthetic-llama-rope-linear), gemma3's sliding_window 0
  means no sliding layer.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_engine_reference import compare, load_fixture, synthetic_pack

from strata import testing as synth
from strata.budget.audit import audit_pack
from strata.budget.cli import main as budget_main
from strata.engine.generate import generate
from strata.engine.models import UnsupportedModel, recipes
from strata.engine.startup import load_engine
from strata.manifests.contract import geometry_from_params, known_archs, load_manifest
from strata.manifests.keys import KeysRefusedError, gguf_key, key_refusals, value_text
from strata.packer.build import build_pack
from strata.packer.cli import main as pack_main
from strata.packer.packfmt import read_geometry_params, read_metadata

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "llamacpp_keys.json").read_text())
#: One preset per architecture (strata.testing.presets).
PRESET = {
    "llama": synth.llama_spec,
    "qwen2": synth.qwen2_spec,
    "qwen3": synth.qwen3_spec,
    "qwen2moe": synth.qwen2moe_spec,
    "qwen3moe": synth.qwen3moe_spec,
    "qwen3next": synth.qwen3next_spec,
    "gemma3": synth.gemma3_spec,
    "deepseek2": synth.deepseek2_spec,
    "gpt-oss": synth.gpt_oss_spec,
}
#: The keys inert for an architecture the engine runs: llama.cpp reads them but uses them for nothing
#: strata computes (a name, a flag only printed, XDRoPE's alpha, YaRN's original context, a type label).
GENERIC_INERT = {
    "/general.name",
    "rope.scaling.alpha",
    "rope.scaling.finetuned",
    "rope.scaling.original_context_length",
    "vocab_size",
}
#: Values strata does not implement, per refused key: the test takes the first one the key's rule refuses
#: for the architecture's preset (a refused key without one here fails the test: add one).
BAD = {
    "embedding_length_out": [7],
    "attention.causal": [False],
    "pooling_type": [1],
    "classifier.pooling_type": [2],
    "classifier.output_labels": [["yes", "no"]],
    "nextn_predict_layers": [1],
    "expert_count": [4],
    "expert_used_count": [2],
    "expert_group_count": [2],
    "expert_group_used_count": [1],
    "attention.key_length_swa": [128],
    "attention.value_length_swa": [128, 100],
    "rope.dimension_count": [32],
    "rope.dimension_count_swa": [16, 8],
    "rope.scaling.type": ["yarn"],
    "rope.scaling.attn_factor": [2.0],
    "expert_weights_scale": [2.5],
    "expert_weights_norm": [False, True],
    "expert_gating_func": [2],
    "attn_logit_softcapping": [50.0],
    "attention.sliding_window_pattern": [[True, False, True, False, True]],
    "attention.recurrent_layers": [[True, True, True, False, True]],
}


def _keys_tool():
    spec = importlib.util.spec_from_file_location("make_llamacpp_keys", ROOT / "tools" / "make_llamacpp_keys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ the list is llama.cpp's


def test_the_fixture_covers_every_contract():
    assert sorted(FIXTURE["archs"]) == known_archs()


def test_the_fixture_is_what_the_vendored_source_reads():
    tool = _keys_tool()
    src = Path(tool.DEFAULT_SRC)
    if not (src / "src" / "llama-model.cpp").is_file():
        pytest.skip(f"no llama.cpp source at {src} (LLAMA_CPP_SRC)")
    assert tool.collect(src) == FIXTURE, "re-run tools/make_llamacpp_keys.py"


@pytest.mark.parametrize("arch", sorted(FIXTURE["archs"]))
def test_every_key_llama_cpp_reads_is_listed_and_no_other(arch):
    m = load_manifest(arch)
    read = FIXTURE["archs"][arch]["keys"]
    missing = sorted(set(read) - set(m.keys))
    assert not missing, f"{arch}: llama.cpp reads {missing}; list them in manifests/{arch}.toml [keys]"
    claimed = {k for k, s in m.keys.items() if s.llamacpp}
    assert claimed == set(read), f"{arch}: listed as read by llama.cpp but not read: {sorted(claimed - set(read))}"
    extra = {k for k, s in m.keys.items() if not s.llamacpp}
    assert extra <= set(FIXTURE["known_keys"]), (
        f"{arch}: not keys of llama-arch.cpp: {sorted(extra - set(FIXTURE['known_keys']))}"
    )
    assert all(m.keys[k].status == "refuse" for k in extra)


@pytest.mark.parametrize("arch", sorted(FIXTURE["archs"]))
def test_per_layer_keys_are_the_get_key_or_arr_ones(arch):
    m = load_manifest(arch)
    for key, r in FIXTURE["archs"][arch]["keys"].items():
        s = m.keys[key]
        array_param = s.param is not None and m.params[s.param].kind.endswith("_array")
        if "get_key_or_arr" in r["how"]:
            assert s.per_layer or array_param, f"{arch} {key}: llama.cpp reads a scalar or one value per layer"
        else:
            assert not s.per_layer, f"{arch} {key}: llama.cpp reads it with {r['how']}, not per layer"


@pytest.mark.parametrize("arch", sorted(FIXTURE["archs"]))
def test_every_param_reading_a_llama_cpp_key_is_listed_with_it(arch):
    m = load_manifest(arch)
    read = FIXTURE["archs"][arch]["keys"]
    for name, p in m.params.items():
        if p.key in read:  # both written relative to "<arch>." ("/" = absolute)
            assert m.keys[p.key].param == name, f"{arch}: param {name} reads {p.key}, [keys] says {m.keys[p.key]}"


@pytest.mark.parametrize("arch", sorted(recipes()))
def test_architectures_the_engine_runs_have_only_the_generic_inert_keys(arch):
    # deepseek2 / gpt-oss mark forward-pass-only keys inert because the engine refuses them by name; an
    # architecture the engine runs must honour or refuse those
    inert = {k for k, s in load_manifest(arch).keys.items() if s.status == "inert"}
    assert inert <= GENERIC_INERT, f"{arch}: inert keys {sorted(inert - GENERIC_INERT)}"
    assert {"/general.name", "rope.scaling.finetuned"} <= inert


def test_counts_per_architecture():
    from strata.manifests.keys import key_counts

    counts = {a: key_counts(load_manifest(a).keys) for a in known_archs()}
    # the decoder base: 32 keys; qwen2 adds nothing but its rope rule (replacing the base's honour)
    assert sum(counts["qwen2"].values()) == len(FIXTURE["archs"]["qwen2"]["keys"]) == 32
    assert counts["qwen2"] == {"honour": 12, "refuse": 16, "inert": 4}
    assert counts["deepseek2"]["inert"] == 15 and counts["gemma3"]["refuse"] == 17


# ------------------------------------------------------------------ refused at build, audit and load


def _refuse_cases():
    out = []
    for arch in sorted(FIXTURE["archs"]):
        for key, s in load_manifest(arch).keys.items():
            if s.status == "refuse":
                out.append(pytest.param(arch, key, id=f"{arch}:{key}"))
    return out


def _bad_value(arch: str, key: str):
    """The first value of :data:`BAD` that ``key``'s rule refuses on ``arch``'s preset, and its spec."""
    assert key in BAD, f"no disallowed value for {key!r} in BAD"
    for v in BAD[key]:
        spec = PRESET[arch](extra_kv={key: v})
        g = synth.spec_geometry(spec)
        kv = {k: val for k, _t, val, _s in synth.model_kv(spec)}
        if any(r.key == gguf_key(arch, key) for r in key_refusals(g, kv)):
            return v, spec
    raise AssertionError(f"{arch}: none of {BAD[key]} is refused for {key}")


@pytest.mark.parametrize("arch,key", _refuse_cases())
def test_refused_key_makes_build_exit_2_naming_file_key_and_value(tmp_path, arch, key):
    bad, spec = _bad_value(arch, key)
    [src] = synth.write_model(tmp_path / "m.gguf", spec)
    r = CliRunner().invoke(pack_main, ["build", str(src), "-o", str(tmp_path / "pack"), "--no-progress"])
    assert r.exit_code == 2, r.output
    full = gguf_key(arch, key)
    want = f"{src}: metadata key {full} = {value_text(bad)} is refused: strata implements "
    assert want in r.output, r.output
    assert not (tmp_path / "pack").exists()


@pytest.fixture(scope="module")
def moe_pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys_moe")
    [src] = synth.write_model(d / "q.gguf", synth.qwen3moe_spec(seed=3))
    build_pack(src, d / "pack", progress=False)
    return d / "pack"


def _with_metadata(pack: Path, dst: Path, *lines: str) -> Path:
    shutil.copytree(pack, dst)
    with open(dst / "metadata.txt", "a") as f:
        f.write("".join(x + "\n" for x in lines))
    return dst


def test_budget_check_and_engine_refuse_the_same_keys_in_metadata_txt(moe_pack, tmp_path):
    pack = _with_metadata(
        moe_pack,
        tmp_path / "p",
        "qwen3moe.rope.scaling.attn_factor float 2.0",
        "qwen3moe.expert_weights_norm bool false",
        "qwen3moe.attention.head_count int_array 4,8,4",
    )
    r = CliRunner().invoke(budget_main, ["check", str(pack), "--card", "24G", "--ctx", "256", "--json"])
    assert r.exit_code == 2, r.output
    errors = {e["tensor"]: e for e in json.loads(r.output)["errors"]}
    assert sorted(errors) == [
        "metadata.txt:qwen3moe.attention.head_count",
        "metadata.txt:qwen3moe.expert_weights_norm",
        "metadata.txt:qwen3moe.rope.scaling.attn_factor",
    ]
    for key, found, needle in (
        (
            "qwen3moe.rope.scaling.attn_factor",
            "2.0",
            "= 2.0 is refused: strata implements rope without a magnitude factor",
        ),
        ("qwen3moe.expert_weights_norm", "False", "= False is refused: strata implements expert weights renormalised"),
        ("qwen3moe.attention.head_count", "[4, 8, 4]", "= [4, 8, 4] is refused: a per-layer array whose values differ"),
    ):
        e = errors[f"metadata.txt:{key}"]
        assert e["found"] == found and f"metadata key {key} {needle}" in e["message"], e
    seen = []
    with pytest.raises(UnsupportedModel) as ei:
        load_engine(pack, n_ctx=32, on_checkpoint=lambda c: seen.append(c.name))
    msg = str(ei.value)
    assert msg.startswith(f"{pack / 'metadata.txt'}: metadata key qwen3moe.attention.head_count = [4, 8, 4] is refused")
    assert (
        "qwen3moe.rope.scaling.attn_factor = 2.0 is refused" in msg
        and "qwen3moe.expert_weights_norm = False is refused" in msg
    )
    assert seen == []  # refused in the 'pack' stage, before any weight is read


def test_a_refused_key_is_refused_by_the_cli_of_the_engine_too(moe_pack, tmp_path):
    from strata.engine.cli import main as engine_main

    pack = _with_metadata(moe_pack, tmp_path / "p", "qwen3moe.rope.scaling.type str yarn")
    r = CliRunner().invoke(engine_main, ["generate", str(pack), "-p", "hi", "-n", "2"])
    assert r.exit_code == 2 and "qwen3moe.rope.scaling.type = 'yarn' is refused" in r.output, r.output


def test_an_allowed_value_of_a_refuse_key_is_accepted(moe_pack, tmp_path):
    # the values that make the key a no-op: what llama.cpp computes without it
    pack = _with_metadata(
        moe_pack,
        tmp_path / "p",
        "qwen3moe.rope.scaling.attn_factor float 1.0",
        "qwen3moe.expert_weights_norm bool true",
        "qwen3moe.rope.scaling.type str none",
        "qwen3moe.expert_gating_func int 1",
    )
    assert audit_pack(pack).errors == []
    load_engine(pack, n_ctx=32)


# ------------------------------------------------------------------ honoured: per-layer arrays

ARRAYS = {
    "attention.head_count": [4, 4, 4],
    "attention.head_count_kv": [2, 2, 2],
    "expert_used_count": [2, 2, 2],
    "expert_feed_forward_length": [256, 256, 256],
}


@pytest.fixture(scope="module")
def array_packs(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys_arrays")
    out = {}
    for name, spec in (
        ("scalar", synth.qwen3moe_spec(seed=5)),
        ("array", synth.qwen3moe_spec(seed=5, extra_kv=ARRAYS)),
    ):
        [src] = synth.write_model(d / f"{name}.gguf", spec)
        build_pack(src, d / name, progress=False)
        out[name] = d / name
    return out


def test_uniform_per_layer_arrays_are_honoured_as_their_one_value(array_packs):
    gp = read_geometry_params(array_packs["array"] / "geometry.txt")
    assert (gp["n_head"], gp["n_head_kv"], gp["n_expert_used"], gp["n_ff_exp"]) == ("4", "2", "2", "256")
    assert gp == read_geometry_params(array_packs["scalar"] / "geometry.txt")
    md = read_metadata(array_packs["array"] / "metadata.txt")
    assert md["qwen3moe.attention.head_count"] == [4, 4, 4] and md["qwen3moe.expert_used_count"] == [2, 2, 2]
    a, s = audit_pack(array_packs["array"]), audit_pack(array_packs["scalar"])
    assert a.errors == [] and a.facts.kv_layers == s.facts.kv_layers
    runs = [
        generate(load_engine(array_packs[n], n_ctx=32), prompt_ids=[1, 2, 3], n_tokens=4, ignore_eos=True)
        for n in ("array", "scalar")
    ]
    assert runs[0].output_ids == runs[1].output_ids
    assert all(np.float32(x[1]) == np.float32(y[1]) for ra, rb in zip(runs[0].top, runs[1].top) for x, y in zip(ra, rb))


@pytest.mark.parametrize(
    "value,why", [([4, 8, 4], "a per-layer array whose values differ"), ([4, 4], "an array of 2 values for 3 layers")]
)
def test_a_non_uniform_or_short_per_layer_array_is_refused(tmp_path, value, why):
    [src] = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec(extra_kv={"attention.head_count": value}))
    with pytest.raises(KeysRefusedError) as ei:
        build_pack(src, tmp_path / "pack", progress=False)
    assert f"{src}: metadata key qwen3moe.attention.head_count = {value} is refused: {why}" in str(ei.value)


# ------------------------------------------------------------------ honoured: rope and sliding window


@pytest.fixture(scope="module")
def rope_packs(tmp_path_factory):
    return {n: synthetic_pack(tmp_path_factory, f"synthetic-{n}") for n in ("gemma3-rope", "llama-rope-linear")}


#: (TOL_LOGIT, TOL_MEAN, TOL_MARGIN, MIN_CHECKED), as tests/test_engine_reference.py TOLERANCES. Measured
#: (max / mean |d logit|, steps checked): gemma3-rope f32 0.0059 / 0.0017 (71), llama-rope-linear llamacpp
#: 0.0088 / 0.0010 (58), f32 0.023 / 0.0043 (58). The same weights without the keys, against the same
#: references: gemma3 rotating the whole head misses llama.cpp's top-1 in its top 5; gemma3 unscaled
#: 0.107 / 0.020, llama unscaled (llamacpp) 0.060 / 0.014: several times the tolerances.
ROPE_TOL = {
    ("gemma3-rope", "f32"): (0.015, 0.004, 0.015, 40),
    ("llama-rope-linear", "llamacpp"): (0.03, 0.005, 0.03, 40),
    ("llama-rope-linear", "f32"): (0.05, 0.008, 0.03, 40),
}


@pytest.mark.parametrize("name,numerics", sorted(ROPE_TOL))
def test_partial_and_linearly_scaled_rope_matches_llama_cpp(rope_packs, name, numerics):
    eng = load_engine(rope_packs[name], n_ctx=256, numerics=numerics, cpu_kernel="f32")  # ROPE_TOL's kernel
    r = compare(eng, load_fixture(f"synthetic-{name}"), ROPE_TOL[(name, numerics)])
    print(f"{name} {numerics}: {r}")


@pytest.mark.parametrize(
    "name,numerics,without",
    [
        ("gemma3-rope", "f32", "rope_dim"),
        ("gemma3-rope", "f32", "extra_kv"),
        ("llama-rope-linear", "llamacpp", "extra_kv"),
    ],
)
def test_the_rope_keys_change_the_computation(tmp_path, name, numerics, without):
    """The same weights without rope.dimension_count (rotating the whole head) or without the linear scaling
    are measurably not what llama.cpp computed: the comparison above fails on them."""
    ref = load_fixture(f"synthetic-{name}")
    spec = synth.ModelSpec.model_validate(ref["synthetic"]["spec"])
    plain = (
        spec.model_copy(update={"dims": spec.dims.model_copy(update={"rope_dim": None})})
        if without == "rope_dim"
        else spec.model_copy(update={"extra_kv": {}})
    )
    [src] = synth.write_model(tmp_path / "plain.gguf", plain)
    build_pack(src, tmp_path / "pack", progress=False)
    with pytest.raises(AssertionError, match=r"max \|logit - llama\.cpp\||argmax|top"):
        compare(
            load_engine(tmp_path / "pack", n_ctx=256, numerics=numerics, cpu_kernel="f32"),
            ref,
            ROPE_TOL[(name, numerics)],
        )


def test_the_budget_plans_the_rope_the_engine_allocates(rope_packs):
    from strata.engine.gpu.backend import SimBackend
    from strata.engine.measure import measure_pack

    facts = audit_pack(rope_packs["gemma3-rope"]).facts
    assert facts.rope_dim == 32 and facts.rope_tables == 2  # (1e6, 1/4) global, (1e4, 1) sliding
    eng = load_engine(rope_packs["gemma3-rope"], n_ctx=64)
    assert sorted(eng.state.ropes) == [(10000.0, 1.0), (1e6, 0.25)]
    assert {r.n_rot for r in eng.state.ropes.values()} == {32}
    a = measure_pack(str(rope_packs["gemma3-rope"]), n_ctx=200, backend=SimBackend())
    assert a.exact_ok, [(t.term, t.predicted_bytes, t.measured_bytes) for t in a.terms if t.exact and t.diff_bytes]


def test_rope_table_angles_are_the_scaled_positions():
    from strata.engine.layers import Rope

    r = Rope(np, 8, 10000.0, 16, freq_scale=0.125)
    p, inv = 13, 10000.0 ** (-np.arange(0, 8, 2) / 8)
    assert np.allclose(r.cos[p], np.cos(0.125 * p * inv), atol=1e-7) and np.allclose(
        r.sin[p], np.sin(0.125 * p * inv), atol=1e-7
    )


def test_gemma3_sliding_window_zero_means_no_sliding_layer(tmp_path):
    # llama.cpp gemma3 load_arch_hparams: n_swa 0 -> LLAMA_SWA_TYPE_NONE, every layer sees the whole context
    [src] = synth.write_model(tmp_path / "g.gguf", synth.gemma3_spec(dims={"sliding_window": 0}))
    build_pack(src, tmp_path / "pack", progress=False)
    g = geometry_from_params("gemma3", read_geometry_params(tmp_path / "pack" / "geometry.txt"))
    assert g.layer_kinds == ["global", "global"] and [g.layer_window(il) for il in range(2)] == [None, None]
    facts = audit_pack(tmp_path / "pack").facts
    assert [k.window for k in facts.kv_layers] == [None, None]
    eng = load_engine(tmp_path / "pack", n_ctx=64)
    assert eng.model.layer_windows() == [None, None] and eng.model.kv_sizes(64) == [64, 64]


def test_gemma3_sliding_window_pattern_as_an_array(tmp_path):
    # load_swa_pattern: a per-layer array wins over the period; here layer 0 global, 1 and 2 sliding
    spec = synth.gemma3_spec(n_layers=3, extra_kv={"attention.sliding_window_pattern": [False, True, True]})
    [src] = synth.write_model(tmp_path / "g.gguf", spec)
    build_pack(src, tmp_path / "pack", progress=False)
    eng = load_engine(tmp_path / "pack", n_ctx=256)
    assert eng.model.kinds == ["global", "swa", "swa"] and eng.model.layer_windows() == [None, 128, 128]
    assert read_metadata(tmp_path / "pack" / "metadata.txt")["gemma3.attention.sliding_window_pattern"] == [
        False,
        True,
        True,
    ]
    assert audit_pack(tmp_path / "pack").errors == []


def test_gemma3_final_logit_softcapping_is_honoured(tmp_path):
    [src] = synth.write_model(tmp_path / "g.gguf", synth.gemma3_spec(params={"logit_softcap": 0.5}))
    build_pack(src, tmp_path / "pack", progress=False)
    eng = load_engine(tmp_path / "pack", n_ctx=32)
    r = generate(eng, prompt_ids=[1, 2, 3], n_tokens=2, ignore_eos=True)
    assert eng.model.hp.logit_softcap == 0.5
    assert max(abs(v) for row in r.top for _i, v in row) < 0.5


def _gpu_ok():
    from strata.engine.gpu import kernels as K

    return K.gpu_available()


@pytest.mark.parametrize(
    "device",
    [
        "sim",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not _gpu_ok()[0], reason=f"needs CuPy and a CUDA GPU: {_gpu_ok()[1]}"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("name", ["gemma3-rope", "llama-rope-linear"])
def test_the_fused_gpu_step_rotates_and_scales_like_the_cpu(rope_packs, device, name):
    # the qk_prep kernel reads the same (base, scale) tables and rotates n_rot < head_dim dims (fused.cu)
    from strata.engine.gpu.backend import SimBackend

    kw = {"backend": SimBackend()} if device == "sim" else {}
    eng = load_engine(rope_packs[name], device="cuda", ubatch=1, n_ctx=128, cpu_kernel="exact", **kw)
    assert type(eng.model).__name__ == "FusedDecoder"
    prompt = list(range(1, 40))
    gpu = generate(eng, prompt_ids=prompt, n_tokens=8, ignore_eos=True)
    cpu = generate(
        load_engine(rope_packs[name], n_ctx=128, cpu_kernel="exact"), prompt_ids=prompt, n_tokens=8, ignore_eos=True
    )
    assert gpu.output_ids == cpu.output_ids
    diff = max(abs(a[1] - b[1]) for ra, rb in zip(gpu.top, cpu.top) for a, b in zip(ra, rb))
    assert diff < 1e-3, diff
