"""MoE (and dense) decode at real models' geometry: strata's engine vs llama.cpp on the same files.

Not a test: a benchmark for the GPU machine (``make bench-moe``; the decode table). For each geometry
below it writes a synthetic GGUF of that shape with :func:`strata.testing.write_model`
(``fill="pattern"``: one ~64 KiB random block pattern per tensor, tiled, so 18 GiB take seconds;
random weights give meaningless text but real byte traffic), builds the pack, and measures:

- strata ``--device cuda``: start-up per checkpoint (s), then greedy decode tok/s (a 16-token
  prompt, ``--tokens`` generated, EOS ignored) with the experts of ALL layers resident, of the last
  half of the layers (layers 0..L/2-1 computed on the CPU: what llama.cpp's ``--n-cpu-moe L/2``
  keeps on the CPU), and of NONE (``--expert-cache 0``); the decode path and launches per token; every
  row once per ``--kernels`` entry (``q8``, the engine's default: llama.cpp's numerics on the GPU and for
  the CPU misses, bit-identical to each other; ``exact``: ``strata-engine generate --kernel exact``);
- strata ``--device cpu`` (``--cpu``);
- llama.cpp (``--llama-bench PATH``, a CUDA build): ``llama-bench -p 0 -n N -ngl 99 -ncmoe 0,L/2,L``
  (and ``-ngl 0`` for the CPU row), its ``avg_ts``.

Prints a table (tok/s side by side, ratio) and writes every number to ``--json`` (default
``$OUT/bench_moe.json``).

Geometries (``--geometry``, repeatable; sizes of the written file):

- ``qwen3moe-30b-a3b``: Qwen3-30B-A3B's shape: 48 layers, n_embd 2048, 32 q / 4 kv heads of 128,
  128 experts of 768 (8 used), vocab 151936; experts Q4_K gate/up + Q6_K down, dense Q8_0 (~18 GiB);
- ``qwen2-7b``: Qwen2.5-7B's shape: 28 layers, n_embd 3584, 28 / 4 heads of 128, n_ff 18944, vocab
  152064; Q4_K with Q6_K ffn_down and output (~4.6 GiB);
- ``gemma3-270m``: Gemma 3 270M's shape: 18 layers, n_embd 640, 4 q / 1 kv head of 256, n_ff 2048, vocab
  262144, tied output; Q5_0 with a Q8_0 token_embd and attn_v, Q4_K attn_output, Q6_K ffn_down (~0.25 GiB);
- ``qwen2-0.5b``: Qwen2.5 0.5B's shape: 24 layers, n_embd 896, 14 / 2 heads of 64, n_ff 4864, vocab 151936;
  Q5_0 with a Q8_0 output and attn_v, Q6_K ffn_down (~0.4 GiB);
- ``qwen3moe-small``: a 4-layer, 32-expert qwen3moe for a dry run of this script (any machine).

    python bench/bench_moe.py --work /tmp/bench_moe [--geometry qwen3moe-30b-a3b] [--tokens 64]
                              [--llama-bench build/bin/llama-bench] [--cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def geometries():
    """name -> ModelSpec (strata.testing presets with real models' dimensions, pattern fill)."""
    from strata import testing as synth

    q30 = synth.qwen3moe_spec(
        name="synthetic Qwen3-30B-A3B geometry",
        n_layers=48,
        fill="pattern",
        seed=1,
        dims={
            "n_embd": 2048,
            "n_head": 32,
            "n_head_kv": 4,
            "head_dim": 128,
            "n_expert": 128,
            "n_expert_used": 8,
            "n_ff_exp": 768,
            "n_vocab": 151936,
            "context_length": 40960,
        },
        expert_types=[("Q4_K", "Q6_K")] * 48,
    )
    q7 = synth.qwen2_spec(
        name="synthetic Qwen2.5-7B geometry",
        n_layers=28,
        fill="pattern",
        seed=1,
        dense_type="Q4_K",
        tensor_types={"ffn_down": "Q6_K", "output": "Q6_K", "attn_output": "Q4_K"},
        dims={
            "n_embd": 3584,
            "n_head": 28,
            "n_head_kv": 4,
            "head_dim": 128,
            "n_ff": 18944,
            "n_vocab": 152064,
            "context_length": 32768,
        },
    )
    # the two small dense rows of the decode table, with the real files' type mix (the registry's Gemma 3 270M
    # Q4_K_M and Qwen2.5 0.5B: n_embd 640 / 896 rows are not multiples of 256, so most of their tensors are Q5_0
    # / Q8_0)
    g270 = synth.gemma3_spec(
        name="synthetic Gemma-3-270M geometry",
        n_layers=18,
        fill="pattern",
        seed=1,
        dense_type="Q5_0",
        tensor_types={"token_embd": "Q8_0", "attn_output": "Q4_K", "attn_v": "Q8_0", "ffn_down": "Q6_K"},
        dims={
            "n_embd": 640,
            "n_head": 4,
            "n_head_kv": 1,
            "head_dim": 256,
            "n_ff": 2048,
            "n_vocab": 262144,
            "context_length": 32768,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
        },
    )
    q05 = synth.qwen2_spec(
        name="synthetic Qwen2.5-0.5B geometry",
        n_layers=24,
        fill="pattern",
        seed=1,
        dense_type="Q5_0",
        tensor_types={"token_embd": "Q5_0", "output": "Q8_0", "attn_v": "Q8_0", "ffn_down": "Q6_K"},
        dims={
            "n_embd": 896,
            "n_head": 14,
            "n_head_kv": 2,
            "head_dim": 64,
            "n_ff": 4864,
            "n_vocab": 151936,
            "context_length": 32768,
        },
    )
    small = synth.qwen3moe_spec(
        name="small qwen3moe (dry run)",
        n_layers=4,
        fill="pattern",
        seed=1,
        dims={
            "n_embd": 512,
            "n_head": 8,
            "n_head_kv": 2,
            "head_dim": 64,
            "n_expert": 32,
            "n_expert_used": 4,
            "n_ff_exp": 256,
            "n_vocab": 2048,
        },
        expert_types=[("Q4_K", "Q6_K")] * 4,
    )
    # Qwen3-Next-80B-A3B's shape (qwen3next: full attention every 4th layer, the others the gated delta net; 512
    # experts of which 10 routed, a shared expert; IQ2_XS experts: ~22 GiB instead of ~50)
    q80 = synth.qwen3next_spec(
        name="synthetic Qwen3-Next-80B-A3B geometry",
        n_layers=48,
        fill="pattern",
        seed=1,
        dims={
            "n_embd": 2048,
            "n_head": 16,
            "n_head_kv": 2,
            "head_dim": 256,
            "rope_dim": 64,
            "n_expert": 512,
            "n_expert_used": 10,
            "n_ff_exp": 512,
            "n_ff_shexp": 512,
            "ssm_d_state": 128,
            "ssm_n_group": 16,
            "ssm_dt_rank": 32,
            "ssm_d_conv": 4,
            "full_attention_interval": 4,
            "n_vocab": 151936,
            "context_length": 262144,
        },
        expert_types=[("IQ2_XS", "IQ2_XS")] * 48,
    )
    return {
        "qwen3moe-30b-a3b": q30,
        "qwen2-7b": q7,
        "gemma3-270m": g270,
        "qwen2-0.5b": q05,
        "qwen3moe-small": small,
        "qwen3next-80b-a3b": q80,
    }


def _prompt_ids(n: int = 16) -> list[int]:
    return [int(10 + 7 * i) for i in range(n)]


def _rss_anon_mib() -> float | None:
    """This process's anonymous resident memory (MiB, /proc/self/status RssAnon; None off Linux): the
    CPU path's memory bound (the weights stay in the page cache, file-backed)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation, min and max of ``values`` (tok/s), rounded to 0.01: the same
    two figures llama-bench reports per row (``avg_ts``, ``stddev_ts``), plus the range."""
    n = len(values)
    mean = sum(values) / n
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return {"mean": round(mean, 2), "stddev": round(sd, 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def strata_run(pack: Path, device: str, tokens: int, repeats: int = 1, **opts) -> dict:
    """Load the engine (start-up timed per checkpoint) and decode ``repeats`` times (each: the 16-token
    prompt, then ``tokens`` tokens); ``decode_tok_s`` is the mean over the repeats (tokens after the
    first / seconds), ``decode_tok_s_spread`` their mean, sample stddev, min and max."""
    from strata.engine.generate import generate
    from strata.engine.startup import load_engine

    anon0 = _rss_anon_mib()
    t0 = time.perf_counter()
    eng = load_engine(pack, device=device, n_ctx=512, **opts)
    startup = time.perf_counter() - t0
    runs = [generate(eng, prompt_ids=_prompt_ids(), n_tokens=tokens, ignore_eos=True) for _ in range(repeats)]
    r = runs[-1]
    rates = [float(x.tokens_per_second) for x in runs]
    out = {
        "startup_s": round(startup, 2),
        "checkpoints_s": {c.name: round(c.seconds, 2) for c in eng.checkpoints if hasattr(c, "seconds")},
        "decode_tok_s": spread(rates)["mean"],
        "decode_tok_s_spread": spread(rates),
        "decode_tok_s_runs": [round(v, 2) for v in rates],
        "tokens": r.output_ids[:8],
        "expert_hits": getattr(r, "expert_hits", None),
        "expert_misses": getattr(r, "expert_misses", None),
        "rss_anon_mib": {"before_load": anon0, "after_decode": _rss_anon_mib()},
    }
    gpu = getattr(eng, "gpu", None)
    if gpu is not None:
        out["decode_path"] = gpu.decode_path
        out["launches_per_token"] = gpu.launches_per_token
        if gpu.slot_plan is not None:
            out["slots"] = gpu.slot_plan.slots
    del eng
    return out


def llama_bench(
    exe: str, gguf: Path, tokens: int, ngl: int, ncmoe: list[int] | None, threads: int, repeats: int = 5
) -> list[dict]:
    """llama-bench's tg rows (``avg_ts``, ``stddev_ts`` over ``repeats`` runs) for ``ncmoe`` values (None: no
    -ncmoe flag)."""
    cmd = [
        exe,
        "-m",
        str(gguf),
        "-p",
        "0",
        "-n",
        str(tokens),
        "-ngl",
        str(ngl),
        "-r",
        str(repeats),
        "-t",
        str(threads),
        "-o",
        "json",
    ]
    if ncmoe is not None:
        cmd += ["-ncmoe", ",".join(str(n) for n in ncmoe)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> exit {p.returncode}: {p.stderr[-800:]}")
    rows = json.loads(p.stdout)
    return [
        {
            "n_cpu_moe": r.get("n_cpu_moe"),
            "ngl": r.get("n_gpu_layers"),
            "avg_ts": r.get("avg_ts"),
            "stddev_ts": r.get("stddev_ts"),
        }
        for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/bench_moe", help="where the GGUFs and packs are written")
    ap.add_argument("--geometry", action="append", help="geometry name (repeatable; default qwen3moe-30b-a3b)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llama-bench", default=None, help="path of a CUDA llama-bench (skipped when absent)")
    ap.add_argument("--cpu", action="store_true", help="also the CPU path (strata and llama.cpp -ngl 0)")
    ap.add_argument("--no-gpu", action="store_true", help="skip strata's GPU rows (a dry run without CuPy)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--kernels",
        default="q8,exact",
        help="matvec kernels, comma-separated, one strata row per kernel and case (--kernel: q8, the "
        "default, llama.cpp's numerics on the GPU and for the CPU misses, bit-identical to each "
        "other; exact: f32 products in the exact kernels' order on both)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="decode runs per strata row and llama-bench repetitions (-r) per llama.cpp row; both report "
        "mean and sample stddev",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from strata import testing as synth
    from strata.packer.build import build_pack

    geos = geometries()
    names = args.geometry or ["qwen3moe-30b-a3b"]
    unknown = [n for n in names if n not in geos]
    if unknown:
        ap.error(f"--geometry {', '.join(unknown)}: known: {', '.join(geos)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"tokens": args.tokens, "threads": args.threads, "rows": []}
    table: list[tuple[str, str, tuple[float, float] | None, tuple[float, float] | None]] = []
    for name in names:
        spec = geos[name]
        gguf = work / f"{name}.gguf"
        t0 = time.perf_counter()
        if not gguf.exists():
            synth.write_model(gguf, spec)
        t_write = time.perf_counter() - t0
        pack = work / f"{name}-pack"
        t0 = time.perf_counter()
        if not pack.exists():
            build_pack(gguf, pack, progress=False)
        t_pack = time.perf_counter() - t0
        gib = gguf.stat().st_size / 2**30
        print(f"[{name}] {gib:.2f} GiB written in {t_write:.1f} s, packed in {t_pack:.1f} s", flush=True)
        row: dict = {
            "geometry": name,
            "file_gib": round(gib, 3),
            "write_s": round(t_write, 1),
            "pack_s": round(t_pack, 1),
            "spec": spec.model_dump(mode="json", exclude={"expert_types"}),
            "strata": {},
            "llama.cpp": {},
        }
        L = spec.n_layers
        moe = bool(synth.moe_layers(spec))
        E = spec.dims.n_expert
        # strata rows: key -> engine options; llama.cpp's -ncmoe value for the same share on the CPU
        cases: list[tuple[str, dict, int | None]] = []
        for k in args.kernels.split(","):
            if k not in ("q8", "exact"):
                ap.error(f"--kernels {k}: expected q8 or exact")
            tag, ko = ("" if k == "q8" else f", {k}"), {"cpu_kernel": k}
            if moe:
                half = [(il, e, 1) for il in range(L // 2, L) for e in range(E)]  # last half resident
                cases += [
                    (f"gpu, all experts resident{tag}", ko, 0),
                    (
                        f"gpu, layers {L // 2}..{L - 1} resident (ncmoe {L // 2}){tag}",
                        {"profile": half, "expert_cache": len(half), **ko},
                        L // 2,
                    ),
                    (f"gpu, no expert resident{tag}", {"expert_cache": 0, **ko}, L),
                ]
            else:
                cases.append((f"gpu{tag}", ko, None))
        lb: dict[int | None, tuple[float, float]] = {}
        if args.llama_bench and Path(args.llama_bench).exists():
            try:
                rows = llama_bench(
                    args.llama_bench,
                    gguf,
                    args.tokens,
                    99,
                    sorted({c[2] for c in cases}) if moe else None,
                    args.threads,
                    args.repeats,
                )
                row["llama.cpp"]["gpu"] = rows
                for r in rows:
                    lb[r["n_cpu_moe"] if moe else None] = (r["avg_ts"], r["stddev_ts"])
            except Exception as e:  # reported, the strata rows still run
                row["llama.cpp"]["gpu_error"] = str(e)
                print(f"  llama-bench failed: {e}", flush=True)
        for key, opts, ncmoe in cases:
            if args.no_gpu:
                table.append((name, key, None, lb.get(ncmoe)))
                continue
            try:
                r = strata_run(pack, "cuda", args.tokens, args.repeats, **opts)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"}
            row["strata"][key] = r
            print(f"  strata {key}: {r}", flush=True)
            sp = r.get("decode_tok_s_spread")
            table.append((name, key, (sp["mean"], sp["stddev"]) if sp else None, lb.get(ncmoe)))
        if args.cpu:
            try:
                r = strata_run(pack, "cpu", max(8, args.tokens // 8))
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"}
            row["strata"]["cpu"] = r
            print(f"  strata cpu: {r}", flush=True)
            lcpu = None
            if args.llama_bench and Path(args.llama_bench).exists():
                try:
                    rows = llama_bench(args.llama_bench, gguf, max(8, args.tokens // 8), 0, None, args.threads)
                    row["llama.cpp"]["cpu"] = rows
                    lcpu = (rows[0]["avg_ts"], rows[0]["stddev_ts"])
                except Exception as e:
                    row["llama.cpp"]["cpu_error"] = str(e)
            sp = r.get("decode_tok_s_spread")
            table.append((name, f"cpu ({args.threads} threads)", (sp["mean"], sp["stddev"]) if sp else None, lcpu))
        results["rows"].append(row)
    path = args.json or (os.path.join(os.environ["OUT"], "bench_moe.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(results, indent=1) + "\n")

    def cell(v: tuple[float, float] | None) -> str:
        return f"{v[0]:.1f} +- {v[1]:.1f}" if v else "-"

    print(f"\n{'geometry':<18} {'case':<54} {'strata tok/s':>14} {'llama.cpp':>14} {'ratio':>6}")
    for name, key, st, lcpp in table:
        ratio = f"{st[0] / lcpp[0]:.2f}" if st and lcpp else "-"
        print(f"{name:<18} {key:<54} {cell(st):>14} {cell(lcpp):>14} {ratio:>6}")
    print("(mean +- sample stddev over the repeats; both columns from this run, on the same files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
