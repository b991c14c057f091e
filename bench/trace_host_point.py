"""Where a hybrid decode step's host time goes, per MoE layer (not a test; a GPU machine, or ``--device sim``).

Loads PACK with no expert resident (``--expert-cache``, default 0) and ``--miss-tier``, decodes 8 tokens to warm up,
then times 32 greedy tokens with the host point of each MoE layer wrapped (``MoeStep.on_fill``; and ``on_route`` where
the code has one: the checkouts before 2026-12-03): microseconds a layer call in the point, of which the spin / stream
wait for the device (``layers.HostWait``) and the CPU's experts (``experts.cpu_expert_ms``), and between two points
(graph launches, the host's own step work). One JSON line. E.g. on the device:
``python bench/trace_host_point.py /tmp/device_prof_work/pp/qwen3moe-30b-a3b-pack --miss-tier auto``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pack")
    ap.add_argument("--miss-tier", default="auto", choices=["auto", "pcie", "cpu"])
    ap.add_argument("--expert-cache", type=int, default=0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "sim"])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.expert_cache < 0:
        ap.error(f"--tokens {args.tokens} / --expert-cache {args.expert_cache}: at least 1 / 0")
    from strata.engine import layers
    from strata.engine.errors import GenerateError
    from strata.engine.generate import generate
    from strata.engine.startup import load_engine

    try:
        eng = load_engine(
            args.pack, device=args.device, n_ctx=512, expert_cache=args.expert_cache, miss_tier=args.miss_tier
        )
    except (GenerateError, OSError, ValueError) as e:
        ap.error(str(e) if args.pack in str(e) else f"{args.pack}: {e}")
    if eng.experts is None or eng.decoder is None or eng.decoder.moe is None:
        ap.error(f"{args.pack}: no fused MoE step here: nothing to trace")
    eng.experts.source.prefetch_wait()
    generate(eng, prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8], n_tokens=8, ignore_eos=True)
    moe, ex = eng.decoder.moe, eng.model.experts
    if not eng.decoder.hybrid:
        ap.error(f"{args.pack}: the step is one graph (no CPU miss): no host point to trace")
    acc: dict[str, float] = {"n": 0, "between": 0.0}
    last: list[float | None] = [None]

    def wrap(name: str, key: str) -> None:
        f = getattr(moe, name)

        def timed(il: int) -> None:
            t = time.perf_counter()
            if last[0] is not None:
                acc["between"] += t - last[0]
            w0, c0 = layers.HostWait.ms, ex.cpu_expert_ms
            f(il)
            last[0] = t1 = time.perf_counter()
            acc[key] = acc.get(key, 0.0) + t1 - t
            acc[key + "_wait"] = acc.get(key + "_wait", 0.0) + (layers.HostWait.ms - w0) / 1000
            acc[key + "_cpu"] = acc.get(key + "_cpu", 0.0) + (ex.cpu_expert_ms - c0) / 1000
            acc["n"] += key == "fill"

        setattr(moe, name, timed)

    if hasattr(moe, "on_route"):
        wrap("on_route", "route")
    wrap("on_fill", "fill")
    r = generate(eng, prompt_ids=[11, 12, 13, 14, 15, 16, 17, 18], n_tokens=args.tokens, ignore_eos=True)
    n = max(int(acc["n"]), 1)
    per = {k: round(v * 1e6 / n, 1) for k, v in acc.items() if k != "n"}
    env = {k: v for k, v in os.environ.items() if k.startswith(("STRATA_", "OMP_", "GOMP_"))}
    print(
        json.dumps(
            {
                "miss_tier": args.miss_tier,
                "tok_s": round(r.tokens_per_second, 2),
                "layer_calls": n,
                "hits_misses_pcie": [r.expert_hits, r.expert_misses, r.expert_pcie],
                "us_per_layer_call": per,
                "env": env,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
