#!/usr/bin/env bash
# Install what tpufab and its simulated pod need on this machine (idempotent, quick when done).
# Used by scripts/demo.sh and scripts/test.sh; safe to run by hand.
# --which-python: print the Python it would use (or say why none) and stop.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Python versions tpufab supports: 3.$PY_MIN to 3.$PY_MAX (pyproject.toml's requires-python
# and ruff's target say the same; tests/test_python_versions.py checks that they agree).
PY_MIN=10
PY_MAX=13
supported() {
  "$1" -c "import sys; sys.exit(not (3, $PY_MIN) <= sys.version_info[:2] <= (3, $PY_MAX))" \
    >/dev/null 2>&1
}
PYTHON=${PYTHON:-}
if [[ -n $PYTHON ]]; then
  supported "$PYTHON" || { echo "PYTHON=$PYTHON is not Python 3.$PY_MIN to 3.$PY_MAX; point PYTHON at one of those (or unset it)" >&2; exit 1; }
else
  # an existing .venv keeps its Python; else python3, else the newest supported python3.X
  for candidate in .venv/bin/python python3 python3.$PY_MAX python3.12 python3.11 python3.$PY_MIN; do
    if command -v "$candidate" >/dev/null && supported "$candidate"; then
      PYTHON=$(command -v "$candidate"); break
    fi
  done
fi
[[ -n $PYTHON ]] || { echo "tpufab needs Python 3.$PY_MIN to 3.$PY_MAX: install one (apt-get install python3) or set PYTHON=/path/to/python3.X" >&2; exit 1; }
if [[ ${1:-} == --which-python ]]; then
  echo "$PYTHON"
  exit 0
fi

# sudo and python3-requests are for the simulated workers, which use the host's /usr: TPU VM
# users have passwordless sudo, and JAX's pod discovery (metadata server) imports requests.
# podman (with podman-docker: the `docker` CLI as podman's), runc, catatonit (`--init`),
# skopeo and docker-registry are the simulated pod's container runtime on every worker and its
# Artifact Registry (docs/images.md); buildah builds users' images FROM the base image.
DEBIAN_PACKAGES=(openssh-server openssh-client fuse3 git rclone clustershell pssh psmisc sudo
                 python3-requests procps iproute2 lsof util-linux openssl rsync
                 podman podman-docker runc catatonit buildah skopeo docker-registry)

need_apt=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "tpufab needs these Debian packages: ${need_apt[*]}; run as root or: sudo apt-get install ${need_apt[*]}" >&2
    exit 1
  fi
  echo "==> installing Debian packages: ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi


if [[ ! -x .venv/bin/python ]]; then
  echo "==> creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.tpufab-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  echo "==> installing tpufab and its dev tools into .venv"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[dev,sim]'
  touch "$stamp"
fi
# tpufab's own bytecode, as pip writes it for an installed package: this is an editable install,
# and where PYTHONDONTWRITEBYTECODE is set (this sandbox, CI) every `tpufab` would compile the
# modules it imports again (~0.14 s of CPU per command; the suite runs thousands). Only what
# changed since is compiled; Python still checks each file's time, so an edit is never missed.
.venv/bin/python -m compileall -q tpufab >/dev/null
