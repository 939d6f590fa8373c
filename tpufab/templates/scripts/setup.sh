#!/usr/bin/env bash
# Setup for every worker of a Cloud TPU VM (Ubuntu 22.04 TPU images): `tpufab setup` (or
# `invoke setup`) runs it on every worker. Makes ~/.venv with JAX for TPU (or torch + torch_xla
# for TPU) and py-spy (for `tpufab stacks`), and installs gcsfuse from Google's apt repository.
# Idempotent: what is already there is only checked. Written by `tpufab init`; edit it freely
# (tpufab reruns it when it changes).
#
# Where the image already carries the framework in a shared, read-only site (the simulated
# pod: its host builds one for every worker with tpufab's scripts/sim-wheels.sh), the venv is
# pointed at it instead of downloading (TPUFAB_PREBUILT_SITE, default /opt/tpufab-sim/share/site).
#
#   scripts/setup.sh [--framework jax|torch|none] [--jax-version V] [--torch-version V]
#                    [--torch-index URL] [--venv DIR] [--python BIN] [--extra PKG]...
#                    [--no-gcsfuse]
#
# --framework torch pins torch and torch_xla[tpu] to the same version (default 2.9.0; a
# torch_xla release works only with the torch release of its own version). torch comes from
# PyTorch's CPU index (--torch-index, default https://download.pytorch.org/whl/cpu: PyPI's
# Linux torch is a CUDA build that drags several GB of nvidia-* wheels onto a TPU VM; pass
# --torch-index pypi for PyPI's); torch_xla and the libtpu it pins (torch_xla 2.9.0 ->
# libtpu 0.0.21) come from PyPI, older releases from Google's libtpu index (-f).
#
# Environment equivalents: TPUFAB_FRAMEWORK, TPUFAB_VENV, TPUFAB_JAX_VERSION,
# TPUFAB_TORCH_VERSION, TPUFAB_TORCH_INDEX.
set -euo pipefail

framework=${TPUFAB_FRAMEWORK:-jax}
venv=${TPUFAB_VENV:-$HOME/.venv}
python=""
jax_version=${TPUFAB_JAX_VERSION:-}
torch_version=${TPUFAB_TORCH_VERSION:-2.9.0}
torch_index=${TPUFAB_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
gcsfuse=1
extras=()

LIBTPU_JAX_INDEX=https://storage.googleapis.com/jax-releases/libtpu_releases.html
LIBTPU_INDEX=https://storage.googleapis.com/libtpu-releases/index.html
GOOGLE_APT=https://packages.cloud.google.com/apt
GOOGLE_APT_KEY=https://packages.cloud.google.com/apt/doc/apt-key.gpg
KEYRING=/usr/share/keyrings/cloud.google.asc

while [ $# -gt 0 ]; do
    case $1 in
        --framework) framework=$2; shift 2 ;;
        --jax-version) jax_version=$2; shift 2 ;;
        --torch-version) torch_version=$2; shift 2 ;;
        --torch-index) torch_index=$2; shift 2 ;;
        --venv) venv=$2; shift 2 ;;
        --python) python=$2; shift 2 ;;
        --extra) extras+=("$2"); shift 2 ;;
        --no-gcsfuse) gcsfuse=0; shift ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "setup: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case $framework in
    jax|torch|none) ;;
    *) echo "setup: --framework must be jax, torch or none, not $framework" >&2; exit 2 ;;
esac

log() { echo "setup: $*"; }

case $framework in
    jax) module=jax ;;
    torch) module=torch_xla ;;
    none) module= ;;
esac
prebuilt=${TPUFAB_PREBUILT_SITE:-/opt/tpufab-sim/share/site}
if [ -n "$module" ] && [ -d "$prebuilt" ] \
        && PYTHONPATH=$prebuilt /usr/bin/python3 -c "import $module" >/dev/null 2>&1; then
    if [ ! -x "$venv/bin/python" ]; then
        /usr/bin/python3 -m venv --without-pip "$venv"
        log "created $venv"
    fi
    purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ "$(cat "$purelib/tpufab-prebuilt.pth" 2>/dev/null)" != "$prebuilt" ]; then
        printf '%s\n' "$prebuilt" > "$purelib/tpufab-prebuilt.pth"
    fi
    version=$("$venv/bin/python" -c "import $module; print($module.__version__)")
    log "ready: $module $version from the pre-built site $prebuilt in $venv"
    exit 0
fi
sudo_=()
if [ "$(id -u)" != 0 ]; then
    sudo_=(sudo -n)    # TPU VMs give the login user passwordless sudo
