"""Synthetic models whose routing means something (strata.testing.routing), and the routing trace.

A pattern-filled router repeats its rows (64 KiB tiles): ties send every token to the same few low-index
experts. ``ModelSpec.routing`` draws routers row by row with a stated skew and distinct embedding rows, so
the choice depends on the token; the trace recorded through the engine's routing hook sums to the profile.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from strata import testing as synth
from strata.budget.errors import PlanInputError
from strata.budget.replay import top_share
from strata.budget.trace import RoutingTrace, read_trace, trace_counts, write_trace
from strata.packer.build import build_pack
from strata.testing.blocks import encode_floats, make_random_blocks, tensor_rng
from strata.testing.models import tensor_data
from strata.testing.routing import TokenRouting, router_scales, router_values, token_rows, topic_prompts

N_EXPERT, N_EMBD, K = 64, 1024, 2


def small_spec(routing: TokenRouting | None, fill: str = "pattern", **kw) -> synth.ModelSpec:
    """2 qwen3moe layers, n_embd 1024, 64 experts (2 used): a 1024-wide f32 router row is 4 KiB, so the
    64 KiB pattern holds 16 distinct rows, each repeated 4 times over the 64 experts."""
    return synth.qwen3moe_spec(
        n_layers=2,
        fill=fill,
        seed=0,
        routing=routing,
        dims={"n_embd": N_EMBD, "n_expert": N_EXPERT, "n_expert_used": K, "n_ff_exp": 64, "n_vocab": 512},
        expert_types=[("Q8_0", "Q8_0")] * 2,
        **kw,
    )


def _data(spec, name):
    t = next(t for t in synth.plan_tensors(spec) if t.name == name)
    return t, tensor_data(spec, t)


def test_router_rows_are_scaled_independent_draws():
    ne = (N_EMBD, N_EXPERT)
    x0 = router_values(ne, 0.0, np.random.default_rng(5), 0.02)
    x1 = router_values(ne, 1.5, np.random.default_rng(5), 0.02)
    s = router_scales(N_EXPERT, 1.5, np.random.default_rng(5))
    assert x0.shape == (N_EXPERT, N_EMBD) and x0.dtype == np.float32
    # the same draws under every skew: row e scaled by exp(skew * z_e)
    np.testing.assert_allclose(x1, x0 * s[:, None].astype(np.float32), rtol=1e-6)
    assert np.all(router_scales(8, 0.0, np.random.default_rng(1)) == 1.0)
    assert len({r.tobytes() for r in x0}) == N_EXPERT  # no repeated row
    with pytest.raises(ValueError, match="2-D"):
        router_values((N_EMBD,), 0.0, np.random.default_rng(0), 0.02)


def test_token_rows_cycle_r_distinct_rows():
    ne = (64, 1000)
    b = token_rows(8, ne, np.random.default_rng(2), 300, std=1.0)  # Q8_0: 64 values = 2 blocks of 34 B
    rows = b.reshape(1000, 68)
    assert len({r.tobytes() for r in rows[:300]}) == 300
    assert np.array_equal(rows[300:600], rows[:300]) and np.array_equal(rows[900:], rows[:100])
    assert token_rows(8, ne, np.random.default_rng(2), 5000).size == 1000 * 68  # R capped at n_vocab


def test_routing_option_changes_routers_and_token_rows_only():
    plain, routed = small_spec(None), small_spec(TokenRouting(skew=1.0))
    changed = [
        t.name
        for t in synth.plan_tensors(plain)
        if not np.array_equal(_data(plain, t.name)[1], _data(routed, t.name)[1])
    ]
    assert sorted(changed) == [
        "blk.0.ffn_gate_inp.weight",
        "blk.1.ffn_gate_inp.weight",
        "output.weight",
        "token_embd.weight",
    ]
    # fill="random": every token row is drawn already; only the routers change
    rand_plain, rand_routed = small_spec(None, fill="random"), small_spec(TokenRouting(), fill="random")
    for name in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight"):
        assert np.array_equal(_data(rand_plain, name)[1], _data(rand_routed, name)[1])
    t, router = _data(rand_routed, "blk.1.ffn_gate_inp.weight")
    rng = tensor_rng(0, t.name)
    assert np.array_equal(router, encode_floats(0, router_values(t.ne, 0.0, rng, 0.02)))
    # the pattern router repeats rows every 16 experts; the option's does not
    _, pat = _data(plain, "blk.0.ffn_gate_inp.weight")
    rows = pat.view("<f4").reshape(N_EXPERT, N_EMBD)
    assert len({r.tobytes() for r in rows}) == 16 and np.array_equal(rows[0], rows[16])
    rows = _data(routed, "blk.0.ffn_gate_inp.weight")[1].view("<f4").reshape(N_EXPERT, N_EMBD)
    assert len({r.tobytes() for r in rows}) == N_EXPERT


def test_routing_option_validation_and_router_types():
    with pytest.raises(ValueError):
        TokenRouting(skew=-1)
    with pytest.raises(ValueError):
        TokenRouting(embd_rows=0)
    assert small_spec(None).routing is None  # default: the file's bytes as before (fixtures pin them)
    spec = synth.ModelSpec.model_validate(small_spec(TokenRouting(skew=0.5)).model_dump(mode="json"))
    assert spec.routing == TokenRouting(skew=0.5)
    # a BF16 / Q8_0 router is encoded from the same values; a K-quant router has no encoder
    for ty in ("BF16", "Q8_0"):
        t, b = _data(small_spec(TokenRouting(), tensor_types={"ffn_gate_inp": ty}), "blk.0.ffn_gate_inp.weight")
        assert t.type_id == synth.blocks.to_type_id(ty) and b.size == t.nbytes
    with pytest.raises(ValueError, match="no encoder for Q4_K"):
        _data(small_spec(TokenRouting(), tensor_types={"ffn_gate_inp": "Q4_K"}), "blk.0.ffn_gate_inp.weight")


def test_encode_floats_matches_make_random_blocks():
    for ty in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "MXFP4"):
        x = np.random.default_rng(9).standard_normal(256, dtype=np.float32) * np.float32(0.02)
        assert np.array_equal(encode_floats(ty, x), make_random_blocks(ty, 256, np.random.default_rng(9)))


def test_topic_prompts_law():
    a = topic_prompts(10, 6, vocab=300, n_topics=4, topic_size=12, run_length=3, seed=1, first_id=10)
    assert a == topic_prompts(10, 6, vocab=300, n_topics=4, topic_size=12, run_length=3, seed=1, first_id=10)
    b = topic_prompts(10, 6, vocab=300, n_topics=4, topic_size=12, run_length=3, seed=2, first_id=10)
    assert a.topic_tokens == b.topic_tokens and a.prompts != b.prompts  # same topics, other prompts
    assert a.describe()["runs"] == [3, 3, 3, 1] and len(a.prompts) == 10
    for i, (p, t) in enumerate(zip(a.prompts, a.topics)):
        assert len(p) == 6 and set(p) <= set(a.topic_tokens[t])
        assert (a.topics[i] == a.topics[i - 1]) == (i % 3 != 0) or i == 0  # a new run changes the topic
    assert all(len(set(tt)) == 12 and min(tt) >= 10 and max(tt) < 300 for tt in a.topic_tokens)
    with pytest.raises(ValueError, match="topic_size=400"):
        topic_prompts(2, 2, vocab=300, topic_size=400)
    with pytest.raises(ValueError, match="n_prompts=0"):
        topic_prompts(0, 2, vocab=300)


# ----------------------------------------------------------------------------- through the CPU engine

PROMPT = list(range(3, 500, 10))  # 50 distinct token ids


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from strata.engine.startup import load_engine

    out = {}
    for name, routing in (("pattern", None), ("skew0", TokenRouting(skew=0.0)), ("skew2", TokenRouting(skew=2.0))):
        d = tmp_path_factory.mktemp(f"routing-{name}")
        path = synth.write_model(d / "m.gguf", small_spec(routing))[0]
        build_pack(path, d / "pack", progress=False)
        out[name] = (d / "pack", load_engine(d / "pack", device="cpu", n_ctx=128, resident="none"))
    return out


@pytest.fixture(scope="module")
def traces(engines):
    from strata.engine.routing import record_trace

    return {name: record_trace(eng, [PROMPT], n_tokens=1) for name, (_, eng) in engines.items()}


def _sets(trace: RoutingTrace, layer: int) -> list[tuple[int, ...]]:
    m = trace.layer == layer
    return [tuple(sorted(trace.expert[m][i : i + K])) for i in range(0, int(m.sum()), K)]


def test_pattern_routes_degenerately_token_routing_spreads(traces):
    for il in (0, 1):
        sets = _sets(traces["pattern"], il)
        # ties: both choices are copies of one router row (r, r + 16), only low-index experts
        assert all(b - a == 16 for a, b in sets)
        assert max(max(s) for s in sets) < N_EXPERT // 2 and len(set(sets)) <= 16
        spread = _sets(traces["skew0"], il)
        chosen = {e for s in spread for e in s}
        assert len(chosen) >= 0.6 * N_EXPERT and max(chosen) >= N_EXPERT // 2
        assert len(set(spread)) >= 0.8 * len(PROMPT)
    # the skew concentrates the choices: the top decile's share rises
    s0, s2 = top_share(traces["skew0"], N_EXPERT), top_share(traces["skew2"], N_EXPERT)
    assert s2 >= s0 + 0.15, (s0, s2)
    assert s0 < 0.35


def test_trace_rows_positions_and_profile(engines, traces, tmp_path):
    from strata.engine.routing import profile_routing, record_trace

    pack, eng = engines["skew0"]
    tr = record_trace(eng, [[5, 6, 7], "hello world"], n_tokens=3)
    assert eng.experts.on_route is None  # the hook is restored
    n_pos = [3 + 3 - 1, len(eng.tokenizer.encode("hello world")) + 3 - 1]  # the last token is not fed back
    assert sorted(set(tr.seq.tolist())) == [0, 1]
    for s, want in zip((0, 1), n_pos):
        pos = tr.position[tr.seq == s]
        assert sorted(set(pos.tolist())) == list(range(want)) and np.all(np.diff(pos) >= 0)
    assert len(tr) == tr.n_steps * 2 * K and tr.n_expert_used() == K
    for step in range(tr.n_steps):  # each step: layer 0's K choices, then layer 1's
        assert tr.layer[tr.steps() == step].tolist() == [0] * K + [1] * K
    assert trace_counts(tr.select([1])) == profile_routing(str(pack), ["hello world"], n_tokens=3, n_ctx=128)
    write_trace(tr, tmp_path / "t.parquet")
    back = read_trace(tmp_path / "t.parquet")
    for c in ("seq", "position", "layer", "expert"):
        assert np.array_equal(getattr(back, c), getattr(tr, c))
    assert math.isclose(sum(c for *_, c in trace_counts(back)), len(tr))


def test_read_trace_refusals(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(PlanInputError, match="no such file"):
        read_trace(tmp_path / "none.parquet")
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(PlanInputError, match="not a readable Parquet file"):
        read_trace(tmp_path / "x.parquet")
    pq.write_table(pa.table({"seq": [0], "position": [0], "layer": [0]}), tmp_path / "m.parquet")
    with pytest.raises(PlanInputError, match=r"lacks column\(s\) \['expert'\]"):
        read_trace(tmp_path / "m.parquet")
    pq.write_table(pa.table({"seq": [0], "position": [0], "layer": [0], "expert": [1.5]}), tmp_path / "f.parquet")
    with pytest.raises(PlanInputError, match="column expert has type double"):
        read_trace(tmp_path / "f.parquet")
    pq.write_table(
        pa.table({"seq": [0, 0], "position": [0, 1], "layer": [0, -1], "expert": [1, 1]}), tmp_path / "n.parquet"
    )
    with pytest.raises(PlanInputError, match="row 1: layer -1 is negative"):
        read_trace(tmp_path / "n.parquet")
    with pytest.raises(ValueError, match="different lengths"):
        RoutingTrace(np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(3))


def test_profile_cli_writes_the_trace_beside_the_profile(engines, tmp_path):
    from click.testing import CliRunner

    from strata.budget.profile import read_profile
    from strata.engine.cli import main

    pack = engines["skew0"][0]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe cat\n")
    out, trace = tmp_path / "p.parquet", tmp_path / "t.parquet"
    args = ["profile", str(pack), "--prompts", str(prompts), "-o", str(out), "-n", "2", "--ctx", "64"]
    r = CliRunner().invoke(main, [*args, "--trace", str(trace)])
    assert r.exit_code == 0, r.output
    tr = read_trace(trace)
    assert r.stdout.endswith(f" -> {out}; trace: {len(tr.seq)} rows (seq, position, layer, expert) -> {trace}\n")
    assert read_profile(out) == trace_counts(tr) and sorted(set(tr.seq.tolist())) == [0, 1]
    # an existing trace file is refused before any routing runs (as -o is)
    r = CliRunner().invoke(main, [*args[:5], str(tmp_path / "q.parquet"), *args[6:], "--trace", str(trace)])
    assert r.exit_code == 2 and f"error: --trace {trace} already exists" in r.stderr, r.stderr
    # --force replaces both files, as profile --help says
    before = trace.stat().st_mtime_ns
    r = CliRunner().invoke(main, [*args, "--trace", str(trace), "--force", "-n", "3"])
    assert r.exit_code == 0, r.output
    assert trace.stat().st_mtime_ns != before and read_profile(out) == trace_counts(read_trace(trace))
    assert len(read_trace(trace).seq) > len(tr.seq)  # 3 tokens per prompt now, not 2
    help_text = " ".join(CliRunner().invoke(main, ["profile", "--help"]).output.split())
    assert "--force Replace an existing -o file (and --trace file)." in help_text
