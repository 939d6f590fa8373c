#!/usr/bin/env bash
# Build, once on the host, the Python packages (CPU builds) that every simulated worker imports.
#
#   scripts/sim-wheels.sh [--sim-dir DIR] [--spec "jax==X.Y.Z"] [--torch] [--ray] [--force] [--no-xprof]
#   (default spec: the jax version of the project's .venv, else the latest jax)
# Also installs py-spy (a static binary in a wheel: site/bin/py-spy, ~6 MB) for `tpufab stacks`
# and the stall watchdog (TPUFAB_SIM_TOOLS="" leaves it out).
# Also puts tpu-info (TPUFAB_SIM_TPU_INFO_SPEC, default tpu-info==0.14.2) in
# $TPUFAB_SIM_DIR/share/tpu-info, which setup-sim.sh adds to the workers' venv with the command.
# Also puts xprof (its trace client only, --no-deps, ~30 MB) in $TPUFAB_SIM_DIR/share/xprof
# for `tpufab profile`; setup-sim.sh adds it to the workers' venv when it is there.
# Installs jax + jaxlib (CPU wheels for the workers' /usr/bin/python3) into
# $TPUFAB_SIM_DIR/share/site; --torch adds torch, torch_xla and Lightning
# (TPUFAB_SIM_TORCH_VERSION, default 2.9.0: torch_xla needs the torch of its own version).
# The simulated pod binds $TPUFAB_SIM_DIR/share read-only into every worker at
# /opt/tpufab-sim/share, and scripts/setup-sim.sh points a worker's ~/.venv at it with a
# .pth file: one download for the whole pod instead of one per worker.
# Idempotent: a build for the same spec is kept (a site with torch also serves a run without
# --torch).
# --ray puts Ray (`ray[default]`: the Job API lives in the dashboard; TPUFAB_SIM_RAY_SPEC,
# default ray[default]) in $TPUFAB_SIM_DIR/share/ray, a folder of its own beside the site with
# its own stamp, so the JAX (and torch) site is never rebuilt for it; setup-sim.sh adds it to
# the workers' venv (and a ~/.venv/bin/ray) when it is there.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
sim_dir=${TPUFAB_SIM_DIR:-$HOME/.tpufab/sim}
# Default: the JAX of the project venv, so `run --local` and the simulated pod agree.
spec=${TPUFAB_SIM_JAX_SPEC:-}
if [ -z "$spec" ]; then
    version=$("$here/.venv/bin/python" -c 'import jax; print(jax.__version__)' 2>/dev/null || true)
    spec=jax${version:+==$version}
fi
torch_version=${TPUFAB_SIM_TORCH_VERSION:-2.9.0}
tools=${TPUFAB_SIM_TOOLS-py-spy}     # worker-side tools every simulated worker finds in site/bin
torch=0
ray=0
ray_spec=${TPUFAB_SIM_RAY_SPEC:-ray[default]}
force=0
xprof_spec=${TPUFAB_SIM_XPROF_SPEC:-xprof}
tpu_info_spec=${TPUFAB_SIM_TPU_INFO_SPEC-tpu-info==0.14.2}   # "" leaves it out
while [ $# -gt 0 ]; do
    case $1 in
        --sim-dir) sim_dir=$2; shift 2 ;;
        --spec) spec=$2; shift 2 ;;
        --torch) torch=1; shift ;;
        --ray) ray=1; shift ;;
        --force) force=1; shift ;;
        --no-xprof) xprof_spec=""; shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "sim-wheels: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# PyPI's torch for Linux is a CUDA build: it imports only with the nvidia-* runtime libraries
# it links against, even with no GPU. These four it never loads at import (cusolver only for
# CUDA linear algebra, nvrtc and nvtx on demand, triton for torch.compile on GPUs), so the
# pod's site leaves them out (~525 MB of wheels, ~1 GB installed).
NOT_LOADED="triton nvidia-cusolver-cu12 nvidia-cuda-nvrtc-cu12 nvidia-nvtx-cu12"

# requests: what jax.distributed.initialize()'s Cloud TPU pod discovery imports
# (jax/_src/clusters/cloud_tpu_cluster.py reads the metadata server with it), as on a TPU VM
specs=("$spec" requests)
[ -n "$tools" ] && specs+=($tools)
if [ "$torch" = 1 ]; then
    specs+=("torch==$torch_version" "torch_xla==$torch_version" "lightning")
fi

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

