#!/usr/bin/env bash
# The q8 kernels' launch shape on the GPU machine (not a test): graph replay ms of the 7B and 30B-A3B geometries
# for a few (warps per CTA, rows per warp), then the q8 GPU tests with the chosen shape. One device call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/o}; WORK=/tmp/q8s; mkdir -p $OUT $WORK; export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env $WORK || echo "!! wheels"; T0=$(date +%s)
step "q8 tests (default shape)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_q8.py 2>&1 | tail -2
step "shapes"
python3 bench/matvec_variants.py --work $WORK/bench --geometry qwen2-7b --geometry qwen3moe-30b-a3b --geometry qwen2-0.5b \
    ${VARIANTS:---variant STRATA_Q8_WARPS=4,STRATA_Q8_RPW=1 --variant STRATA_Q8_WARPS=4,STRATA_Q8_RPW=2 \
    --variant STRATA_Q8_WARPS=8,STRATA_Q8_RPW=1 --variant STRATA_Q8_WARPS=4,STRATA_Q8_RPW=4 \
    --variant STRATA_Q8_WARPS=2,STRATA_Q8_RPW=2}
step "q8 tests, rows per warp 2 and 4"
STRATA_Q8_RPW=2 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_q8.py 2>&1 | tail -1
STRATA_Q8_RPW=4 STRATA_Q8_WARPS=2 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_q8.py 2>&1 | tail -1
step done
