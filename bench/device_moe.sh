#!/usr/bin/env bash
# The MoE-at-scale run on the GPU machine (not a test): issue 9's table, in two device calls.
#
#   STEP=1 bash bench/device_moe.sh   # carry [".whl", ".lcp"]: environment, llama.cpp CUDA build started in
#                                     # the background (setsid), the GPU tests, strata's rows of bench_moe.py
#   STEP=2 bash bench/device_moe.sh   # (same machine, still warm) llama-bench's rows on the same files, the
#                                     # CPU rows (strata's and llama.cpp -ngl 0), the qwen2-7b geometry
#
# .lcp/llama.cpp.tar.xz: the tree vendored in the llama-cpp-python 0.3.36 sdist without models/, docs/,
# media/, gguf-py/ and the server's web assets. Everything lands in $OUT (at most 8 files come back).
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

if [ "${STEP:-1}" = 1 ]; then
    step "llama.cpp CUDA build (background)"
    if [ ! -x /tmp/lcp/llama.cpp/build/bin/llama-bench ]; then
        mkdir -p /tmp/lcp && tar -xJf .lcp/llama.cpp.tar.xz -C /tmp/lcp
        setsid bash -c 'cd /tmp/lcp/llama.cpp && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
            -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > /tmp/lcp/build.log 2>&1 && \
            nice cmake --build build --target llama-bench -j 12 >> /tmp/lcp/build.log 2>&1; echo "exit $?" >> /tmp/lcp/build.log' \
            < /dev/null > /dev/null 2>&1 &
    fi
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    step "GPU tests"
    timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -m "gpu and not real" tests/test_gpu_fused.py \
        tests/test_gpu_engine.py tests/test_gpu_kernels.py -k "not dequant" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -12
    step "CPU kernel tests on this host (its SIMD paths)"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_engine_cpu_q8.py 2>&1 | tee "$OUT/cpu_tests.txt" | tail -4
    step "strata rows"
    python3 bench/bench_moe.py --work "$WORK/bench" --geometry qwen3moe-30b-a3b --tokens "$TOKENS" \
        --miss-kernels exact,q8 --json "$OUT/bench_moe_strata.json" 2>&1 | tee "$OUT/bench_moe_strata.log" | tail -40
    step "llama.cpp build so far"
    tail -3 /tmp/lcp/build.log
else
    step "llama.cpp build"
    for _ in $(seq 1 60); do grep -q "^exit" /tmp/lcp/build.log 2>/dev/null && break; sleep 5; done
    tail -3 /tmp/lcp/build.log
    LB=/tmp/lcp/llama.cpp/build/bin/llama-bench
    step "llama.cpp rows, qwen3moe-30b-a3b (strata's GPU rows ran in step 1)"
    python3 bench/bench_moe.py --work "$WORK/bench" --geometry qwen3moe-30b-a3b --tokens "$TOKENS" --no-gpu --cpu \
        --miss-kernels exact,q8 --llama-bench $LB --json "$OUT/bench_moe_llama.json" 2>&1 \
        | tee "$OUT/bench_moe_llama.log" | tail -12
    step "qwen2-7b: strata GPU and CPU rows, llama.cpp rows"
    python3 bench/bench_moe.py --work "$WORK/bench" --geometry qwen2-7b --tokens "$TOKENS" --cpu \
        --llama-bench $LB --json "$OUT/bench_moe_7b.json" 2>&1 | tee "$OUT/bench_moe_7b.log" | tail -12
fi
step "done"
