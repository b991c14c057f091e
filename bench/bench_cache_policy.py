"""The engine's decode-time cache policy measured: hit rates (and swaps) of ``--cache-policy fill`` against
``--cache-policy class`` on a model whose routers choose by the token (``TokenRouting``), at a few cache sizes.

Not a test: the figures are the engine's own counts (routed expert evaluations that were hits), which do not depend
on the device, so ``--device sim`` (the GPU path on NumPy, any machine) measures them; ``--device cuda`` adds decode
tok/s (the swaps' cost over PCIe included). The cache lives across the prompts (one engine), as a server's does; the
prompts are topic prompts (``strata.testing.routing.topic_prompts``), each generating ``--tokens`` tokens.

    python bench/bench_cache_policy.py --work /tmp/bcp [--geometry qwen3moe-small] [--device sim]
        [--fractions 0.25,0.5,0.75] [--prompts 8] [--prompt-len 16] [--tokens 32] [--pack P] [--json F]

On the GPU machine after ``bench/device_prompt.sh`` (its 30B-A3B pack is this spec at skew 0.5):
``python3 bench/bench_cache_policy.py --device cuda --geometry qwen3moe-30b-a3b --pack
/tmp/device_pp_work/pp/qwen3moe-30b-a3b-pack``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_case(pack: Path, device: str, slots: int, policy: str, prompts: list[list[int]], tokens: int) -> dict:
    """One engine, every prompt in turn; the decode positions' hits, misses and swaps (counts) and tok/s."""
    from strata.engine.generate import generate
    from strata.engine.gpu.backend import SimBackend
    from strata.engine.startup import load_engine

    kw: dict = {"n_ctx": max(len(p) for p in prompts) + tokens + 8, "expert_cache": slots, "miss_tier": "pcie"}
    kw["cache_policy"] = policy
    eng = (
        load_engine(pack, device="cuda", backend=SimBackend(), **kw)
        if device == "sim"
        else load_engine(pack, device="cuda", **kw)
    )
    hits = misses = n = 0
    secs = 0.0
    for p in prompts:
        r = generate(eng, prompt_ids=p, n_tokens=tokens, ignore_eos=True)
        dec = [s for s in r.steps if s.phase == "decode"]
        hits += sum(s.expert_hits for s in dec)
        misses += sum(s.expert_misses for s in dec)
        secs += sum(s.forward_ms for s in dec) / 1000
        n += len(dec)
    moe = eng.decoder.moe
    return {
        "slots": slots,
        "policy": policy,
        "decode_positions": n,
        "hits": hits,
        "misses": misses,
        "hit_rate": round(hits / max(hits + misses, 1), 4),
        "swaps": moe.swaps,
        "swaps_per_token": round(moe.swaps / max(n, 1), 2),
        "decode_tok_s": round(n / secs, 1) if device == "cuda" and secs else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--work", default="/tmp/bench_cache_policy")
    ap.add_argument("--geometry", default="qwen3moe-small", help="bench_moe's MoE geometries")
    ap.add_argument("--device", default="sim", choices=["sim", "cuda"])
    ap.add_argument("--skew", type=float, default=0.5)
    ap.add_argument("--fractions", default="0.25,0.5,0.75", help="cache slots, fractions of the (layer, expert) pairs")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument(
        "--pack",
        default=None,
        help="a pack of --geometry written with TokenRouting(--skew) already (e.g. bench_prompt_gpu's "
        "WORK/pp/qwen3moe-30b-a3b-pack: same spec): measured instead of writing one (saves the GGUF on a device call)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from bench_moe import geometries

    from strata import testing as synth
    from strata.packer.build import build_pack
    from strata.testing.routing import TokenRouting, topic_prompts

    geos = geometries()
    moe = sorted(n for n, g in geos.items() if g.arch in ("qwen3moe", "qwen2moe", "qwen3next"))
    if args.geometry not in moe:
        ap.error(f"--geometry {args.geometry}: one of bench_moe's MoE geometries ({', '.join(moe)})")
    try:
        fractions = [float(x) for x in args.fractions.split(",")]
    except ValueError:
        ap.error(f"--fractions {args.fractions!r}: comma-separated numbers in (0, 1)")
    if not fractions or any(not 0.0 < f < 1.0 for f in fractions):
        ap.error(f"--fractions {args.fractions}: each in (0, 1) (at 1 every pair is resident: nothing to compare)")
    for name in ("prompts", "prompt_len", "tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.skew < 0:
        ap.error(f"--skew {args.skew}: must be >= 0")
    if args.device == "cuda":
        from strata.engine.gpu.kernels import gpu_available

        ok, why = gpu_available()
        if not ok:
            ap.error(f"--device cuda: {why} (--device sim measures the hit rates anywhere)")
    base = geos[args.geometry]
    spec = base.model_copy(update={"routing": TokenRouting(skew=args.skew)})
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{args.geometry}-skew{args.skew:g}"  # a file per router skew: another skew never reuses this one
    gguf, pack = work / f"{tag}.gguf", work / f"{tag}-pack"
    if args.pack is not None:
        pack = Path(args.pack)
        if not (pack / "index.txt").is_file():
            ap.error(f"--pack {pack}: not a pack (no index.txt)")
    else:
        if not gguf.exists():
            synth.write_model(gguf, spec)
        if not pack.exists():
            build_pack(gguf, pack, progress=False)
    vocab = min(base.dims.n_vocab, 4096)
    tp = topic_prompts(args.prompts, args.prompt_len, seed=2, vocab=vocab, n_topics=8, topic_size=48, run_length=4,
                       topic_seed=0)  # fmt: skip
    prompts = [list(p) for p in tp.prompts]
    pairs = base.n_layers * int(base.dims.n_expert)
    rows = []
    print(
        f"{args.geometry}: TokenRouting({args.skew}), {pairs} (layer, expert) pairs, {args.prompts} topic prompts of "
        f"{args.prompt_len} ids x {args.tokens} tokens, one engine per row (the cache lives across the prompts), "
        f"device {args.device}; hit rate = hits / routed expert evaluations of the decode positions (counts)"
    )
    for f in fractions:
        slots = max(2, int(round(f * pairs)))
        for policy in ("fill", "class"):
            t0 = time.perf_counter()
            row = run_case(pack, args.device, slots, policy, prompts, args.tokens)
            row["fraction"] = f
            rows.append(row)
            tps = f", {row['decode_tok_s']} tok/s" if row["decode_tok_s"] else ""
            print(
                f"  {slots:6d} slots ({f:.0%}) {policy:5s}: hit rate {100 * row['hit_rate']:5.1f}% "
                f"({row['hits']} hits, {row['misses']} misses), {row['swaps']} swaps ({row['swaps_per_token']} a "
                f"token){tps}  [{time.perf_counter() - t0:.1f} s]",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
