#!/usr/bin/env bash
# Where the decode step's device time goes (bench/profile_step.py), in ONE device call:
#
#   bash bench/device_profile.sh    # carry [".whl"]
#
# TESTS=all (or test files) first runs those gpu tests that need no real model; VARIANTS="STRATA_Q8_SPLIT=1 ..." adds the
# graph replay under each environment (a space-separated list of NAME=VALUE); NCU=1 adds Nsight Compute's duration of every kernel of one eager step.
# PP="all none ..." adds bench/profile_prompt.py (where a -ub 512 prompt chunk's time goes) for those cases (PP_ARGS).
# .base/src (an older checkout's packages, carried): its replay and decode beside (BASE_ARGS, default --replay-only).
# Every profile_step run also decodes 64 tokens: decode ms per token = replay + the host's share (PROF_ARGS
# "--host-profile" adds cProfile's top functions of that decode).
#
# LLAMA="-ncmoe 0,48 ..." builds llama-bench in the background from the carried .lcp (while the tests run), waits for it
# before anything is timed, and runs `llama-bench -m GGUF -p 0 -n 32 -r 5 -t 16 -ngl 99 $LLAMA` on each geometry's
# GGUF after strata's figures (one call: a comparison). VARIANT_ARGS (default --replay-only) are the VARIANTS' arguments
# (a variant NAME=VALUE[+NAME=VALUE],--arg=v,... sets several variables and adds its own arguments).
# GEOS (default qwen3moe-30b-a3b): bench_prompt_gpu.py --prepare-only writes each GGUF + pack (MoE ones with
# TokenRouting(0.5) routers), then profile_step.py per pack, every expert resident.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_prof}; WORK=${WORK:-/tmp/device_prof_work}; mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env "$WORK" || echo "!! wheel install failed"; T0=$(date +%s)
[ -n "${LLAMA:-}" ] && lcp_build_start
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
which nsys ncu 2>/dev/null
if [ -n "${TESTS:-}" ]; then
    [ "$TESTS" = all ] && SEL=tests/ || SEL=$TESTS
    step "gpu tests that need no real model: $SEL"
    { echo "commit ${COMMIT:-unknown}, $(date -u +%FT%TZ)"
      timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and not real" $SEL 2>&1; } \
        | tee "$OUT/gpu_tests.txt" | tail -15
fi
GEOS=${GEOS:-"qwen3moe-30b-a3b"}
for g in $GEOS; do
    step "$g: GGUF and pack"
    python3 bench/bench_prompt_gpu.py --work "$WORK/pp" --geometry $g --prepare-only 2>&1 | tail -2
    sync  # the GGUF just written flushed before anything is timed
    if [ -n "${LLAMA:-}" ]; then step "waiting for the llama-bench build (nothing is timed beside it)"; lcp_build_wait; fi
    step "$g: profile"
    timeout ${PROF_S:-200} python3 bench/profile_step.py "$WORK/pp/$g-pack" --json "$OUT/profile_$g.json" ${PROF_ARGS:-} 2>&1 \
        | tee -a "$OUT/profile.log"
    if [ -n "${PP:-}" ]; then  # PP="all none": where a prompt chunk's time goes (bench/profile_prompt.py), per case
        for c in $PP; do
            step "$g: prompt chunk profile, case $c"
            timeout ${PROF_S:-200} python3 bench/profile_prompt.py "$WORK/pp/$g-pack" --geometry $g --case $c \
                ${PP_ARGS:---cprofile} --json "$OUT/pp_profile_${g}_$c.json" 2>&1 | tee -a "$OUT/pp_profile.log"
        done
    fi
    if [ -d .base/src ]; then
        step "$g: profile of the code in .base/src (an older checkout's packages, for an A/B in one call)"
        PYTHONPATH=$PWD/.base/src:$PYTHONPATH timeout ${PROF_S:-200} python3 bench/profile_step.py "$WORK/pp/$g-pack" \
            ${BASE_ARGS:---replay-only} 2>&1 | tee -a "$OUT/profile.log"
    fi
    for v in ${VARIANTS:-}; do  # NAME=VALUE[,--arg=value,...]: the environment, then that variant's own arguments
        va=""; [[ $v == *,* ]] && va=${v#*,} && va=${va//,/ } && v=${v%%,*}; v=${v//+/ }  # A=1+B=2: two variables
        echo "-- variant $v $va"
        timeout ${PROF_S:-200} env $v python3 bench/profile_step.py "$WORK/pp/$g-pack" ${VARIANT_ARGS:---replay-only} $va 2>&1 \
            | tail -4 | tee -a "$OUT/profile.log"
    done
    if [ -n "${LLAMA:-}" ] && [ -x "$LCP_BENCH" ]; then
        step "$g: llama-bench $LLAMA on the same GGUF"
        timeout ${LLAMA_S:-240} "$LCP_BENCH" -m "$WORK/pp/$g.gguf" -p 0 -n 32 -r 5 -t 16 -ngl 99 $LLAMA 2>&1 \
            | grep -E "^\|" | tee -a "$OUT/profile.log"
    fi
    if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
        step "$g: Nsight Compute, one eager step (gpu__time_duration per kernel)"
        timeout ${NCU_S:-180} ncu --nvtx --nvtx-include "strata_step/" --metrics gpu__time_duration.sum --csv \
            --print-units base python3 bench/profile_step.py "$WORK/pp/$g-pack" --ncu-step > "$OUT/ncu_$g.csv" 2> "$OUT/ncu_$g.err"
        echo "ncu exit $?: $(wc -l < "$OUT/ncu_$g.csv") lines"; tail -3 "$OUT/ncu_$g.err"
    fi
done
step done
