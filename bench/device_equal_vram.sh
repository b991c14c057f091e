#!/usr/bin/env bash
# strata beside llama.cpp at equal VRAM on token-dependent routing (issue 19's table), in ONE device call:
#
#   bash bench/device_equal_vram.sh    # carry [".whl", ".lcp"] (and ".base" for the replay A/B)
#
# 1. the llama.cpp CUDA build starts in the background (as bench/device_moe.sh);
# 2. meanwhile the gpu tests TESTS names (default: every gpu-marked test that needs no real model; "none" skips);
#    with .base/src (an older checkout's packages), the graph replay of the every-expert-resident step of the first
#    geometry under both (bench/profile_step.py --replay-only): an A/B of a kernel change in the same call;
# 3. per geometry of GEOS (default qwen3moe-30b-a3b): strata bench_profile_fill.py with TokenRouting(0.5) routers on
#    the cards of CARDS (NAME:total MiB, default 16G and 24G), with and without a profile recorded on other prompts
#    (misses: --miss-tier auto; TIERS=pcie,cpu for others); EMPTY=1 adds no expert resident (--expert-cache 0);
# 4. once the build is done, on the SAME GGUF: llama-bench -ngl 99 -fitt M per card (M = free now - (card total -
#    context) + 1024: llama.cpp's --fit sees the card strata emulates, with the same 1024 MiB margin;
#    ../shared/BENCH.md), and -ncmoe NCMOE (default 0,L/2,L; "none" skips it). tg 32 tokens, 5 repetitions, 16 threads.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_ev}; WORK=${WORK:-/tmp/device_ev_work}; mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env "$WORK" || echo "!! wheel install failed"; T0=$(date +%s)
step "llama.cpp CUDA build (background)"
lcp_build_start
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
GEOS=${GEOS:-qwen3moe-30b-a3b}; CARDS=${CARDS:-"16G:15848 24G:24210"}
CARD_NAMES=$(for c in $CARDS; do printf '%s,' "${c%%:*}"; done); CARD_NAMES=${CARD_NAMES%,}
if [ "${TESTS:-all}" != none ]; then
    [ "${TESTS:-all}" = all ] && SEL=tests/ || SEL=$TESTS
    step "gpu tests that need no real model: $SEL"
    { echo "commit ${COMMIT:-unknown} (the checkout this call ran), $(date -u +%FT%TZ)"
      timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and not real" $SEL 2>&1; } \
        | tee "$OUT/gpu_tests.txt" | tail -4
fi
for g in $GEOS; do
    step "$g: the GGUF and pack (TokenRouting 0.5), while the build runs"
    python3 bench/bench_profile_fill.py --work "$WORK/pf" --geometry $g --prepare-only 2>&1 | tail -2
done
G0=${GEOS%% *}
if [ -d .base/src ]; then
    step "$G0: graph replay, this checkout then .base/src"
    python3 bench/profile_step.py "$WORK/pf/$G0-pack" --replay-only 2>&1 | tail -1 | tee -a "$OUT/replay_ab.log"
    PYTHONPATH=$PWD/.base/src:$PYTHONPATH python3 bench/profile_step.py "$WORK/pf/$G0-pack" --replay-only 2>&1 \
        | tail -1 | sed 's/^/base: /' | tee -a "$OUT/replay_ab.log"
fi
step "waiting for the llama.cpp build (strata's rows would share the CPU with the compiler)"
lcp_build_wait
LB=$LCP_BENCH
for g in $GEOS; do
    step "strata: $g, token-dependent routing, $CARD_NAMES"
    timeout ${GEO_S:-300} python3 bench/bench_profile_fill.py --work "$WORK/pf" --geometry $g --cards "$CARD_NAMES" \
        --tiers ${TIERS:-auto} ${EMPTY:+--empty-cache} --json "$OUT/strata_$g.json" 2>&1 | tee -a "$OUT/equal_vram.log"
    G="$WORK/pf/$g.gguf"
    for card in $CARDS; do
        name=${card%%:*}; total=${card##*:}
        free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
        M=$(( free - (total - 527) + 1024 ))
        step "$g: llama-bench -fitt $M ($name: free now $free MiB, card $total MiB - 527 MiB context, + 1024 MiB margin)"
        $LB -m "$G" -p 0 -n 32 -ngl 99 -fitt $M -r 5 -t 16 -o md 2>&1 | tee -a "$OUT/equal_vram.log" | grep -E "tg[0-9]+ |error"
    done
    [ "${NCMOE:-}" = none ] && continue
    L=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from bench_routing import geometries; print(geometries()['$g'].n_layers)")
    step "$g: llama-bench -ncmoe ${NCMOE:-0,$((L / 2)),$L}"
    $LB -m "$G" -p 0 -n 32 -ngl 99 -ncmoe ${NCMOE:-0,$((L / 2)),$L} -r 5 -t 16 -o md 2>&1 | tee -a "$OUT/equal_vram.log" \
        | grep -E "tg[0-9]+ |error"
done
step done
