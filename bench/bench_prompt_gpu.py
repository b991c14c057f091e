"""Prompt processing on the GPU (pp512): strata's chunked prompt beside llama-bench ``-p 512`` on the same GGUF.

Not a test: a benchmark for the GPU machine (``bench/device_prompt.sh``). For each ``--geometry`` it writes the
synthetic GGUF (bench_moe's geometries; MoE ones with ``TokenRouting(skew)`` routers, so a chunk's tokens route to
many experts as real text does) and its pack, then per case, each in a process of its own:

- strata ``--device cuda -ub 512``: a prompt of 513 token-dependent ids (``strata.testing.routing.topic_prompts``),
  one token generated; pp tok/s = 512 / the chunk's seconds (the last prompt position runs alone, as llama.cpp's
  pp512 has no 513th position), best of ``--repeats`` (each run's in ``runs_tok_s``); ``-ub 1`` once on the first
  case (the one-position path);
- cases: ``all`` (every expert resident), ``half`` (layers L/2..L-1 resident: llama.cpp's ``-ncmoe L/2``),
  ``none`` (``--expert-cache 0``: llama.cpp's ``-ncmoe L``), ``16G`` / ``24G`` (``--card``, reserve 1024 MiB);
- llama.cpp (``--llama-bench``): ``llama-bench -p 512 -n 0 -ngl 99 -ncmoe 0,L/2,L -ub 512``, and for a card
  ``-fitt M`` with M = free now - (card total - 527 MiB) + 1024 (../shared/BENCH.md).

    python3 bench/bench_prompt_gpu.py --work /tmp/pp --geometry qwen2-7b --cases all [--llama-bench LB] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CARD_MIB = {"16G": 15848, "24G": 24210}


def case_kwargs(case: str, n_layer: int, n_expert: int, ubatch: int, n_ctx: int) -> dict:
    """``load_engine`` keywords of one case (the module docstring's ``all`` / ``half`` / ``none`` / a card)."""
    from strata.budget.cards import card_preset

    kw: dict = {"device": "cuda", "n_ctx": n_ctx, "ubatch": ubatch}
    if case == "half":  # the experts of layers L/2..L-1 resident (what llama.cpp's -ncmoe L/2 keeps on the GPU)
        half = [(il, e, 1) for il in range(n_layer // 2, n_layer) for e in range(n_expert)]
        kw.update(profile=half, expert_cache=len(half))
    elif case == "none":
        kw["expert_cache"] = 0
    elif case in CARD_MIB:
        kw.update(card=card_preset(case), vram_reserve_mib=1024)
    elif case != "all":
        raise ValueError(f"unknown case {case!r}: all, half, none, {', '.join(CARD_MIB)}")
    return kw


def topic_ids(vocab: int) -> list[int]:
    """The 513-id token-dependent prompt every case runs (ids below ``min(vocab, 4096)``)."""
    from strata.testing.routing import topic_prompts

    v = min(vocab, 4096)
    tp = topic_prompts(1, 513, seed=3, vocab=v, n_topics=8, topic_size=48, run_length=4, topic_seed=0)
    return list(tp.prompts[0])


def one(pack: str, case: str, n_layer: int, n_expert: int, ubatch: int, repeats: int, ids: list[int]) -> dict:
    """One case in this process: load, run the prompt ``repeats`` times; the row as a dict."""
    from strata.engine.generate import generate
    from strata.engine.startup import load_engine

    kw = case_kwargs(case, n_layer, n_expert, ubatch, len(ids) + 8)
    t0 = time.perf_counter()
    eng = load_engine(pack, **kw)
    start_s = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
        r = generate(eng, prompt_ids=ids, n_tokens=1, ignore_eos=True)
        chunk = [s for s in r.steps if s.phase == "prompt"]
        secs = sum(s.forward_ms for s in chunk) / 1000
        runs.append(len(chunk) / secs)
    return {
        "case": case,
        "ubatch": ubatch,
        "pp_tok_s": round(max(runs), 1),
        "runs_tok_s": [round(t, 1) for t in runs],  # in order: a first run slower than the rest shows here
        "positions": len(ids) - 1,
        "start_s": round(start_s, 1),
        "slots": eng.gpu.slot_plan.slots if eng.gpu.slot_plan else None,
        "miss_tier": eng.gpu.miss_tier or "-",
        "chunk_bytes": eng.gpu.chunk_bytes,
        "staged": eng.experts.chunk_path.staged if eng.experts is not None and eng.experts.chunk_path else 0,
        "tier_copied": eng.experts.chunk_path.tier_copied if eng.experts is not None and eng.experts.chunk_path else 0,
    }


def llama_rows(lb: str, gguf: Path, n_layer: int, moe: bool, cards: list[str]) -> list[dict]:
    """llama-bench pp512 rows (``avg_ts``), ``-ncmoe`` and ``-fitt`` as the module docstring says."""
    rows = []
    runs = [("ncmoe", ["-ncmoe", f"0,{n_layer // 2},{n_layer}"] if moe else [])]
    for c in cards:
        free = int(
            subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            ).stdout.split()[0]
        )
        runs.append((c, ["-fitt", str(free - (CARD_MIB[c] - 527) + 1024)]))
    for what, extra in runs:
        cmd = [
            lb,
            "-m",
            str(gguf),
            "-p",
            "512",
            "-n",
            "0",
            "-ngl",
            "99",
            "-ub",
            "512",
            "-r",
            "3",
            "-t",
            "16",
            "-o",
            "json",
        ]
        p = subprocess.run(cmd + extra, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"  llama-bench {what}: exit {p.returncode}: {p.stderr[-800:]}", flush=True)
            continue
        for r in json.loads(p.stdout):
            row = {"run": what, "n_cpu_moe": r.get("n_cpu_moe"), "pp_tok_s": round(float(r["avg_ts"]), 1)}
            rows.append(row)
            print(f"  llama.cpp {what} ncmoe={row['n_cpu_moe']}: pp512 {row['pp_tok_s']} tok/s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        pack, case, n_layer, n_expert, ub, reps, ids = argv[1:]
        print(json.dumps(one(pack, case, int(n_layer), int(n_expert), int(ub), int(reps), json.loads(ids))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/bench_prompt_gpu")
    ap.add_argument("--geometry", default="qwen2-7b")
    ap.add_argument("--cases", default="all")
    ap.add_argument("--skew", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--ub1", action="store_true", help="also -ub 1 (one position at a time) on the first case")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from bench_moe import geometries

    from strata import testing as synth
    from strata.engine.gpu.kernels import gpu_available

    if args.geometry not in geometries():
        ap.error(f"--geometry {args.geometry}: one of {', '.join(sorted(geometries()))}")
    bad = [c for c in args.cases.split(",") if c not in ("all", "half", "none", *CARD_MIB)]
    if bad:
        ap.error(f"--cases {','.join(bad)}: each one of all, half, none, {', '.join(CARD_MIB)}")
    ok, why = gpu_available()
    if not ok and not args.prepare_only:  # before writing a file of up to tens of GB
        print(f"bench_prompt_gpu: no GPU to measure on ({why}); --prepare-only writes the files", file=sys.stderr)
        return 2
    from strata.packer.build import build_pack
    from strata.testing.routing import TokenRouting

    base = geometries()[args.geometry]
    moe = "moe" in args.geometry or "next" in args.geometry
    spec = base.model_copy(update={"routing": TokenRouting(skew=args.skew)}) if moe else base
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gguf, pack = work / f"{args.geometry}.gguf", work / f"{args.geometry}-pack"
    if not gguf.exists():
        synth.write_model(gguf, spec)
    if not pack.exists():
        build_pack(gguf, pack, progress=False)
    os.sync()  # the files just written flushed before anything is timed (a 24G row measured during the flush of a
    # 45 GB GGUF ran ~30% slow: bench/results/h200-2026-12-02x/y)
    if args.prepare_only:
        return 0
    n_layer = base.n_layers
    ids = topic_ids(base.dims.n_vocab)
    out: dict = {"args": vars(args), "strata": [], "llama.cpp": []}
    failed: list[str] = []
    cases = [(c, 512) for c in args.cases.split(",")]
    if args.ub1:
        cases.insert(1, (cases[0][0], 1))
    for case, ub in cases:
        reps = 1 if ub == 1 else args.repeats
        n_expert = int(base.dims.n_expert or 0) if moe else 0
        cmd = [sys.executable, __file__, "--one", str(pack), case, str(n_layer), str(n_expert), str(ub), str(reps)]
        cmd.append(json.dumps(ids))
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"  strata {case} -ub {ub}: exit {p.returncode}: {p.stderr[-2000:]}", flush=True)
            failed.append(case)
            continue
        row = json.loads(p.stdout.strip().splitlines()[-1])
        out["strata"].append(row)
        print(f"  strata [{args.geometry}] {json.dumps(row)}", flush=True)
    if args.llama_bench:
        cards = [c for c in args.cases.split(",") if c in CARD_MIB]
        out["llama.cpp"] = llama_rows(args.llama_bench, gguf, n_layer, moe, cards)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if failed:
        print(f"bench_prompt_gpu: strata failed on {', '.join(failed)} (above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
