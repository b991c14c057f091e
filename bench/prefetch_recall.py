"""How well the expert prefetch's prediction recalls the experts a layer selects (offline, CPU, no GPU).

The fused step's prefetch (strata.engine.gpu.prefetch) predicts layer ``j``'s routing from the output of layer ``j - 1``
(layer ``j``'s router on it, normed with layer ``j``'s ffn_norm) and copies the predicted host-tier experts ahead.
This runs the NumPy decoder on a reduced copy of a geometry (its first ``--layers`` layers, a 4,096-token vocabulary,
``TokenRouting(skew)`` routers: token-dependent, as bench_profile_fill.py writes them) and reports, over the prompt
positions of held-out topic prompts, the share of the experts each layer ``j >= 1`` selects that are among the
predicted top ``K`` / top ``2K``:

- ``after experts``: the prediction the engine makes (from the residual after layer ``j - 1``'s experts);
- ``after attention``: from the residual after layer ``j - 1``'s attention, before its experts (a longer lead, the
  alternative the engine does not take).

    python bench/prefetch_recall.py [--geometry qwen3moe-30b-a3b] [--layers 6] [--prompts 2]

Figures (2026-12-04, qwen3moe-30b-a3b, 6 layers, 2 prompts x 16 positions, 1,280 selections): after experts 0.880
(top K) / 0.973 (top 2K); after attention 0.543 / 0.696. On the H200 the engine's prefetch then served 1,310 of the
2,106 misses of the 30B-A3B 16G profile row (bench/results/h200-2026-12-04d-prefetch_ab.log).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="qwen3moe-30b-a3b")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--skew", type=float, default=0.5)
    ap.add_argument("--work", default="/tmp/prefetch_recall")
    args = ap.parse_args(argv)

    from bench_routing import geometries

    from strata import testing as synth
    from strata.engine.layers import route_topk
    from strata.engine.startup import load_engine
    from strata.manifests.names import tensor_name
    from strata.packer.build import build_pack
    from strata.testing.routing import TokenRouting, topic_prompts

    base = geometries()[args.geometry]
    L = args.layers
    spec = base.model_copy(
        update={
            "routing": TokenRouting(skew=args.skew),
            "n_layers": L,
            "expert_types": base.expert_types[:L],
            "dims": base.dims.model_copy(update={"n_vocab": 4096}),
        }
    )
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gguf, pack = work / f"{args.geometry}-{L}.gguf", work / f"{args.geometry}-{L}-pack"
    if not gguf.exists():
        synth.write_model(gguf, spec)
    if not pack.exists():
        build_pack(gguf, pack, progress=False)
    dec = load_engine(str(pack), n_ctx=64, device="cpu").model
    w, K = dec.w, dec.hp.n_expert_used
    hit = {"after experts": [0, 0], "after attention": [0, 0]}
    total = [0]

    def top(x, j: int) -> list[int]:  # layer j's router on x normed with layer j's ffn_norm: the best 2K, in order
        lg = np.asarray(w.matmul(tensor_name("ffn_gate_inp.weight", j), dec._norm(x, dec.blocks[j].ffn_norm, j)))
        return [int(i) for i in np.argsort(-lg, kind="stable")[: 2 * K]]

    def step(token: int, pos: int, state) -> None:  # Decoder._step for attention + MoE layers, with the predictions
        x = w.rows("token_embd.weight", [token])[0]
        pred: dict[str, list[int]] = {}
        for il, b in enumerate(dec.blocks):
            x = x + dec.attn[il](
                dec.xp, dec._norm(x, b.mixer_norm, il), pos, state.cache, state.ropes[dec.rope_key_of(il)]
            )
            hn = dec._norm(x, b.ffn_norm, il)
            ids, _ = route_topk(dec.xp, w.matmul(tensor_name("ffn_gate_inp.weight", il), hn), K, norm=True)
            if pred:
                sel = {int(i) for i in ids}
                total[0] += len(sel)
                for name, p in pred.items():
                    hit[name][0] += len(sel & set(p[:K]))
                    hit[name][1] += len(sel & set(p))
            if il + 1 < len(dec.blocks):
                pred = {"after attention": top(x, il + 1)}
            x = x + dec.ffn(il, hn)
            if il + 1 < len(dec.blocks):
                pred["after experts"] = top(x, il + 1)

    kw = dict(vocab=4096, n_topics=8, topic_size=48, run_length=4, topic_seed=0)
    t0 = time.perf_counter()
    for pr in topic_prompts(args.prompts, 16, seed=2, **kw).prompts:
        st = dec.new_state(64)
        for i, t in enumerate(pr):
            step(int(t), i, st)
    print(f"{args.geometry}, {L} layers, {total[0]} selections ({time.perf_counter() - t0:.0f} s):")
    for name, (a, b) in hit.items():
        print(f"  {name:<16} recall top K {a / total[0]:.3f}  top 2K {b / total[0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
