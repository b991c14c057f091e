"""Matvec launch-shape variants (not a test): rows per warp and the CTAs-per-SM launch bound of
the GPU matvec kernels (``STRATA_MATVEC_RPW``, ``STRATA_MATVEC_MIN_BLOCKS``: ``--variant RPW,MIN_BLOCKS``), or
any environment (``--variant STRATA_Q8_SPLIT=2,STRATA_Q8_WARPS=8``: the q8 kernels' warps per row and warps per
CTA); the arithmetic is the same in every variant. Timed as the pure graph replay of bench_moe.py's
geometries (default kernel: q8), one process per variant. On the H200:
``python bench/matvec_variants.py --work DIR [--variant 4,5 ...]``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from strata.engine.startup import load_engine
from strata.engine.generate import generate
out = {}
for pack in sys.argv[1:]:
    e = load_engine(pack, device="cuda", n_ctx=512)
    generate(e, prompt_ids=list(range(10, 18)), n_tokens=4, ignore_eos=True)
    out[pack] = round(e.decoder.replay_ms(100), 3)
    del e
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--geometry", action="append", default=None)
    ap.add_argument("--variant", action="append", default=None, help="RPW,MIN_BLOCKS (default: a few)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_moe as B

    from strata import testing as synth
    from strata.packer.build import build_pack

    geos, work = B.geometries(), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    packs = []
    for name in args.geometry or ["qwen3moe-30b-a3b", "qwen2-7b"]:
        gguf, pack = work / f"{name}.gguf", work / f"{name}-pack"
        if not gguf.exists():
            synth.write_model(gguf, geos[name])
        if not pack.exists():
            build_pack(gguf, pack, progress=False)
        packs.append(str(pack))
    rows = []
    for v in args.variant or ["4,5", "2,5", "4,0", "2,0", "4,4"]:
        if "=" in v:
            envs = dict(kv.split("=", 1) for kv in v.split(","))
        else:
            rpw, mb = v.split(",")
            envs = {"STRATA_MATVEC_RPW": rpw, "STRATA_MATVEC_MIN_BLOCKS": mb}
        r = subprocess.run(
            [sys.executable, "-c", CHILD, *packs], capture_output=True, text=True, env={**os.environ, **envs}
        )
        res = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-500:]}
        rows.append({"env": envs, "replay_ms": res})
        print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "matvec_variants.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
