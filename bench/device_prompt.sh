#!/usr/bin/env bash
# Prompt processing on the GPU beside llama.cpp (issue 20's table), in ONE device call:
#
#   bash bench/device_prompt.sh    # carry [".whl", ".lcp"]; LLAMA=0 skips llama.cpp (strata's rows only)
#
# 1. the llama.cpp CUDA build starts in the background (as bench/device_moe.sh), unless LLAMA=0;
# 2. meanwhile the gpu-marked tests (TESTS=chunk, the default: the chunk path's; all: every gpu test that needs no
#    real model; none: no tests; or the files to run, e.g. TESTS="tests/test_gpu_chunk.py tests/test_gpu_moe_mm.py"),
#    and the GGUFs and packs (bench_prompt_gpu.py --prepare-only: qwen2-7b pattern fill, 30B-A3B TokenRouting(0.5));
#    GEOS: bench_moe's geometries (default "qwen2-7b qwen3moe-30b-a3b"; "qwen3next-80b-a3b" adds the 80B-A3B: cases
#    CASES_80B, default all,half,none,24G - its equal-VRAM card; the 30B's CASES_MOE default all,half,none,16G);
# 3. once the build is done, per geometry bench_prompt_gpu.py: strata -ub 512 (and -ub 1 once) per case, then
#    llama-bench -p 512 -n 0 on the same GGUF (-ncmoe 0,L/2,L; -fitt for a card).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_pp}; WORK=${WORK:-/tmp/device_pp_work}; mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env "$WORK" || echo "!! wheel install failed"; T0=$(date +%s)
[ "${LLAMA:-1}" = 1 ] && { step "llama.cpp CUDA build (background)"; lcp_build_start; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${TESTS:-chunk}" != none ]; then
    step "gpu tests (${TESTS:-chunk})"
    case ${TESTS:-chunk} in all) SEL="tests/";; chunk) SEL="tests/test_gpu_chunk.py";; *) SEL="$TESTS";; esac
    { echo "commit ${COMMIT:-unknown}, $(date -u +%FT%TZ)"
      timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and not real" $SEL 2>&1; } \
        | tee "$OUT/gpu_tests.txt" | tail -15
fi
GEOS=${GEOS:-"qwen2-7b qwen3moe-30b-a3b"}
step "GGUFs and packs: $GEOS"
for g in $GEOS; do python3 bench/bench_prompt_gpu.py --work "$WORK/pp" --geometry $g --prepare-only 2>&1 | tail -2; done
sync  # the GGUFs just written flushed first: a 24G row measured during the flush ran ~30% slow (2026-12-02 calls x, y)
LB=""
if [ "${LLAMA:-1}" = 1 ]; then step "waiting for the llama.cpp build"; lcp_build_wait; LB="--llama-bench $LCP_BENCH"; fi
for g in $GEOS; do
    case $g in qwen2-7b) C=${CASES_DENSE:-all};; qwen3next-*) C=${CASES_80B:-all,half,none,24G};; *) C=${CASES_MOE:-all,half,none,16G};; esac
    step "$g: strata ($C), then llama-bench"
    timeout ${GEO_S:-400} python3 bench/bench_prompt_gpu.py --work "$WORK/pp" --geometry $g --cases $C ${UB1:+--ub1} $LB \
        --json "$OUT/pp_$g.json" 2>&1 | tee -a "$OUT/pp.log"
done
step done
