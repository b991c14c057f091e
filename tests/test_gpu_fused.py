"""The fused dense decode step (strata.engine.gpu.fused): launch list, CUDA graph, stage-timer guard.

On the ``sim`` backend (CI, no GPU) the fused step runs its NumPy stand-ins, which are written with
the CPU path's own layer functions: its logits must equal the generic per-layer path's on the same
backend BIT FOR BIT (the same matvec replica, the same layer arithmetic), which checks the wiring -
buffers, the device-side position, ring slots, rope rows, norms - and the tokens must equal the CPU
path's. On CUDA (gpu-marked, skipped without CuPy and a GPU): graph replay and eager launches give
bit-identical logits at every position, tokens equal the CPU path's, the pool does not grow in
decode, and per-stage timing is refused while the graph is on.

The GPU takes the prompt one position at a time; the CPU engines it is compared with do too (``ubatch=1``): a CPU
prompt chunk differs by the attention's float rounding (tests/test_engine_chunked.py), the one-position path is the
same computation as the GPU's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from strata.engine.errors import StageTimesRefused
from strata.engine.generate import generate
from strata.engine.gpu import kernels as K
from strata.engine.gpu.backend import SimBackend
from strata.engine.gpu.fused import FusedUnsupported
from strata.engine.startup import load_engine

GPU_OK, GPU_WHY = K.gpu_available()
skip_no_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")
PROMPT = [1, 2, 3, 4, 5]


def _gemma_swa_spec():
    """Gemma 3 270M's attention shape and tensor types at a small width: 7 layers (0-4 and 6 slide over
    16 positions, 5 is global), 4 query heads / 1 KV head of 256, Q5_0 / Q8_0 / Q4_K / Q6_K, Q8_0 tied head."""
    from strata import testing as synth

    return synth.gemma3_spec(
        n_layers=7,
        dense_type="Q5_0",
        tensor_types={"token_embd": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_down": "Q6_K"},
        dims={
            "n_head": 4,
            "n_head_kv": 1,
            "head_dim": 256,
            "n_ff": 512,
            "sliding_window": 16,
            "sliding_window_pattern": 6,
        },
    )


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    from strata import testing as synth
    from strata.packer.build import build_pack

    d = tmp_path_factory.mktemp("fused_packs")
    out = {}
    for name, spec in (
        ("qwen2", synth.qwen2_spec()),
        ("gemma3", synth.gemma3_spec()),
        ("gemma_swa", _gemma_swa_spec()),
        ("moe", synth.qwen3moe_spec()),
        ("q3n", synth.qwen3next_spec()),
        ("q3n_legacy", synth.qwen3next_spec(choices={"gdn_in": 1})),
        ("llama", synth.llama_spec()),
        ("qwen3", synth.qwen3_spec()),
        ("llama_moe", synth.llama_moe_spec()),
        ("qwen2moe", synth.qwen2moe_spec()),
    ):
        paths = synth.write_model(d / f"{name}.gguf", spec)
        build_pack(paths[0], d / f"{name}-pack", progress=False)
        out[name] = d / f"{name}-pack"
    return out


def _ids(n: int, seed: int = 3) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 500, size=n)]


def _tops_equal(a, b) -> bool:
    return len(a.top) == len(b.top) and all(
        x[0] == y[0] and np.float32(x[1]).tobytes() == np.float32(y[1]).tobytes()
        for ra, rb in zip(a.top, b.top)
        for x, y in zip(ra, rb)
    )


def _logits_per_position(eng, ids: list[int]) -> list[np.ndarray]:
    """Full logits at every position, teacher-forced through ``eng.model.step`` (copied: the fused
    step's host buffer is overwritten by the next step)."""
    from strata.engine.layers import to_host

    out = []
    for pos, t in enumerate(ids):
        out.append(np.array(to_host(eng.model.step(t, pos, eng.state, logits=True)), dtype=np.float32, copy=True))
    return out


# ------------------------------------------------------------------ sim backend (CI)


@pytest.mark.parametrize(
    "name,n", [("qwen2", 24), ("gemma3", 24), ("gemma_swa", 40), ("llama", 24), ("qwen3", 24), ("llama_moe", 24)]
)
def test_sim_fused_equals_generic_bitwise_and_cpu_tokens(packs, name, n):
    """gemma_swa: 40 positions wrap the 16-position rings of its sliding layers; llama: NORM rope with
    rope_freqs factors; qwen3: q/k norms, q wider than n_embd; llama_moe: Mixtral-style experts. The exact
    kernels: fused = generic bit for bit, tokens = the CPU path's with its exact kernel; the default q8 kernels:
    tokens = the CPU path's with its default (q8) kernel."""
    ids = _ids(n)
    fused = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), cpu_kernel="exact")
    generic = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), fused=False)
    assert fused.decoder is not None and generic.decoder is None
    assert fused.gpu.decode_path.startswith("fused") and generic.gpu.decode_path.startswith("generic")
    rf = generate(fused, prompt_ids=ids, n_tokens=6, ignore_eos=True)
    rg = generate(generic, prompt_ids=ids, n_tokens=6, ignore_eos=True)
    assert rf.output_ids == rg.output_ids and _tops_equal(rf, rg)
    cpu = generate(
        load_engine(packs[name], n_ctx=64, ubatch=1, cpu_kernel="exact"), prompt_ids=ids, n_tokens=6, ignore_eos=True
    )
    assert rf.output_ids == cpu.output_ids
    q8 = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend())
    assert q8.decoder.kernel == "q8" and "q8 matvecs" in q8.gpu.decode_path
    r8 = generate(q8, prompt_ids=ids, n_tokens=6, ignore_eos=True)
    assert (
        r8.output_ids
        == generate(
            load_engine(packs[name], n_ctx=64, ubatch=1), prompt_ids=ids, n_tokens=6, ignore_eos=True
        ).output_ids
    )


