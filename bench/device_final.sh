#!/usr/bin/env bash
# One H200 call: the fused-step GPU tests (kernels, qwen3next, MoE, grouped matvecs), then the documents'
# model on emulated cards (bench/device_docs.sh) in what is left. carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_final}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "!! wheel install failed"
W=/tmp/final; mkdir -p $W/src/strata
for d in packer budget engine manifests testing; do ln -sfn "$PWD/$d" "$W/src/strata/$d"; done
export PYTHONPATH=$W/src:/tmp/site
T0=$(date +%s)
timeout ${TEST_S:-110} python3 -m pytest -q -p no:cacheprovider -m "gpu and not real" tests/test_gpu_fused.py \
    tests/test_gpu_kernels.py tests/test_metadata_keys.py -k "not dequant" 2>&1 \
    | tee "$OUT/gpu_tests_final.txt" | tail -12
echo "== gpu tests: $(( $(date +%s) - T0 )) s"
OUT=$OUT DEADLINE=${DOCS_S:-320} TOKENS=${TOKENS:-8} SKIP_TESTS=1 bash bench/device_docs.sh 2>&1 | tail -45
