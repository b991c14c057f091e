#!/usr/bin/env bash
# The qwen3next reference model on emulated 24 GB and 16 GB cards, on the GPU machine (not a test).
#
#   On the device, from the repository root, with .whl carried (the `run` tool's carry: [".whl"]):
#     bash bench/device_docs.sh            # ~6-8 minutes on an H200 with 16 cores; at most 8 files into $OUT
#
# Environment: OUT (default /tmp/device_docs), DOCS_DIR (the packs, ~3 GB each; default /tmp/docs),
# GGUF_DIR (the ~47 GB GGUF pair: default /dev/shm/strata-docs when /dev/shm has 56 GB free, else DOCS_DIR;
# 64 GB disk: ~47 + 3 + 3 GB), TOKENS (default 32), CTX (default 4096), CARDS (the measured cards,
# default "24G 16G"), SKIP_TESTS=1, BENCH_12G=1 (adds the 12G row of make bench-docs), DOCS_PLAN (a
# scaled-down dry run: "n_layer=4,n_expert=8,n_vocab=5000").
#
# Steps (each timed; a failed step is reported and the script goes on; exit code = failed steps):
#   1. environment: the carried wheels into /tmp/site (as device_moe.sh), strata importable from here;
#   2. the qwen3next reference model, full size, written pattern-filled as a pair of split GGUF files
#      (strata.testing.write_reference_model: 48 layers, 512 experts of 640, its expert types,
#      BF16 routers, the indexer, a 150k vocabulary, one NextN draft block) - and the same model with its
#      draft head grown by 154.5 MiB (nextn.shared_head_head Q1_0 -> Q4_K: shard 1 rewritten, shard 2
#      linked); both built into packs; the worked numbers read back from native_experts.txt;
#   3. an expert profile: strata-engine profile --device cuda over the prompt, TOKENS tokens;
#   4. strata-budget check --card 24G / 16G (and the bigger draft head at 16G) with the profile;
#   5. strata-engine generate --device cuda --card 24G --verbose: start-up checkpoints (emulated and
#      physical figures, "expert cache auto: ..."), TOKENS tokens with the misses on the CPU;
#   6. strata-engine measure --card 24G / 16G / 16G with the bigger draft head, -n TOKENS (bench_docs.py):
#      every term predicted vs measured, the slots, the reserve, the hit rate predicted vs measured;
#   7. the gpu-marked start-up tests (tests/test_startup_reserve_gpu.py with STRATA_DOCS_PACK, test_card_emulation.py);
#   8. the compact table, last.
# Files in $OUT: device_docs.log, summary.json, checks.json, bench_docs.json, generate_24G.log, gpu_tests.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/device_docs}
DOCS_DIR=${DOCS_DIR:-/tmp/docs}
TOKENS=${TOKENS:-32}
CTX=${CTX:-4096}
CARDS=${CARDS:-"24G 16G"}
PY=${PYTHON:-python3}
PROMPT="The capital of France is"
mkdir -p "$OUT" "$DOCS_DIR"
exec > >(tee -a "$OUT/device_docs.log") 2>&1
export PYTHONUNBUFFERED=1
FAILED=0
T0=$(date +%s)
. bench/device_env.sh
fail() { echo "!! FAILED: $*"; FAILED=$((FAILED + 1)); }
# every step's time limit is cut to what is left of DEADLINE (default 525 s: the whole run under 9 minutes)
DEADLINE=${DEADLINE:-525}
limit() { local left=$(( DEADLINE - ($(date +%s) - T0) )); [ "$left" -lt 5 ] && left=5; [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }

step "environment"
device_env "$DOCS_DIR" || fail "wheel install"
$PY -c "import strata.engine.cli, strata.testing; from strata.engine.gpu import kernels as K; print('gpu:', K.gpu_available())" \
    || fail "imports"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null || true
nproc; free -g | head -2; df -h "$DOCS_DIR" | tail -1

step "the qwen3next reference model: a pair of split GGUF files, pattern-filled, and the bigger draft head's shard 1"
# the ~47 GB pair goes to GGUF_DIR: /dev/shm when it has room (RAM speed; the writes never wait for a disk),
# else DOCS_DIR; the packs (~3 GB each) to DOCS_DIR either way
if [ -z "${GGUF_DIR:-}" ]; then
    GGUF_DIR=$DOCS_DIR
    shm=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1)
    [ -n "$shm" ] && [ "$shm" -gt 56000000000 ] && GGUF_DIR=/dev/shm/strata-docs