def test_sim_fused_shared_expert_gate_tokens(packs):
    """qwen2moe: routed experts without renormalisation plus the shared expert and its sigmoid gate
    (a one-row F32 matvec in the fused step, a dot product on the generic path: the same tokens, the
    logits within float summation order)."""
    ids = _ids(24)
    a = _logits_per_position(
        load_engine(packs["qwen2moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), cpu_kernel="exact"), ids
    )
    b = _logits_per_position(
        load_engine(packs["qwen2moe"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), fused=False), ids
    )
    assert all(int(np.argmax(x)) == int(np.argmax(y)) for x, y in zip(a, b))
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 1e-4
    f = generate(
        load_engine(
            packs["qwen2moe"],
            device="cuda",
            ubatch=1,
            n_ctx=64,
            backend=SimBackend(),
            resident="half",
            cpu_kernel="exact",
        ),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    cpu = generate(
        load_engine(packs["qwen2moe"], n_ctx=64, ubatch=1, cpu_kernel="exact"),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    assert f.output_ids == cpu.output_ids


def test_sim_fused_full_logits_equal_generic_every_position(packs):
    """With the exact kernels the fused step's logits are the generic path's bit for bit."""
    ids = _ids(36)
    a = _logits_per_position(
        load_engine(packs["gemma_swa"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), cpu_kernel="exact"),
        ids,
    )
    b = _logits_per_position(
        load_engine(packs["gemma_swa"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), fused=False), ids
    )
    for pos, (x, y) in enumerate(zip(a, b)):
        assert x.tobytes() == y.tobytes(), f"position {pos}: max |diff| {np.abs(x - y).max()}"


def test_sim_fused_ring_equals_full_cache(packs):
    ids = _ids(40)
    r = {
        s: generate(
            load_engine(packs["gemma_swa"], device="cuda", ubatch=1, n_ctx=48, backend=SimBackend(), sliding=s),
            prompt_ids=ids,
            n_tokens=4,
            ignore_eos=True,
        )
        for s in ("ring", "full")
    }
    assert r["ring"].output_ids == r["full"].output_ids and _tops_equal(r["ring"], r["full"])


@pytest.mark.parametrize(
    "name,per_layer,q8_layer,q8_norms", [("qwen2", 9, 2, 5), ("gemma3", 9, 0, 1), ("gemma_swa", 10, 2, 15)]
)
def test_fused_launch_count(packs, name, per_layer, q8_layer, q8_norms):
    """Per layer: q, k and v in one matvec_group launch when they share a type (gemma_swa's attn_v is
    Q8_0, its q/k Q5_0: two launches), qk_prep, attn, out, norm, gate + up in one launch, act, down,
    norm = 9 (10); plus the staging copy and the embedding norm, plus the head matvec, the logit summary's two
    kernels (cuda/logit_top.cu) and the copies of the logits and of the summary. The default q8 kernels add one
    ``quantize_q8`` per input the q8 matvecs read that no norm writes - the output projection's and the down
    projection's: 2 per layer where those weights have a q8 kernel (gemma3's fixture layers have none) - while
    the normed rows (q/k/v - both Q5_0 and Q8_0 meet Q8_0 activations -, gate/up, the head) are quantized by
    their ``resid_norm`` (``q8_norms`` of them: the embedding's, two per layer, the output norm where their
    readers have q8 kernels), and nothing else."""
    q8 = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend())
    eng = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend(), cpu_kernel="exact")
    n_layer = eng.model.hp.n_layer
    c, c8 = eng.decoder.launches_per_token(True), q8.decoder.launches_per_token(True)
    names = [L.name for L in q8.decoder.launches(True)]
    assert sum(n.startswith("quantize q8") for n in names) == q8_layer * n_layer
    assert sum(n.startswith("resid_norm") and n.endswith("+ quantize q8 (Q8_0)") for n in names) == q8_norms
    assert c8 == {**c, "kernels": c["kernels"] + q8_layer * n_layer, "total": c["total"] + q8_layer * n_layer}
    assert all(
        n.startswith(("matvec_q8", "quantize q8"))
        for i, n in enumerate(names)
        if i and names[i - 1].startswith("quantize q8")
    )
    n_layer = eng.model.hp.n_layer
    c = eng.decoder.launches_per_token(True)
    assert c == {"kernels": per_layer * n_layer + 4, "memcpy": 3, "total": per_layer * n_layer + 7, "host": 0}
    assert eng.decoder.launches_per_token(False)["total"] == per_layer * n_layer + 2  # prompt positions: no head
    assert eng.gpu.launches_per_token == c
    stages = eng.decoder.stages(True)
    assert stages[0] == "embed" and stages[-1] == "head" and len(stages) == 2 * n_layer + 2


def test_stage_times_refused_with_graph(packs):
    with pytest.raises(StageTimesRefused, match="record nothing"):
        load_engine(packs["gemma3"], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend(), stage_times=True)
    with pytest.raises(StageTimesRefused, match="fused step only"):  # the generic path has no stage timers at all
        load_engine(
            packs["q3n_legacy"], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend(), graph=False, stage_times=True
        )
    eng = load_engine(
        packs["moe"],
        device="cuda",
        ubatch=1,
        n_ctx=32,
        backend=SimBackend(),
        graph=False,
        stage_times=True,
        resident="half",
    )  # MoE, hybrid: timed per stage (the host points inside the FFN stages)
    generate(eng, prompt_ids=PROMPT, n_tokens=2, ignore_eos=True)
    assert eng.decoder.stage_times.steps == len(PROMPT) + 1 and eng.decoder.stage_times.grouped()["ffn"] > 0


def test_stage_times_eager_sim(packs):
    eng = load_engine(
        packs["gemma_swa"], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend(), graph=False, stage_times=True
    )
    generate(eng, prompt_ids=PROMPT, n_tokens=3, ignore_eos=True)
    st = eng.decoder.stage_times
    assert st.steps == len(PROMPT) + 2
    grouped = st.grouped()
    assert set(grouped) == {"embed", "attn", "ffn", "head"} and all(v > 0 for v in grouped.values())
    assert st.n["head"] == 3 and st.n["L0 attn"] == st.steps  # the head runs on positions with logits only


def test_fused_refuses_a_routing_kernel_past_its_shared_memory(packs, monkeypatch):
    """moe_route keeps every expert's probability and 32 candidates a chunk of 32 experts in shared memory: 4,096
    experts take exactly the 49,152 B a CTA gets without opting in; one more is refused by name with both numbers
    (a launch failure inside graph capture otherwise), and the engine takes the generic path, said so."""
    from strata.engine.gpu.fused import fused_unsupported
    from strata.engine.gpu.fused_ops import ROUTE_SHMEM_MAX, route_shared_bytes

    assert route_shared_bytes(4096) == 4 * 4096 + 8 * 32 * 128 == ROUTE_SHMEM_MAX == 49152
    eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend())
    m = eng.decoder.model
    assert fused_unsupported(m) is None
    monkeypatch.setattr(m, "hp", dataclasses.replace(m.hp, n_expert=4097))
    assert fused_unsupported(m) == (
        "n_expert 4097: the fused routing kernel's shared memory (49412 B) exceeds the 49152 B a CTA takes without "
        "opting in"
    )


def test_fused_on_legacy_ssm_in_is_refused_not_ignored(packs):
    with pytest.raises(FusedUnsupported, match="legacy ssm_in"):
        load_engine(packs["q3n_legacy"], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend(), fused=True)
    eng = load_engine(
        packs["q3n_legacy"], device="cuda", ubatch=1, n_ctx=32, backend=SimBackend()
    )  # the generic path, said so
    assert eng.decoder is None and "legacy ssm_in" in eng.gpu.decode_path


def test_sim_fused_qwen3next_delta_net_and_gated_attention(packs):
    """qwen3next in the fused step: per recurrent layer attn_qkv + attn_gate + ssm_ba in one launch,
    gdn_conv, gdn_step, ssm_out; the attention layer's output gate (gate_mul). Against the generic
    path on the same backend: the same argmax at every position, logits within float summation order
    (the shared expert's gate is a one-row matvec here, a dot product there); a second sequence from
    position 0 gives the first one's logits bit for bit (the kernels start the recurrent state at zero,
    nothing on the host resets it); tokens equal the CPU path's with half the experts resident."""
    ids = _ids(20)
    f = load_engine(packs["q3n"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), cpu_kernel="exact")
    assert f.decoder is not None and f.decoder.gdn is not None
    names = [L.name for L in f.decoder.launches(True)]
    assert sum(n.startswith("gdn_step") for n in names) == 3 and sum(n.startswith("gate_mul") for n in names) == 1
    a = _logits_per_position(f, ids)
    b = _logits_per_position(
        load_engine(packs["q3n"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), fused=False), ids
    )
    assert all(int(np.argmax(x)) == int(np.argmax(y)) for x, y in zip(a, b))
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 1e-4
    again = _logits_per_position(f, ids)
    assert all(np.array_equal(x, y) for x, y in zip(a, again))
    sim = generate(
        load_engine(
            packs["q3n"], device="cuda", ubatch=1, n_ctx=64, backend=SimBackend(), resident="half", cpu_kernel="exact"
        ),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    cpu = generate(
        load_engine(packs["q3n"], n_ctx=64, ubatch=1, cpu_kernel="exact"),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    assert sim.output_ids == cpu.output_ids


# ------------------------------------------------------------------ routed experts in the fused step


def _moe(packs, **kw):
    """The synthetic qwen3moe on the sim; misses in the GPU kernels' order (``cpu_kernel="exact"``, bit-identical
    to hits) unless ``cpu_kernel`` says otherwise (the engine's default is ``q8``)."""
    kw.setdefault("cpu_kernel", "exact")
    return load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=48, backend=SimBackend(), **kw)


def test_sim_fused_moe_equals_generic_bitwise_for_any_cache(packs):
    """Routing on the device, batched expert matvecs from the slots, misses from the CPU (``--miss-tier cpu``) or
    read by the same kernels from the host tier (``pcie``): the logits equal the generic per-layer path's bit for
    bit (the same matvec replica, the same combine order) whatever the cache holds - none, half (the hybrid path
    on the CPU tier; one graph on the PCIe tier), all (one graph) - and the tokens equal the CPU path's."""
    ids = _ids(20)
    ref = _logits_per_position(_moe(packs, fused=False, expert_cache=0), ids)
    for tier in ("cpu", "pcie"):
        for ec, resident in ((0, "all"), ("auto", "half"), ("auto", "all")):
            eng = _moe(packs, expert_cache=ec, resident=resident, miss_tier=tier)
            assert eng.decoder is not None and eng.decoder.moe is not None
            assert eng.decoder.hybrid == (tier == "cpu" and (resident != "all" or ec == 0))
            n_tier = len(eng.decoder.moe.tier) if eng.decoder.moe.tier is not None else 0
            assert n_tier == (0 if tier == "cpu" else eng.decoder.moe.n_pairs - len(eng.experts.cache))
            got = _logits_per_position(eng, ids)
            assert all(np.array_equal(a, b) for a, b in zip(ref, got)), (tier, ec, resident)
    cpu = generate(
        load_engine(packs["moe"], n_ctx=48, ubatch=1, cpu_kernel="exact"),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    sim = generate(_moe(packs, resident="half"), prompt_ids=PROMPT, n_tokens=8, ignore_eos=True)
    assert sim.output_ids == cpu.output_ids


@pytest.mark.parametrize("name", ["moe", "llama_moe", "qwen2moe", "q3n"])
def test_sim_cache_plumbing_q8_logits_equal_for_empty_half_full_cache(packs, name):
    """The PLUMBING of the hit/miss split on the sim backend with the default q8 kernels: the slot lookup,
    the miss list handed to the CPU, the misses' outputs put back in their routed order and weights - the
    logits with the cache empty and half full equal the all-resident run's (no miss at all) bit for bit at
    every position, and the routing is the same whatever the cache holds.

    What it does NOT check: that the device's hit kernels equal the CPU's miss kernels. On the sim a hit runs
    the CPU ``q8`` kernel too (:meth:`strata.engine.gpu.backend.SimBackend.matvec_q8`), so hits and misses
    share one kernel here by construction. That invariant is proved on the GPU: ``matvec_q8`` vs the CPU
    kernel bit for bit (tests/test_gpu_q8.py) and the device run of every gpu test, whose log is kept in
    bench/results/ (``*-gpu_tests.txt``, headed by the commit it ran)."""
    ids = _ids(16)

    def run(**kw):
        eng = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=48, backend=SimBackend(), threads=2, **kw)
        routes: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in ids]
        pos = [0]
        eng.experts.on_route = lambda il, sel: routes[pos[0]].append((il, tuple(int(i) for i in sel)))
        out = []
        for p, t in enumerate(ids):
            pos[0] = p
            from strata.engine.layers import to_host

            out.append(np.array(to_host(eng.model.step(t, p, eng.state, logits=True)), dtype=np.float32, copy=True))
        return eng, out, routes

    full_eng, full, full_routes = run()
    assert full_eng.decoder.kernel == "q8" and full_eng.decoder.moe.miss_kernel(full_eng.experts.kernel) == "q8-exact"
    for tier in ("cpu", "pcie"):
        for kw in ({"expert_cache": 0}, {"resident": "half"}):
            eng, got, routes = run(miss_tier=tier, **kw)
            assert eng.decoder.hybrid == (tier == "cpu") and routes == full_routes, (name, tier, kw)
            assert all(a.tobytes() == b.tobytes() for a, b in zip(full, got)), (name, tier, kw)
    exact = run(cpu_kernel="exact")[1]  # and the q8 numerics are not the exact ones (the test can fail)
    assert any(a.tobytes() != b.tobytes() for a, b in zip(full, exact))


def test_sim_fused_moe_launches_hybrid_and_full(packs):
    """Per MoE layer: q/k/v (one matvec_group launch), qk_prep, attn, out, norm; router, moe_route,
    gate + up of the selected experts (one batched launch; the preset's types agree per layer), silu_mul, down, norm
    (which also sums the experts: moe_combine fused into it) = 11 kernels (the step's head: 4 kernels and 3 copies,
    test_fused_launch_count; the routing record: 1 copy). The hybrid path (``--miss-tier cpu``) adds 3 copies (routing,
    input, the flag), one host point and one kernel (``moe_take_rows``: the CPU's rows) per layer; with every expert
    resident, or the rest in the host tier (``pcie``), the step is the full list: no host point."""
    full = _moe(packs, expert_cache="auto", resident="all")
    hyb = _moe(packs, expert_cache="auto", resident="half", miss_tier="cpu")
    tier = _moe(packs, expert_cache="auto", resident="half", miss_tier="pcie")
    L = full.model.hp.n_layer
    one = {"kernels": 11 * L + 4, "memcpy": 4, "total": 11 * L + 8, "host": 0}
    assert full.decoder.launches_per_token(True) == one
    # the host tier's step adds the prefetch of every MoE layer but the first (router, plan, copy on the side stream;
    # the fork and join are edges, no node) and the copy of its counters with the routing record
    pf = {"kernels": one["kernels"] + 3 * (L - 1), "memcpy": 5, "total": one["total"] + 3 * (L - 1) + 1, "host": 0}
    assert tier.decoder.launches_per_token(True) == pf and tier.decoder.moe.prefetch.active
    edges = [x.name for x in tier.decoder.launches(True) if x.kind == "edge"]
    assert edges == [f"{w} prefetch L{j}" for j in range(1, L) for w in ("fork", "join")]
    assert not full.decoder.moe.prefetch.active and not hyb.decoder.moe.prefetch.active
    assert hyb.decoder.launches_per_token(True) == {
        "kernels": 12 * L + 4,
        "memcpy": 4 + 3 * L,
        "total": 15 * L + 8,
        "host": L,
    }
    assert "every expert resident" in full.gpu.decode_path
    assert f"hybrid ({L} MoE layers: the host computes the CPU's misses at one point a layer)" in hyb.gpu.decode_path
    # the budget's count of captured graphs (its CUDA runtime term) is the engine's: 2 whole steps + the segments
    # + 2 whole steps with the prefetch (built on every MoE layer but the first, whatever the cache: chosen at bind)
    from strata.budget.formulas_gpu import fused_graph_count

    hyb.decoder.capture()
    segs = sum(1 for lg in (True, False) for ls, _h in hyb.decoder.segments(lg) if ls)
    assert hyb.decoder.moe.prefetch.built == set(range(1, L)) == full.decoder.moe.prefetch.built
    assert fused_graph_count(L, True) == 4 + segs == 4 + 2 * (L + 1) and fused_graph_count(L) == 2 + segs
    n_tier = tier.decoder.moe.n_pairs - len(tier.experts.cache)
    assert f"+ {n_tier} read over PCIe from the host tier" in tier.gpu.decode_path and n_tier > 0
    assert len(hyb.decoder.segments(True)) == L + 1
    K = full.model.hp.n_expert_used
    r = generate(full, prompt_ids=PROMPT, n_tokens=4, ignore_eos=True)
    assert r.expert_misses == 0 and r.expert_hits == (len(PROMPT) + 3) * L * K
    # the routing record counts the host tier's misses: every miss read over PCIe, none on the CPU
    r = generate(tier, prompt_ids=PROMPT, n_tokens=4, ignore_eos=True)
    assert r.expert_hits + r.expert_misses == (len(PROMPT) + 3) * L * K
    assert r.expert_misses == r.expert_pcie > 0 and r.expert_hits > 0
    h = generate(hyb, prompt_ids=PROMPT, n_tokens=4, ignore_eos=True)
    assert (h.expert_hits, h.expert_misses, h.expert_pcie) == (r.expert_hits, r.expert_misses, 0)


def test_sim_fused_moe_admission_updates_the_device_slot_table(packs):
    """Misses admitted into free slots at decode time become hits through the step's slot table: the
    table on the device lists exactly the cache's pairs, and the tokens do not change. (Started empty: with a
    profile the start-up fill takes every free slot, the profiled pairs first.)"""
    eng = _moe(packs, expert_cache=12, resident="none", admit=True)
    before = len(eng.experts.cache)
    r = generate(eng, prompt_ids=PROMPT, n_tokens=8, ignore_eos=True)
    cache, moe = eng.experts.cache, eng.decoder.moe
    assert before == 0 and cache.admitted == len(cache) > 0
    table = {(i // moe.E, i % moe.E): int(s) for i, s in enumerate(moe.slot_of) if s >= 0}
    assert table == cache.where
    ref = generate(_moe(packs, fused=False, expert_cache=0), prompt_ids=PROMPT, n_tokens=8, ignore_eos=True)
    assert r.output_ids == ref.output_ids and _tops_equal(r, ref)
    assert r.expert_hits > 0 and r.expert_misses > 0


def test_sim_fused_moe_routing_hook_sees_every_layer(packs):
    """The routing hook (strata-engine profile's counter) is fed from the step's routing record: with every
    expert resident the step stays one graph and the hook sees the same selections as the generic path."""
    seen = {}
    for fused in (None, False):
        eng = _moe(packs, expert_cache="auto", fused=fused)
        got: list[tuple[int, tuple[int, ...]]] = []
        eng.experts.on_route = lambda il, ids, got=got: got.append((il, tuple(int(i) for i in ids)))
        if fused is None:
            assert eng.decoder.moe.full and not eng.decoder.hybrid
        generate(eng, prompt_ids=PROMPT, n_tokens=4, ignore_eos=True)
        seen[fused] = got
    assert seen[None] == seen[False] and len(seen[None]) == (len(PROMPT) + 3) * 3


def test_cli_stage_times_refusals(packs):
    from click.testing import CliRunner

    from strata.engine.cli import main

    r = CliRunner().invoke(main, ["generate", str(packs["gemma3"]), "-p", "hi", "-n", "2", "--stage-times"])
    assert r.exit_code == 2 and "cuda only" in r.output
    r = CliRunner().invoke(
        main, ["generate", str(packs["gemma3"]), "-p", "hi", "-n", "2", "--device", "cuda", "--stage-times"]
    )
    assert r.exit_code == 2 and "record nothing" in r.output  # refused before any device is touched


def test_fused_step_rejects_other_state_and_bad_position(packs):
    from strata.engine.errors import GenerateError

    eng = load_engine(packs["qwen2"], device="cuda", ubatch=1, n_ctx=16, backend=SimBackend())
    other = eng.model.new_state(16)
    with pytest.raises(GenerateError, match="another session state"):
        eng.model.step(1, 0, other)
    with pytest.raises(GenerateError, match="outside"):
        eng.model.step(1, 16, eng.state)


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("name,n", [("qwen2", 20), ("gemma3", 20), ("gemma_swa", 40)])
def test_cuda_graph_and_eager_logits_bit_identical(packs, name, n):
    ids = _ids(n)
    g = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64)
    e = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, graph=False)
    assert g.decoder.captured and g.decoder.graph_on and not e.decoder.graph_on
    lg, le = _logits_per_position(g, ids), _logits_per_position(e, ids)
    for pos, (x, y) in enumerate(zip(lg, le)):
        assert x.tobytes() == y.tobytes(), f"{name} position {pos}: graph and eager logits differ"
        assert np.isfinite(x).all()


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("kernel", ["q8", "exact"])
@pytest.mark.parametrize("name", ["qwen2", "gemma3", "gemma_swa", "llama", "qwen3", "llama_moe", "qwen2moe", "q3n"])
def test_cuda_fused_tokens_match_cpu_and_generic(packs, name, kernel):
    """The fused step's tokens equal the CPU path's with the same kernel (q8: the same integer numerics for the
    q8 types; exact: the same order), and with the exact kernels the generic GPU path's; the top logits within
    1e-3 relative of the CPU's (exact), 3e-2 (q8: an activation that differs by float order between the devices -
    attention, norms - can round to the neighbouring int8 step, 1/127 of its block's largest value; measured on
    the H200 2026-11-30: gemma_swa 1.07e-2); decode allocates nothing."""
    import cupy as cp

    ids = _ids(30)
    eng = load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, cpu_kernel=kernel)
    r = generate(eng, prompt_ids=ids, n_tokens=8, ignore_eos=True)
    grown = cp.get_default_memory_pool().total_bytes() - eng.gpu.pool_after_warmup
    assert grown == 0, f"decode allocated {grown} B of new device memory"
    cpu = generate(
        load_engine(packs[name], n_ctx=64, ubatch=1, cpu_kernel=kernel), prompt_ids=ids, n_tokens=8, ignore_eos=True
    )
    gap = max(
        abs(a[1] - b[1]) / max(1.0, abs(b[1])) for ra, rb in zip(r.top, cpu.top) for a, b in zip(ra, rb) if a[0] == b[0]
    )
    print(
        f"\n[fused] {name} {kernel}: graph {r.tokens_per_second:.0f} tok/s; "
        f"tokens {r.output_ids}; max relative top-5 logit gap vs cpu {gap:.2e}"
    )
    assert r.output_ids == cpu.output_ids
    assert gap < (1e-3 if kernel == "exact" else 3e-2)
    if kernel == "exact":
        gen = generate(
            load_engine(packs[name], device="cuda", ubatch=1, n_ctx=64, fused=False),
            prompt_ids=ids,
            n_tokens=8,
            ignore_eos=True,
        )
        assert r.output_ids == gen.output_ids


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_replay_and_stage_timer_guard(packs):
    g = load_engine(packs["gemma_swa"], device="cuda", ubatch=1, n_ctx=64)
    generate(g, prompt_ids=PROMPT, n_tokens=4, ignore_eos=True)
    ms = g.decoder.replay_ms(50)
    assert 0 < ms < 50
    with pytest.raises(StageTimesRefused):
        load_engine(packs["gemma_swa"], device="cuda", ubatch=1, n_ctx=64, stage_times=True)
    e = load_engine(packs["gemma_swa"], device="cuda", ubatch=1, n_ctx=64, graph=False, stage_times=True)
    generate(e, prompt_ids=PROMPT, n_tokens=4, ignore_eos=True)
    grouped = e.decoder.stage_times.grouped()
    print(f"\n[fused] gemma_swa: replay {ms:.3f} ms/token; eager stage ms/token {grouped}")
    assert set(grouped) == {"embed", "attn", "ffn", "head"} and all(v > 0 for v in grouped.values())


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_fused_moe_cache_does_not_change_logits(packs):
    """On the device, the default q8 kernels: none, half (hybrid: segment graphs, CPU misses; or one graph, misses
    read over PCIe from the host tier) or all (one graph) resident, graph or eager, with admission on both tiers:
    the logits are bit-identical at every position (a CPU miss replays the hit's arithmetic: the CPU q8 kernel =
    the GPU's matvec_q8; a PCIe miss is the hit's kernel on the hit's bytes); decode allocates no device memory.
    The tokens equal the CPU path's with the same kernel (and, with the exact kernels, the generic path's)."""
    import cupy as cp

    ids = _ids(24)
    runs = {}
    cpu, pcie = {"miss_tier": "cpu"}, {"miss_tier": "pcie"}
    for key, kw in (
        ("none", {"expert_cache": 0, **cpu}),
        ("none pcie", {"expert_cache": 0, **pcie}),
        ("half", {"resident": "half", **cpu}),
        ("half pcie", {"resident": "half", **pcie}),
        ("all", {}),
        ("all eager", {"graph": False}),
        ("half eager", {"resident": "half", "graph": False, **cpu}),
        ("half pcie eager", {"resident": "half", "graph": False, **pcie}),
        ("admit", {"expert_cache": 12, "resident": "none", "admit": True, **cpu}),
        ("admit pcie", {"expert_cache": 12, "resident": "none", "admit": True, **pcie}),
    ):
        eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=48, **kw)
        assert eng.decoder is not None and eng.decoder.moe is not None
        runs[key] = _logits_per_position(eng, ids)
        grown = cp.get_default_memory_pool().total_bytes() - eng.gpu.pool_after_warmup
        assert grown == 0, f"{key}: decode allocated {grown} B of new device memory"
        if key.startswith("admit"):
            assert eng.experts.cache.admitted > 0
        assert eng.decoder.hybrid == (kw.get("miss_tier") == "cpu"), key
    for key, got in runs.items():
        for pos, (a, b) in enumerate(zip(runs["none"], got)):
            assert a.tobytes() == b.tobytes(), f"{key} position {pos}: logits differ from the all-miss run"
    gen = generate(
        load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=48, fused=False),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    cpu = generate(
        load_engine(packs["moe"], n_ctx=48, ubatch=1, cpu_kernel="exact"),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    fus = generate(
        load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=48, resident="half", cpu_kernel="exact"),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    print(f"\n[fused moe] tokens {fus.output_ids}; generic {gen.output_ids}; cpu {cpu.output_ids}")
    assert fus.output_ids == gen.output_ids == cpu.output_ids
    q8 = generate(
        load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=48, resident="half"),
        prompt_ids=PROMPT,
        n_tokens=8,
        ignore_eos=True,
    )
    assert (
        q8.output_ids
        == generate(
            load_engine(packs["moe"], n_ctx=48, ubatch=1), prompt_ids=PROMPT, n_tokens=8, ignore_eos=True
        ).output_ids
    )


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_fused_qwen3next_graph_eager_and_cache(packs):
    """qwen3next on the device: graph and eager logits bit for bit at every position; none, half or all
    experts resident: the same logits bit for bit; a second sequence repeats the first (the delta-net
    state starts at zero in the kernels)."""
    ids = _ids(24)
    runs = {
        key: _logits_per_position(load_engine(packs["q3n"], device="cuda", ubatch=1, n_ctx=48, **kw), ids)
        for key, kw in (
            ("all", {}),
            ("eager", {"graph": False}),
            ("none", {"expert_cache": 0}),
            ("half", {"resident": "half"}),
        )
    }
    for key, got in runs.items():
        for pos, (a, b) in enumerate(zip(runs["all"], got)):
            assert a.tobytes() == b.tobytes(), f"{key} position {pos}"
    eng = load_engine(packs["q3n"], device="cuda", ubatch=1, n_ctx=48)
    first, second = _logits_per_position(eng, ids), _logits_per_position(eng, ids)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, second))