fi
export DEBIAN_FRONTEND=noninteractive
apt_updated=0

apt_install() {
    local missing=() pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$pkg")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        return 0
    fi
    if [ "$apt_updated" = 0 ]; then
        "${sudo_[@]}" apt-get update -qq
        apt_updated=1
    fi
    log "apt install ${missing[*]}"
    "${sudo_[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# 1. Python. Current jax and torch_xla wheels want 3.11 (Ubuntu 22.04 ships 3.10 as python3,
#    and python3.11 in its universe component).
if [ -z "$python" ]; then
    if ! command -v python3.11 >/dev/null 2>&1; then
        apt_install python3.11 python3.11-venv
    fi
    python=python3.11
fi
if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    apt_install "$(basename "$python")-venv"
fi

# 2. The venv (kept when it exists; a different Python version is reported, not replaced).
if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -U pip wheel
else
    want=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    have=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$want" != "$have" ]; then
        log "note: $venv has Python $have, not $want; remove it to recreate"
    fi
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

installed_version() {   # installed_version DIST -> version or nothing
    "$venv/bin/python" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}

# 3. The framework, for TPU.
case $framework in
    jax)
        have=$(installed_version jax)
        libtpu=$(installed_version libtpu)$(installed_version libtpu-nightly)
        if [ -n "$have" ] && [ -n "$libtpu" ] && { [ -z "$jax_version" ] || [ "$have" = "$jax_version" ]; }; then
            log "jax $have with libtpu $libtpu already installed"
        else
            log "installing jax[tpu]${jax_version:+==$jax_version}"
            "${pip[@]}" -U "jax[tpu]${jax_version:+==$jax_version}" -f "$LIBTPU_JAX_INDEX"
        fi
        ;;
    torch)
        have=$(installed_version torch_xla)
        have_torch=$(installed_version torch)
        if [ -n "$have" ] && [ "${have%%+*}" = "$torch_version" ] \
                && [ "${have_torch%%+*}" = "$torch_version" ]; then
            log "torch $have_torch with torch_xla $have already installed"
        else
            # torch first, from its index, so torch_xla's `torch==V` finds it installed.
            log "installing torch==$torch_version${torch_index:+ from $torch_index}"
            if [ "$torch_index" = pypi ] || [ -z "$torch_index" ]; then
                "${pip[@]}" "torch==$torch_version"
            else
                "${pip[@]}" "torch==$torch_version" --index-url "$torch_index"
            fi
            log "installing torch_xla[tpu]==$torch_version"
            "${pip[@]}" "torch==$torch_version" "torch_xla[tpu]==$torch_version" -f "$LIBTPU_INDEX"
        fi
        ;;
esac
# 3b. py-spy for `tpufab stacks` and `run --stall`: one static binary in a ~3 MB wheel with no
#     dependencies (~/.venv/bin/py-spy); best effort, stacks says so where it is missing.
if [ ! -x "$venv/bin/py-spy" ]; then
    log "installing py-spy"
    "${pip[@]}" py-spy || log "note: could not install py-spy; \`tpufab stacks\` will try again"
fi
if [ ${#extras[@]} -gt 0 ]; then
    log "installing ${extras[*]}"
    "${pip[@]}" "${extras[@]}"
fi

# 4. gcsfuse from Google's apt repository.
if [ "$gcsfuse" = 1 ]; then
    if command -v gcsfuse >/dev/null 2>&1; then
        log "gcsfuse already installed"
    else
        apt_install curl ca-certificates lsb-release fuse3
        codename=$(lsb_release -cs)
        if [ ! -s "$KEYRING" ]; then
            curl -fsSL "$GOOGLE_APT_KEY" | "${sudo_[@]}" tee "$KEYRING" >/dev/null
        fi
        echo "deb [signed-by=$KEYRING] $GOOGLE_APT gcsfuse-$codename main" \
            | "${sudo_[@]}" tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
        apt_updated=0
        apt_install gcsfuse
    fi
fi

# 5. Check what a recipe will import, without touching the TPU (a job may hold it).
case $framework in
    jax) check='import jax, libtpu; print("jax", jax.__version__)' ;;
    torch) check='import torch, torch_xla; print("torch_xla", torch_xla.__version__)' ;;
    none) check='import sys; print("python", sys.version.split()[0])' ;;
esac
summary="$("$venv/bin/python" -c "$check") in $venv"
if [ "$gcsfuse" = 1 ]; then
    summary="$summary; $(gcsfuse --version 2>/dev/null | head -n 1)"
fi
log "ready: $summary"