works() {   # works DIR: the workers' python imports what DIR should hold (and has its tools)
    for tool in $tools; do
        [ -x "$1/bin/$tool" ] || return 1
    done
    JAX_PLATFORMS=cpu PYTHONPATH=$1 "$worker_python" -c 'import jax, jax.numpy as jnp, requests
assert float(jnp.arange(4.0).sum()) == 6.0' >/dev/null 2>&1 || return 1
    [ "$torch" = 0 ] && return 0
    PJRT_DEVICE=CPU PYTHONPATH=$1 "$worker_python" -c 'import torch, torch_xla, lightning
assert float((torch.arange(4.0, device=torch_xla.device()) * 2).sum()) == 12.0' >/dev/null 2>&1
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

# Google's tpu-info (and what it imports: grpcio, protobuf, rich, ...) for `tpufab top` and for
# users on a worker, as `pip install tpu-info` would give them: its own folder and stamp.
# setup-sim.sh puts it on the workers' venv path and writes ~/.venv/bin/tpu-info. Best effort.
install_tpu_info() {
    [ -n "$tpu_info_spec" ] || return 0
    local dir=$sim_dir/share/tpu-info want_t="$tpu_info_spec python$pyver" tmp_t
    if [ "$(cat "$dir/.tpufab-spec" 2>/dev/null)" = "$want_t" ]; then
        return 0
    fi
    tmp_t=$(mktemp -d "$sim_dir/share/.tpu-info.XXXXXX")
    if ! "$pip_python" -m pip install --quiet --disable-pip-version-check \
            --no-warn-script-location --target "$tmp_t" --python-version "$pyver" \
            --only-binary=:all: "$tpu_info_spec"; then
        rm -rf "$tmp_t"
        echo "sim-wheels: could not install $tpu_info_spec; tpu-info is not on the workers" >&2
        return 0
    fi
    rm -rf "$tmp_t/bin"     # pip's scripts name the host's python; setup-sim.sh writes the worker's
    printf '%s\n' "$want_t" > "$tmp_t/.tpufab-spec"
    chmod -R a+rX "$tmp_t"
    rm -rf "$dir"
    mv "$tmp_t" "$dir"
    echo "sim-wheels: $dir has $want_t"
}
install_tpu_info

# Ray for `tpufab ray`: its own folder and stamp (the site's stays what it was).
install_ray() {
    [ "$ray" = 1 ] || return 0
    local dir=$sim_dir/share/ray want_r="$ray_spec python$pyver" tmp_r started_r
    if [ "$force" = 0 ] && [ "$(cat "$dir/.tpufab-spec" 2>/dev/null)" = "$want_r" ] \
            && PYTHONPATH=$dir "$worker_python" -c 'import ray' >/dev/null 2>&1; then
        echo "sim-wheels: $dir already has $want_r"
        return 0
    fi
    started_r=$(date +%s)
    tmp_r=$(mktemp -d "$sim_dir/share/.ray.XXXXXX")
    if ! "$pip_python" -m pip install --quiet --disable-pip-version-check \
            --no-warn-script-location --target "$tmp_r" --python-version "$pyver" \
            --only-binary=:all: "$ray_spec"; then
        rm -rf "$tmp_r"
        echo "sim-wheels: could not install $ray_spec" >&2
        return 1
    fi
    rm -rf "$tmp_r/bin"     # pip's scripts name the host's python; setup-sim.sh writes the worker's
    if ! PYTHONPATH=$tmp_r "$worker_python" -c 'import ray, ray.dashboard' >/dev/null 2>&1; then
        rm -rf "$tmp_r"
        echo "sim-wheels: $worker_python cannot import $ray_spec from the new build" >&2
        return 1
    fi
    printf '%s\n' "$want_r" > "$tmp_r/.tpufab-spec"
    chmod -R a+rX "$tmp_r"
    rm -rf "$dir"
    mv "$tmp_r" "$dir"
    echo "sim-wheels: $dir has $want_r ($(du -sh "$dir" | cut -f1), built in $(( $(date +%s) - started_r )) s)"
}
install_ray

want="${specs[*]} python$pyver"
have=$(cat "$stamp" 2>/dev/null || true)
if [ "$force" = 0 ] && { [ "$have" = "$want" ] || { [ "$torch" = 0 ] && [ "${have%% *}" = "$spec" ] \
        && [ "${have##* }" = "python$pyver" ]; }; } && works "$site"; then
    echo "sim-wheels: $site already has $have"
    exit 0
fi

tmp=$(mktemp -d "$sim_dir/share/.site.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
started=$(date +%s)
# Wheels for the workers' interpreter, not necessarily the one running pip.
pip_install=("$pip_python" -m pip install --quiet --disable-pip-version-check
             --no-warn-script-location --target "$tmp" --python-version "$pyver"
             --only-binary=:all:)
if [ "$torch" = 1 ]; then
    # Download once (pip resolves everything together), resolve again offline to learn the
    # exact list, drop what torch never loads, and install exactly that list from the files.
    wheels=$tmp/.wheels
    "$pip_python" -m pip download --quiet --disable-pip-version-check -d "$wheels" \
        --python-version "$pyver" --only-binary=:all: "${specs[@]}"
    "${pip_install[@]}" --no-index --find-links "$wheels" --dry-run --ignore-installed \
        --report "$tmp/.report.json" "${specs[@]}"
    "$pip_python" - "$tmp/.report.json" "$tmp/.requirements.txt" $NOT_LOADED <<'PYTHON'
import json, sys
report, out, skipped = sys.argv[1], sys.argv[2], {name.lower() for name in sys.argv[3:]}
with open(report) as fh:
    picked = [item["metadata"] for item in json.load(fh)["install"]]
with open(out, "w") as fh:
    for meta in picked:
        if meta["name"].lower() not in skipped:
            fh.write(f"{meta['name']}=={meta['version']}\n")
PYTHON
    "${pip_install[@]}" --no-index --find-links "$wheels" --no-deps -r "$tmp/.requirements.txt"
    rm -rf "$wheels" "$tmp/.report.json"
else
    "${pip_install[@]}" "${specs[@]}"
fi
printf '%s\n' "$want" > "$tmp/.tpufab-spec"
chmod -R a+rX "$tmp"
works "$tmp" || { echo "sim-wheels: $worker_python cannot import ${specs[*]} from the new build" >&2; exit 1; }
rm -rf "$site.old"
[ -e "$site" ] && mv "$site" "$site.old"
mv "$tmp" "$site"
trap - EXIT
rm -rf "$site.old"
echo "sim-wheels: $site has $want ($(du -sh "$site" | cut -f1), built in $(( $(date +%s) - started )) s)"
