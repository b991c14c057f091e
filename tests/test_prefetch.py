"""The fused step's expert prefetch (strata.engine.gpu.prefetch, cuda/prefetch.cu): the next layer's predicted
host-tier experts copied into staging slots on a side stream, read by ``moe_route`` when they are selected.

What must hold: the tokens and logits do not depend on it (bit for bit against the same run without it and against
every expert resident); it plans what its rule says (the K best predicted experts, those in the host tier, most
probable first, at most PREFETCH_SLOTS); the staged bytes are the tier's; it runs only where the step is one graph
that reads misses from the host tier; its bytes are the budget's term. On the sim in CI, and on CUDA (gpu-marked).
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine.gpu import kernels as K
from strata.engine.gpu.backend import SimBackend
from strata.engine.layers import to_host
from strata.engine.startup import load_engine
from strata.layout import step as LS

GPU_OK, GPU_WHY = K.gpu_available()
skip_no_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs CuPy and a CUDA GPU: {GPU_WHY}")


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    from strata import testing as synth
    from strata.packer.build import build_pack

    d = tmp_path_factory.mktemp("prefetch_packs")
    out = {}
    for name, spec in (("moe", synth.qwen3moe_spec()), ("q3n", synth.qwen3next_spec())):
        paths = synth.write_model(d / f"{name}.gguf", spec)
        build_pack(paths[0], d / f"{name}-pack", progress=False)
        out[name] = str(d / f"{name}-pack")
    return out


IDS = [int(i) for i in np.random.default_rng(3).integers(1, 200, 20)]


def _run(pack, sim: bool, **kw):
    """(engine, logits per position) of IDS fed one position at a time."""
    extra = {"backend": SimBackend()} if sim else {}
    eng = load_engine(pack, device="cuda", ubatch=1, n_ctx=48, **extra, **kw)
    out = []
    for p, t in enumerate(IDS):
        out.append(np.array(to_host(eng.model.step(t, p, eng.state, logits=True)), dtype=np.float32, copy=True))
    return eng, out


def _prefetch_changes_no_bit(pack, sim: bool, monkeypatch) -> tuple[int, int]:
    """Half the experts resident, the rest in the host tier: logits with the prefetch = without it = every expert
    resident, bit for bit at every position, the same hits and misses; the PCIe bytes differ by exactly the staged
    copies (each a blob span) less the misses they served (each its parts, counted with the misses); returns the
    prefetch's (staged, read) counts."""
    eng, got = _run(pack, sim, resident="half", miss_tier="pcie")
    pf = eng.decoder.moe.prefetch
    assert pf.active and not eng.decoder.hybrid
    assert "predicted misses copied ahead" in eng.gpu.decode_path
    counts = pf.counts()
    c = eng.experts.counts
    assert (c.prefetched, c.prefetch_read) == counts
    monkeypatch.setenv("STRATA_PREFETCH", "0")
    off, plain = _run(pack, sim, resident="half", miss_tier="pcie")
    assert not off.decoder.moe.prefetch.active and off.decoder.moe.prefetch.counts() == (0, 0)
    o = off.experts.counts
    assert (o.hits, o.misses, o.pcie, o.prefetched) == (c.hits, c.misses, c.pcie, 0)
    built = sorted(pf.built)
    assert all(pf.span[j] >= pf.blob[j] > 0 and pf.span[j] % 16 == 0 for j in built)
    assert len({int(pf.blob[j]) for j in built}) > 1  # the preset's types vary by layer: bytes per layer
    assert c.pcie_bytes - o.pcie_bytes == int((pf.totals[:, 0] * pf.span - pf.totals[:, 1] * pf.blob).sum())
    monkeypatch.delenv("STRATA_PREFETCH")
    full_eng, full = _run(pack, sim)
    assert not full_eng.decoder.moe.prefetch.active  # every pair in a slot: nothing to prefetch
    for pos, (a, b, c) in enumerate(zip(got, plain, full)):
        assert a.tobytes() == b.tobytes() == c.tobytes(), f"position {pos}"
    return counts


