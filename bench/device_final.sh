#!/usr/bin/env bash
# One H200 call at the end of a session: every gpu-marked test that fits (kernels, fused step, engine, metadata
# keys, start-up order and the reserve, card emulation), the 30B-A3B-geometry decode rows with the engine's default
# miss kernel (bench_moe.py), then the qwen3next reference model on emulated cards (bench/device_docs.sh) in what is left.
# carry [".whl"]. Environment: OUT, TEST_S (default 170), TOKENS (default 32), DOCS_S (default 330).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_final}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/device_env.sh
device_env /tmp/final || echo "!! wheel install failed"
T0=$(date +%s)
timeout ${TEST_S:-170} python3 -m pytest -q -p no:cacheprovider -m "gpu and not real" tests/test_gpu_fused.py \
    tests/test_gpu_engine.py tests/test_gpu_kernels.py tests/test_metadata_keys.py \
    tests/test_startup_reserve.py -k "not dequant" 2>&1 | tee "$OUT/gpu_tests_final.txt" | tail -8
echo "== gpu tests: $(( $(date +%s) - T0 )) s"
python3 bench/bench_moe.py --work /tmp/final_moe --geometry qwen3moe-30b-a3b --tokens "${TOKENS:-32}" \
    --json "$OUT/bench_moe_final.json" 2>&1 | tail -6
rm -rf /tmp/final_moe
echo "== bench_moe: $(( $(date +%s) - T0 )) s"
OUT=$OUT DEADLINE=${DOCS_S:-330} TOKENS=${TOKENS:-32} SKIP_TESTS=${SKIP_DOCS_TESTS:-0} bash bench/device_docs.sh 2>&1 | tail -25
