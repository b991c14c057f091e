"""Benchmark (not a test): `strata-budget check` on the qwen3next reference model.

Writes the qwen3next reference geometry as a header-only sparse GGUF (n_embd 2560, 48 layers,
full attention every 4th layer, 512 experts of width 640, 150k vocab, 1,000+ tensors:
``synth.reference_model_header_only``), builds its pack (the pool is a few GB of zeros on
disk), then times, best of ``--repeat`` warm runs:

- the library audit alone (``audit_pack``) with the BF16 value scan, and without it (the rest),
- audit + plan (``audit_pack`` + ``make_plan``, what the command computes),
- the whole command in a child process (``strata-budget check PACK --card 24G --json``: interpreter
  start-up and imports included).

The reference model's own file has 891 tensors (747 dense + 144 expert tensors; the C++ engine's real
index listed 1,079, with tensor kinds no contract describes), so the run is repeated with the same
geometry extended to 64 layers (same interval, same per-layer pattern): 1,187 tensors.

Goal: well under a second. Everything it writes is removed at the end.

    python bench/bench_budget.py [--dir /tmp] [--repeat 5] [--layers 48 64] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def best(fn, repeat: int) -> tuple[float, object]:
    out = None
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def write_reference_model(path: Path, n_layers: int):
    """The qwen3next reference model (synth.reference_model_plan), with layers 48.. repeating
    the pattern of layers 0.. when ``n_layers`` > 48 (48 is a multiple of the interval 4)."""
    from strata.testing import reference_model_plan, write_header_only

    kv, tensors = reference_model_plan()
    if n_layers != 48:
        if n_layers < 48 or n_layers % 4:
            raise SystemExit(f"--layers {n_layers}: use 48 or more, a multiple of 4")
        kv["qwen3next.block_count"] = n_layers
        head = [
            t
            for t in tensors
            if not t[0].startswith("blk.") and t[0] != "output_norm.weight" and t[0] != "output.weight"
        ]
        tail = [t for t in tensors if t[0] in ("output_norm.weight", "output.weight")]
        body = [t for t in tensors if t[0].startswith("blk.")]
        extra = []
        for il in range(48, n_layers):
            src = f"blk.{il - 48}."
            extra += [(f"blk.{il}." + n[len(src) :], ty, ne) for n, ty, ne in body if n.startswith(src)]
        tensors = head + body + extra + tail
    return write_header_only(path, "qwen3next", kv, tensors), len(tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the model and the pack")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--layers", type=int, nargs="+", default=[48, 64], help="layer counts to run (48 = the reference model's)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the files (default: removed)")
    args = ap.parse_args()
    for n in args.layers:
        run(args, n)


def run(args, n_layers: int) -> None:
    from strata.budget.audit import audit_pack
    from strata.budget.cards import card_preset
    from strata.budget.plan import PlanOptions, make_plan
    from strata.packer.build import build_pack

    work = Path(tempfile.mkdtemp(prefix="bench-budget-", dir=args.dir))
    try:
        src = work / f"reference-qwen3next-{n_layers}L.gguf"
        t0 = time.perf_counter()
        _lay, n_tensors = write_reference_model(src, n_layers)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = build_pack(src, work / "pack", progress=False)
        t_build = time.perf_counter() - t0
        print(
            f"\n== {n_layers} layers: model {src.stat().st_size / 2**30:.1f} GiB logical, {n_tensors} tensors, "
            f"written in {t_write:.2f} s; "
            f"pack: {r.dense_tensors} dense tensors, pool {r.pool_bytes / 2**30:.2f} GiB, {r.expert_layers} expert "
            f"layers, built in {t_build:.1f} s"
        )

        audit_pack(work / "pack")  # warm the page cache and the imports
        t_full, res = best(lambda: audit_pack(work / "pack"), args.repeat)
        t_rest, _ = best(lambda: audit_pack(work / "pack", bf16_scan=False), args.repeat)
        card = card_preset("24G")
        t_plan, plan = best(
            lambda: make_plan(audit_pack(work / "pack").facts, card, PlanOptions(n_ctx=32768)), args.repeat
        )
        assert res.ok, res.errors[:5]
        print(
            f"audit, full (BF16 scan of {res.bf16_tensors} tensors, {res.bf16_values_scanned:,} values): {t_full:.3f} s"
        )
        print(f"audit without the BF16 value scan:                         {t_rest:.3f} s")
        print(f"audit + plan (24G, 32K context):                            {t_plan:.3f} s")
        print("audit stages (last full run): " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in res.seconds.items()))
        cmd = [
            sys.executable,
            "-m",
            "strata.budget.cli",
            "check",
            str(work / "pack"),
            "--card",
            "24G",
            "--max-context",
            "32768",
            "--json",
        ]
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
        d = json.loads(p.stdout)
        print(
            f"strata-budget check (child process, imports included):     {min(times):.3f} s  (exit {p.returncode}: "
            f"{d['verdict_line']})"
        )
        print(
            f"  max_blob {d['max_blob']:,} B engine form ({d['max_blob_source']:,} B source), {d['slots']} slots, "
            f"KV {d['kv_bytes_per_token']:,} B/token, recurrent {d['recurrent_state_bytes_per_seq']:,} B/seq, "
            f"widened +{d['widened_scale_bytes']:,} B, BF16 saved {d['bf16_saved_bytes']:,} B"
        )
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
