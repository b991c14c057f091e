"""Prompts in chunks (:meth:`strata.engine.decoder.Decoder.forward`, ``-ub``) against one position at a time.

The chunk's products, norms, ropes, cache writes, recurrences and routed experts are the one-position values bit for
bit; only the attention is computed differently (matrix products, :func:`strata.engine.layers.attend_rows`). So:
with the attention replaced by the one-position :func:`strata.engine.layers.attend` per query, a chunked prompt must
give the SAME bits - every logit, the KV cache, the recurrent state, the routing and the counts - for any chunk size;
with the real ``attend_rows`` the logits stay within float rounding (the fixtures' tolerances hold chunked:
tests/test_engine_reference.py ``test_synthetic_chunked_prompt_matches_llama_cpp``).
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from test_engine_reference import synthetic_pack

from strata.engine import deltanet as DN
from strata.engine import layers as L
from strata.engine.errors import GenerateError
from strata.engine.generate import decode, generate
from strata.engine.options import DEFAULT_UBATCH, EngineOptions
from strata.engine.routing import record_trace
from strata.engine.startup import load_engine

NAMES = ["gemma3", "qwen3next", "qwen3moe", "llama"]  # sliding window + ring; delta net + gate; MoE; norm rope


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return {n: synthetic_pack(tmp_path_factory, f"synthetic-{n}") for n in NAMES}


def per_position_delta(xp, H, Z, BA, S, dt_bias, ssm_a, norm_w, d, chunk=None, inverse=None):
    """delta_rule_rows computed as the one-position path does: the recurrence, position by position."""
    return xp.stack([DN.delta_rule(xp, H[t], Z[t], BA[t], S, dt_bias, ssm_a, norm_w, d) for t in range(H.shape[0])])


def per_query(xp, q, K, V, scale, pos0, lo, window, f16_operands=False):
    """attend_rows computed as the one-position path does: attend() per query on exactly the keys it sees."""
    out = []
    for t in range(q.shape[0]):
        p = pos0 + t
        a = lo if window is None else max(lo, p + 1 - window)
        out.append(L.attend(xp, q[t], K[a - lo : p - lo + 1], V[a - lo : p - lo + 1], scale, f16_operands))
    return xp.stack(out)


def run(eng, ids: list[int], ubatch: int, n_new: int = 3):
    """Greedy decode of ``ids`` + ``n_new`` tokens: (the logit rows of every emitting step, the step stats)."""
    rows = []

    def pick(row):
        rows.append(row.copy())
        return int(np.argmax(row))

    _, _, steps, *_ = decode(eng.model, eng.state, ids, n_new, pick, experts=eng.experts, ubatch=ubatch)
    return rows, steps


def snapshot(state) -> list[np.ndarray]:
    arrays = [*state.cache.k, *state.cache.v]
    if state.recurrent is not None:
        arrays.append(state.recurrent.arena)
    return [np.array(a, copy=True) for a in arrays]


def prompt(eng, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, eng.model.hp.n_vocab, n).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prompt_is_one_position_at_a_time_bit_for_bit(packs, name, monkeypatch):
    """With the attention taken per query and the delta rule position by position, chunks of 1, 2, 7 and 512
    positions give the same logits, caches and per-position expert counts bit for bit. The prompt (150 ids) runs past
    gemma3's 128-position window, so its ring is written across chunk boundaries and wraps inside a chunk."""
    monkeypatch.setattr(L, "attend_rows", per_query)
    monkeypatch.setattr(DN, "delta_rule_rows", per_position_delta)
    eng = load_engine(packs[name], n_ctx=256)
    ids = prompt(eng, 150)
    want_rows, want_steps = run(eng, ids, 1)
    want_state = snapshot(eng.state)
    assert all(s.chunk == 1 for s in want_steps)
    for ub in (2, 7, 512):
        rows, steps = run(eng, ids, ub)
        assert len(rows) == len(want_rows)
        for a, b in zip(rows, want_rows):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (name, ub)
        for a, b in zip(snapshot(eng.state), want_state):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (name, ub)
        assert [s.position for s in steps] == [s.position for s in want_steps]
        assert [(s.expert_hits, s.expert_misses, s.expert_layers) for s in steps] == [
            (s.expert_hits, s.expert_misses, s.expert_layers) for s in want_steps
        ]
        # positions 0..148 in chunks of ub (the last one partial), the last prompt position and the decode steps alone
        sizes = [min(ub, 149 - (p - p % ub)) for p in range(149)]
        assert [s.chunk for s in steps] == sizes + [1] * 3


