#!/usr/bin/env bash
# The real-model check on the GPU machine (not a test; ~3-5 minutes on an H200, 8 at most).
#
#   On the device, from the repository root, with .whl carried (the `run` tool's carry: [".whl"]):
#     MODEL=$HOME/models/gemma-3-270m-q4_k_m.gguf bash bench/device_real.sh
#
# What it does, every figure into $OUT (default /tmp/device_real; at most 8 files come back):
# Environment: BENCH_ARGS (default "--mib 128 --reps 10") for bench_gpu.py's kernel part.
#   1. installs the carried wheels (.whl/: gguf, pydantic and its parts; the image has numpy, CuPy,
#      cuda-bindings, tokenizers, pyarrow, click, rich, tqdm) into /tmp/site unless they import, and
#      makes `strata` importable from this checkout without installing it;
#   2. checks the GGUF's sha256 (packer/real_models.toml) and builds its pack, plus two synthetic MoE packs
#      (strata.testing: the qwen3moe preset, and one with Q1_0/Q2_0/IQ2_S experts);
#   3. greedy decoding, 3 prompts x 32 tokens (the llama.cpp fixture's prompts), on the CPU path
#      and on the GPU path (the fused step as a CUDA graph, the default): per step, equal/different
#      tokens and the largest top-5 logit gap; the first 24 steps also against llama.cpp's recorded
#      tokens; the same prompts with --no-graph (eager launches of the same kernels): tokens equal
#      and top-5 logits bit for bit equal to the graph's -> greedy.json;
#   4. `strata-engine audit` (predicted vs measured bytes per budget term) for the Gemma pack
#      (--kv f16 and f32) and the synthetic MoE (auto slots and a fixed 12) -> audit.log, audits.json;
#      and `strata-budget check --card measure` for the Gemma pack;
#   5. the `make bench-gpu` benchmark (kernel bandwidth per type; decode tok/s for the Gemma pack
#      and the synthetic packs on the generic / eager / graph paths and the CPU path, launches per
#      token, the pure-GPU graph replay next to the bandwidth floor) -> bench_gpu.json;
#   6. `generate --device cuda --stats` on the MoE (per-step gpu/cpu-experts/wait ms, per-layer
#      hits/misses) -> in device_real.log.
# Steps that fail are reported and the script goes on; the exit code is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/device_real}
MODEL=${MODEL:-$HOME/models/gemma-3-270m-q4_k_m.gguf}
SHA256=${SHA256:-a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818}
# another real model: MODEL=... SHA256=... FIXTURE=tests/fixtures/reference/<name>.json ONLY_GREEDY=1
FIXTURE=${FIXTURE:-tests/fixtures/reference/gemma3-270m.json}
ONLY_GREEDY=${ONLY_GREEDY:-0}
WORK=${WORK:-/tmp/device_real_work}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/device_real.log") 2>&1
export PYTHONUNBUFFERED=1
FAILED=0
T0=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - T0 )) s] $*"; }
fail() { echo "!! FAILED: $*"; FAILED=$((FAILED + 1)); }

step "environment"
if ! $PY -c "import gguf, pydantic" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || fail "wheel install"
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        fail "gguf/pydantic missing and no .whl/ carried"
    fi
