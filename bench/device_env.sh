# Sourced by the bench/device_*.sh scripts (the GPU machine reaches no registry): the environment in one place.
#   device_env DIR  - the carried wheels (.whl/*.whl) into /tmp/site, strata importable from this checkout
#                     through links DIR/src/strata/<pkg> -> ./<pkg> (pyproject.toml's package-dir), and
#                     PYTHONPATH set to DIR/src:/tmp/site (before what it held). Returns 1 when the wheels
#                     could not be installed (the caller reports it its own way).
#   step TEXT       - "== [N s] TEXT", N seconds since T0 (set T0=$(date +%s) first).
#   lcp_build_start - the llama.cpp CUDA build of llama-bench in the background (nice), from the carried
#                     .lcp/llama.cpp.tar.xz into /tmp/lcp (log /tmp/lcp/build.log; skipped when built or under way)
#   lcp_build_wait  - wait up to 6 minutes for it; prints the log's last line
#   LCP_BENCH       - the llama-bench it builds
device_env() {
    local dir=$1 rc=0
    if ls .whl/*.whl >/dev/null 2>&1; then
        ${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >/dev/null 2>&1 || rc=1
    fi
    mkdir -p "$dir/src/strata"
    for d in packer layout budget engine manifests testing; do ln -sfn "$PWD/$d" "$dir/src/strata/$d"; done
    export PYTHONPATH=$dir/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    return $rc
}

step() { echo; echo "== [$(( $(date +%s) - T0 )) s] $*"; }

LCP_BENCH=/tmp/lcp/llama.cpp/build/bin/llama-bench

lcp_build_start() {
    [ -x "$LCP_BENCH" ] && return 0
    [ -f /tmp/lcp/build.log ] && ! grep -q "^exit [1-9]" /tmp/lcp/build.log && return 0  # a build under way
    mkdir -p /tmp/lcp && tar -xJf .lcp/llama.cpp.tar.xz -C /tmp/lcp
    setsid bash -c 'cd /tmp/lcp/llama.cpp && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > /tmp/lcp/build.log 2>&1 && \
        nice cmake --build build --target llama-bench -j 15 >> /tmp/lcp/build.log 2>&1; echo "exit $?" >> /tmp/lcp/build.log' \
        < /dev/null > /dev/null 2>&1 &
}

lcp_build_wait() {
    [ -x "$LCP_BENCH" ] && [ ! -f /tmp/lcp/build.log ] && return 0
    for _ in $(seq 1 180); do grep -q "^exit" /tmp/lcp/build.log 2>/dev/null && break; sleep 2; done
    tail -1 /tmp/lcp/build.log
}
