"""Where the fused decode step's device time goes: every launch of the step timed alone, by kind.

Not a test: a profile for the GPU machine. For a pack (every expert resident unless ``--expert-cache``), it loads
the CUDA engine (graph on), generates a few tokens (the step captured, the pool warm), then:

- ``replay_ms``: the captured step replayed back to back (no host work; ``FusedDecoder.replay_ms``);
- per launch: the step's launch list issued eagerly ``--reps`` times with a CUDA event after every launch, in
  windows of ``--window`` launches, each window queued behind a kernel that spins ``--spin-ms`` on the device: the
  host issues a launch in tens of microseconds (longer than most kernels: without the spin the time between two
  events would be the host's), so the device runs the window back to back as it runs a stream, and the time
  between two events is that launch's share. Summed by kind (the launch name with the layer number taken out),
  microseconds per step;
- ``empty_node_us``: a graph of as many launches of an empty kernel as the step has, replayed - what a graph node
  costs with no work (the floor under the launch count).

The sum of the launches minus ``replay_ms`` is what the graph saves by issuing back to back; ``replay_ms`` minus
``nodes x empty_node_us`` is roughly the kernels' own work.

    python3 bench/profile_step.py PACK [--expert-cache auto] [--reps 20] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict


def kind_of(name: str) -> str:
    """A launch name with every ``blk.N.`` made ``blk.*.`` and every ``LN`` made ``L*`` (one kind across layers)."""
    return re.sub(r"\bL\d+\b", "L*", re.sub(r"blk\.\d+\.", "blk.*.", name))


def graph_us(g, s, n: int = 40, warmup: int = 3) -> float:
    """Device microseconds per replay of the captured graph ``g`` on stream ``s`` (strata.engine.gpu.fused.graph_ms)."""
    from strata.engine.gpu.fused import graph_ms

    return graph_ms(g, s, n, warmup) * 1000


def empty_node_us(n: int, reps: int = 50) -> float:
    """Device microseconds per node of a captured graph of ``n`` launches of an empty kernel (1 CTA, 32 threads)."""
    import cupy as cp

    k = cp.RawKernel('extern "C" __global__ void nop() {}', "nop")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        k((1,), (32,), ())
        s.begin_capture()
        for _ in range(n):
            k((1,), (32,), ())
        g = s.end_capture()
    return graph_us(g, s, reps, warmup=5) / n


def decode_share(eng, n: int, replay_ms: float | None, profile: bool) -> dict:
    """Generate ``n`` tokens (greedy, after an 8-id prompt) and print the decode milliseconds per token beside the
    graph replay's: the rest is the host's share of a step (the step's own Python, sampling, counting). A hybrid
    step (``replay_ms`` None: misses stop at the host) prints instead the host's wait for the device and the CPU's
    expert time per token (milliseconds, ``layers.HostWait`` / ``experts.cpu_expert_ms``). With ``profile``,
    cProfile's 15 costliest functions (own time) of a second such run. Returns the figures."""
    import cProfile
    import pstats

    from strata.engine import layers
    from strata.engine.generate import generate

    ex = eng.model.experts  # None for a dense model
    at = {"w0": 0.0, "c0": 0.0, "decode": 0}  # the host wait and CPU time once the prompt is done; decode steps

    def on_step(st) -> None:
        if st.phase == "prompt":
            at["w0"], at["c0"] = layers.HostWait.ms, ex.cpu_expert_ms if ex is not None else 0.0
        else:
            at["decode"] += 1

    r = generate(eng, prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8], n_tokens=n, ignore_eos=True, on_step=on_step)
    ms = 1000.0 / r.tokens_per_second
    if replay_ms is None:
        env = {k: v for k, v in os.environ.items() if k.startswith("STRATA_")}
        k = max(at["decode"], 1)  # the decode steps' own host wait and CPU expert time, a step
        cpu = ex.cpu_expert_ms - at["c0"] if ex is not None else 0.0
        tuner = getattr(getattr(eng.decoder, "moe", None), "tuner", None)  # the split's search, where it runs
        print(
            f"decode: {r.tokens_per_second:.1f} tok/s = {ms:.3f} ms per token ({n} tokens, greedy, hybrid step) = "
            f"host waiting for the device {(layers.HostWait.ms - at['w0']) / k:.3f} ms + CPU experts "
            f"{cpu / k:.3f} ms + the rest; env {env}" + (f"; split {tuner.describe()}" if tuner is not None else "")
        )
        return {"tokens": n, "tok_s": r.tokens_per_second, "ms_per_token": ms}
    print(
        f"decode: {r.tokens_per_second:.1f} tok/s = {ms:.3f} ms per token ({n} tokens, greedy) = graph replay "
        f"{replay_ms:.3f} ms + host {ms - replay_ms:.3f} ms"
    )
    if profile:  # a second run: the profiler's own cost stays out of the figure above
        prof = cProfile.Profile()
        prof.enable()
        generate(eng, prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8], n_tokens=n, ignore_eos=True)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return {"tokens": n, "tok_s": r.tokens_per_second, "ms_per_token": ms, "host_ms": ms - replay_ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pack")
    ap.add_argument("--expert-cache", default="auto")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--window", type=int, default=200)
    ap.add_argument("--spin-ms", type=float, default=30.0)
    ap.add_argument("--ncu-step", action="store_true", help="run one eager step in an NVTX range and exit")
    ap.add_argument("--replay-only", action="store_true", help="print the graph replay ms and exit")
    ap.add_argument(
        "--decode",
        type=int,
        default=64,
        help="also generate this many tokens (greedy) and set the step's host share beside the replay: decode ms per "
        "token less the replay's (0: skip); with --host-profile, cProfile's top functions of that decode",
    )
    ap.add_argument("--miss-tier", default="auto", choices=["auto", "pcie", "cpu"], help="strata-engine's --miss-tier")
    ap.add_argument("--threads", type=int, default=None, help="strata-engine's --threads (CPU kernel threads)")
    ap.add_argument("--host-profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.expert_cache != "auto" and not args.expert_cache.isdigit():
        ap.error(f"--expert-cache {args.expert_cache!r}: auto or a slot count (0, 1, ...)")
    try:
        import cupy as cp
    except ImportError:
        ap.error("needs CuPy and a CUDA GPU (pip install -e '.[cuda]'): a profile of the GPU's decode step")
    import numpy as np

    from strata.engine.errors import GenerateError
    from strata.engine.generate import generate
    from strata.engine.startup import load_engine

    ec = args.expert_cache if args.expert_cache == "auto" else int(args.expert_cache)
    kw = {"expert_cache": ec, "miss_tier": args.miss_tier, "threads": args.threads}
    try:
        eng = load_engine(args.pack, device="cuda", n_ctx=512, **kw)
    except (GenerateError, OSError, ValueError) as e:  # a missing pack, no GPU, a refused option: the engine's words
        ap.error(f"{args.pack}: {e}")
    if eng.experts is not None:  # decode timed on warm page tables (the start-up's shard prefetch done)
        eng.experts.source.prefetch_wait()
    generate(eng, prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8], n_tokens=8, ignore_eos=True)
    dec = eng.decoder
    if dec is None:
        raise SystemExit(f"{args.pack}: no fused decode step on this path: nothing to profile")
    ls = dec.launches(True)
    if dec.hybrid:  # misses stop at the host: no single graph to replay; the decode figures only
        if not args.decode or args.ncu_step:
            raise SystemExit(f"{args.pack}: experts miss (hybrid segments): profile a cache that holds every expert")
        for c in eng.checkpoints:  # the cache stage's notes: the split, the PCIe and CPU probes
            if c.name == "expert cache":
                print(c.line())
        got = decode_share(eng, args.decode, None, args.host_profile)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"pack": args.pack, "hybrid": True, "decode": got}, f, indent=1)
        return 0
    replay = dec.replay_ms(200) if not args.ncu_step else None
    host = None
    if args.decode and not args.ncu_step:
        host = decode_share(eng, args.decode, replay, args.host_profile)
    if args.replay_only and not args.ncu_step:
        env = {k: v for k, v in os.environ.items() if k.startswith("STRATA_")}
        print(f"{args.pack}: graph replay {replay:.3f} ms per step ({len(ls)} launches), env {env}")
        return 0
    s = dec.stream
    evs = [cp.cuda.Event() for _ in range(len(ls) + 1)]
    per = defaultdict(float)
    count = defaultdict(int)
    for L in ls:
        count[kind_of(L.name)] += 1
    spin = cp.RawKernel(
        'extern "C" __global__ void spin(long long n) { long long t0 = clock64(); while (clock64() - t0 < n) {} }',
        "spin",
    )
    rate = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) * 1000  # Hz
    cycles = np.int64(rate * args.spin_ms / 1000)
    if args.ncu_step:  # one eager step inside an NVTX range for Nsight Compute (--nvtx-include "strata_step/")
        with s:
            cp.cuda.nvtx.RangePush("strata_step")
            for L in ls:
                L.run()
            cp.cuda.nvtx.RangePop()
            s.synchronize()
        return 0
    with s:
        for _ in range(args.reps):
            for w0 in range(0, len(ls), args.window):
                w = range(w0, min(len(ls), w0 + args.window))
                spin((1,), (32,), (cycles,))
                evs[w0].record(s)
                for i in w:
                    ls[i].run()
                    evs[i + 1].record(s)
                evs[w[-1] + 1].synchronize()
                for i in w:
                    per[kind_of(ls[i].name)] += float(cp.cuda.get_elapsed_time(evs[i], evs[i + 1])) * 1000 / args.reps
    total = sum(per.values())

    # the marginal cost in the graph: the step captured without one kind's launches, replayed; the drop from the whole
    # step's replay is what that kind costs where it runs (the values it would have written stay stale: timing only)
    def capture(sub):
        with s:
            s.begin_capture()
            for L in sub:
                L.run()
            return s.end_capture()

    whole = graph_us(capture(ls), s)
    marginal = {k: whole - graph_us(capture([L for L in ls if kind_of(L.name) != k]), s) for k in count}
    node = empty_node_us(len(ls))
    rows = sorted(
        ({"kind": k, "count": count[k], "us": round(v, 2), "graph_us": round(marginal[k], 2)} for k, v in per.items()),
        key=lambda r: -r["graph_us"],
    )
    print(
        f"{args.pack}: {len(ls)} launches per step; launches alone {total / 1000:.3f} ms, graph replay "
        f"{replay if replay is None else round(replay, 3)} ms, an empty graph node {node:.2f} us "
        f"(x {len(ls)} = {node * len(ls) / 1000:.3f} ms); per kind: in the graph (the step's replay less the replay "
        f"without that kind: {whole / 1000:.3f} ms whole) | issued alone"
    )
    for r in rows[: args.top]:
        c, g = r["count"], r["graph_us"]
        print(f"  graph {g:8.1f} us = {c:3d} x {g / c:6.2f} | alone {r['us'] / c:6.2f} us  {r['kind']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "pack": args.pack,
                    "launches": len(ls),
                    "launch_sum_ms": total / 1000,
                    "replay_ms": replay,
                    "empty_node_us": node,
                    "graph_whole_us": whole,
                    "decode": host,
                    "kinds": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