def test_sim_profile_routing_two_prompts_on_the_fused_step(packs):
    """strata-engine profile runs every prompt from position 0 on the session's own state (the fused step
    is bound to it: a new state per prompt was refused on the H200), counting the same selections as the
    CPU path."""
    from strata.engine.routing import profile_routing

    prompts = ["The capital of France is", "hello world"]
    sim = profile_routing(str(packs["moe"]), prompts, n_tokens=3, n_ctx=32, device="sim")
    cpu = profile_routing(str(packs["moe"]), prompts, n_tokens=3, n_ctx=32, device="cpu")
    assert sim == cpu and sum(c for _il, _e, c in sim) > 0


# ------------------------------------------------------------------ the logit summary (cuda/logit_top.cu)


def _summary_rows(rng) -> list[tuple[str, np.ndarray]]:
    """Rows the summary must rank exactly as top_k_pairs: random, ties everywhere (a few distinct values), the best
    value repeated at far-apart ids, +0.0 / -0.0 ties, one NaN, infinities, a vocabulary that is not a multiple of
    anything, and the gemma vocabulary."""
    r = [
        ("random", rng.standard_normal(151936).astype(np.float32)),
        ("ties", rng.integers(0, 3, 50257).astype(np.float32)),
        ("max repeated", np.full(262144, -1.0, np.float32)),
        ("signed zeros", np.where(rng.random(1000) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)),
        ("small", rng.standard_normal(7).astype(np.float32)),
    ]
    r[2][1][[262143, 5, 131072, 77, 200000, 6]] = 3.0
    nan = rng.standard_normal(4099).astype(np.float32)
    nan[1234] = np.nan
    inf = rng.standard_normal(4099).astype(np.float32)
    inf[[3, 4000]] = [np.inf, -np.inf]
    return r + [("nan", nan), ("inf", inf)]


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_logit_summary_ranks_as_top_k_pairs():
    """The device's ranking (count of non-finite logits, best 5 by logit descending then id ascending) equals
    strata.engine.sampling.top_k_pairs and numpy's argmax on every row, bit for bit in the logits."""
    import cupy as cp

    from strata.engine.gpu.fused_ops import TOP_WORDS, CudaOps
    from strata.engine.sampling import top_k_pairs
    from strata.layout import step as LS

    stream = cp.cuda.Stream(non_blocking=False)
    ops = CudaOps(stream)
    part = cp.zeros((LS.FUSED_TOP_BYTES - 4 * TOP_WORDS) // 4, dtype=cp.float32)
    out = cp.zeros(TOP_WORDS, dtype=cp.int32)
    for name, row in _summary_rows(np.random.default_rng(11)):
        y = cp.asarray(row)
        ops.logit_top_part(y, part)()
        ops.logit_top_final(part, out)()
        stream.synchronize()
        w = out.get()
        bad = int(np.count_nonzero(~np.isfinite(row)))
        assert w[0] == bad, name
        if bad:
            continue
        k = min(5, row.size)
        got = [(int(w[1 + i]), w[8 + i : 9 + i].view(np.float32)[0].tobytes()) for i in range(k)]
        want = [(i, np.float32(v).tobytes()) for i, v in top_k_pairs(row, 5)]
        assert got == want, name
        assert got[0][0] == int(np.argmax(row)), name


def test_sim_greedy_decode_reads_the_summary_and_agrees_with_the_row(packs):
    """The wiring: a greedy decode on the fused step takes its token and top pairs from the logit summary, once per
    generated token, and its token is the summary's first pair; a custom pick (argmax of the row) reads the row and
    gives the same tokens and pairs. (On the sim the summary IS top_k_pairs; the device's ranking is checked against
    it in test_cuda_logit_summary_ranks_as_top_k_pairs.)"""
    from strata.engine.sampling import Sampler

    eng = load_engine(packs["gemma3"], device="cuda", ubatch=1, n_ctx=48, backend=SimBackend())
    calls = []
    real = eng.decoder.logit_summary

    def spy():
        calls.append(1)
        return real()

    eng.decoder.logit_summary = spy
    a = generate(eng, prompt_ids=PROMPT, n_tokens=6, ignore_eos=True, sampler=Sampler())
    assert len(calls) == 6 and [t[0][0] for t in a.top] == a.output_ids
    b = generate(
        load_engine(packs["gemma3"], device="cuda", ubatch=1, n_ctx=48, backend=SimBackend()),
        prompt_ids=PROMPT,
        n_tokens=6,
        ignore_eos=True,
        sampler=lambda row: int(np.argmax(row)),
    )
    assert a.output_ids == b.output_ids and a.top == b.top


@pytest.mark.parametrize("share", ["0.5", "0.3", "0.01"])
def test_sim_split_misses_between_pcie_and_cpu_change_no_bit(packs, share, monkeypatch):
    """STRATA_PCIE_SHARE (issue 19's split of a layer's misses): the host tier holds every non-resident pair and
    ``moe_route`` splits each token's - of a layer's c selected experts in the tier the first keep[c] are read over
    PCIe, the CPU computes the rest in the hybrid step - the same tokens and top logits, bit for bit, as every expert
    resident and as every miss over PCIe; every layer of every step split exactly by the table (the routing record);
    the start-up notes say the rule; nothing learns (the fill stays). A share outside (0, 1] is refused by name."""
    from strata.engine.errors import ExpertCacheError
    from strata.engine.gpu import miss_split as MS

    full = generate(_moe(packs, resident="all"), prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    pcie = generate(_moe(packs, expert_cache=0, miss_tier="pcie"), prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    monkeypatch.setenv("STRATA_PCIE_SHARE", share)
    eng = _moe(packs, expert_cache=0, miss_tier="pcie")
    moe = eng.decoder.moe
    steps: list[np.ndarray] = []
    take = moe.take_record

    def record(now=True):  # every step's routing record, as the host counts it
        steps.append(moe.record_host.reshape(-1, 2, moe.K)[moe.layer_rows, 1].copy())
        take(now)

    moe.take_record = record
    r = generate(eng, prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)
    assert (r.output_ids, r.top) == (full.output_ids, full.top) == (pcie.output_ids, pcie.top)
    keep = MS.keep_table(float(share), moe.K)
    assert steps and all(((s <= -2).sum(axis=1) == keep[moe.K]).all() for s in steps), keep
    assert all(((s == -1).sum(axis=1) == moe.K - keep[moe.K]).all() for s in steps)
    assert eng.decoder.hybrid and r.expert_misses == pcie.expert_misses and 0 < r.expert_misses
    assert r.expert_pcie == len(steps) * len(moe.layers) * keep[moe.K]
    n_expert, layers = moe.E, eng.experts.source.layers
    assert len(eng.experts.tier) == len(layers) * n_expert  # the tier holds every pair
    notes = {k: v for cp in eng.checkpoints for k, v in cp.extra.items()}
    assert notes["miss split"] == MS.split_note(float(share), moe.K, len(layers) * n_expert)
    assert notes["cache policy"].startswith("auto: fill")
    for bad in ("0", "0.001", "1e-300", "1.5", "nan", "half"):  # refused at the options, before any weight is read
        monkeypatch.setenv("STRATA_PCIE_SHARE", bad)
        with pytest.raises(ExpertCacheError, match=rf"STRATA_PCIE_SHARE='{bad}': .* in \[0.01, 1\] \(it overrides"):
            _moe(packs, expert_cache=0, miss_tier="pcie")
    monkeypatch.setenv("STRATA_PCIE_SHARE", " ")  # empty: unset (every miss in the tier, one graph)
    assert not _moe(packs, expert_cache=0, miss_tier="pcie").decoder.hybrid


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_split_misses_between_pcie_and_cpu_change_no_bit(packs, monkeypatch):
    """The split on CUDA (captured hybrid segments reading host-tier addresses, the CPU computing the rest): the
    same tokens and top logits, bit for bit, as every expert resident; both kinds of misses counted."""

    def cuda(**kw):
        eng = load_engine(packs["moe"], device="cuda", ubatch=1, n_ctx=48, cpu_kernel="exact", **kw)
        return eng, generate(eng, prompt_ids=PROMPT, n_tokens=6, ignore_eos=True)

    _e, full = cuda(resident="all")
    monkeypatch.setenv("STRATA_PCIE_SHARE", "0.5")
    eng, r = cuda(expert_cache=0, miss_tier="pcie")
    assert eng.decoder.hybrid and (r.output_ids, r.top) == (full.output_ids, full.top)
    assert 0 < r.expert_pcie < r.expert_misses


def test_start_up_measures_the_cpu_experts_where_misses_run_there(packs, monkeypatch):
    """Issue 19 item 2's CPU probe: where misses run on the CPU (``--miss-tier cpu``, or a share of them with
    STRATA_PCIE_SHARE) the start-up notes give the CPU's microseconds an expert, measured with the step's miss kernel
    and threads on the first experts of MoE layers spread over the model; not where every miss is read over PCIe or
    nothing misses."""
    import re

    from strata.engine.gpu import slots as SL

    def notes(**kw):
        eng = _moe(packs, **kw)
        return eng, {k: v for cp in eng.checkpoints for k, v in cp.extra.items()}

    eng, n = notes(resident="half", miss_tier="cpu")
    layers = eng.experts.source.layers
    R, N = SL.CPU_PROBE_RUNS, SL.CPU_PROBE_ROUNDS  # calls on layers spread over the model (repeated where it has fewer)
    spread = [layers[i * len(layers) // (N * (R + 1))] for i in range(N * (R + 1))]
    # the first timed call's layer of each round (the kept one is named): a layer once a round, so the call before
    # a timed one never read the same experts
    rounds = [list(dict.fromkeys(spread[r::N])) for r in range(N)]
    firsts = {(p if len(p) > 1 else p * 2)[1] for p in rounds}
    k = min(SL.CPU_PROBE_EXPERTS, eng.decoder.moe.E)
    threads = eng.experts.threads or "all"
    got = re.fullmatch(
        rf"\d+ us an expert on the CPU \(measured: {k} experts a call, {threads} threads; the least of {N} rounds' "
        rf"medians \((\d) calls, on layers spread over the model, from layer (\d+)\)\)",
        n["cpu experts"],
    )
    assert got and 1 <= int(got.group(1)) <= R and int(got.group(2)) in firsts, n["cpu experts"]
    assert "cpu experts" not in notes(resident="half", miss_tier="pcie")[1]
    assert "cpu experts" not in notes(resident="all")[1]
    monkeypatch.setenv("STRATA_PCIE_SHARE", "0.5")
    assert "cpu experts" in notes(expert_cache=0, miss_tier="pcie")[1]
    us, got_k, got_layer, runs = SL.probe_cpu_experts(eng.experts.source, eng.decoder.moe.E, "exact", 1)
    assert us > 0 and got_k == k and 1 <= runs <= R and got_layer in firsts


def test_sim_hybrid_host_point_refuses_a_routing_that_never_arrived(packs):
    """The hybrid step's host point spins on a flag the layer's last copy writes (engine/gpu/moe_host.py); a flag
    still -1 when the host gets there is refused with the layer named (on CUDA once the stream has ended), never
    waited for forever or read as stale routing."""
    from strata.engine.errors import GenerateError

    hyb = _moe(packs, expert_cache="auto", resident="half", miss_tier="cpu")
    generate(hyb, prompt_ids=PROMPT, n_tokens=2, ignore_eos=True)
    moe = hyb.decoder.moe
    il = moe.layers[-1]
    assert moe.flag_host[il] >= 0  # the last step wrote every MoE layer's flag (its position)
    moe.reset_flags()
    with pytest.raises(GenerateError, match=f"layer {il}'s routing flag was not written"):
        moe.on_fill(il)


@pytest.mark.parametrize("share", ["0.3", "0.5", "0.8"])
@pytest.mark.parametrize("slots", [3, 12])
def test_sim_split_with_some_experts_resident_follows_the_table_for_every_count(packs, share, slots, monkeypatch):
    """Some experts in slots and a split (a fixed cache: --cache-policy fill): a layer's selected experts in the host
    tier number c = 0..K by token, and in every layer of every step the first keep[c] of them stay in the tier (slot
    <= -2), the others go to the CPU (-1) and the resident ones keep their slots - against the slot table; the tokens
    and top logits are those of every expert resident. (A review's test, 2026-12-04.)"""
    from strata.engine.gpu import miss_split as MS

    full = generate(_moe(packs, resident="all"), prompt_ids=PROMPT, n_tokens=8, ignore_eos=True)
    monkeypatch.setenv("STRATA_PCIE_SHARE", share)
    eng = _moe(packs, expert_cache=slots, miss_tier="pcie", cache_policy="fill")
    moe = eng.decoder.moe
    keep = MS.keep_table(float(share), moe.K)
    recs = []
    take = moe.take_record

    def record(now=True):
        recs.append(moe.record_host.reshape(-1, 2, moe.K)[moe.layer_rows].copy())
        take(now)

    moe.take_record = record
    r = generate(eng, prompt_ids=PROMPT, n_tokens=8, ignore_eos=True)
    assert (r.output_ids, r.top) == (full.output_ids, full.top)
    table = np.asarray(moe.slot_of).reshape(-1, moe.E)
    counts = set()
    for rec in recs:
        for j, il in enumerate(moe.layers):
            ids, got = rec[j, 0], rec[j, 1]
            want = table[il, ids].copy()
            tier = np.flatnonzero(want <= -2)
            counts.add(tier.size)
            want[tier[keep[tier.size] :]] = -1
            assert got.tolist() == want.tolist(), (il, keep)
    assert len(counts) > 1  # more than one count of tier experts seen (c < K included)
    identity = keep == list(range(moe.K + 1))  # a table that sends the CPU nothing: no split, one graph, said so
    assert eng.decoder.hybrid == (not identity)
    choice = {k: v for cp in eng.checkpoints for k, v in cp.extra.items()}.get("miss split choice")
    want = f"none: STRATA_PCIE_SHARE={float(share)} keeps every one of {moe.K} experts in the tier"
    assert (choice == want) == identity, choice


def test_sim_hybrid_split_admits_misses_until_every_pair_is_in_a_slot(packs, monkeypatch):
    """A hybrid step with a split (STRATA_PCIE_SHARE 0.5: the host tier holds every pair, moe_route sends part of each
    layer's to the CPU) and admission (``--admit``): after each step its misses, the CPU's (-1) and the tier's, are
    admitted into free slots (the tier keeps its copy: every pair stays readable); the step stays hybrid exactly while
    some pair is not in a slot, then runs as one graph; the tokens are those of every expert resident."""
    monkeypatch.setenv("STRATA_PCIE_SHARE", "0.5")
    ref = generate(_moe(packs, resident="all"), prompt_ids=PROMPT, n_tokens=12, ignore_eos=True)
    eng = _moe(packs, expert_cache="auto", resident="none", admit=True)
    moe = eng.decoder.moe
    assert eng.decoder.hybrid and moe.tier is not None and len(moe.tier) == moe.n_pairs
    seen = []
    settle = moe.settle

    def checked():
        settle()
        left = moe.n_pairs - len(eng.experts.cache)
        seen.append(left)
        assert eng.decoder.hybrid == (left > 0), (left, len(eng.experts.cache))

    moe.settle = checked
    r = generate(eng, prompt_ids=PROMPT, n_tokens=12, ignore_eos=True)
    assert r.output_ids == ref.output_ids
    assert seen[0] > seen[-1] and len(eng.experts.cache) > 0  # misses were admitted on the way


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_moe_route_chooses_as_a_stable_argsort():
    """moe_route's two-step choice (each warp's chunk first, then the candidates among themselves) picks exactly the
    experts a stable argsort of -p picks, in its order (ties: lower id first), with weights p[id] / sum in k order,
    bit for bit, on the kernel's own probabilities: expert counts around and past a chunk (32) and a CTA (1,024), k
    from 1 to past a chunk, random logits and logits with ties everywhere (3 distinct values, or all equal). The
    slots: the table's, except that of the c selected in the host tier those past the first keep[c] become -1 (a
    random split table each case), with a 0 address; the tier's addresses tagged (bit 0)."""
    import cupy as cp

    from strata.engine.gpu.fused_ops import CudaOps, MoeIO

    stream = cp.cuda.Stream(non_blocking=False)
    ops = CudaOps(stream)
    rng = np.random.default_rng(5)
    for n in (8, 31, 100, 128, 512, 1100):
        for k in sorted({1, 2, min(8, n), min(10, n), min(33, n)}):
            for kind in ("random", "ties", "equal"):
                x = {
                    "random": rng.standard_normal(n),
                    "ties": rng.integers(0, 3, n),
                    "equal": np.zeros(n),
                }[kind].astype(np.float32)
                slot_of = cp.asarray(rng.integers(-3, 5, 2 * n).astype(np.int32))
                ptrs = [cp.asarray(np.array([v], np.uint64)) for v in (1 << 20, 1 << 40)]
                keep = np.array([rng.integers(0, c + 1) for c in range(k + 1)], np.int32)  # any split table
                M = MoeIO(
                    il=1, logits=cp.asarray(x), n_expert=n, k=k, norm=True, slot_of=slot_of,
                    storage_ptr=ptrs[0], host_ptr=ptrs[1], keep=cp.asarray(keep),
                    slot_bytes=4096, offsets=(0, 1024, 2048), probs=cp.zeros(n, cp.float32),
                    weights=cp.zeros(k, cp.float32), bases=cp.zeros(3 * k, cp.uint64), info=cp.zeros(2 * k, cp.int32),
                )  # fmt: skip
                ops.moe_route(M)()
                stream.synchronize()
                p = M.probs.get()
                want = np.argsort(-p, kind="stable")[:k]
                info = M.info.get()
                assert info[:k].tolist() == want.tolist(), (n, k, kind)
                slots = slot_of.get()[n + want]
                tier = np.flatnonzero(slots <= -2)  # the split: the first keep[c] of the c in the tier stay there
                slots[tier[keep[tier.size] :]] = -1
                assert info[k:].tolist() == slots.tolist(), (n, k, kind, keep)
                b = M.bases.get().reshape(3, k)
                assert ((b == 0) == (slots == -1)[None, :]).all() and ((b & 1) == (slots <= -2)[None, :]).all()
                s = np.float32(0)
                for e in want:
                    s = np.float32(s + p[e])
                w = p[want] / np.maximum(s, np.float32(6.103515625e-5))
                assert M.weights.get().tobytes() == w.astype(np.float32).tobytes(), (n, k, kind)


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("ds,nk,nv", [(128, 16, 32), (32, 2, 4), (160, 2, 4), (256, 2, 6), (1024, 1, 2)])
def test_cuda_gdn_step_equals_the_numpy_delta_rule(ds, nk, nv):
    """gdn_step (16 warps a v head, rows in groups, columns over the lanes) against deltanet.delta_rule, the CPU
    path's arithmetic, over 6 positions from a new sequence: the state and the gated-normed output within float
    rounding (5e-5 of the largest |value|: the two add a row's products in different orders) at every position; the
    Qwen3-Next-80B-A3B head shape (128, 16 k heads, 32 v heads), the smallest head the kernel takes, one not a power
    of two (160), one wider than a lane's registers (256: the chunked two-pass form) and the widest it takes (1024); a
    second sequence (position 0 again) starts from zero."""
    import cupy as cp

    from strata.engine.deltanet import DeltaNetDims, delta_rule
    from strata.engine.gpu.fused_ops import CudaOps, GdnIO

    d = DeltaNetDims(
        d_conv=4, d_state=ds, n_group=nk, dt_rank=nv, eps=1e-6, key_dim=nk * ds, value_dim=nv * ds,
        conv_dim=2 * nk * ds + nv * ds,
    )  # fmt: skip
    rng = np.random.default_rng(ds + nv)
    stream = cp.cuda.Stream(non_blocking=False)
    ops = CudaOps(stream)
    f32 = np.float32
    dt_bias, ssm_a = rng.standard_normal(nv).astype(f32), -np.abs(rng.standard_normal(nv)).astype(f32)
    norm_w = (1 + 0.1 * rng.standard_normal(ds)).astype(f32)
    S_ref = np.zeros((nv, ds, ds), f32)
    dev = {k: cp.zeros(n, cp.float32) for k, n in (("h", d.conv_dim), ("z", d.value_dim), ("ba", 2 * nv))}
    params = cp.zeros(4, cp.int32)
    G = GdnIO(
        il=0, qkv=None, z=dev["z"], ba=dev["ba"], cs=None, S=cp.full((nv, ds, ds), 7.0, cp.float32), cw=None,
        dt_bias=cp.asarray(dt_bias), ssm_a=cp.asarray(ssm_a), norm_w=cp.asarray(norm_w), h=dev["h"],
        o=cp.zeros(d.value_dim, cp.float32), params=params, dims=d,
    )  # fmt: skip
    run = ops.gdn_step(G)
    for seq in range(2):
        S_ref[...] = 0
        for pos in range(6):
            h, z = rng.standard_normal(d.conv_dim).astype(f32), rng.standard_normal(d.value_dim).astype(f32)
            ba = rng.standard_normal(2 * nv).astype(f32)
            for k, v in (("h", h), ("z", z), ("ba", ba)):
                dev[k][...] = cp.asarray(v)
            params[0] = pos
            run()
            stream.synchronize()
            want = delta_rule(np, h, z, ba, S_ref, dt_bias, ssm_a, norm_w, d)
            got_o, got_S = G.o.get(), G.S.get()
            assert np.abs(got_o - want).max() <= 5e-5 * np.abs(want).max(), (seq, pos)
            assert np.abs(got_S - S_ref).max() <= 5e-5 * np.abs(S_ref).max(), (seq, pos)
