"""GPU benchmark (not a test): kernel bandwidth per ggml type, and decode speed when packs are given.

Part 1 (always): the memory ceiling - a large device-to-device copy, counting bytes read plus
bytes written - then, per type with a kernel, the matrix-vector product ``y = W x`` on a weight
of ~``--mib`` MiB in engine form (several times the H200's 50-60 MB L2, so it measures HBM, not
cache): median time of ``--reps`` launches timed with CUDA events, effective GB/s
(engine-form bytes read / time) and that as a share of the copy ceiling. Also the dequantize
kernel (bytes read + f32 bytes written).

Part 2 (``--pack DIR``, repeatable, and/or ``--synth DIR`` to build synthetic packs there): decode
tokens/s through the GPU engine (batch 1, greedy), next to the bandwidth floor (engine-form bytes
one token reads / measured copy bandwidth) and the pool growth during decode (0 = the token loop
allocated no new device memory).

Prints a table last; with ``--json PATH`` (default ``$OUT/bench_gpu.json`` when $OUT is set)
writes every number.

    python bench/bench_gpu.py [--mib 512] [--reps 30] [--types Q4_K,IQ2_XXS] [--pack DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _events_median_ms(fn, reps: int, warmup: int = 3) -> float:
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> dict:
    """Device-to-device copy of ``nbytes``: GB/s counting read + write (METHOD.md)."""
    import cupy as cp

    src = cp.empty(nbytes, dtype=cp.uint8)
    src[:] = 1
    dst = cp.empty_like(src)
    ms = _events_median_ms(lambda: dst.__setitem__(slice(None), src), reps)
    del src, dst
    return {"bytes": nbytes, "ms": ms, "gbps_rw": 2 * nbytes / ms / 1e6}


def _random_engine_weight(type_id: int, rows: int, ne0: int):
    """A weight in engine form made on the device: random payload bytes, sane scales (timing only)."""
    import cupy as cp

    from strata.engine.engine_form import engine_layout
    from strata.packer import quants

    t = quants.qtype(type_id)
    pool, src = (quants.F32.id, quants.BF16.id) if t.name == "BF16" else (type_id, type_id)
    lay = engine_layout(pool, src, (ne0, rows))
    buf = cp.random.randint(0, 256, size=lay.nbytes, dtype=cp.int32).astype(cp.uint8)
    if t.name in ("F32", "F16", "BF16"):
        n = rows * ne0
        vals = (cp.random.standard_normal(n, dtype=cp.float32) * 0.02)
        if t.name == "F32":
            buf = vals.view(cp.uint8)
        elif t.name == "F16":
            buf = vals.astype(cp.float16).view(cp.uint8)
        else:
            buf = (vals.view(cp.uint32) >> 16).astype(cp.uint16).view(cp.uint8)
        return buf, lay
    if lay.kind == "widened":
        buf[:lay.scales_nbytes].view(cp.float32)[:] = 0.01
    else:
        blocks = buf.reshape(lay.n_blocks, t.block_bytes)
        h = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
        for o in t.fp16_scale_offsets:
            blocks[:, o] = int(h[0])
            blocks[:, o + 1] = int(h[1])
    return buf, lay


def bench_kernels(types: list[int], mib: int, reps: int, copy: dict) -> list[dict]:
    import cupy as cp

    from strata.engine.gpu import kernels as K
    from strata.packer import quants

    rows_out = []
    for tid in types:
        t = quants.qtype(tid)
        ne0 = 4096
        pool = quants.F32.id if t.name == "BF16" else tid
        src = quants.BF16.id if t.name == "BF16" else tid
        row_bytes = quants.engine_nbytes(pool, src, (ne0, 1))
        rows = max(4, (mib << 20) // row_bytes)
        buf, lay = _random_engine_weight(tid, rows, ne0)
        x = cp.random.standard_normal(ne0, dtype=cp.float32)
        y = cp.empty(rows, dtype=cp.float32)
        t0 = time.perf_counter()
        K.kernels_for(tid)
        compile_s = time.perf_counter() - t0
        ms = _events_median_ms(lambda: K.matvec(tid, buf, rows, ne0, x, out=y), reps)
        n = rows * ne0
        out = cp.empty(n, dtype=cp.float32)
        dq_ms = _events_median_ms(lambda: K.dequantize(tid, buf.reshape(-1), n, out=out), max(5, reps // 3))
        gbps = lay.nbytes / ms / 1e6
        r = {"type": t.name, "rows": rows, "ne0": ne0, "engine_bytes": lay.nbytes, "matvec_ms": ms,
             "matvec_gbps": gbps, "matvec_pct_of_copy": 100 * gbps / copy["gbps_rw"],
             "dequant_ms": dq_ms, "dequant_gbps_rw": (lay.nbytes + 4 * n) / dq_ms / 1e6, "compile_s": compile_s}
        rows_out.append(r)
        print(f"  {t.name:8s} W[{rows}x{ne0}] {lay.nbytes / 2**20:7.1f} MiB  matvec {ms:7.3f} ms {gbps:7.0f} GB/s "
              f"({r['matvec_pct_of_copy']:4.0f}% of copy)  dequant {dq_ms:7.3f} ms", flush=True)
        del buf, out, x, y
        cp.get_default_memory_pool().free_all_blocks()
    return rows_out


def synth_packs(root: str, big_mib: int) -> list[tuple[str, str]]:
    """Synthetic packs made on the spot (packer/synth presets + a big dense qwen2 of ~big_mib MiB):
    the device machine cannot fetch the real models."""
    from strata.packer import synth
    from strata.packer.build import build_pack

    specs = [("synth qwen3moe (3 layers, 8 experts)", "moe", synth.qwen3moe_spec()),
             ("synth qwen2 (2 layers)", "qwen2", synth.qwen2_spec()),
             ("synth gemma3 (2 layers, BF16)", "gemma3", synth.gemma3_spec())]
    if big_mib:
        specs.append((f"synth big dense qwen2 (~{big_mib} MiB Q8_0)", "big", synth.big_dense_spec(big_mib << 20)))
    out = []
    for label, name, spec in specs:
        paths = synth.write_model(os.path.join(root, f"{name}.gguf"), spec)
        pk = os.path.join(root, f"{name}-pack")
        build_pack(paths[0], pk, progress=False, force=True)
        out.append((label, pk))
    return out


def bench_decode(packs: list[tuple[str, str]], n_tokens: int, copy: dict) -> list[dict]:
    """Decode tok/s (batch 1, greedy, --ignore-eos) per pack on the GPU path, next to the bandwidth
    floor: engine-form bytes one token reads (dense + head + the routed experts it uses) over the
    measured copy bandwidth (read+write GB/s, the most a read-only pass can hope for)."""
    from strata.engine.generate import generate
    from strata.engine.gpu.engine import load_engine_gpu

    rows = []
    for label, pk in packs:
        for ec in (("auto", 0) if "moe" in pk else ("auto",)):
            eng = load_engine_gpu(pk, n_ctx=max(256, n_tokens + 16), device="cuda", expert_cache=ec)
            g = eng.gpu
            r = generate(eng, prompt_ids=[1, 2, 3, 4], n_tokens=n_tokens, ignore_eos=True)
            per_tok = g.weights_engine_bytes + g.head_engine_bytes
            if eng.experts is not None:
                n_used = int(eng.geometry["n_expert_used"])
                per_tok += n_used * sum(p.nbytes for L in eng.experts.cache.layouts.values() for p in L)
            floor_tps = copy["gbps_rw"] * 1e9 / per_tok
            import cupy as cp
            grown = cp.get_default_memory_pool().total_bytes() - g.pool_after_warmup
            row = {"pack": label, "expert_cache": ec, "tok_s": r.tokens_per_second, "n_tokens": n_tokens,
                   "bytes_per_token": per_tok, "floor_tok_s": floor_tps, "hits": r.expert_hits,
                   "misses": r.expert_misses, "decode_pool_growth_bytes": grown,
                   "ms_per_token": 1000 / r.tokens_per_second if r.tokens_per_second else None}
            rows.append(row)
            print(f"  {label} [cache {ec}]: {r.tokens_per_second:.1f} tok/s ({row['ms_per_token']:.2f} ms/token), "
                  f"floor {floor_tps:.0f} tok/s ({per_tok / 2**20:.1f} MiB/token), hits {r.expert_hits} / misses "
                  f"{r.expert_misses} (counts), pool growth during decode {grown} B", flush=True)
            del eng
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="weight size per type for the matvec benchmark (MiB)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--types", default="", help="comma-separated ggml type names (default: every type with a kernel)")
    ap.add_argument("--pack", action="append", default=[], help="pack directory for the decode benchmark (repeatable)")
    ap.add_argument("--synth", default=None, help="make synthetic packs in this folder and bench decode on them")
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the synthetic big dense model (0: none)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from strata.engine.gpu import kernels as K
    from strata.packer import quants

    ok, why = K.gpu_available()
    if not ok:
        print(f"bench_gpu: no GPU ({why}); nothing to measure")
        return 0
    print(f"device: {why}")
    copy = copy_bandwidth()
    print(f"copy ceiling: {copy['gbps_rw']:.0f} GB/s (read+write, {copy['bytes'] >> 20} MiB in {copy['ms']:.3f} ms)")
    if a.types:
        types = [quants.by_name(s.strip()).id for s in a.types.split(",") if s.strip()]
    else:
        types = sorted(K.SUPPORTED_TYPES, key=lambda i: quants.qtype(i).name)
    kern = [] if a.no_kernels else bench_kernels(types, a.mib, a.reps, copy)
    packs = [(p, p) for p in a.pack]
    if a.synth:
        os.makedirs(a.synth, exist_ok=True)
        packs += synth_packs(a.synth, a.big_mib)
    dec = bench_decode(packs, a.tokens, copy) if packs else []

    print("\n| type | W MiB | matvec ms | GB/s | % of copy | dequant ms |")
    print("|---|---|---|---|---|---|")
    for r in kern:
        print(f"| {r['type']} | {r['engine_bytes'] / 2**20:.0f} | {r['matvec_ms']:.3f} | {r['matvec_gbps']:.0f} | "
              f"{r['matvec_pct_of_copy']:.0f}% | {r['dequant_ms']:.3f} |")
    if dec:
        print("\n| pack | expert cache | decode tok/s | ms/token | floor tok/s (bytes/token / copy GB/s) | hits/misses |")
        print("|---|---|---|---|---|---|")
        for r in dec:
            print(f"| {r['pack']} | {r['expert_cache']} | {r['tok_s']:.1f} | {r['ms_per_token']:.2f} | "
                  f"{r['floor_tok_s']:.0f} | {r['hits']}/{r['misses']} |")
    path = a.json or (os.path.join(os.environ["OUT"], "bench_gpu.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"device": why, "copy": copy, "kernels": kern, "decode": dec}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
