#!/usr/bin/env bash
# Build, once on the host, the JAX (CPU) that every simulated worker imports.
#
#   scripts/sim-wheels.sh [--sim-dir DIR] [--spec "jax==X.Y.Z"] [--force] [--no-xprof]
#   (default spec: the jax version of the project's .venv, else the latest jax)
# Also puts xprof (its trace client only, --no-deps, ~30 MB) in $TPUFAB_SIM_DIR/share/xprof
# for `tpufab profile`; setup-sim.sh adds it to the workers' venv when it is there.
# Installs jax + jaxlib (CPU wheels for the workers' /usr/bin/python3) into
# $TPUFAB_SIM_DIR/share/site. The simulated pod binds $TPUFAB_SIM_DIR/share read-only into
# every worker at /opt/tpufab-sim/share, and scripts/setup-sim.sh points a worker's ~/.venv
# at it with a .pth file: one download for the whole pod instead of ~600 MB per worker.
# Idempotent: a build for the same spec is kept.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
sim_dir=${TPUFAB_SIM_DIR:-$HOME/.tpufab/sim}
# Default: the JAX of the project venv, so `run --local` and the simulated pod agree.
spec=${TPUFAB_SIM_JAX_SPEC:-}
if [ -z "$spec" ]; then
    version=$("$here/.venv/bin/python" -c 'import jax; print(jax.__version__)' 2>/dev/null || true)
    spec=jax${version:+==$version}
fi
force=0
xprof_spec=${TPUFAB_SIM_XPROF_SPEC:-xprof}
while [ $# -gt 0 ]; do
    case $1 in
        --sim-dir) sim_dir=$2; shift 2 ;;
        --spec) spec=$2; shift 2 ;;
        --force) force=1; shift ;;
        --no-xprof) xprof_spec=""; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "sim-wheels: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

site=$sim_dir/share/site
stamp=$site/.tpufab-spec
worker_python=/usr/bin/python3
[ -x "$worker_python" ] || worker_python=python3
pyver=$("$worker_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# pip from the project venv when there is one (Debian's python3 may lack pip).
pip_python=${TPUFAB_PIP_PYTHON:-}
if [ -z "$pip_python" ]; then
    for candidate in "$here/.venv/bin/python" "$worker_python" python3; do
        if "$candidate" -m pip --version >/dev/null 2>&1; then
            pip_python=$candidate
            break
        fi
    done
fi
if [ -z "$pip_python" ]; then
    echo "sim-wheels: no python with pip found; set TPUFAB_PIP_PYTHON" >&2
    exit 1
fi

works() {
    JAX_PLATFORMS=cpu PYTHONPATH=$site "$worker_python" -c 'import jax, jax.numpy as jnp
assert float(jnp.arange(4.0).sum()) == 6.0' >/dev/null 2>&1
}

mkdir -p "$sim_dir/share"
exec 9>"$sim_dir/share/.sim-wheels.lock"
flock 9     # one build at a time per sim dir: a second run waits, then finds it done

# The profiler's trace client for `tpufab profile` (xprof's C API library; its Python
# dependencies serve TensorBoard, which the workers do not need). Best effort.
install_xprof() {
    [ -n "$xprof_spec" ] || return 0
    local dir=$sim_dir/share/xprof want_x="$xprof_spec python$pyver" tmp_x
    if [ "$(cat "$dir/.tpufab-spec" 2>/dev/null)" = "$want_x" ]; then
        return 0
    fi
    mkdir -p "$sim_dir/share"
    tmp_x=$(mktemp -d "$sim_dir/share/.xprof.XXXXXX")
    if ! "$pip_python" -m pip install --quiet --disable-pip-version-check --no-deps \
            --no-warn-script-location --target "$tmp_x" --python-version "$pyver" \
            --only-binary=:all: "$xprof_spec"; then
        rm -rf "$tmp_x"
        echo "sim-wheels: could not install $xprof_spec; tpufab profile will say so" >&2
        return 0
    fi
    printf '%s\n' "$want_x" > "$tmp_x/.tpufab-spec"
    chmod -R a+rX "$tmp_x"
    rm -rf "$dir"
    mv "$tmp_x" "$dir"
    echo "sim-wheels: $dir has $want_x"
}
install_xprof

want="$spec python$pyver"
if [ "$force" = 0 ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && works; then
    echo "sim-wheels: $site already has $want"
    exit 0
fi

mkdir -p "$sim_dir/share"
tmp=$(mktemp -d "$sim_dir/share/.site.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Wheels for the workers' interpreter, not necessarily the one running pip.
"$pip_python" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$tmp" --python-version "$pyver" --only-binary=:all: "$spec"
printf '%s\n' "$want" > "$tmp/.tpufab-spec"
chmod -R a+rX "$tmp"
rm -rf "$site.old"
[ -e "$site" ] && mv "$site" "$site.old"
mv "$tmp" "$site"
trap - EXIT
rm -rf "$site.old"
works || { echo "sim-wheels: $worker_python cannot import JAX from $site" >&2; exit 1; }
echo "sim-wheels: $site has $want ($(du -sh "$site" | cut -f1))"
