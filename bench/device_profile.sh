#!/usr/bin/env bash
# Where the decode step's device time goes (bench/profile_step.py), in ONE device call:
#
#   bash bench/device_profile.sh    # carry [".whl"]; TESTS=all also runs every gpu test that needs no real model
#
# GEOS (default qwen3moe-30b-a3b): bench_prompt_gpu.py --prepare-only writes each GGUF + pack (MoE ones with
# TokenRouting(0.5) routers), then profile_step.py per pack, every expert resident.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_prof}; WORK=${WORK:-/tmp/device_prof_work}; mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env "$WORK" || echo "!! wheel install failed"; T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
which nsys ncu 2>/dev/null
if [ "${TESTS:-}" = all ]; then
    step "every gpu test that needs no real model"
    { echo "commit ${COMMIT:-unknown}, $(date -u +%FT%TZ)"
      timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and not real" tests/ 2>&1; } \
        | tee "$OUT/gpu_tests.txt" | tail -15
fi
GEOS=${GEOS:-"qwen3moe-30b-a3b"}
for g in $GEOS; do
    step "$g: GGUF and pack"
    python3 bench/bench_prompt_gpu.py --work "$WORK/pp" --geometry $g --prepare-only 2>&1 | tail -2
    step "$g: profile"
    timeout ${PROF_S:-200} python3 bench/profile_step.py "$WORK/pp/$g-pack" --json "$OUT/profile_$g.json" ${PROF_ARGS:-} 2>&1 \
        | tee -a "$OUT/profile.log"
done
step done
