# Sourced by the bench/device_*.sh scripts (the GPU machine reaches no registry): the environment in one place.
#   device_env DIR  - the carried wheels (.whl/*.whl) into /tmp/site, strata importable from this checkout
#                     through links DIR/src/strata/<pkg> -> ./<pkg> (pyproject.toml's package-dir), and
#                     PYTHONPATH set to DIR/src:/tmp/site (before what it held). Returns 1 when the wheels
#                     could not be installed (the caller reports it its own way).
#   step TEXT       - "== [N s] TEXT", N seconds since T0 (set T0=$(date +%s) first).
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
