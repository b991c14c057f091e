"""Where a GPU prompt chunk's time goes (strata alone; not a speed comparison - bench_prompt_gpu.py is that).

Not a test: a profile for the GPU machine. Loads a pack as ``bench_prompt_gpu.py``'s case (``all``: every expert
resident, ``none``, ``half``, ``16G`` / ``24G``), runs the same 513-id topic prompt (``-ub 512``), and prints:

1. ``chunk``: the chunk's milliseconds (the engine's own ``forward_ms``, best of ``--repeats``);
2. ``phases``: the same chunk with the device synchronized around each phase of every layer (attention or delta net,
   router product, routing, routed experts' device work, the experts' host bookkeeping, shared expert, norms): each
   phase's milliseconds summed over the layers. Synchronizing serializes host and device, so the sum exceeds (1);
   the phases' shares say where the time is;
3. with ``--cprofile``: cProfile's costliest functions (own time) of one more chunk (host work; a function that
   waits for the device shows the device's time as its own).

    python3 bench/profile_prompt.py PACK [--geometry G] [--case all] [--cprofile] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def chunk_ms(eng, ids: list[int]) -> float:
    """One prompt of ``ids`` (one token generated): the prompt chunk's milliseconds (positions before the last)."""
    from strata.engine.generate import generate

    r = generate(eng, prompt_ids=ids, n_tokens=1, ignore_eos=True)
    return sum(s.forward_ms for s in r.steps if s.phase == "prompt")


def timed_phases(targets: list[tuple[object, str, str]], sync) -> tuple[dict, dict, list]:
    """Wrap each ``(owner, attribute, phase)`` callable so that a call synchronizes the device, runs, synchronizes
    again and adds its milliseconds to ``phase`` (a nested phase's time is taken out of the outer one). Returns the
    milliseconds and call counts per phase and the originals (to put back)."""
    ms: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    stack: list[float] = []
    saved = []
    for owner, attr, phase in targets:
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def wrap(*a, _fn=fn, _phase=phase, **kw):
            sync()
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                sync()
                dt = (time.perf_counter() - t0) * 1000
                inner = stack.pop()
                ms[_phase] += dt - inner
                calls[_phase] += 1
                if stack:
                    stack[-1] += dt

        setattr(owner, attr, wrap)
    return ms, calls, saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pack", help="a pack written from one of bench_moe's geometries (bench_prompt_gpu --prepare-only)")
    ap.add_argument("--geometry", default="qwen3moe-30b-a3b", help="bench_moe's geometry the pack was written from")
    ap.add_argument("--case", default="all", help="all | half | none | 16G | 24G (bench_prompt_gpu's cases)")
    ap.add_argument("--ubatch", type=int, default=512, help="-ub: prompt positions a chunk")
    ap.add_argument("--repeats", type=int, default=3, help="chunks timed (the best is printed)")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile's costliest functions of one more chunk")
    ap.add_argument("--top", type=int, default=25, help="functions cProfile lists")
    ap.add_argument("--json", default=None, help="write the chunk ms and the phases here")
    args = ap.parse_args(argv)

    from bench_moe import geometries

    from strata.engine.gpu.kernels import gpu_available

    if args.geometry not in geometries():
        ap.error(f"--geometry {args.geometry}: one of {', '.join(sorted(geometries()))}")
    ok, why = gpu_available()
    if not ok:
        print(f"profile_prompt: needs a CUDA GPU ({why})", file=sys.stderr)
        return 2
    import cupy as cp
    from bench_prompt_gpu import case_kwargs, topic_ids

    from strata.engine import decoder as D
    from strata.engine import deltanet, experts, layers
    from strata.engine.gpu import chunk as GC
    from strata.engine.gpu import slots
    from strata.engine.startup import load_engine

    base = geometries()[args.geometry]
    ids = topic_ids(base.dims.n_vocab)
    n_expert = int(base.dims.n_expert or 0)
    eng = load_engine(args.pack, **case_kwargs(args.case, base.n_layers, n_expert, args.ubatch, len(ids) + 8))
    chunk_ms(eng, ids)  # warm
    best = min(chunk_ms(eng, ids) for _ in range(args.repeats))
    n = len(ids) - 1
    tps = n / best * 1000
    print(f"{args.pack} ({args.case}, -ub {args.ubatch}): chunk of {n} positions {best:.1f} ms = {tps:.1f} tok/s")

    targets = [
        (layers.Attention, "chunk", "attention: rest (cache, concat, casts)"),
        (layers.Attention, "project", "attention: q/k/v products"),
        (layers.Attention, "output", "attention: output product"),
        (layers.Rope, "rows", "attention: rope"),
        (layers, "attend_rows", "attention: scores, softmax, values (array form)"),
        (GC.ChunkPath, "attend_rows", "attention: the attention kernel"),
        (GC.ChunkPath, "rope_rows", "attention: rope (kernel)"),
        (GC.ChunkPath, "route_rows", "routing (kernel; ids stay on the device)"),
        (slots.GpuExpertPath, "combine", "experts: weighted sum"),
        (deltanet.GatedDeltaNet, "chunk", "delta net"),
        (D, "route_topk_rows", "routing (array form, to host)"),
        (experts.ExpertPath, "chunk", "experts: host bookkeeping + weighting"),
        (GC.ChunkPath, "expert_outputs", "experts: grouped products"),
        (GC.ChunkPath, "device_grouped", "experts: grouped products, pairs sorted on the device"),
        (slots.GpuExpertPath, "chunk", "experts: host bookkeeping + weighting"),
        (D.Decoder, "shared_expert", "shared expert"),
        (D.Decoder, "ffn", "ffn: router product + rest"),
        (D.Decoder, "_norm", "norms"),
        (D.Decoder, "logits", "head"),
    ]
    ms, calls, saved = timed_phases(targets, cp.cuda.Device().synchronize)
    t0 = time.perf_counter()
    synced = chunk_ms(eng, ids)
    wall = (time.perf_counter() - t0) * 1000
    for owner, attr, fn in saved:
        setattr(owner, attr, fn)
    print(f"phases (device synchronized around each; the chunk then took {synced:.1f} ms, the call {wall:.1f} ms):")
    rows = sorted(ms.items(), key=lambda kv: -kv[1])
    for k, v in rows:
        print(f"  {v:9.1f} ms  {100 * v / synced:5.1f}%  {calls[k]:5d} calls  {k}")
    print(f"  {synced - sum(ms.values()):9.1f} ms  (outside the phases: embedding, residual adds, the loop)")

    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        chunk_ms(eng, ids)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"pack": args.pack, "case": args.case, "chunk_ms": best, "positions": n, "phases_ms": ms})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
