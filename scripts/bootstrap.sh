#!/usr/bin/env bash
# Install what tpufab and its simulated pod need on this machine (idempotent, quick when done).
# Used by scripts/demo.sh and scripts/test.sh; safe to run by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

# sudo and python3-requests are for the simulated workers, which use the host's /usr: TPU VM
# users have passwordless sudo, and JAX's pod discovery (metadata server) imports requests.
DEBIAN_PACKAGES=(openssh-server openssh-client fuse3 git rclone clustershell pssh psmisc sudo
                 python3-requests procps iproute2 lsof util-linux)

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

PYTHON=${PYTHON:-}
if [[ -z $PYTHON ]]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PYTHON=$(command -v "$candidate"); break
    fi
  done
fi
[[ -n $PYTHON ]] || { echo "tpufab needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

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
