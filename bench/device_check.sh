#!/usr/bin/env bash
# A GPU check run (not a test): the GPU tests, strata-engine measure on a qwen3next pack (the recurrent
# state and KV terms), and strata's decode rows of bench_moe.py (the decode table's geometries).
#   bash bench/device_check.sh        # on the H200, repo root, carry [".whl"]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_check}
WORK=${WORK:-/tmp/device_check_work}
TOKENS=${TOKENS:-32}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh
device_env "$WORK" || echo "!! wheel install failed"
T0=$(date +%s)
step "GPU tests"
python3 -m pytest -q -p no:cacheprovider -m "gpu and not real" ${TESTS:-tests/} 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
step "qwen3next: strata-engine measure (recurrent state + KV exact)"
python3 - "$WORK" <<'PY' 2>&1 | tee "$OUT/qwen3next_measure.txt" | tail -40
import sys, subprocess, json
from pathlib import Path
from strata import testing as synth
from strata.packer.build import build_pack
w = Path(sys.argv[1]); pk = w / "q3n-pack"
if not pk.exists():
    p = synth.write_model(w / "q3n.gguf", synth.qwen3next_spec(seed=7)); build_pack(p[0], pk, progress=False)
for args in ([], ["--kv", "f32"], ["--expert-cache", "12"]):
    r = subprocess.run([sys.executable, "-m", "strata.engine.cli", "measure", str(pk), "--ctx", "256", *args],
                       capture_output=True, text=True)
    print(" ".join(["measure", *args]), "-> exit", r.returncode); print(r.stdout[-3000:]); print(r.stderr[-1500:])
PY
step "bench_moe strata rows"
python3 bench/bench_moe.py --work "$WORK/bench" --geometry qwen3moe-30b-a3b --geometry qwen2-7b --tokens "$TOKENS" \
    --json "$OUT/bench_moe_strata.json" 2>&1 | tee "$OUT/bench_moe_strata.log" | tail -12
step "done"
