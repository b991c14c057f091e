#!/usr/bin/env bash
# strata beside llama.cpp at equal VRAM on token-dependent routing (issue 19's table), in ONE device call (~9 min):
#
#   bash bench/device_equal_vram.sh    # carry [".whl", ".lcp"]
#
# 1. the llama.cpp CUDA build starts in the background (as bench/device_moe.sh);
# 2. meanwhile every gpu-marked test that needs no real model (gpu_tests.txt, headed by $COMMIT);
# 3. strata: bench_profile_fill.py on the 30B-A3B geometry with TokenRouting(0.5) at --card 16G and 24G, with and
#    without a profile recorded on other prompts (misses: --miss-tier auto; TIERS=pcie,cpu for others); EMPTY=1 adds
#    no expert resident (--expert-cache 0), beside llama.cpp's -ncmoe 48;
# 4. once the build is done, on the SAME GGUF: llama-bench -ngl 99 -fitt M (M = free now - (card total - context)
#    + 1024: llama.cpp's --fit sees the card strata emulates, with the same 1024 MiB margin; ../shared/BENCH.md)
#    for 16G and 24G, and -ncmoe 0,24,48. tg 32 tokens, 5 repetitions, 16 threads.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_ev}; WORK=${WORK:-/tmp/device_ev_work}; mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env "$WORK" || echo "!! wheel install failed"; T0=$(date +%s)
step "llama.cpp CUDA build (background)"
lcp_build_start
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step "every gpu test that needs no real model"
{ echo "commit ${COMMIT:-unknown} (the checkout this call ran), $(date -u +%FT%TZ)"
  timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and not real" tests/ 2>&1; } \
    | tee "$OUT/gpu_tests.txt" | tail -4
step "the 30B-A3B GGUF and pack (TokenRouting 0.5), while the build runs"
python3 bench/bench_profile_fill.py --work "$WORK/pf" --prepare-only 2>&1 | tail -2
step "waiting for the llama.cpp build (strata's rows would share the CPU with the compiler)"
lcp_build_wait
step "strata: 30B-A3B, token-dependent routing, 16G and 24G"
python3 bench/bench_profile_fill.py --work "$WORK/pf" --cards 16G,24G --tiers ${TIERS:-auto} ${EMPTY:+--empty-cache} \
    --json "$OUT/strata.json" 2>&1 \
    | tee "$OUT/equal_vram.log"
LB=$LCP_BENCH
G="$WORK/pf/qwen3moe-30b-a3b.gguf"
for card in 16G:15848 24G:24210; do
    name=${card%%:*}; total=${card##*:}
    free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
    M=$(( free - (total - 527) + 1024 ))
    step "llama-bench -fitt $M ($name: free now $free MiB, card $total MiB - 527 MiB context, + 1024 MiB margin)"
    $LB -m "$G" -p 0 -n 32 -ngl 99 -fitt $M -r 5 -t 16 -o md 2>&1 | tee -a "$OUT/equal_vram.log" | grep -E "\| tg|error" 
done
step "llama-bench -ncmoe 0,24,48"
$LB -m "$G" -p 0 -n 32 -ngl 99 -ncmoe 0,24,48 -r 5 -t 16 -o md 2>&1 | tee -a "$OUT/equal_vram.log" | grep -E "\| tg|error"
step done
