"""Expert-cache policies on routing that means something: traces replayed offline, Belady's optimum beside them,
and the budget's hit-rate prediction checked on held-out prompts.

Not a test: a benchmark (``make bench-routing``; issue 19 items 3 and 4). For one geometry it

1. writes a synthetic GGUF whose routers choose by the token (:class:`strata.testing.routing.TokenRouting`:
   router rows drawn per expert, scaled by ``exp(skew * z_e)``; distinct embedding rows), pattern-filled
   elsewhere, and packs it (both kept in ``--work`` and reused);
2. makes two prompt sets of token ids in topic runs (:func:`strata.testing.routing.topic_prompts`, the same
   topics, different prompts): the *profile* set (seed 1) and the *held-out* set (seed 2);
3. routes both through the engine (``--device``; no expert resident, so only the router decides) and
   records their routing traces (:func:`strata.engine.routing.record_trace`, written as Parquet to
   ``--work``);
4. profiles the first trace (:func:`strata.budget.trace.trace_counts`: what ``strata-engine profile``
   writes) and replays the held-out trace through every policy of :mod:`strata.budget.replay`
   (profile-only (the engine's default with a profile), profile + first-come admission (``--admit``),
   LRU, the decayed-frequency class policy, class + bypass (the engine's ``--cache-policy class``), profile + LRU,
   profile + class, Belady's MIN, and the
   optimum) at ``--fractions`` of all (layer, expert) pairs as slots (global slots, as the engine's cache);
5. checks the budget's prediction: ``fill_profile``'s expected hit rate (what ``strata-budget check
   --expert-profile`` reports: in-sample, on the profile's own prompts) against the profile-only hit rate
   measured on the held-out prompts.

Prints the concentration of each trace (share of the top decile of experts, distinct experts per layer), the
policy table (hit rates, percent of routed expert evaluations) and the prediction check, and writes every
number to ``--json`` (default ``WORK/bench_routing-GEOMETRY.json``). ``--pattern-baseline`` also traces the
same geometry written without ``TokenRouting`` (the tiled routers: every policy looks alike there).

Geometries (``--geometry``):

- ``qwen3moe-small``: bench/bench_moe.py's 4-layer, 32-expert (4 used) qwen3moe, n_embd 512, vocab 2048: runs
  on a laptop's CPU in a minute or two;
- ``qwen3moe-30b-a3b``: bench/bench_moe.py's Qwen3-30B-A3B shape (48 layers, 128 experts, 8 used, ~18 GiB);
- ``qwen3next-80b-a3b``: Qwen3-Next-80B-A3B's shape (48 layers, full attention every 4th, n_embd 2048, 16 q / 2 kv
  heads of 256, delta net 16 k-heads / 32 v-heads of 128, 512 experts of 512 (10 used) + a shared expert of
  512, vocab 151936), experts IQ2_XS (the routing does not depend on their type; ~22 GiB instead of ~50).

For the big ones use a GPU machine (``--device cuda --gpu-cache``) with ~60 GB of disk.

    python bench/bench_routing.py --work /tmp/bench_routing [--geometry qwen3moe-small] [--skew 0.5]
        [--prompts 16] [--prompt-len 16] [--tokens 16] [--device cpu] [--fractions 0.25,0.5,0.75,0.9]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from bench_moe import geometries as moe_geometries


def geometries() -> dict:
    """name -> ModelSpec without routing (the written file adds ``TokenRouting``): bench_moe's MoE geometries."""
    g = moe_geometries()
    return {n: g[n] for n in ("qwen3moe-small", "qwen3moe-30b-a3b", "qwen3next-80b-a3b")}


def concentration(trace, n_expert: int) -> dict:
    """Top-decile share (mean over layers) and distinct experts selected per layer (mean, min)."""
    import numpy as np

    from strata.budget.replay import top_share

    distinct = [len(np.unique(trace.expert[trace.layer == L])) for L in np.unique(trace.layer)]
    return {
        "top_decile_share": round(top_share(trace, n_expert, 0.1), 4),
        "distinct_experts_per_layer_mean": round(float(np.mean(distinct)), 1),
        "distinct_experts_per_layer_min": int(min(distinct)),
        "selections": len(trace),
        "positions": trace.n_steps,
    }