# qwen3moe's router has near ties on random ids (a rounding difference may send a token to another expert: the
# fixture test bounds that with its router-gap rule)
@pytest.mark.parametrize("name", ["gemma3", "llama", "qwen3next"])
def test_chunked_logits_are_within_rounding_of_one_position(packs, name):
    """The real chunk attention (matrix products) and qwen3next's chunked delta rule: the same greedy tokens, and
    logits that differ (the chunk's forms are really taken) by at most 2e-2 of their scale (measured: 0.0103 on
    llama's 1.17; Q8 activation rounding amplifies the float rounding; the fixtures' tolerances for llama.cpp are
    0.015-0.05)."""
    eng = load_engine(packs[name], n_ctx=256)
    ids = prompt(eng, 150, seed=1)
    want, _ = run(eng, ids, 1)
    got, _ = run(eng, ids, 64)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, want)) > 0.0
    for a, b in zip(got, want):
        assert int(np.argmax(a)) == int(np.argmax(b))
        assert np.max(np.abs(a - b)) <= 2e-2 * max(1.0, float(np.max(np.abs(b))))


def test_chunk_logits_do_not_depend_on_residency(packs):
    eng = {r: load_engine(packs["qwen3moe"], n_ctx=256, resident=r) for r in ("all", "half", "none")}
    ids = prompt(eng["all"], 40)
    rows = {r: run(e, ids, 16) for r, e in eng.items()}
    for r in ("half", "none"):
        for a, b in zip(rows[r][0], rows["all"][0]):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), r
    hits = {r: sum(s.expert_hits for s in rows[r][1]) for r in rows}
    misses = {r: sum(s.expert_misses for s in rows[r][1]) for r in rows}
    assert misses["all"] == 0 and hits["none"] == 0 and hits["half"] > 0 and misses["half"] > 0
    assert {hits[r] + misses[r] for r in rows} == {hits["all"]}


