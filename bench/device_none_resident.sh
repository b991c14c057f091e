#!/usr/bin/env bash
# The 30B-A3B geometry with no expert resident (issue 19's "none resident >= 1.0x of -ncmoe all"), in ONE device call:
#
#   bash bench/device_none_resident.sh    # carry [".whl", ".lcp"] (and ".base" for an A/B against an older checkout)
#
# 1. the llama.cpp CUDA build starts in the background (bench/device_env.sh);
# 2. meanwhile the TokenRouting GGUF and pack are written (bench/bench_profile_fill.py --prepare-only) and the GPU tests
#    of the miss split run;
# 3. once the build is done: llama-bench -ncmoe 48 (tg32, 5 repetitions, 16 threads), then strata's decode with
#    --expert-cache 0 (bench/profile_step.py --decode 128: the start-up's probes and split choice, tok/s, the host's
#    wait and the CPU's expert time per token, the split tuner's search), A B A with .base/src when it exists
#    (an older checkout's packages: git archive HEAD packer layout budget engine manifests testing | tar -x -C
#    .base/src/strata), then llama-bench again.
# Session 17's calls (bench/results/h200-2026-12-04{b,c}-none_resident.log) ran this sequence.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_nr}; WORK=${WORK:-/tmp/device_nr_work}; mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
. bench/device_env.sh; device_env "$WORK" || echo "!! wheel install failed"; T0=$(date +%s)
lcp_build_start
step "30B GGUF + pack (background) and the split's gpu tests"
(python3 bench/bench_profile_fill.py --work "$WORK/pf" --geometry qwen3moe-30b-a3b --prepare-only > "$WORK/prep.log" 2>&1
 echo "prep exit $?" >> "$WORK/prep.log") &
{ echo "commit ${COMMIT:-unknown}, $(date -u +%FT%TZ)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and not real" tests/test_miss_split.py \
      tests/test_gpu_fused.py -k "split or route or hybrid or miss" 2>&1; } | tee "$OUT/gpu_tests.txt" | tail -4
wait; tail -1 "$WORK/prep.log"; sync
step "waiting for the llama.cpp build (strata's CPU experts would share the cores with the compiler)"
lcp_build_wait
P=$WORK/pf/qwen3moe-30b-a3b-pack G=$WORK/pf/qwen3moe-30b-a3b.gguf
lb() { $LCP_BENCH -m "$G" -p 0 -n 32 -ngl 99 -ncmoe 48 -r 5 -t 16 -o md 2>&1 | tee -a "$OUT/nr.log" | grep -E "tg[0-9]+ |error"; }
run() {  # tag, then env assignments
    local tag=$1; shift
    env "$@" timeout 80 python3 bench/profile_step.py "$P" --expert-cache 0 --decode 128 2>&1 \
        | grep -oE "cpu experts [0-9]+ us an expert|miss split choice [^,]*|^decode: .*" | sed "s/^/$tag: /" \
        | tee -a "$OUT/nr.log"
}
step "llama-bench -ncmoe 48"; lb
if [ -d .base/src ]; then
    step "strata, no expert resident: this checkout, .base, this checkout"
    run new X=1; run base "PYTHONPATH=$PWD/.base/src:$PYTHONPATH"; run new X=1
else
    step "strata, no expert resident (twice)"
    run new X=1; run new X=1
fi
step "llama-bench -ncmoe 48 again"; lb
step done
