#!/usr/bin/env bash
# The decode table (bench_moe.py) on the GPU machine (not a test), in ONE device call of about 9 minutes:
#
#   bash bench/device_moe.sh    # carry [".whl", ".lcp"]
#
# 1. the llama.cpp CUDA build starts in the background (nice, the cmake line below; ~4-5 min);
# 2. meanwhile: every gpu-marked test that needs no real model (log: gpu_tests.txt, headed by $COMMIT), then every
#    geometry's GGUF and pack written (bench_moe.py
#    --no-gpu: strata.testing pattern fill, seconds);
# 3. once the build is done (strata's rows would otherwise share the CPU with the compiler): per geometry
#    bench_moe.py with --llama-bench: llama-bench's rows, then strata's on the same file - the dense rows
#    (gemma3-270m, qwen2-0.5b, qwen2-7b) and the 30B-A3B rows (all resident, ncmoe 24 / 48), each with both
#    kernels (q8, the default, and exact).
# .lcp/llama.cpp.tar.xz: the tree vendored in the llama-cpp-python 0.3.36 sdist without models/, docs/, media/,
# gguf-py/ and the server's web assets. Everything lands in $OUT (at most 8 files come back).
# Files: gpu_tests.txt, bench_moe.log (every geometry), bench_moe_<geometry>.json: 6 of the 8 that come back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_moe}
WORK=${WORK:-/tmp/device_moe_work}
TOKENS=${TOKENS:-32}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh
device_env "$WORK" || echo "!! wheel install failed"
T0=$(date +%s)

step "llama.cpp CUDA build (background)"
lcp_build_start
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step "every gpu test that needs no real model (the device-side oracle of the cache invariant)"
{ echo "commit ${COMMIT:-unknown} (the checkout this call ran), $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and not real" tests/ 2>&1; } \
    | tee "$OUT/gpu_tests.txt" | tail -4
step "GGUFs and packs"
GEOS="qwen3moe-30b-a3b qwen2-7b qwen2-0.5b gemma3-270m"  # the largest first: a call cut at its limit keeps it
for g in $GEOS; do python3 bench/bench_moe.py --work "$WORK/bench" --geometry $g --tokens 8 --no-gpu 2>&1 | grep "^\[" ; done
step "waiting for the llama.cpp build"
lcp_build_wait
LB=$LCP_BENCH
for g in $GEOS; do
    step "$g: llama-bench, then strata"
    python3 bench/bench_moe.py --work "$WORK/bench" --geometry $g --tokens "$TOKENS" --llama-bench $LB \
        --kernels q8,exact --repeats ${REPEATS:-5} --json "$OUT/bench_moe_$g.json" 2>&1 | tee -a "$OUT/bench_moe.log" | tail -9
done
step "done"