def test_routing_trace_is_the_same_chunked(packs, monkeypatch):
    """The routing hook sees each position's selections as one position at a time does (replayed per position
    after the chunk): the recorded trace is identical."""
    monkeypatch.setattr(L, "attend_rows", per_query)
    prompts = [prompt(load_engine(packs["qwen3moe"], n_ctx=64), 20, seed=s) for s in (2, 3)]
    traces = []
    for ub in (1, 8):
        eng = load_engine(packs["qwen3moe"], n_ctx=64, ubatch=ub)
        traces.append(record_trace(eng, prompts, n_tokens=2))
    a, b = traces
    n_moe, k = len(eng.experts.source.layers), eng.model.hp.n_expert_used
    assert a.expert.size == 2 * (20 + 1) * n_moe * k  # seqs x positions x MoE layers x n_expert_used
    for f in ("seq", "position", "layer", "expert"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def test_attend_rows_is_attend_per_query_within_rounding():
    """GQA (8 query heads on 2 KV heads), earlier positions in the cache (pos0 > lo), a sliding window that cuts
    into the chunk, f16 operands: each row within 2e-6 relative of attend() on exactly its visible keys."""
    rng = np.random.default_rng(5)
    T, S0, hd = 9, 6, 16
    q = rng.standard_normal((T, 8, hd)).astype(np.float32)
    K = rng.standard_normal((S0 + T, 2, hd)).astype(np.float32)
    V = rng.standard_normal((S0 + T, 2, hd)).astype(np.float32)
    for window, f16 in ((None, False), (4, False), (4, True)):
        got = L.attend_rows(np, q, K, V, 0.25, 20, 20 - S0, window, f16)
        want = per_query(np, q, K, V, 0.25, 20, 20 - S0, window, f16)
        assert got.shape == (T, 8 * hd)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    # a query block split (ATTEND_BLOCK_ELEMS small): the same values within rounding (other matrix shapes)
    old = L.ATTEND_BLOCK_ELEMS
    try:
        L.ATTEND_BLOCK_ELEMS = 8 * (S0 + T) * 2  # two queries per block
        split = L.attend_rows(np, q, K, V, 0.25, 20, 20 - S0, None)
    finally:
        L.ATTEND_BLOCK_ELEMS = old
    np.testing.assert_allclose(split, L.attend_rows(np, q, K, V, 0.25, 20, 20 - S0, None), rtol=2e-6, atol=2e-6)


def test_generate_uses_the_options_ubatch_and_refuses_zero(packs):
    assert EngineOptions().ubatch == DEFAULT_UBATCH == 512
    for bad in (0, -1, 2.5, True, "4"):  # a count: not a float, a bool or a string (a helper met a TypeError)
        with pytest.raises(GenerateError, match=rf"--ubatch-size {bad!s}: must be >= 1 \(1 = one prompt position"):
            EngineOptions(ubatch=bad)
    eng = load_engine(packs["llama"], n_ctx=64, ubatch=4)
    r = generate(eng, prompt_ids=prompt(eng, 11), n_tokens=2)
    assert [s.chunk for s in r.steps] == [4] * 8 + [2] * 2 + [1, 1]
    from strata.engine.generate_cli import stats_line

    assert "ms (wall, 1/4 of a 4-position chunk)" in stats_line(r.steps[0]) and "chunk" not in stats_line(r.steps[-1])


def test_cli_ubatch_is_min_of_b_and_ub(packs, monkeypatch):
    from strata.engine import generate as G
    from strata.engine.cli import main

    seen = []
    real = G.decode

    def spy(*a, **kw):
        seen.append(kw["ubatch"])
        return real(*a, **kw)

    monkeypatch.setattr(G, "decode", spy)
    base = ["generate", str(packs["llama"]), "--prompt", "a b c d e f", "-n", "1", "--ctx", "32"]
    for extra, want in (([], 512), (["-ub", "2"], 2), (["-b", "3", "-ub", "8"], 3)):
        r = CliRunner().invoke(main, base + extra)
        assert r.exit_code == 0, r.output
        assert seen[-1] == want
    r = CliRunner().invoke(main, [*base, "-ub", "0"])
    assert r.exit_code == 2 and "-ub" in r.output


def test_profile_takes_ub(packs, tmp_path, monkeypatch):
    """strata-engine profile routes the prompt in chunks too (-ub, default 512) and takes -ub 1 (one position at a
    time, the GPU's routing): the loop gets that chunk size, and both write a profile of the same total (positions x
    MoE layers x experts used)."""
    from strata.budget.profile import read_profile
    from strata.engine import generate as G
    from strata.engine.cli import main

    seen = []
    real = G.decode

    def spy(*a, **kw):
        seen.append(kw["ubatch"])
        return real(*a, **kw)

    monkeypatch.setattr(G, "decode", spy)
    (tmp_path / "p.txt").write_text("one two three four five six\nseven eight nine\n", encoding="utf-8")
    totals = []
    for ub in ("512", "1"):
        out = tmp_path / f"prof{ub}.parquet"
        r = CliRunner().invoke(
            main, ["profile", str(packs["qwen3moe"]), "--prompts", str(tmp_path / "p.txt"), "-o", str(out), "-ub", ub]
        )
        assert r.exit_code == 0, r.output
        totals.append(sum(c for _, _, c in read_profile(str(out))))
        assert set(seen) == {int(ub)}  # every prompt routed with the -ub given
        seen.clear()
    assert totals[0] == totals[1] > 0
    r = CliRunner().invoke(main, ["profile", str(packs["qwen3moe"]), "--prompts", str(tmp_path / "p.txt"), "-ub", "0"])
    assert r.exit_code == 2 and "-ub" in r.output


def test_attend_rows_blocks_and_threads_change_no_bit():
    """On the CPU a chunk's attention goes in blocks of ``ATTEND_CPU_ROWS`` queries shared by the threads
    (strata.engine.rowpar), each block reading only the keys its queries may see: 1 thread or 3 give the same bits,
    and every row stays within rounding of attend() on its visible keys - 150 queries (3 blocks), earlier positions
    in the cache, with and without a window that starts inside the chunk."""
    from strata.engine import rowpar

    rng = np.random.default_rng(8)
    T, S0, hd = 150, 20, 16
    q = rng.standard_normal((T, 4, hd)).astype(np.float32)
    K = rng.standard_normal((S0 + T, 2, hd)).astype(np.float32)
    V = rng.standard_normal((S0 + T, 2, hd)).astype(np.float32)
    assert T > 2 * L.ATTEND_CPU_ROWS
    for window in (None, 40):
        with rowpar.row_threads(1):
            one = L.attend_rows(np, q, K, V, 0.25, 100, 100 - S0, window)
        with rowpar.row_threads(3):
            three = L.attend_rows(np, q, K, V, 0.25, 100, 100 - S0, window)
        assert np.array_equal(one.view(np.uint32), three.view(np.uint32)), window
        want = per_query(np, q, K, V, 0.25, 100, 100 - S0, window)
        np.testing.assert_allclose(one, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_chunk_logits_do_not_depend_on_the_threads(packs, name):
    """The C kernels and the NumPy rows between them (attention blocks, the FFN activation: gelu for gemma3, silu for
    llama) split over 1 or 3 threads: every logit of a chunked prompt the same bits."""
    rows = {}
    for t in (1, 3):
        eng = load_engine(packs[name], n_ctx=256, threads=t)
        rows[t], _ = run(eng, prompt(eng, 150, seed=4), 64)
    for a, b in zip(rows[1], rows[3]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_rowpar_ranges_and_errors():
    """rowpar.ranges: near-equal contiguous parts, none under min_rows; run: every task once, on the threads set by
    row_threads (1 outside it), a task's exception raised to the caller."""
    from strata.engine import rowpar

    assert rowpar.threads() == 1
    assert rowpar.ranges(100, parts=3) == [(0, 34), (34, 68), (68, 100)]
    assert rowpar.ranges(20, parts=4) == [(0, 20)]  # 16 rows at least per part
    assert rowpar.ranges(0, parts=2) == [(0, 0)]
    seen = []
    with rowpar.row_threads(2):
        assert rowpar.threads() == 2
        rowpar.run([(0, 3), (3, 5), (5, 9)], lambda a, b: seen.append((a, b)))

        def boom(a, b):
            raise ValueError(f"rows {a}..{b}")

        with pytest.raises(ValueError, match="rows 3..5"):
            rowpar.run([(0, 3), (3, 5)], lambda a, b: boom(a, b) if a == 3 else None)
    assert sorted(seen) == [(0, 3), (3, 5), (5, 9)] and rowpar.threads() == 1


def test_rowpar_count_is_per_thread_and_honoured():
    """The count belongs to the thread that set it (another thread still sees 1, and its own setting does not leak);
    at most that many tasks run at once even after a larger count was used; a run() inside a task runs inline."""
    import threading
    import time

    from strata.engine import rowpar

    def peak(n: int) -> int:
        live, top, lock = [0], [0], threading.Lock()

        def task(a, b):
            with lock:
                live[0] += 1
                top[0] = max(top[0], live[0])
            time.sleep(0.01)
            with lock:
                live[0] -= 1

        with rowpar.row_threads(n):
            rowpar.run([(i, i + 1) for i in range(12)], task)
        return top[0]

    assert peak(6) <= 6
    assert peak(2) == 2  # the 6-worker pool exists now; a count of 2 still runs 2 at a time
    other = []
    with rowpar.row_threads(4):
        t = threading.Thread(target=lambda: other.append(rowpar.threads()))
        t.start()
        t.join()
        inner = []
        rowpar.run([(0, 1), (1, 2)], lambda a, b: inner.append(rowpar.threads()))
    assert other == [1] and inner == [1, 1] and rowpar.threads() == 1


def test_long_context_decode_takes_matrix_products_within_rounding(packs, monkeypatch):
    """From ``ATTEND_MM_MIN_KEYS`` keys on, one position's attention on the CPU is attend_rows of one query (BLAS)
    instead of attend()'s elementwise sums: taken exactly at the positions that see that many keys, in every layer,
    and the decode's logits stay within rounding of the elementwise form (the same greedy tokens)."""
    import strata.engine.decoder as D

    orig, calls = L.attend_rows, []

    def counted(*a, **k):
        calls.append(a[1].shape[0])
        return orig(*a, **k)

    monkeypatch.setattr(L, "attend_rows", counted)
    rows = {}
    for name, keys in (("mm", 40), ("elementwise", 10**9)):
        monkeypatch.setattr(L, "ATTEND_MM_MIN_KEYS", keys)
        monkeypatch.setattr(D, "ATTEND_MM_MIN_KEYS", keys)
        calls.clear()
        eng = load_engine(packs["llama"], n_ctx=128)
        rows[name], _ = run(eng, prompt(eng, 60, seed=6), 1, n_new=4)
        # positions 0..62 run (60 prompt ids + 3 fed back); those at 39 and later see >= 40 keys
        want = (63 - 39) * eng.model.hp.n_layer if name == "mm" else 0
        assert len(calls) == want and set(calls) <= {1}, (name, len(calls))
    for a, b in zip(rows["mm"], rows["elementwise"]):
        assert int(np.argmax(a)) == int(np.argmax(b))
        assert np.max(np.abs(a - b)) <= 2e-2 * max(1.0, float(np.max(np.abs(b))))


def test_chunk_routing_sorts_once_exactly():
    """ChunkRouting (engine/chunk_routing.py): the pairs sorted by expert (stable: rows ascending within an expert), the
    experts used, each one's first position and count, and the first pair of each - exact arrays."""
    from strata.engine.chunk_routing import ChunkRouting

    r = ChunkRouting.of([[5, 2], [2, 7], [5, 0]])
    assert r.k == 2 and r.ids.tolist() == [[5, 2], [2, 7], [5, 0]]
    assert r.perm.tolist() == [5, 1, 2, 0, 4, 3]  # pairs of experts 0, 2, 2, 5, 5, 7
    assert r.used.tolist() == [0, 2, 5, 7] and r.counts.tolist() == [1, 2, 2, 1] and r.starts.tolist() == [0, 1, 3, 5]
    assert r.first.tolist() == [5, 1, 0, 3]  # expert 2 first at pair 1 (row 0), expert 5 at pair 0
    assert ChunkRouting.of(np.array([[3]])).used.tolist() == [3]