@pytest.mark.parametrize("name", ["moe", "q3n"])
def test_sim_prefetch_changes_no_bit_and_is_used(packs, name, monkeypatch):
    staged, read = _prefetch_changes_no_bit(packs[name], True, monkeypatch)
    # the test means something: experts were staged and read from their staging slots (the counts differ by model)
    assert staged > 0 and 0 < read <= staged, (staged, read)


@pytest.mark.parametrize("how", ["cpu tier", "split"])
def test_sim_prefetch_is_off_in_the_hybrid_step(packs, how, monkeypatch):
    """Misses on the CPU (hybrid): ``--miss-tier cpu`` (no host tier), or a host tier whose misses are split with
    the CPU (``STRATA_PCIE_SHARE``): the prefetch is off, nothing is staged (the tags stay -1), no count."""
    if how == "split":
        monkeypatch.setenv("STRATA_PCIE_SHARE", "0.5")
        eng, _ = _run(packs["moe"], True, expert_cache=0, miss_tier="pcie")
        assert eng.decoder.moe.tier is not None and len(eng.decoder.moe.tier) > 0
    else:
        eng, _ = _run(packs["moe"], True, resident="half", miss_tier="cpu")
    pf = eng.decoder.moe.prefetch
    assert eng.decoder.hybrid and not pf.active and pf.built  # built (its graphs exist), not run
    assert pf.counts() == (0, 0) and (pf.staged == -1).all() and eng.experts.counts.prefetched == 0


def test_sim_prefetch_plans_by_its_rule_and_copies_the_tier_bytes(packs):
    """Run one step launch by launch; after each layer's plan: ``xn2`` is the residual normed with that layer's
    ffn_norm, the predicted logits are its router on it, the staged tags are the K best (stable order) that sit in
    the host tier, first PREFETCH_SLOTS; after its copy the staging slots hold the tier's bytes of those pairs."""
    from strata.engine.layers import rms_norm
    from strata.manifests.names import tensor_name

    eng, _ = _run(packs["moe"], True, resident="half", miss_tier="pcie")
    dec, m = eng.decoder, eng.decoder.moe
    pf, Kx, E = m.prefetch, m.K, m.E
    dec.params_host[0] = 3
    dec.model.w.host_row("token_embd.weight", 7, dec.row_host)
    plans = 0
    for L in dec.launches(True):
        L.run()
        if L.name.startswith("prefetch plan L"):
            j = int(L.name.rsplit("L", 1)[1])
            w = dec.model.w
            want_x = rms_norm(np, dec.x, w.get(tensor_name(dec.model.blocks[j].ffn_norm, j)), dec.model.hp.rms_eps)
            assert np.array_equal(pf.xn2, want_x)
            assert np.array_equal(pf.logits, w.matmul(tensor_name("ffn_gate_inp.weight", j), pf.xn2))
            best = np.lexsort((np.arange(E), -pf.logits))[:Kx]
            tier = [int(e) for e in best if m.slot_of[j * E + e] <= -2][: LS.PREFETCH_SLOTS]
            st = pf.stage_of(j)
            want = [j * E + e for e in tier] + [-1] * (LS.PREFETCH_SLOTS - len(tier))
            assert st.staged.tolist() == want
            plans += 1
        if L.name.startswith("prefetch copy L"):
            st = pf.stage_of(int(L.name.rsplit("L", 1)[1]))
            for p, tag in enumerate(st.staged.tolist()):
                if tag < 0:
                    continue
                il, e = divmod(tag, E)
                h = m.tier.where[(il, e)]
                nb = m.offsets[il][2] + m.part_bytes[il][2]
                o = st.base - (1 << 47) + p * m.slot_bytes
                got = pf.storage[o : o + nb]
                assert np.array_equal(got, m.tier.storage[h * m.slot_bytes : h * m.slot_bytes + nb]), (il, e)
    assert plans == len(m.layers) - 1  # every MoE layer but the first


