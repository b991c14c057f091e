"""CPU decode: strata's CPU path against llama.cpp (llama-cpp-python) on the same GGUF files, same threads.

Not a test (``make bench-cpu``; README "On a GPU" has its rows). For each model it builds a strata pack (cached under
``--work``) and runs, each in its own process so that thread pools and memory do not mix:

- strata (``strata.engine.startup.load_engine`` with ``cpu_kernel`` = each of ``--kernels``, default ``q8``:
  llama.cpp's CPU numerics; ``exact`` and ``f32`` on request): greedy decode of ``--tokens`` tokens after an
  8-token prompt (the model's BOS, then ids 17, ..., 59, EOS ignored; ``--decode-after N``: after an N-id prompt, a
  long context), the first 8 greedy tokens compared with llama.cpp's (``same tokens``),
  ``tokens_per_second`` of strata.engine.generate (decode
  steps after the first), best of ``--reps`` runs after one warm-up run; in the same process the peak and
  final RssAnon (/proc/self/status, sampled every 5 ms) and the pool.bin pages resident right after start-up
  (/proc/self/smaps of the mapping: what start-up touched) beside the bytes of the vectors it has to read;
- llama.cpp through llama-cpp-python 0.3.36 (``--lcp``: a directory put first on its PYTHONPATH; default
  /opt/lcp_avx2 when present - the pip build crashes on AMX hosts): ``Llama(n_threads=n_threads_batch=T)``,
  the same prompt ids, then ``--tokens`` single-token ``eval`` calls on the greedy token, timed the same way,
  best of ``--reps`` after a warm-up.

Models: the real Gemma 3 270M and Qwen2.5 0.5B (``strata.packer.fetch``; cached), with ``--moe`` Qwen2.5 0.5B
upcycled to a real-weight MoE of 4 experts, 2 used (``strata.testing.upcycle``, as ``make demo``; llama.cpp runs it as
``llama`` with routed experts), and with ``--q7b`` the
synthetic Qwen2.5-7B geometry (strata.testing qwen2_spec, n_embd 3584, 28 layers, n_ff 18944, vocab 152064,
Q4_K with Q6_K ffn_down and output, ``fill="pattern"``; ~4.4 GiB, written once under ``--work``; skipped when
the machine has less than 3x its size in RAM). Threads: ``--threads`` (default ``2,all``: 2 and the cores
this process may use). Each row records the load average before and after (the machine may be shared).

Prints the table last and writes every number to ``--json`` (default bench/results/cpu-<host>-<date>.json).

    python bench/bench_cpu.py [--models gemma3-270m,qwen2.5-0.5b] [--moe] [--q7b] [--threads 2,all] [--tokens 32]
                              [--reps 3] [--kernels q8,exact] [--work /tmp/bench_cpu] [--lcp /opt/lcp_avx2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [10 + 7 * i for i in range(8)]
#: The prompt of the prompt-processing figure: ``--prompt-len`` ids (default 512, llama-bench's pp512), a fixed walk
#: over ids 10..4009 (token-dependent routing does not matter here: the real models are dense).
N_CTX = 1024


def long_prompt(n: int) -> list[int]:
    return [10 + (37 * i) % 4000 for i in range(n)]


def decode_prompt(a) -> list[int]:
    """The prompt the decode figure generates after: the 8 ids of ``PROMPT``, or with ``--decode-after N`` a prompt of
    N ids (the decode then reads N earlier positions: a long context); its first id replaced by the model's BOS
    (``a.bos`` >= 0) - a BOS-led prompt, as both engines see in use, whose greedy streams can be compared (without
    one, strata's and llama.cpp's streams differed from the first token on near-ties)."""
    p = PROMPT if a.decode_after <= len(PROMPT) else long_prompt(a.decode_after)
    return [a.bos] + p[1:] if getattr(a, "bos", -1) >= 0 else p


def bos_id(gguf: Path) -> int:
    """``tokenizer.ggml.bos_token_id`` of ``gguf`` (the first shard of a split model holds the metadata; gguf-py's
    reader), or -1 where the file has none."""
    from gguf import GGUFReader

    f = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.bos_token_id")
    return int(f.parts[f.data[0]][0]) if f is not None else -1


def n_ctx(a) -> int:
    """The context both engines are given: ``N_CTX``, or room for ``--decode-after`` + the tokens."""
    return max(N_CTX, a.decode_after + a.tokens + 16)


REAL = ("gemma3-270m", "qwen2.5-0.5b")


def q7b_spec():
    """The synthetic Qwen2.5-7B geometry (the CPU table's row; pattern fill: real byte traffic, meaningless text)."""
    from strata import testing as synth

    return synth.qwen2_spec(
        name="synthetic Qwen2.5-7B geometry",
        n_layers=28,
        fill="pattern",
        seed=1,
        dense_type="Q4_K",
        tensor_types={"ffn_down": "Q6_K", "output": "Q6_K"},
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


# ------------------------------------------------------------------ workers (one process per measurement)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _mapping_rss(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def strata_worker(a) -> dict:
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    from strata.engine.generate import generate
    from strata.engine.startup import load_engine

    t0 = time.perf_counter()
    eng = load_engine(a.pack, n_ctx=n_ctx(a), threads=a.threads, cpu_kernel=a.kernel, ubatch=a.ubatch)
    startup = time.perf_counter() - t0
    pool = str(Path(a.pack, "pool.bin").resolve())
    out = {
        "startup_s": round(startup, 2),
        "rss_anon_after_start_mib": round(_rss_anon() / 2**20, 1),
        "pool_rss_after_start_kib": round(_mapping_rss(pool) / 1024, 1),
        "f32_vectors_kib": round(eng.weights.nbytes_f32 / 1024, 1),
    }
    rates = []
    for rep in range(a.reps + 1):
        r = generate(eng, prompt_ids=decode_prompt(a), n_tokens=a.tokens, ignore_eos=True)
        if rep:
            rates.append(float(r.tokens_per_second))
    pp = []
    for rep in range(a.reps + 1):
        r_pp = generate(eng, prompt_ids=long_prompt(a.prompt_len), n_tokens=1, ignore_eos=True)
        if rep:
            pp.append(float(r_pp.prompt_tokens_per_second))
    stop.set()
    peak[0] = max(peak[0], _rss_anon())
    out.update(
        pp_tok_s=round(max(pp), 2),
        pp_runs=[round(x, 2) for x in pp],
        tok_s=round(max(rates), 2),
        runs=[round(x, 2) for x in rates],
        tokens=r.output_ids[:8],
        rss_anon_peak_mib=round(peak[0] / 2**20, 1),
        rss_anon_end_mib=round(_rss_anon() / 2**20, 1),
    )
    return out


def llama_worker(a) -> dict:
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(
        model_path=a.gguf,
        n_ctx=n_ctx(a),
        n_batch=512,
        n_ubatch=512,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        verbose=False,
    )
    startup = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def greedy() -> int:  # the last position's logits (llama_get_logits; logits_all is off, as in generation)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    rates, toks = [], []
    for rep in range(a.reps + 1):
        llm.reset()
        llm.eval(decode_prompt(a))
        tok = greedy()
        toks = [tok]
        t0 = time.perf_counter()
        for _ in range(a.tokens - 1):
            llm.eval([tok])
            tok = greedy()
            toks.append(tok)
        if rep:
            rates.append((a.tokens - 1) / (time.perf_counter() - t0))
    pp = []
    for rep in range(a.reps + 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(long_prompt(a.prompt_len))  # n_batch = n_ubatch = 512: llama-bench's pp with -ub 512
        if rep:
            pp.append(a.prompt_len / (time.perf_counter() - t0))
    return {
        "pp_tok_s": round(max(pp), 2),
        "pp_runs": [round(x, 2) for x in pp],
        "startup_s": round(startup, 2),
        "tok_s": round(max(rates), 2),
        "runs": [round(x, 2) for x in rates],
        "tokens": toks[:8],
        "rss_anon_end_mib": round(_rss_anon() / 2**20, 1),
    }


# ------------------------------------------------------------------ the driver

QUIET = {"load": None, "wait_s": 0.0}


def _wait_quiet() -> float:
    """With ``--quiet L``: wait (up to ``--quiet-wait`` s) until the 1-minute load average is below L - on a shared
    machine a descheduled OpenMP thread stalls every product's barrier. Returns the seconds waited."""
    if QUIET["load"] is None:
        return 0.0
    t0 = time.time()
    while os.getloadavg()[0] >= QUIET["load"] and time.time() - t0 < QUIET["wait_s"]:
        time.sleep(5)
    return time.time() - t0


def _run_worker(kind: str, env_extra: dict, **kw) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    env = dict(os.environ, **env_extra)
    waited = _wait_quiet()
    load0 = os.getloadavg()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    load1 = os.getloadavg()
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-1500:], "load_before": load0, "load_after": load1}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r.update(
        load_before=[round(x, 2) for x in load0],
        load_after=[round(x, 2) for x in load1],
        waited_for_quiet_s=round(waited),
    )
    return r


def _ensure_pack(gguf: Path, work: Path, name: str) -> Path:
    from strata.packer.build import build_pack

    pack = work / f"{name}-pack"
    if not (pack / "pool.bin").exists():
        build_pack(gguf, pack, progress=False)
    return pack


def _models(args, work: Path) -> list[tuple[str, Path, Path]]:
    from strata.packer.fetch import fetch_model

    out = []
    for name in [m for m in args.models.split(",") if m]:
        gguf = fetch_model(name, progress=False)
        out.append((name, gguf, _ensure_pack(gguf, work, name)))
    if args.moe:  # a real-weight MoE: Qwen2.5 0.5B upcycled to 4 experts, 2 used (as make demo builds it)
        from strata.testing.upcycle import write_upcycled_moe

        first = work / "qwen-moe-00001-of-00002.gguf"
        if not first.exists():
            t0 = time.perf_counter()
            write_upcycled_moe(fetch_model("qwen2.5-0.5b", progress=False), work / "qwen-moe.gguf")
            print(f"[moe] upcycled in {time.perf_counter() - t0:.1f} s", flush=True)
        out.append(("qwen2.5-0.5b upcycled MoE (4 experts, 2 used)", first, _ensure_pack(first, work, "qwen-moe")))
    if args.q7b:
        gguf = work / "qwen2-7b-geometry.gguf"
        spec = q7b_spec()
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if not gguf.exists():
            from strata import testing as synth

            need = 4.5 * 2**30  # the file; the pack's pool.bin holds the same bytes again
            if ram < 3 * need:
                print(f"[q7b] skipped: {ram / 2**30:.1f} GiB RAM < 3 x {need / 2**30:.1f} GiB", flush=True)
                return out
            t0 = time.perf_counter()
            synth.write_model(gguf, spec)
            print(f"[q7b] written in {time.perf_counter() - t0:.1f} s", flush=True)
        out.append(("qwen2.5-7b-geometry (synthetic)", gguf, _ensure_pack(gguf, work, "qwen2-7b-geometry")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["strata", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--pack", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--kernel", default="q8", help=argparse.SUPPRESS)
    ap.add_argument("--bos", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(REAL))
    ap.add_argument("--q7b", action="store_true", help="also the synthetic Qwen2.5-7B geometry (~4.4 GiB)")
    ap.add_argument(
        "--moe", action="store_true", help="also a real-weight MoE: Qwen2.5 0.5B upcycled to 4 experts (~1.1 GB)"
    )
    ap.add_argument("--threads", default="2,all")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt ids of the prompt-processing figure")
    ap.add_argument(
        "--decode-after", type=int, default=8, help="prompt ids before the decode figure's tokens (a long context)"
    )
    ap.add_argument("--ubatch", type=int, default=512, help="strata's -ub (llama.cpp runs n_ubatch 512)")
    ap.add_argument("--kernels", default="q8", help="strata CPU kernels to run (q8, exact, f32)")
    ap.add_argument("--work", default="/tmp/bench_cpu")
    ap.add_argument("--lcp", default="/opt/lcp_avx2" if Path("/opt/lcp_avx2").is_dir() else "")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--quiet",
        type=float,
        default=None,
        help="wait before each run until the 1-min load average is below this (a shared machine)",
    )
    ap.add_argument("--quiet-wait", type=float, default=1800, help="at most this many seconds per wait")
    args = ap.parse_args(argv)
    QUIET.update(load=args.quiet, wait_s=args.quiet_wait)
    if args.worker:
        args.threads = int(args.threads)
        r = strata_worker(args) if args.worker == "strata" else llama_worker(args)
        print(json.dumps(r))
        return 0

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ncores = len(os.sched_getaffinity(0))
    threads = sorted({ncores if t == "all" else int(t) for t in args.threads.split(",")})
    lcp_env = {"PYTHONPATH": os.pathsep.join(p for p in (args.lcp, os.environ.get("PYTHONPATH", "")) if p)}
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"host {socket.gethostname()}, {ncores} cores, uptime: {up}", flush=True)
    results = {
        "host": socket.gethostname(),
        "cores": ncores,
        "uptime_start": up,
        "tokens": args.tokens,
        "reps": args.reps,
        "prompt_ids": PROMPT,
        "decode_after": args.decode_after,
        "rows": [],
    }
    table = []
    for name, gguf, pack in _models(args, work):
        for t in threads:
            bos = bos_id(gguf)
            row = {"model": name, "threads": t, "gguf": str(gguf), "bos": bos, "strata": {}}
            for k in args.kernels.split(","):
                r = _run_worker(
                    "strata",
                    {},
                    pack=pack,
                    threads=t,
                    tokens=args.tokens,
                    reps=args.reps,
                    kernel=k,
                    prompt_len=args.prompt_len,
                    ubatch=args.ubatch,
                    decode_after=args.decode_after,
                    bos=bos,
                )
                row["strata"][k] = r
                print(f"  [{name}, {t} threads] strata {k}: {r}", flush=True)
            r = _run_worker(
                "llama",
                lcp_env,
                gguf=gguf,
                threads=t,
                tokens=args.tokens,
                reps=args.reps,
                prompt_len=args.prompt_len,
                decode_after=args.decode_after,
                bos=bos,
            )
            row["llama.cpp"] = r
            print(f"  [{name}, {t} threads] llama.cpp: {r}", flush=True)
            results["rows"].append(row)
            for k, s in row["strata"].items():
                # the first 8 greedy tokens of both engines on the same BOS-led prompt (q8: llama.cpp's numerics)
                s["same_tokens_as_llama"] = s.get("tokens") is not None and s.get("tokens") == r.get("tokens")
                table.append(
                    (
                        name,
                        t,
                        k,
                        s.get("tok_s"),
                        r.get("tok_s"),
                        s.get("pp_tok_s"),
                        r.get("pp_tok_s"),
                        s.get("rss_anon_peak_mib"),
                        max(s.get("load_before", [0])[0], s.get("load_after", [0])[0]),
                        s["same_tokens_as_llama"],
                    )
                )
    results["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    path = Path(
        args.json or ROOT / "bench" / "results" / f"cpu-{socket.gethostname()}-{datetime.date.today().isoformat()}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nresults: {path}\nuptime at the end: {results['uptime_end']}")
    print(
        f"\n{'model':<34} {'thr':>3} {'kernel':<6} {'decode tok/s':>12} {'llama.cpp':>10} {'ratio':>6} "
        f"{'pp tok/s':>9} {'llama.cpp':>10} {'ratio':>6} {'RssAnon MiB':>11} {'load':>5} {'same tokens':>11}"
    )
    for name, t, k, s, ll, ps, pl, rss, load, same in table:
        ratio = f"{s / ll:.2f}" if s and ll else "-"
        pratio = f"{ps / pl:.2f}" if ps and pl else "-"
        print(
            f"{name:<34} {t:>3} {k:<6} {s if s else '-':>12} {ll if ll else '-':>10} {ratio:>6} "
            f"{ps if ps else '-':>9} {pl if pl else '-':>10} {pratio:>6} {rss if rss else '-':>11} {load:>5.1f} "
            f"{'yes' if same else 'no':>11}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