fi
if ! $PY -c "import strata.engine.cli" 2>/dev/null; then
    # the package maps strata.<x> to ./<x> (pyproject.toml package-dir): the same, with links
    mkdir -p "$WORK/src/strata"
    for d in packer layout budget engine manifests testing; do ln -sfn "$ROOT/$d" "$WORK/src/strata/$d"; done
    export PYTHONPATH=$WORK/src${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - <<'EOF' || fail "imports"
import platform, numpy, gguf, pydantic, tokenizers
print(f"python {platform.python_version()}, numpy {numpy.__version__}, gguf {gguf.__version__ if hasattr(gguf, '__version__') else '?'}, "
      f"pydantic {pydantic.VERSION}, tokenizers {tokenizers.__version__}")
from strata.engine.gpu import kernels as K
print("gpu:", K.gpu_available())
EOF
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null || true

step "model and packs"
GEMMA_PACK=$WORK/gemma-pack
if [ -f "$MODEL" ]; then
    echo "$SHA256  $MODEL" | sha256sum -c - || fail "sha256 of $MODEL"
    timeout 120 $PY -m strata.packer.cli build "$MODEL" -o "$GEMMA_PACK" --force --no-progress || fail "pack build"
else
    fail "no model at $MODEL (set MODEL=...)"
fi
timeout 120 $PY - "$WORK" <<'EOF' || fail "synthetic packs"
import sys
from pathlib import Path
from strata import testing as synth
from strata.packer.build import build_pack
w = Path(sys.argv[1])
for name, spec in (("moe", synth.qwen3moe_spec()),
                   ("moe-newtypes", synth.qwen3moe_spec(expert_types=[("IQ2_S", "Q2_0"), ("Q1_0", "Q1_0"), ("Q2_0", "IQ2_S")]))):
    [src] = synth.write_model(w / f"{name}.gguf", spec)
    build_pack(src, w / f"{name}-pack", progress=False, force=True)
    print(f"built {w / (name + '-pack')}")
EOF

step "greedy: CPU vs GPU, 3 prompts x 32 tokens"
if [ -d "$GEMMA_PACK" ]; then timeout 240 $PY - "$GEMMA_PACK" "$OUT/greedy.json" "$ROOT/$FIXTURE" <<'EOF' || fail "greedy comparison"
import json, sys, time
import numpy as np
from strata.engine.generate import generate
from strata.engine.startup import load_engine
pack, out, fixture = sys.argv[1:4]
ref = json.load(open(fixture))
N, CTX = 32, 128
t = time.perf_counter(); cpu = load_engine(pack, n_ctx=CTX); t_cpu = time.perf_counter() - t
gpu, eager, why = None, None, ""
try:
    from strata.engine.startup import load_engine
    t = time.perf_counter(); gpu = load_engine(pack, device="cuda", n_ctx=CTX); t_gpu = time.perf_counter() - t
    eager = load_engine(pack, device="cuda", n_ctx=CTX, graph=False)
except Exception as e:  # no device: the CPU half still runs
    why = f"{type(e).__name__}: {e}"
print(f"loaded: cpu {t_cpu:.1f} s" + (f", gpu {t_gpu:.1f} s ({gpu.gpu.device}; {gpu.gpu.decode_path})" if gpu
                                      else f"; GPU path unavailable: {why}"))
def bitwise_tops(a, b):
    return a.output_ids == b.output_ids and all(x[0] == y[0] and np.float32(x[1]).tobytes() == np.float32(y[1]).tobytes()
                                                for ra, rb in zip(a.top, b.top) for x, y in zip(ra, rb))
report = {"pack": pack, "n_tokens": N, "n_ctx": CTX, "prompts": []}
all_equal = True
for p in ref["prompts"]:
    rc = generate(cpu, p["prompt"], N, ignore_eos=True)
    rg = generate(gpu, p["prompt"], N, ignore_eos=True) if gpu else None
    re_ = generate(eager, p["prompt"], N, ignore_eos=True) if eager else None
    eager_eq = bitwise_tops(rg, re_) if re_ else None
    all_equal &= bool(eager_eq) if re_ else True
    print(f"\nprompt {p['prompt'][:50]!r} ({len(rc.prompt_ids)} tokens): cpu {rc.tokens_per_second:.1f} tok/s"
          + (f", gpu graph {rg.tokens_per_second:.1f} tok/s" if rg else "")
          + (f", gpu eager {re_.tokens_per_second:.1f} tok/s; graph vs eager top-5 logits "
             f"{'bit-identical' if eager_eq else 'DIFFER'}" if re_ else ""))
    steps = []
    for s in range(N):
        c = rc.output_ids[s]
        g = rg.output_ids[s] if rg else None
        lc = p["output_ids"][s] if s < len(p["output_ids"]) else None
        gap = None
        if rg:
            tc, tg = dict(rc.top[s]), dict(rg.top[s])
            common = set(tc) & set(tg)
            gap = max(abs(tc[i] - tg[i]) for i in common) if common else None
        eq = (g == c) if rg else None
        all_equal &= bool(eq) if rg else True
        steps.append({"step": s, "cpu": c, "gpu": g, "llama_cpp": lc, "equal": eq, "max_top5_logit_gap": gap})
        print(f"  step {s:2d}: cpu {c:6d} gpu {str(g):>6s} {'equal' if eq else ('DIFFERENT' if rg else '-')}"
              f"{'' if gap is None else f' (max |top-5 logit gap| {gap:.2e})'}"
              f"{'' if lc is None else (' | llama.cpp ' + str(lc) + (' =' if lc == c else ' !='))}")
    report["prompts"].append({"prompt": p["prompt"], "prompt_ids": rc.prompt_ids, "cpu_tok_s": rc.tokens_per_second,
                              "gpu_tok_s": rg.tokens_per_second if rg else None,
                              "gpu_eager_tok_s": re_.tokens_per_second if re_ else None,
                              "graph_eager_bitwise_equal": eager_eq, "text_cpu": rc.text,
                              "text_gpu": rg.text if rg else None, "steps": steps})
report["all_equal"] = all_equal if gpu else None
json.dump(report, open(out, "w"), indent=1)
print(f"\nCPU and GPU greedy tokens: {'ALL EQUAL' if all_equal else 'DIFFER'} " if gpu else "\nGPU not run")
sys.exit(0 if (gpu is None or all_equal) else 1)
EOF
fi

if [ "$ONLY_GREEDY" = 1 ]; then step "done (ONLY_GREEDY): $FAILED failed step(s)"; exit $FAILED; fi

step "audits (predicted vs measured bytes per budget term)"
: > "$OUT/audit.log"
for spec in "gemma-pack --ctx 1024 --kv f16" "gemma-pack --ctx 1024 --kv f32" "moe-pack --ctx 256" \
            "moe-pack --ctx 256 --expert-cache 12" "moe-newtypes-pack --ctx 256"; do
    set -- $spec
    [ -d "$WORK/$1" ] || continue
    echo "-- strata-engine audit $spec" | tee -a "$OUT/audit.log"
    p=$1; shift
    timeout 120 $PY -m strata.engine.cli audit "$WORK/$p" "$@" 2>&1 | tee -a "$OUT/audit.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || fail "audit $spec: exit $rc (1: an exact term differs or the total missed the goal; 2: refused)"
done
echo "-- strata-engine audit --json" >> "$OUT/audit.log"
for p in gemma-pack moe-pack; do
    [ -d "$WORK/$p" ] && timeout 120 $PY -m strata.engine.cli audit "$WORK/$p" --ctx 1024 --json >> "$OUT/audits.json" 2>>"$OUT/audit.log"
done
[ -d "$GEMMA_PACK" ] && { timeout 60 $PY -m strata.budget.cli check "$GEMMA_PACK" --card measure --max-context 1024 \
    --prefill 0 2>&1 | tee -a "$OUT/audit.log"; }

step "stats on the GPU path (MoE, 12 of 24 experts resident)"
if [ -d "$WORK/moe-pack" ]; then
    timeout 120 $PY -m strata.engine.cli generate "$WORK/moe-pack" -p "hello world" -n 6 --ignore-eos \
        --device cuda --expert-cache 12 --stats -v 2>&1 | cut -c1-600
    [ "${PIPESTATUS[0]}" -eq 0 ] || fail "generate --stats"
fi

step "bench-gpu: kernels per type, decode tok/s (gemma pack + synthetic packs)"
PACKS=()
[ -d "$GEMMA_PACK" ] && PACKS+=(--pack "$GEMMA_PACK")
timeout 300 $PY bench/bench_gpu.py ${BENCH_ARGS:---mib 128 --reps 10} --tokens 64 --synth "$WORK/bench" --big-mib 0 \
    --cpu "${PACKS[@]}" --json "$OUT/bench_gpu.json" || fail "bench_gpu"
# the guard: per-stage timing with the graph on must be refused (exit 2), never printed as zeros
timeout 30 $PY bench/bench_gpu.py --no-kernels --stage-times >/dev/null 2>&1
[ $? -eq 2 ] || fail "bench_gpu --stage-times with the graph on was not refused"

step "done: $FAILED failed step(s); files in $OUT:"
ls -la "$OUT"
exit $FAILED