def run_geometry(spec, tag: str, work: Path, args, prompt_sets) -> dict:
    """Write + pack ``spec`` (reused when present), trace both prompt sets, replay, check the prediction."""
    from strata import testing as synth
    from strata.budget.replay import compare_policies, format_table, held_out_check, slot_counts
    from strata.budget.trace import trace_counts, write_trace
    from strata.engine.routing import record_trace, routing_engine
    from strata.packer.build import build_pack

    gguf, pack = work / f"{tag}.gguf", work / f"{tag}-pack"
    t0 = time.perf_counter()
    if not gguf.exists():
        synth.write_model(gguf, spec)
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    if not pack.exists():
        build_pack(gguf, pack, progress=False)
    t_pack = time.perf_counter() - t0
    print(f"[{tag}] {gguf.stat().st_size / 2**30:.2f} GiB written in {t_write:.1f} s, packed in {t_pack:.1f} s")
    n_ctx = args.prompt_len + args.tokens + 8
    if args.gpu_cache:  # the same routing: a hit computes what a miss does, bit for bit (docs/DESIGN.md)
        from strata.engine.startup import load_engine

        eng = load_engine(pack, device="cuda", n_ctx=n_ctx)
    else:
        eng = routing_engine(str(pack), n_ctx=n_ctx, device=args.device)
    traces = {}
    for name, ps in prompt_sets.items():
        t0 = time.perf_counter()
        traces[name] = record_trace(eng, ps.prompts, n_tokens=args.tokens)
        write_trace(traces[name], work / f"{tag}-{name}.trace.parquet", force=True)
        dt = time.perf_counter() - t0
        print(f"[{tag}] traced the {name} set: {traces[name].n_steps} positions in {dt:.1f} s")
    del eng
    n_expert = spec.dims.n_expert
    n_pairs = len(synth.moe_layers(spec)) * n_expert
    slots = slot_counts(n_pairs, args.fractions)
    labels = {n: f"{100 * n / n_pairs:.0f}%" for n in slots}
    prof, held = traces["profile"], traces["held_out"]
    rows = trace_counts(prof)
    results = compare_policies(held, slots, profile=rows, profile_steps=prof.n_steps, decay=args.decay)
    checks = [held_out_check(prof, held, n) for n in slots]
    conc = {k: concentration(t, n_expert) for k, t in traces.items()}
    print(
        f"\n[{tag}] routing: "
        + "; ".join(
            f"{k}: top-decile share {c['top_decile_share']:.1%}, {c['distinct_experts_per_layer_mean']:.0f} of "
            f"{n_expert} experts per layer ({c['positions']} positions)"
            for k, c in conc.items()
        )
    )
    print(
        f"[{tag}] hit rate on the held-out prompts (percent of routed expert evaluations), slots of "
        f"{n_pairs} (layer, expert) pairs, global; profile from the profile prompts; class decay {args.decay}:"
    )
    print(format_table(results, labels))
    print(f"[{tag}] the budget's prediction (fill_profile, in-sample) vs profile-only measured on held-out prompts:")
    for c in checks:
        print(
            f"  {c.slots:>8d} slots ({labels[c.slots]:>4s}): predicted {c.predicted:6.1%} (in-sample), "
            f"held-out {c.held_out:6.1%}, error {100 * c.error:+5.1f} points"
        )
    return {
        "geometry": tag,
        "file_gib": round(gguf.stat().st_size / 2**30, 3),
        "write_s": round(t_write, 1),
        "pack_s": round(t_pack, 1),
        "n_pairs": n_pairs,
        "concentration": conc,
        "policies": [r.as_dict() for r in results],
        "held_out_check": [c.as_dict() for c in checks],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/bench_routing", help="where the GGUFs, packs and traces are written")
    ap.add_argument("--geometry", default="qwen3moe-small")
    ap.add_argument("--skew", type=float, default=0.5, help="TokenRouting.skew (router row scales exp(skew * z))")
    ap.add_argument("--embd-rows", type=int, default=4096, help="TokenRouting.embd_rows")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per set (profile, held-out)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated after each prompt")
    ap.add_argument("--topics", type=int, default=8)
    ap.add_argument("--topic-size", type=int, default=48, help="token ids per topic")
    ap.add_argument("--run-length", type=int, default=4, help="prompts per topic run")
    ap.add_argument("--fractions", default="0.25,0.5,0.75,0.9", help="slot counts as fractions of all pairs")
    ap.add_argument("--decay", type=float, default=0.95, help="the class policy's decay per token")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--gpu-cache",
        action="store_true",
        help="cuda: trace with the engine's automatic expert cache (all experts resident where they fit) instead of "
        "none: the same routing, far faster than computing every expert on the CPU",
    )
    ap.add_argument("--pattern-baseline", action="store_true", help="also trace the file without TokenRouting")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.fractions = [float(x) for x in args.fractions.split(",")]
    if args.gpu_cache and args.device != "cuda":
        ap.error("--gpu-cache needs --device cuda")
    from strata.testing.routing import TokenRouting, topic_prompts

    geos = geometries()
    if args.geometry not in geos:
        ap.error(f"--geometry {args.geometry}: known: {', '.join(geos)}")
    base = geos[args.geometry]
    routing = TokenRouting(skew=args.skew, embd_rows=args.embd_rows)
    spec = base.model_copy(update={"routing": routing})
    vocab = min(base.dims.n_vocab, args.embd_rows)  # ids below embd_rows: every token its own row
    kw = dict(vocab=vocab, n_topics=args.topics, topic_size=args.topic_size, run_length=args.run_length, topic_seed=0)
    sets = {
        "profile": topic_prompts(args.prompts, args.prompt_len, seed=1, **kw),
        "held_out": topic_prompts(args.prompts, args.prompt_len, seed=2, **kw),
    }
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{args.geometry}: TokenRouting(skew={args.skew}, embd_rows={args.embd_rows}); {args.prompts} prompts per set "
        f"of {args.prompt_len} ids + {args.tokens} generated, {args.topics} topics of {args.topic_size} ids in runs of "
        f"{args.run_length}; device {args.device}"
    )
    path = Path(args.json) if args.json else work / f"bench_routing-{args.geometry}.json"
    out = {
        "args": {k: v for k, v in vars(args).items()},
        "prompt_sets": {k: v.describe() for k, v in sets.items()},
        "rows": [],
    }
    tags = [(spec, f"{args.geometry}-skew{args.skew:g}")]
    if args.pattern_baseline:
        tags.append((base, f"{args.geometry}-pattern"))
    for i, (sp, tag) in enumerate(tags):
        if i:  # one model on disk at a time: the 30B/80B files are 19-22 GiB each
            for p in work.glob(f"{tags[i - 1][1]}*"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        out["rows"].append(run_geometry(sp, tag, work, args, sets))
        path.write_text(json.dumps(out, indent=1))  # after every model: a later failure keeps the rows so far
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