fi
mkdir -p "$GGUF_DIR"
echo "GGUF files in $GGUF_DIR, packs in $DOCS_DIR"
if [ ! -f "$GGUF_DIR/docs-00002-of-00002.gguf" ]; then
    timeout $(limit 300) $PY - "$GGUF_DIR" <<'EOF' || fail "write the qwen3next reference model"
import os, sys, time
from strata.testing import write_reference_model
d = sys.argv[1]
kw = dict(nextn=1, workers=min(16, len(os.sched_getaffinity(0))))
# DOCS_PLAN="n_layer=4,n_expert=8,n_vocab=5000": a scaled-down dry run of this script (any machine)
kw.update({k: int(v) for k, v in (x.split("=") for x in os.environ.get("DOCS_PLAN", "").split(",") if x)})
t = time.perf_counter()
a = write_reference_model(f"{d}/docs.gguf", draft_head_type="Q1_0", **kw)
print(f"wrote {[p.name for p in a]}: {sum(p.stat().st_size for p in a) / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
t = time.perf_counter()
b = write_reference_model(f"{d}/docs-big.gguf", draft_head_type="Q4_K", only={0}, **kw)
os.link(a[1], b[1])
print(f"wrote {b[0].name} (shard 2 linked): {b[0].stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
EOF
fi
ls -la "$GGUF_DIR"/*.gguf
for name in docs docs-big; do
    [ -d "$DOCS_DIR/$name-pack" ] && continue
    step "pack $name"
    timeout $(limit 240) $PY -m strata.packer.cli build "$GGUF_DIR/$name-00001-of-00002.gguf" -o "$DOCS_DIR/$name-pack" --force \
        --no-progress || fail "pack build $name"
done
PACK=$DOCS_DIR/docs-pack
BIGPACK=$DOCS_DIR/docs-big-pack
$PY - "$PACK" <<'EOF' | tee "$OUT/worked.txt" || fail "worked numbers"
import sys
from strata.packer.pack import open_pack
rows = {r.layer: r for r in open_pack(sys.argv[1]).experts.layers}
l0, l1 = rows[0], rows[1]
print(f"worked numbers: layer 0 blob {l0.blob_bytes} B (1868800), layer 1 blob {l1.blob_bytes} B (1305600), "
      f"layer 1 arena offset {l1.arena_offset} B (956825600): "
      + ("ok" if (l0.blob_bytes, l1.blob_bytes, l1.arena_offset) == (1868800, 1305600, 956825600) else "DIFFER"))
EOF

step "expert profile (strata-engine profile --device cuda: the prompt and $TOKENS tokens, every expert a miss)"
PROFILE=$DOCS_DIR/profile.parquet
echo "$PROMPT" > "$DOCS_DIR/prompts.txt"
timeout $(limit 200) $PY -m strata.engine.cli profile "$PACK" --prompts "$DOCS_DIR/prompts.txt" -n "$TOKENS" --ctx "$CTX" \
    --device cuda -o "$PROFILE" || fail "profile"
[ -f "$PROFILE" ] || PROFILE=""
PROF=${PROFILE:+--expert-profile $PROFILE}

step "strata-budget check (24G, 16G, and the bigger draft head at 16G)"
: > "$OUT/checks.json"
for spec in "docs:24G:$PACK" "docs:16G:$PACK" "docs-big:16G:$BIGPACK"; do
    IFS=: read -r name card pk <<< "$spec"
    timeout $(limit 60) $PY -m strata.budget.cli check "$pk" --card "$card" --ctx "$CTX" $PROF --json > "$DOCS_DIR/check.json"
    code=$?
    $PY - "$DOCS_DIR/check.json" "$name" "$card" "$code" <<'EOF' >> "$OUT/checks.json" || fail "check $name $card"
import json, sys
d = json.load(open(sys.argv[1])); d["row"], d["card_preset"], d["exit_code"] = sys.argv[2], sys.argv[3], int(sys.argv[4])
print(json.dumps(d))
print(f"check {sys.argv[2]} {sys.argv[3]} (exit {sys.argv[4]}): {d['verdict_line']}", file=sys.stderr)
EOF
done

step "strata-engine generate --device cuda --card 24G --verbose ($TOKENS tokens, misses on the CPU)"
timeout $(limit 200) $PY -m strata.engine.cli generate "$PACK" --device cuda --card 24G --ctx "$CTX" $PROF -p "$PROMPT" \
    -n "$TOKENS" --ignore-eos --verbose > "$OUT/generate_24G.log" 2>&1 || fail "generate 24G"
tail -12 "$OUT/generate_24G.log"

step "strata-engine measure: ${CARDS}, and 16G with the bigger draft head (bench_docs.py)"
EXTRA=""
[ "${BENCH_12G:-0}" = 1 ] && EXTRA="12G"
timeout $(limit 420) $PY bench/bench_docs.py "$PACK" --cards "$(echo $CARDS $EXTRA | tr ' ' ,)" --ctx "$CTX" ${PROFILE:+--profile $PROFILE} \
    -n "$TOKENS" --variant "big-draft=$BIGPACK@16G" --json "$OUT/bench_docs.json" --timeout $(limit 200) > "$DOCS_DIR/bench.txt" 2>&1 \
    || fail "measure (bench_docs.py)"
cat "$DOCS_DIR/bench.txt" | grep -v "^   " | head -20

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    step "gpu tests (tests/test_startup_reserve_gpu.py with the reference model's pack, tests/test_card_emulation.py)"
    STRATA_DOCS_PACK=$PACK STRATA_DOCS_PROFILE=$PROFILE timeout $(limit 300) $PY -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/test_startup_reserve_gpu.py tests/test_card_emulation.py -s 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
    grep -qE "passed" "$OUT/gpu_tests.txt" && ! grep -qE "[0-9]+ failed" "$OUT/gpu_tests.txt" || fail "gpu tests"
fi

step "summary"
$PY - "$OUT" "$FAILED" "$(( $(date +%s) - T0 ))" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = json.loads((out / "bench_docs.json").read_text())["rows"] if (out / "bench_docs.json").exists() else []
checks = [json.loads(l) for l in (out / "checks.json").read_text().splitlines() if l.strip()] if (out / "checks.json").exists() else []
worked = (out / "worked.txt").read_text().strip() if (out / "worked.txt").exists() else "worked numbers: not read"
summary = {"failed_steps": int(sys.argv[2]), "seconds": int(sys.argv[3]), "worked": worked,
           "checks": [{k: c.get(k) for k in ("row", "card_preset", "exit_code", "verdict_line", "slots")} for c in checks],
           "rows": [{"label": r["label"], "card": r["card"], "ok": r.get("measure", {}).get("exact_ok"),
                     "total_ok": r.get("measure", {}).get("total_ok"), "reserve_ok": r.get("measure", {}).get("reserve_ok"),
                     "slots": r.get("measure", {}).get("slots"), "predicted_slots": r.get("measure", {}).get("predicted_slots"),
                     "total_diff_bytes": r.get("measure", {}).get("total_diff_bytes"),
                     "generation": r.get("measure", {}).get("generation"),
                     "terms": [(t["term"], t["predicted_bytes"], t["measured_bytes"]) for t in r.get("measure", {}).get("terms", [])],
                     "stages": r.get("measure", {}).get("stages"), "error": r.get("measure_error")} for r in rows]}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
sys.path.insert(0, "bench")
from bench_docs import table, term_table
print("\n".join(term_table(rows)))
print(worked)
for c in checks:
    print(f"check {c['row']} {c['card_preset']}: {c['verdict_line']}")
print("\n".join(table(rows)))
print(f"failed steps: {sys.argv[2]}; {sys.argv[3]} s")
EOF
rm -f "$OUT/worked.txt"
exit $FAILED
