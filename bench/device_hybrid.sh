#!/usr/bin/env bash
# The 30B-A3B rows of bench_moe.py alone (strata, both miss kernels) and one token's CPU expert work per kernel:
# a short GPU-machine call after a change to the CPU kernels (llama.cpp's rows: bench/device_moe.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/o}; WORK=/tmp/hw; mkdir -p $OUT $WORK; export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env $WORK || echo "!! wheels"; T0=$(date +%s)
step "30B GGUF and pack"
python3 bench/bench_moe.py --work $WORK/bench --geometry qwen3moe-30b-a3b --tokens 8 --no-gpu 2>&1 | grep "^\["
step "CPU expert work per token, 16 threads"
python3 bench/cpu_moe_layers.py $WORK/bench/qwen3moe-30b-a3b-pack --kernel exact --kernel q8 --json $OUT/cpu_moe_layers.json 2>&1 | grep '"populate": false'
step "strata rows"
python3 bench/bench_moe.py --work $WORK/bench --geometry qwen3moe-30b-a3b --tokens 32 --kernels q8,exact --json $OUT/bench_moe_hybrid.json 2>&1 | tail -6
step done
