#!/usr/bin/env bash
# The whole tpufab workflow on the simulated pod: installs what it needs, then
#   sim up -> create (v4-32, 4 workers) -> list -> describe -> delete -> sim down.
# Run as root (the simulated workers use namespaces). Keep the pod with KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
export TPUFAB_SIM_DIR=${TPUFAB_SIM_DIR:-$HOME/.tpufab/sim}
NAME=${NAME:-demo}

step() { printf '\n\033[1;36m$ %s\033[0m\n' "$*"; "$@"; }

cleanup() {
  if [[ ${KEEP:-0} != 1 ]]; then
    tpufab delete --name "$NAME" --yes >/dev/null 2>&1 || true
    tpufab sim down || true
  fi
}
trap cleanup EXIT

step tpufab sim up
eval "$(tpufab sim up 2>/dev/null | grep '^ *export ')"
step tpufab create --name "$NAME" --type v4-32
step tpufab list
step tpufab describe --name "$NAME"
step invoke describe --name "$NAME" --json
step tpufab delete --name "$NAME" --yes
echo
echo "Demo finished: the simulated pod walked create -> list -> describe -> delete."
