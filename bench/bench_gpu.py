"""GPU benchmark (not a test): kernel bandwidth per ggml type, and decode speed when packs are given.

Part 1 (always): the memory ceiling - a large device-to-device copy, counting bytes read plus
bytes written - then, per type with a kernel, the matrix-vector product ``y = W x`` on a weight
of ~``--mib`` MiB in engine form (several times the H200's 50-60 MB L2, so it measures HBM, not
cache): median time of ``--reps`` launches timed with CUDA events, effective GB/s
(engine-form bytes read / time) and that as a share of the copy ceiling. Also the dequantize
kernel (bytes read + f32 bytes written).

Part 2 (``--pack DIR``, repeatable, and/or ``--synth DIR`` to build synthetic packs there, among
them a Gemma-3-270M-shaped one): decode tokens/s through the GPU engine (batch 1, greedy) on each
decode path - ``generic`` (the shared layers on CuPy arrays), ``eager`` (the fused dense step
launched kernel by kernel, ``--no-graph``) and ``graph`` (the fused step replayed as a CUDA graph) -
with launches per token, the pure-GPU replay (graph launches back to back with no host work, timed
with CUDA events), the bandwidth floor (engine-form bytes one token reads / measured copy
bandwidth), token equality between the paths (and with the CPU path, ``--cpu``), eager vs graph
top-5 logits bit for bit, and the pool growth during decode (0 = the token loop allocated no new
device memory). ``--stage-times`` (per-stage device times of the eager step) needs ``--no-graph``:
with the graph on it refuses to run (exit 2), because events recorded between the launches of a
captured graph record nothing.

Prints a table last; with ``--json PATH`` (default ``$OUT/bench_gpu.json`` when $OUT is set)
writes every number.

    python bench/bench_gpu.py [--mib 512] [--reps 30] [--types Q4_K,IQ2_XXS] [--pack DIR ...] [--synth DIR]
                              [--cpu] [--no-graph [--stage-times]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _events_median_ms(fn, reps: int, warmup: int = 3) -> float:
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> dict:
    """Device-to-device copy of ``nbytes``: GB/s counting read + write (METHOD.md)."""
    import cupy as cp

    src = cp.empty(nbytes, dtype=cp.uint8)
    src[:] = 1
    dst = cp.empty_like(src)
    ms = _events_median_ms(lambda dst=dst, src=src: dst.__setitem__(slice(None), src), reps)
    del src, dst
    return {"bytes": nbytes, "ms": ms, "gbps_rw": 2 * nbytes / ms / 1e6}


def _random_engine_weight(type_id: int, rows: int, ne0: int):
    """A weight in engine form made on the device: random payload bytes, sane scales (timing only)."""
    import cupy as cp

    from strata.engine.engine_form import engine_layout
    from strata.packer import quants

    t = quants.qtype(type_id)
    pool, src = (quants.F32.id, quants.BF16.id) if t.name == "BF16" else (type_id, type_id)
    lay = engine_layout(pool, src, (ne0, rows))
    buf = cp.random.randint(0, 256, size=lay.nbytes, dtype=cp.int32).astype(cp.uint8)
    if t.name in ("F32", "F16", "BF16"):
        n = rows * ne0
        vals = cp.random.standard_normal(n, dtype=cp.float32) * 0.02
        if t.name == "F32":
            buf = vals.view(cp.uint8)
        elif t.name == "F16":
            buf = vals.astype(cp.float16).view(cp.uint8)
        else:
            buf = (vals.view(cp.uint32) >> 16).astype(cp.uint16).view(cp.uint8)
        return buf, lay
    if lay.kind == "widened":
        buf[: lay.scales_nbytes].view(cp.float32)[:] = 0.01
    else:
        blocks = buf.reshape(lay.n_blocks, t.block_bytes)
        h = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
        for o in t.fp16_scale_offsets:
            blocks[:, o] = int(h[0])
            blocks[:, o + 1] = int(h[1])
    return buf, lay


def bench_kernels(types: list[int], mib: int, reps: int, copy: dict) -> list[dict]:
    import cupy as cp

    from strata.engine.gpu import kernels as K
    from strata.packer import quants

    rows_out = []
    for tid in types:
        t = quants.qtype(tid)
        ne0 = 4096
        pool = quants.F32.id if t.name == "BF16" else tid
        src = quants.BF16.id if t.name == "BF16" else tid
        row_bytes = quants.engine_nbytes(pool, src, (ne0, 1))
        rows = max(4, (mib << 20) // row_bytes)
        buf, lay = _random_engine_weight(tid, rows, ne0)
        x = cp.random.standard_normal(ne0, dtype=cp.float32)
        y = cp.empty(rows, dtype=cp.float32)
        t0 = time.perf_counter()
        K.kernels_for(tid)
        compile_s = time.perf_counter() - t0
        ms = _events_median_ms(
            lambda tid=tid, buf=buf, rows=rows, ne0=ne0, x=x, y=y: K.matvec(tid, buf, rows, ne0, x, out=y), reps
        )
        n = rows * ne0
        out = cp.empty(n, dtype=cp.float32)
        dq_ms = _events_median_ms(
            lambda tid=tid, buf=buf, n=n, out=out: K.dequantize(tid, buf.reshape(-1), n, out=out), max(5, reps // 3)
        )
        gbps = lay.nbytes / ms / 1e6
        r = {
            "type": t.name,
            "rows": rows,
            "ne0": ne0,
            "engine_bytes": lay.nbytes,
            "matvec_ms": ms,
            "matvec_gbps": gbps,
            "matvec_pct_of_copy": 100 * gbps / copy["gbps_rw"],
            "dequant_ms": dq_ms,
            "dequant_gbps_rw": (lay.nbytes + 4 * n) / dq_ms / 1e6,
            "compile_s": compile_s,
        }
        rows_out.append(r)
        print(
            f"  {t.name:8s} W[{rows}x{ne0}] {lay.nbytes / 2**20:7.1f} MiB  matvec {ms:7.3f} ms {gbps:7.0f} GB/s "
            f"({r['matvec_pct_of_copy']:4.0f}% of copy)  dequant {dq_ms:7.3f} ms",
            flush=True,
        )
        del buf, out, x, y
        cp.get_default_memory_pool().free_all_blocks()
    return rows_out


def gemma_like_spec(n_vocab: int = 262144):
    """A synthetic gemma3 with Gemma 3 270M's geometry and tensor types (18 layers, n_embd 640, 4 query
    heads / 1 KV head of 256, n_ff 2048, window 512 every 6th layer global, Q5_0 / Q8_0 / Q4_K / Q6_K,
    Q8_0 tied head of ``n_vocab`` rows): the real model's launch count and bytes per token, made on
    the device machine, which cannot fetch the real file. Weights are tiled random blocks."""
    from strata import testing as synth

    return synth.gemma3_spec(
        n_layers=18,
        fill="pattern",
        dense_type="Q5_0",
        tensor_types={"token_embd": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_down": "Q6_K"},
        dims={
            "n_embd": 640,
            "n_head": 4,
            "n_head_kv": 1,
            "head_dim": 256,
            "n_ff": 2048,
            "n_vocab": n_vocab,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
        },
    )


def synth_packs(root: str, big_mib: int, gemma_like_vocab: int = 0) -> list[tuple[str, str]]:
    """Synthetic packs made on the spot (strata.testing presets, a big dense qwen2 of ~big_mib MiB, and
    with ``gemma_like_vocab`` the Gemma-3-270M-shaped pack of :func:`gemma_like_spec`): the device
    machine cannot fetch the real models."""
    from strata import testing as synth
    from strata.packer.build import build_pack

    specs = [
        ("synth qwen3moe (3 layers, 8 experts)", "moe", synth.qwen3moe_spec()),
        ("synth qwen2 (2 layers)", "qwen2", synth.qwen2_spec()),
        ("synth gemma3 (2 layers, BF16)", "gemma3", synth.gemma3_spec()),
    ]
    if gemma_like_vocab:
        specs.append(
            (
                f"synth gemma3 270M-like (18 layers, vocab {gemma_like_vocab})",
                "gemma-like",
                gemma_like_spec(gemma_like_vocab),
            )
        )
    if big_mib:
        specs.append((f"synth big dense qwen2 (~{big_mib} MiB Q8_0)", "big", synth.big_dense_spec(big_mib << 20)))
    out = []
    for label, name, spec in specs:
        paths = synth.write_model(os.path.join(root, f"{name}.gguf"), spec)
        pk = os.path.join(root, f"{name}-pack")
        build_pack(paths[0], pk, progress=False, force=True)
        out.append((label, pk))
    return out


def generic_launch_count(eng) -> tuple[int | None, str]:
    """Kernel launches + copies of ONE step of the generic per-layer path, counted exactly as the nodes
    of a CUDA graph captured around it (cuda-python stream capture, relaxed mode, the host-side
    embedding row replaced by a device row made before the capture). Returns ``(count, how)``, or
    ``(None, the error)`` where the capture fails."""
    import cupy as cp

    try:
        from cuda.bindings import runtime as rt
    except ImportError as e:
        return None, f"cuda-python missing ({e})"
    model, st = eng.model, eng.state
    w = model.w
    row = cp.asarray(w.rows("token_embd.weight", [1]))
    w.rows = lambda name, ids: row  # instance attribute shadows the method during the capture
    s = cp.cuda.Stream(non_blocking=True)
    graph = None
    try:
        with s:
            (err,) = rt.cudaStreamBeginCapture(s.ptr, rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
            if err != rt.cudaError_t.cudaSuccess:
                return None, f"cudaStreamBeginCapture: {err}"
            try:
                model.step(1, 5, st, logits=True)
            finally:
                err, graph = rt.cudaStreamEndCapture(s.ptr)
            if err != rt.cudaError_t.cudaSuccess:
                return None, f"cudaStreamEndCapture: {err}"
        err, _nodes, n = rt.cudaGraphGetNodes(graph, 0)
        if err != rt.cudaError_t.cudaSuccess:
            return None, f"cudaGraphGetNodes: {err}"
        return int(n), "nodes of one step captured as a CUDA graph (kernels + copies + memsets)"
    except Exception as e:  # report why; the benchmark goes on
        return None, f"capture failed: {type(e).__name__}: {e}"
    finally:
        del w.rows
        if graph is not None:
            try:
                rt.cudaGraphDestroy(graph)
            except Exception:
                pass
        s.synchronize()


def _tops_equal(a, b) -> bool:
    return len(a.top) == len(b.top) and all(
        x[0] == y[0] and np.float32(x[1]).tobytes() == np.float32(y[1]).tobytes()
        for ra, rb in zip(a.top, b.top)
        for x, y in zip(ra, rb)
    )


def bench_decode(
    packs: list[tuple[str, str]],
    n_tokens: int,
    copy: dict,
    *,
    modes=("generic", "eager", "graph"),
    stage_times: bool = False,
    cpu: bool = False,
    replay: int = 200,
) -> list[dict]:
    """Decode tok/s (batch 1, greedy, --ignore-eos) per pack on the GPU path, per decode path:

    - ``generic``: the shared layers with CuPy arrays, one launch per array operation (MoE models
      only run this path);
    - ``eager``: the fused dense step launched kernel by kernel (``--no-graph``);
    - ``graph``: the fused step replayed as a CUDA graph (the default).

    Next to each: launches per token (fused: the launch list; generic: counted by capturing one step),
    the bandwidth floor (engine-form bytes one token reads / the measured copy bandwidth), and for
    ``graph`` the pure-GPU replay (``replay`` graph launches back to back, no host work, CUDA events).
    With ``cpu``, the CPU path's tok/s and tokens on the same machine. Tokens of every path are
    compared with the generic path's (and the CPU's), and eager vs graph top-5 logits bit for bit."""
    import cupy as cp

    from strata.engine.generate import generate
    from strata.engine.startup import load_engine

    rows = []
    prompt = [1, 2, 3, 4]
    n_ctx = max(256, n_tokens + 16)
    for label, pk in packs:
        runs: dict[str, object] = {}
        cpu_r = None
        if cpu:
            ce = load_engine(pk, n_ctx=n_ctx)
            cpu_r = generate(ce, prompt_ids=prompt, n_tokens=n_tokens, ignore_eos=True)
            print(f"  {label} [cpu path]: {cpu_r.tokens_per_second:.1f} tok/s", flush=True)
            rows.append(
                {
                    "pack": label,
                    "mode": "cpu",
                    "expert_cache": "-",
                    "tok_s": cpu_r.tokens_per_second,
                    "n_tokens": n_tokens,
                    "ms_per_token": 1000 / cpu_r.tokens_per_second,
                }
            )
            del ce
        moe = None
        for mode in modes:
            if mode != "generic" and moe:
                continue
            kw = (
                dict(fused=False)
                if mode == "generic"
                else dict(graph=(mode == "graph"), stage_times=stage_times and mode == "eager")
            )
            for ec in ("auto", 0) if moe else ("auto",):
                eng = load_engine(pk, device="cuda", n_ctx=n_ctx, expert_cache=ec, **kw)
                moe = eng.experts is not None
                g = eng.gpu
                r = generate(eng, prompt_ids=prompt, n_tokens=n_tokens, ignore_eos=True)
                runs[f"{mode}/{ec}"] = r
                per_tok = g.weights_engine_bytes + g.head_engine_bytes
                if eng.experts is not None:
                    n_used = int(eng.geometry["n_expert_used"])
                    per_tok += n_used * sum(p.nbytes for L in eng.experts.cache.layouts.values() for p in L)
                floor_tps = copy["gbps_rw"] * 1e9 / per_tok
                grown = cp.get_default_memory_pool().total_bytes() - g.pool_after_warmup
                dec = getattr(eng, "decoder", None)
                row = {
                    "pack": label,
                    "mode": mode,
                    "decode_path": g.decode_path,
                    "expert_cache": ec,
                    "tok_s": r.tokens_per_second,
                    "n_tokens": n_tokens,
                    "bytes_per_token": per_tok,
                    "floor_tok_s": floor_tps,
                    "floor_ms": 1000 / floor_tps,
                    "hits": r.expert_hits,
                    "misses": r.expert_misses,
                    "decode_pool_growth_bytes": grown,
                    "ms_per_token": 1000 / r.tokens_per_second if r.tokens_per_second else None,
                    "tokens_equal_generic": None,
                    "tokens_equal_cpu": None,
                }
                if dec is not None:
                    row["launches_per_token"] = dec.launches_per_token(True)["total"]
                    row["launches_how"] = "the fused launch list (kernels + 2 copies)"
                else:
                    n, how = generic_launch_count(eng) if not moe else (None, "MoE: host syncs inside the step")
                    row["launches_per_token"], row["launches_how"] = n, how
                if mode == "graph" and dec is not None:
                    ms = dec.replay_ms(replay)
                    row["replay_ms"], row["replay_tok_s"] = ms, 1000 / ms
                    row["host_ms_per_token"] = row["ms_per_token"] - ms
                if stage_times and dec is not None and mode == "eager":
                    row["stage_ms"] = dec.stage_times.grouped()
                if "generic/" + str(ec) in runs:
                    row["tokens_equal_generic"] = r.output_ids == runs["generic/" + str(ec)].output_ids
                if cpu_r is not None:
                    row["tokens_equal_cpu"] = r.output_ids == cpu_r.output_ids
                if mode == "graph" and f"eager/{ec}" in runs:
                    row["top5_bitwise_equal_eager"] = _tops_equal(r, runs[f"eager/{ec}"])
                rows.append(row)
                extra = ""
                if "replay_tok_s" in row:
                    extra = f", pure-GPU replay {row['replay_tok_s']:.0f} tok/s ({row['replay_ms']:.3f} ms)"
                print(
                    f"  {label} [{mode}, cache {ec}]: {r.tokens_per_second:.1f} tok/s ({row['ms_per_token']:.3f} "
                    f"ms/token), {row['launches_per_token']} launches/token{extra}, floor {floor_tps:.0f} tok/s "
                    f"({per_tok / 2**20:.1f} MiB/token), hits {r.expert_hits} / misses {r.expert_misses} (counts), "
                    f"pool growth during decode {grown} B, tokens = generic: {row['tokens_equal_generic']}, "
                    f"= cpu: {row['tokens_equal_cpu']}"
                    + (
                        f", top-5 bitwise = eager: {row['top5_bitwise_equal_eager']}"
                        if "top5_bitwise_equal_eager" in row
                        else ""
                    )
                    + (f", stages ms/token: {row['stage_ms']}" if "stage_ms" in row else ""),
                    flush=True,
                )
                del eng, dec
                cp.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="weight size per type for the matvec benchmark (MiB)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--types", default="", help="comma-separated ggml type names (default: every type with a kernel)")
    ap.add_argument("--pack", action="append", default=[], help="pack directory for the decode benchmark (repeatable)")
    ap.add_argument("--synth", default=None, help="make synthetic packs in this folder and bench decode on them")
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the synthetic big dense model (0: none)")
    ap.add_argument(
        "--gemma-like-vocab",
        type=int,
        default=262144,
        help="with --synth: vocabulary of the Gemma-3-270M-shaped synthetic pack (0: none)",
    )
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-graph", action="store_true", help="decode paths generic and eager only (no CUDA graph)")
    ap.add_argument(
        "--stage-times",
        action="store_true",
        help="per-stage device times of the eager fused step (needs --no-graph: refused with the graph on)",
    )
    ap.add_argument("--cpu", action="store_true", help="also the CPU path's tok/s and tokens on each pack")
    ap.add_argument("--replay", type=int, default=200, help="graph replays timed for the pure-GPU figure")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    if a.stage_times and not a.no_graph:
        # a stage timer inside a captured graph records nothing: refuse instead of printing zeros
        print(
            "bench_gpu: --stage-times needs --no-graph: events recorded between the launches of a captured CUDA "
            "graph record nothing, so per-stage times cannot be measured with the graph on; refusing",
            file=sys.stderr,
        )
        return 2

    from strata.engine.gpu import kernels as K
    from strata.engine.kernel_src import assembly as A
    from strata.packer import quants

    ok, why = K.gpu_available()
    if not ok:
        print(f"bench_gpu: no GPU ({why}); nothing to measure")
        return 0
    print(f"device: {why}")
    copy = copy_bandwidth()
    print(f"copy ceiling: {copy['gbps_rw']:.0f} GB/s (read+write, {copy['bytes'] >> 20} MiB in {copy['ms']:.3f} ms)")
    if a.types:
        types = [quants.by_name(s.strip()).id for s in a.types.split(",") if s.strip()]
    else:
        types = sorted(A.SUPPORTED_TYPES, key=lambda i: quants.qtype(i).name)
    kern = [] if a.no_kernels else bench_kernels(types, a.mib, a.reps, copy)
    packs = [(p, p) for p in a.pack]
    if a.synth:
        os.makedirs(a.synth, exist_ok=True)
        packs += synth_packs(a.synth, a.big_mib, a.gemma_like_vocab)
    modes = ("generic", "eager") if a.no_graph else ("generic", "eager", "graph")
    dec = (
        bench_decode(packs, a.tokens, copy, modes=modes, stage_times=a.stage_times, cpu=a.cpu, replay=a.replay)
        if packs
        else []
    )

    print("\n| type | W MiB | matvec ms | GB/s | % of copy | dequant ms |")
    print("|---|---|---|---|---|---|")
    for r in kern:
        print(
            f"| {r['type']} | {r['engine_bytes'] / 2**20:.0f} | {r['matvec_ms']:.3f} | {r['matvec_gbps']:.0f} | "
            f"{r['matvec_pct_of_copy']:.0f}% | {r['dequant_ms']:.3f} |"
        )
    if dec:

        def f(v, fmt):
            return "-" if v is None else format(v, fmt)

        print(
            "\n| pack | path | expert cache | decode tok/s | ms/token | launches/token | pure-GPU replay tok/s "
            "(ms) | floor tok/s (ms) | tokens = generic / cpu | hits/misses |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in dec:
            rp = f"{r['replay_tok_s']:.0f} ({r['replay_ms']:.3f})" if "replay_tok_s" in r else "-"
            fl = f"{r['floor_tok_s']:.0f} ({r['floor_ms']:.4f})" if "floor_tok_s" in r else "-"
            print(
                f"| {r['pack']} | {r['mode']} | {r['expert_cache']} | {f(r['tok_s'], '.1f')} | "
                f"{f(r['ms_per_token'], '.3f')} | {f(r.get('launches_per_token'), 'd')} | {rp} | {fl} | "
                f"{r.get('tokens_equal_generic')} / {r.get('tokens_equal_cpu')} | "
                f"{r.get('hits', '-')}/{r.get('misses', '-')} |"
            )
        bad = [r for r in dec if r.get("top5_bitwise_equal_eager") is False]
        print(
            "\ngraph vs eager top-5 logits bit for bit: "
            f"{'DIFFER on ' + str([r['pack'] for r in bad]) if bad else 'equal'}"
        )
    path = a.json or (os.path.join(os.environ["OUT"], "bench_gpu.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as fh:
            json.dump({"device": why, "copy": copy, "kernels": kern, "decode": dec}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