def test_prefetch_bytes_are_the_budgets_term(packs):
    """The prefetch's device bytes by hand on the 30B-A3B figures, and the buffers the engine allocates for it sum
    to the layout's count (the budget's term: tests/test_startup_reserve.py compares the whole step)."""
    P, S = LS.PREFETCH_SLOTS, LS.PREFETCH_SETS
    assert (P, S) == (2, 1)
    slot = 3_059_712  # Q4_K gate/up + Q6_K down of 2048 x 768, parts 256-aligned
    assert LS.prefetch_bytes(2048, 128, slot, 48) == 4 * (2048 + 128) + 2 * 12 + 8 * 48 + 2 * slot == 6_128_536
    eng, _ = _run(packs["moe"], True, resident="half", miss_tier="pcie")
    m, pf = eng.decoder.moe, eng.decoder.moe.prefetch
    # what it allocated, array by array, is the layout's count (Prefetch.nbytes is that count: not compared here)
    held = sum(int(a.nbytes) for a in (pf.xn2, pf.logits, pf.staged, pf.src, pf.counters, pf.storage))
    assert held == LS.prefetch_bytes(m.n_embd, m.E, m.slot_bytes, eng.model.hp.n_layer) > S * P * m.slot_bytes
    assert pf.storage.nbytes == S * P * m.slot_bytes and pf.counters.size == 2 * eng.model.hp.n_layer


@pytest.mark.gpu
@skip_no_gpu
@pytest.mark.parametrize("name", ["moe", "q3n"])
def test_cuda_prefetch_changes_no_bit_and_is_used(packs, name, monkeypatch):
    staged, read = _prefetch_changes_no_bit(packs[name], False, monkeypatch)
    print(f"\n[prefetch {name}] staged {staged}, read {read}")
    assert staged > 0 and 0 < read <= staged, (staged, read)


def test_sim_prefetch_with_stage_timers(packs):
    """Eager with stage timers (``--no-graph --stage-times``) and the prefetch on: its launches are a stage of their
    own a layer, timed; the decoder's timers were sized for that list before the cache was bound."""
    eng, _ = _run(packs["moe"], True, resident="half", miss_tier="pcie", graph=False, stage_times=True)
    dec = eng.decoder
    assert dec.moe.prefetch.active and dec.stage_times.steps > 0
    assert "L1 prefetch" in dec.stage_times.ms and dec._most_stages() == len(dec.stages(True))


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_prefetch_eager_with_stage_timers(packs):
    """The same on CUDA, where each stage takes an event (the first version sized them before the prefetch's
    stages were in the list: an IndexError at the first step, session 18's review); the logits equal the graph's."""
    eng, eager = _run(packs["moe"], False, resident="half", miss_tier="pcie", graph=False, stage_times=True)
    assert eng.decoder.moe.prefetch.active and eng.decoder.stage_times.ms["L1 prefetch"] >= 0
    _g, graph = _run(packs["moe"], False, resident="half", miss_tier="pcie")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(eager, graph))


@pytest.mark.gpu
@skip_no_gpu
def test_cuda_moe_stage_and_copy_follow_the_rule():
    """``moe_stage`` against the rule in NumPy (random logits, ties, NaN; random slot tables; k 1..10; n_expert
    past a CTA), and ``moe_stage_copy`` copying exactly the staged entries' bytes from mapped pinned memory."""
    import cupy as cp

    from strata.engine.gpu.fused_ops import CudaOps
    from strata.engine.gpu.prefetch import StageSet

    stream = cp.cuda.Stream(non_blocking=True)
    ops = CudaOps(stream)
    rng = np.random.default_rng(11)
    # through the copy's unrolled loop (4 x 64 CTAs x 256 threads x 16 B = 1 MiB a round) and its remainder loop
    slot_bytes, P = 1_200_128, LS.PREFETCH_SLOTS
    copy_bytes = slot_bytes - 16 * 5
    mem = cp.cuda.alloc_pinned_memory(64 * slot_bytes)
    host = np.frombuffer(mem, np.uint8, 64 * slot_bytes)
    host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)
    host_ptr = cp.asarray(np.array([mem.ptr], np.uint64))
    for n in (8, 128, 512, 1100):
        for k in sorted({1, 2, min(8, n), min(10, n)}):
            for kind in ("random", "ties", "nan"):
                x = rng.standard_normal(n).astype(np.float32)
                if kind == "ties":
                    x = rng.integers(0, 3, n).astype(np.float32)
                if kind == "nan":
                    x[rng.integers(0, n, 3)] = np.nan
                layer = 1
                table = rng.integers(-40, 5, 2 * n).astype(np.int32)  # <= -2: host slots 0..38
                dst = cp.zeros(P * slot_bytes, cp.uint8)
                st = StageSet(
                    P, cp.full(P, -7, cp.int32), cp.zeros(P, cp.uint64), cp.full(4, 9, cp.int32), int(dst.data.ptr)
                )
                ops.moe_stage(cp.asarray(x), n, k, cp.asarray(table), layer, host_ptr, slot_bytes, st)()
                ops.moe_stage_copy(st, slot_bytes, copy_bytes)()
                stream.synchronize()
                v = np.where(np.isnan(x), -np.inf, x)
                best = np.lexsort((np.arange(n), -v))[:k]
                tier = [int(e) for e in best if table[n + e] <= -2][:P]
                want = [n + e for e in tier] + [-1] * (P - len(tier))
                assert st.staged.get().tolist() == want, (n, k, kind)
                assert st.counts.get().tolist() == [9, 9, len(tier), 0]  # layer 1's pair: staged, read = 0
                got = dst.get()
                for p, e in enumerate(tier):
                    h = -2 - int(table[n + e])
                    assert int(st.src.get()[p]) == mem.ptr + h * slot_bytes
                    a = got[p * slot_bytes : (p + 1) * slot_bytes]
                    assert np.array_equal(a[:copy_bytes], host[h * slot_bytes :][:copy_bytes]), (n, k, kind, p)
                    assert not a[copy_bytes:].any()  # nothing past the span
                for p in range(len(tier), P):
                    assert not got[p * slot_bytes : (p + 1) * slot_bytes].any() and int(st.src.get()[p]) == 0


