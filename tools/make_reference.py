#!/usr/bin/env python
"""Record llama.cpp's greedy decoding of a GGUF model as a JSON reference fixture.

Reference engine: llama.cpp through llama-cpp-python (0.3.36 here), driven exactly as
docs/DESIGN.md "Real models and the reference engine" describes:

    llm = Llama(model_path, n_ctx=512, logits_all=True, n_threads=2)
    ids = llm.tokenize(prompt.encode(), add_bos=True)   # BOS only where the GGUF asks
    llm.eval(ids)
    repeat: tok = argmax(llm.scores[llm.n_tokens - 1]); llm.eval([tok])

For every prompt the fixture holds prompt_ids, output_ids (``--steps`` greedy tokens,
default 24), the detokenized output text and, per step, the top-k ``[id, logit]``
pairs (logits are llama.cpp's float32 values, unscaled) and the top1-top2 margin.
Step 0 is the last prompt position (its argmax is output_ids[0]); step s is the
position after output_ids[s-1]. Ties are broken toward the lower token id, as
numpy.argmax does. The run is deterministic: llama.cpp's logits are bit-identical
across runs and thread counts, so regenerating must give the same file (no timing is
stored in it; timings go to stderr).

The logits do depend on which CPU kernels llama.cpp was compiled with. On this AMD EPYC
(AVX512 + VNNI + BF16) a native build (``CMAKE_ARGS="-DGGML_NATIVE=ON"``, the default)
reproduces the numbers of docs/DESIGN.md "Reference numbers"; a portable ``-DGGML_NATIVE=OFF`` build (AVX2
only) gives logits that differ by up to ~0.1-1.2 and a different greedy token for the
0.5B France prompt at step 2 (margin 0.046). Both are ~0.1 from a float64 NumPy forward
pass at step 0. The fixture therefore records ``llama_print_system_info()``; the
committed fixtures under tests/fixtures/reference were made with the native build.

Works with any GGUF llama.cpp can load (real models or synthetic ones with a
tokenizer). Examples::

    python tools/make_reference.py ~/.cache/strata/0.5b.gguf tests/fixtures/reference/qwen2.5-0.5b.json
    python tools/make_reference.py moe.gguf out.json --prompts "Hello" "1, 2, 3," --steps 8
    python tools/make_reference.py ~/.cache/strata/0.5b.gguf - --bench 64   # decode tok/s only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
]
FORMAT = "strata-reference-v1"


def sha256_file(path: Path) -> str:
    """Lower-case hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def top_k(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k largest logits of one row as (id, logit), by logit desc then id asc."""
    k = min(k, row.shape[0])
    idx = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    # include every id tied with the k-th value so the lower id wins deterministically
    kth = row[idx].min()
    cand = np.flatnonzero(row >= kth)
    order = sorted(cand.tolist(), key=lambda i: (-float(row[i]), i))[:k]
    return [(int(i), float(row[i])) for i in order]


def _load(model_path: Path, n_ctx: int, n_threads: int, logits_all: bool):
    from llama_cpp import Llama

    return Llama(model_path=str(model_path), n_ctx=n_ctx, logits_all=logits_all, n_threads=n_threads, verbose=False)


def greedy(llm, prompt: str, steps: int, k: int) -> dict:
    """Greedy-decode ``steps`` tokens after ``prompt``; return the fixture record."""
    llm.reset()
    prompt_ids = [int(t) for t in llm.tokenize(prompt.encode("utf-8"), add_bos=True)]
    if len(prompt_ids) + steps > llm.n_ctx():
        raise SystemExit(f"prompt of {len(prompt_ids)} tokens + {steps} steps exceeds n_ctx")
    t0 = time.perf_counter()
    llm.eval(prompt_ids)
    t_prompt = time.perf_counter() - t0
    out_ids: list[int] = []
    records = []
    t1 = time.perf_counter()
    for step in range(steps):
        pos = llm.n_tokens - 1
        row = np.asarray(llm.scores[pos], dtype=np.float32)
        tk = top_k(row, max(k, 2))
        tok = int(np.argmax(row))
        assert tok == tk[0][0], (tok, tk[0])
        records.append(
            {
                "step": step,
                "position": pos,
                "top": [[i, v] for i, v in tk[:k]],
                "margin": tk[0][1] - tk[1][1],
            }
        )
        out_ids.append(tok)
        if step + 1 < steps:
            llm.eval([tok])
    t_decode = time.perf_counter() - t1
    text = llm.detokenize(out_ids).decode("utf-8", errors="replace")
    print(
        f"  prompt {prompt!r}: {len(prompt_ids)} tok in {t_prompt:.3f} s; "
        f"{steps - 1} decode evals in {t_decode:.3f} s "
        f"({(steps - 1) / t_decode if t_decode > 0 else float('nan'):.1f} tok/s, logits_all=True)"
        f" -> {text!r}",
        file=sys.stderr,
    )
    return {
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "output_ids": out_ids,
        "output_text": text,
        "steps": records,
    }


def bench_decode(
    model_path: Path,
    n_threads: int,
    n_tokens: int,
    n_ctx: int = 512,
    prompt: str = DEFAULT_PROMPTS[0],
    repeats: int = 3,
) -> dict:
    """Decode speed of llama.cpp (tokens/s) for single-token greedy evals.

    Loads with logits_all=False (only the last row is computed, as a server would),
    evaluates the prompt, then times ``n_tokens`` single-token evals plus argmax.
    Reports the best of ``repeats`` runs.
    """
    llm = _load(model_path, n_ctx, n_threads, logits_all=False)
    ids = llm.tokenize(prompt.encode(), add_bos=True)
    rates = []
    for _ in range(repeats):
        llm.reset()
        llm.eval(ids)
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([tok])
        rates.append(n_tokens / (time.perf_counter() - t0))
    return {
        "model": model_path.name,
        "n_threads": n_threads,
        "n_tokens": n_tokens,
        "tok_per_s_best": max(rates),
        "tok_per_s_all": rates,
    }


def make_reference(
    model_path: Path, prompts: list[str], steps: int = 24, k: int = 5, n_ctx: int = 512, n_threads: int = 2
) -> dict:
    """Run greedy decoding for every prompt and return the fixture as a dict."""
    import llama_cpp

    llm = _load(model_path, n_ctx, n_threads, logits_all=True)
    meta = dict(getattr(llm, "metadata", {}) or {})
    results = [greedy(llm, p, steps, k) for p in prompts]
    return {
        "format": FORMAT,
        "model": {
            "file": model_path.name,
            "sha256": sha256_file(model_path),
            "size_bytes": model_path.stat().st_size,
            "arch": meta.get("general.architecture", ""),
            "n_vocab": int(llm.n_vocab()),
        },
        "engine": {
            "name": "llama.cpp via llama-cpp-python",
            "llama_cpp_python": llama_cpp.__version__,
            # CPU kernels compiled in (e.g. AVX2 vs AVX512): logits depend on them
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "n_ctx": n_ctx,
            "n_threads": n_threads,
            "logits_all": True,
            "add_bos": True,
            "decoding": "greedy (argmax over the last row of scores, lowest id on ties)",
        },
        "n_steps": steps,
        "top_k": k,
        "prompts": results,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="GGUF file")
    ap.add_argument("output", help="output JSON path ('-' for stdout)")
    ap.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="prompts to run (default: France, a Python def, a story opening)",
    )
    ap.add_argument("--steps", type=int, default=24, help="greedy tokens per prompt (default 24)")
    ap.add_argument("--top-k", type=int, default=5, help="pairs recorded per step (default 5)")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--bench",
        type=int,
        default=0,
        metavar="N",
        help="only measure decode tok/s over N tokens (logits_all=False); prints JSON, writes no fixture",
    )
    args = ap.parse_args(argv)
    if not args.model.is_file():
        ap.error(f"no such file: {args.model}")
    if args.steps < 1 or args.top_k < 1:
        ap.error("--steps and --top-k must be >= 1")

    if args.bench:
        res = bench_decode(args.model, args.threads, args.bench, n_ctx=args.n_ctx)
        print(json.dumps(res))
        return 0

    ref = make_reference(
        args.model,
        args.prompts or DEFAULT_PROMPTS,
        steps=args.steps,
        k=args.top_k,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
    )
    text = json.dumps(ref, indent=1, ensure_ascii=False) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
