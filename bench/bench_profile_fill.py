"""Decode on an emulated card with and without an expert profile, on token-dependent routing (GPU machine).

    python3 bench/bench_profile_fill.py --work /tmp/pf --geometry qwen3moe-30b-a3b --cards 16G,24G

Writes the geometry with ``TokenRouting(skew)`` routers (strata.testing.routing), records an expert profile on
one prompt set (``strata.engine.routing.profile_routing`` on the GPU, every expert resident: the same routing),
then decodes ANOTHER prompt set (held out) on each emulated card (``--card``, ``--vram-reserve-mib 1024``, the
margin llama.cpp's ``--fit`` keeps) with no profile and with the profile: slots, decode tok/s (tokens after the
first / seconds, summed over the prompts), expert hits and misses (counts) and the hit rate. A profile orders the
fill and never makes the cache smaller than what fits (docs/DESIGN.md "The profile fill"), so the slot counts
with and without it are equal. Not a comparison with llama.cpp (no llama.cpp row here): strata's own figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def one(
    card: str, name: str, pack: str, prof_path: str, n_ctx: int, tokens: int, held: list[list[int]], tier: str
) -> dict:
    """One case in this process: load on the emulated ``card`` (reserve 1024 MiB) with or without the profile,
    misses on ``tier`` (``--miss-tier``), decode every held-out prompt; the row as a dict."""
    from strata.budget.cards import card_preset
    from strata.budget.profile import read_profile
    from strata.engine.generate import generate
    from strata.engine.startup import load_engine

    prof = read_profile(prof_path) if name == "profile" else None
    slots = 0 if name == "empty cache" else None  # no expert resident: every one read over PCIe (or on the CPU)
    t0 = time.perf_counter()
    eng = load_engine(
        pack,
        device="cuda",
        n_ctx=n_ctx,
        card=card_preset(card),
        vram_reserve_mib=1024,
        profile=prof,
        miss_tier=tier,
        expert_cache=slots,
    )
    start_s = time.perf_counter() - t0
    if eng.experts is not None:  # decode timed on warm page tables, as llama.cpp's populated mmap leaves them
        eng.experts.source.prefetch_wait()
    moe = eng.decoder.moe if eng.decoder is not None else None
    pf = getattr(moe, "prefetch", None)  # (None: no MoE step, or a checkout before the prefetch: A/B runs)
    if pf is not None:
        pf.reset_counts()
    toks = secs = hits = misses = pcie = 0
    for p in held:
        r = generate(eng, prompt_ids=list(p), n_tokens=tokens, ignore_eos=True)
        toks += len(r.output_ids) - 1
        secs += r.decode_seconds
        hits += r.expert_hits or 0
        misses += r.expert_misses or 0
        pcie += r.expert_pcie or 0
    return {
        "card": card,
        "case": name,
        "miss_tier": eng.gpu.miss_tier or "-",
        "host_tier_bytes": eng.gpu.host_tier_bytes,
        "host_tier_map_bytes": eng.gpu.host_tier_map_bytes,
        "host_tier_map_predicted_bytes": eng.gpu.host_tier_map_predicted_bytes,
        "free_after_bytes": eng.gpu.free_after_bytes,
        "start_s": round(start_s, 1),
        "expert_pcie": pcie,
        "slots": eng.gpu.slot_plan.slots if eng.gpu.slot_plan else None,
        "decode_tok_s": round(toks / secs, 2),
        "expert_hits": hits,
        "expert_misses": misses,
        "hit_rate": round(hits / max(hits + misses, 1), 4),
        # the prefetch (strata.engine.gpu.prefetch): experts copied ahead, and of those read by the layer they were for
        "prefetch": ("on" if pf.active else "off") if pf is not None else "-",
        "prefetch_staged": pf.counts()[0] if pf is not None else 0,
        "prefetch_read": pf.counts()[1] if pf is not None else 0,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        card, name, pack, prof_path, n_ctx, tokens, held, tier = argv[1:]
        print(json.dumps(one(card, name, pack, prof_path, int(n_ctx), int(tokens), json.loads(held), tier)))
        return 0
    from bench_routing import geometries

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/bench_profile_fill")
    ap.add_argument("--geometry", default="qwen3moe-30b-a3b")
    ap.add_argument("--cards", default="16G,24G")
    ap.add_argument("--skew", type=float, default=0.5)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set (profile, held-out)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated after each held-out prompt")
    ap.add_argument("--tiers", default="auto", help="--miss-tier values to run where experts miss (cpu,pcie)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--prepare-only", action="store_true", help="write the GGUF and the pack, then stop")
    ap.add_argument(
        "--empty-cache",
        action="store_true",
        help="also no expert resident (--expert-cache 0 on 24G, each --tiers value): llama.cpp's -ncmoe <all> row",
    )
    args = ap.parse_args(argv)

    from strata import testing as synth
    from strata.budget.profile import write_profile
    from strata.engine.routing import profile_routing
    from strata.packer.build import build_pack
    from strata.testing.routing import TokenRouting, topic_prompts

    base = geometries()[args.geometry]
    spec = base.model_copy(update={"routing": TokenRouting(skew=args.skew)})
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gguf, pack = work / f"{args.geometry}.gguf", work / f"{args.geometry}-pack"
    if not gguf.exists():
        synth.write_model(gguf, spec)
    if not pack.exists():
        build_pack(gguf, pack, progress=False)
    if args.prepare_only:
        return 0
    kw = dict(vocab=min(base.dims.n_vocab, 4096), n_topics=8, topic_size=48, run_length=4, topic_seed=0)
    prof_set = topic_prompts(args.prompts, args.prompt_len, seed=1, **kw).prompts
    held = topic_prompts(args.prompts, args.prompt_len, seed=2, **kw).prompts
    n_ctx = args.prompt_len + args.tokens + 8
    t0 = time.perf_counter()
    rows = profile_routing(str(pack), [list(p) for p in prof_set], n_tokens=8, n_ctx=n_ctx, device="cuda")
    print(
        f"[{args.geometry}] profile: {len(rows)} (layer, expert) pairs from {len(prof_set)} prompts in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    out = {"args": vars(args), "profile_pairs": len(rows), "rows": []}
    prof_path = work / "profile.parquet"
    write_profile(rows, prof_path, force=True)
    del rows
    # each case in a process of its own: a start-up on an emulated card sees the card as a fresh process would
    tiers = args.tiers.split(",")
    cases = [(c, n, t) for c in args.cards.split(",") for n in ("no profile", "profile") for t in tiers]
    cases += [("24G", "empty cache", t) for t in tiers] if args.empty_cache else []
    for card, name, tier in cases:
        if card == "24G" and tier != tiers[0] and name != "empty cache":
            continue  # every expert fits: nothing misses, the tier does not matter
        cmd = [
            sys.executable,
            __file__,
            "--one",
            card,
            name,
            str(pack),
            str(prof_path),
            str(n_ctx),
            str(args.tokens),
            json.dumps([list(p) for p in held]),
            tier,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"  {card} {name}: exit {p.returncode}: {p.stderr[-1500:]}", flush=True)
            continue
        row = json.loads(p.stdout.strip().splitlines()[-1])
        out["rows"].append(row)
        print(
            f"  {card:>4} {name:<10} misses on {row['miss_tier']:<4} slots {row['slots']:>6}  "
            f"decode {row['decode_tok_s']:7.2f} tok/s  hits {row['expert_hits']} / misses {row['expert_misses']} "
            f"({row['expert_pcie']} over PCIe) (counts) = {100 * row['hit_rate']:.1f}%  "
            f"prefetch {row.get('prefetch', '-')}: {row.get('prefetch_read', 0)} read of "
            f"{row.get('prefetch_staged', 0)} staged (counts)  "
            f"start-up {row['start_s']} s, "
            f"host tier {row['host_tier_bytes'] / 2**30:.2f} GiB, its mapping {row['host_tier_map_bytes']} B "
            f"(planned {row['host_tier_map_predicted_bytes']} B), {row['free_after_bytes'] / 2**20:.1f} MiB free after",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
