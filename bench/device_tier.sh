#!/usr/bin/env bash
# The host tier (--miss-tier pcie) against the CPU tier on the GPU machine, in one device call of ~8 minutes:
#
#   bash bench/device_tier.sh    # carry [".whl"]
#
# 1. the CUDA tests of the fused step and the GPU engine (logits equal for empty / half / full caches on both
#    tiers; gpu_tests.txt, headed by $COMMIT);
# 2. bench_profile_fill.py on the 30B-A3B geometry with token-dependent routing: emulated cards (CARDS, default
#    16G,8G), with and without a held-out profile, misses on the CPU and over PCIe (strata's own figures; the
#    llama.cpp rows: bench/device_moe.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_tier}; WORK=${WORK:-/tmp/device_tier_work}; mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env "$WORK" || echo "!! wheel install failed"; T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step "gpu tests of the fused step and the engine"
{ echo "commit ${COMMIT:-unknown} (the checkout this call ran), $(date -u +%FT%TZ)"
  timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and not real" \
      tests/test_gpu_fused.py tests/test_gpu_engine.py 2>&1; } | tee "$OUT/gpu_tests.txt" | tail -4
step "bench_profile_fill: 30B-A3B, token-dependent routing, tiers ${TIERS:-cpu,pcie}"
python3 bench/bench_profile_fill.py --work "$WORK/pf" --cards "${CARDS:-16G,8G}" --tiers "${TIERS:-cpu,pcie}" \
    --json "$OUT/bench_tier.json" 2>&1 | tee "$OUT/bench_tier.log"
step done