def test_experts_too_large_to_stage_get_no_prefetch(packs, monkeypatch):
    """Where the staging slots would take more than PREFETCH_MAX_BYTES (Mixtral-size experts: 2 x 114 MB), the model
    gets none: no buffer, no launch, no graph - and the budget says the same (its bytes, its allocations, its graph
    count, its detail), against the same engine; the tokens are those of every expert resident."""
    from strata.budget import engine_terms as ET
    from strata.budget import formulas_gpu as FG
    from strata.budget.audit import audit_pack

    facts = audit_pack(packs["moe"], bf16_scan=False).facts
    act_on, detail_on, _ = ET.activation_term(facts, 48)
    assert "staging slots" in detail_on and LS.prefetch_entries(facts.max_slot_bytes) == 2
    monkeypatch.setattr(LS, "PREFETCH_MAX_BYTES", 2 * facts.max_slot_bytes - 1)
    assert LS.prefetch_entries(facts.max_slot_bytes) == 0
    eng, got = _run(packs["moe"], True, resident="half", miss_tier="pcie")
    pf = eng.decoder.moe.prefetch
    assert pf.entries == 0 and not pf.built and not pf.active and pf.storage.nbytes == 0
    assert not [x for x in eng.decoder.launches(True, hybrid=False) if x.kind in ("side", "edge", "side-memcpy")]
    act, detail, exact = ET.activation_term(facts, 48)
    assert exact and act == eng.gpu.fused_buffer_bytes == act_on - 2 * facts.max_slot_bytes - 2 * 12
    assert "staging" not in detail and 0 in ET.allocations(facts, 48, "f16")
    L = len(facts.trunk_experts)
    assert FG.fused_graph_count(L, False) == FG.fused_graph_count(L, True) - 2
    _e, full = _run(packs["moe"], True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, full))


@pytest.mark.parametrize("value,off", [("0", True), ("off", True), ("False", True), (" no ", True), ("", False),
                                       ("1", False), ("on", False), ("YES", False)])  # fmt: skip
def test_strata_prefetch_values(value, off, monkeypatch):
    from strata.engine.gpu.prefetch import asked_off

    monkeypatch.setenv("STRATA_PREFETCH", value)
    assert asked_off() is off


def test_strata_prefetch_typo_is_refused_at_load(packs, monkeypatch):
    """A value that is neither on nor off is refused by name at start-up, not taken as on."""
    from strata.engine.errors import ExpertCacheError

    monkeypatch.setenv("STRATA_PREFETCH", "of")
    with pytest.raises(ExpertCacheError, match=r"STRATA_PREFETCH='of': expected 0, off, false or no"):
        _run(packs["moe"], True, resident="half", miss_tier="pcie")
