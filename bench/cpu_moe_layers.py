"""One token's routed-expert work on the CPU (not a test): for a pack, every MoE layer's ``ShardExperts.ffn_many``
over ``--used`` random experts (the same choice for each kernel), per ``--kernel``, timed per pass - pass 0 touches
the experts' pages for the first time in this mapping, later passes find them mapped - with and without
``populate()`` (the shards' page tables filled up front). Says how much of a hybrid token's time is the CPU's
arithmetic and how much is page faults. On the GPU machine, after bench_moe.py wrote its packs, e.g.
``python bench/cpu_moe_layers.py /tmp/bench_moe/qwen3moe-30b-a3b-pack --kernel q8 --kernel exact --threads 16``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pack")
    ap.add_argument("--kernel", action="append", default=None, choices=["q8", "exact", "f32"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--used", type=int, default=None, help="experts per layer (default: the model's experts used)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.json:  # refused before the run, not after it
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            ap.error(f"--json {args.json}: {d} is not a writable directory")
    for name in ("threads", "used", "passes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: must be at least 1")
    from strata.engine.experts import ShardExperts
    from strata.engine.startup import open_checked

    try:
        _, geom, plan = open_checked(args.pack)
    except Exception as e:  # a missing or broken pack: the engine's own message
        ap.error(str(e) if args.pack in str(e) else f"{args.pack}: {e}")
    if not plan.experts:
        ap.error(f"{args.pack}: a {geom.manifest.arch} model without routed experts: nothing to time")
    args.used = args.used or int(geom.env["n_expert_used"])
    if args.used > int(geom.env["n_expert"]):
        ap.error(f"--used {args.used}: the model has {geom.env['n_expert']} experts per layer")
    rng = np.random.default_rng(0)
    out = []
    for populate in (False, True):
        for kernel in args.kernel or ["q8", "exact"]:
            src = ShardExperts(plan)  # a fresh mapping: its page tables start empty
            t0 = time.perf_counter()
            populated = src.populate() if populate else None
            t_pop = time.perf_counter() - t0
            n_expert = int(geom.env["n_expert"])
            picks = {il: rng.choice(n_expert, size=args.used, replace=False).tolist() for il in src.layers}
            xs = {il: rng.standard_normal(src.shapes[il].gate[0]).astype(np.float32) for il in src.layers}
            times = []
            for _p in range(args.passes):
                t0 = time.perf_counter()
                for il in src.layers:
                    src.ffn_many(il, picks[il], xs[il], kernel=kernel, threads=args.threads)
                times.append(round((time.perf_counter() - t0) * 1e3, 2))
            row = {
                "kernel": kernel,
                "populate": populate,
                "populated": populated,
                "populate_s": round(t_pop, 2),
                "layers": len(src.layers),
                "used": args.used,
                "threads": args.threads,
                "ms_per_pass": times,
            }
            print(json.dumps(row), flush=True)
            out.append(row)
            del src
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
