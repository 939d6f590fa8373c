#!/usr/bin/env bash
# The whole tpufab workflow on the simulated pod: installs what it needs, then
#   sim up -> create (v4-32, 4 workers) -> list -> describe
#   -> a project of your own: tpufab init (tasks.py, tpufab.yaml, scripts/setup.sh, recipes/hello.sh)
#   -> deploy it (through its remote, then --direct) -> exec on every worker
#   -> sim bucket -> mount it on every worker (rclone) -> write on w0, read on w3 -> umount
#   -> invoke setup (JAX on every worker) -> invoke run recipes/hello.sh on all 4 workers at once
#   -> logs, runs -> sim zombie (a crashed job's mess) -> status -> kill -> status
#   -> kill --force (the protected holder too) -> status
#   -> delete -> TPU7x on Compute Engine: create tpu7x-8 (one VM instance) -> list -> exec -> delete
#   -> sim down.
# Run as root (the simulated workers use namespaces). Keep the pod with KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
export TPUFAB_SIM_DIR=${TPUFAB_SIM_DIR:-$HOME/.tpufab/sim}
NAME=${NAME:-demo}
REPO=$PWD
WORK=$(mktemp -d /tmp/tpufab-demo.XXXXXX)   # the demo's git remote and checkout
GIT_DAEMON=

step() { printf '\n\033[1;36m$ %s\033[0m\n' "$*"; "$@"; }
say() { printf '\n\033[1m# %s\033[0m\n' "$*"; }

cleanup() {
  if [[ ${KEEP:-0} != 1 ]]; then
    tpufab umount --name "$NAME" >/dev/null 2>&1 || true
    tpufab delete --name "$NAME" --yes >/dev/null 2>&1 || true
    tpufab delete --name "$NAME-7x" --yes >/dev/null 2>&1 || true
    tpufab sim down || true
  fi
  if [[ -n $GIT_DAEMON ]]; then
    kill "$GIT_DAEMON" 2>/dev/null || true
    wait "$GIT_DAEMON" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

step tpufab sim up
eval "$(tpufab sim up 2>/dev/null | grep '^ *export ')"
step tpufab create --name "$NAME" --type v4-32
step tpufab list
step tpufab describe --name "$NAME"
step invoke describe --name "$NAME" --json

say "Code on every worker: a throwaway repository whose remote is a git daemon on loopback"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$WORK/srv"
git init -q --bare -b main "$WORK/srv/climate.git"
git daemon --export-all --enable=receive-pack --base-path="$WORK/srv" --listen=127.0.0.1 \
  --port="$PORT" --reuseaddr "$WORK/srv" &
GIT_DAEMON=$!
git init -q -b main "$WORK/climate"
cd "$WORK/climate"
export GIT_AUTHOR_NAME=demo GIT_AUTHOR_EMAIL=demo@example.com
export GIT_COMMITTER_NAME=demo GIT_COMMITTER_EMAIL=demo@example.com
step tpufab init                           # tasks.py, tpufab.yaml, scripts/setup.sh, recipes/hello.sh
echo "print('training v1')" > train.py
git add -A && git commit -q -m "train: v1"
git remote add origin "git://127.0.0.1:$PORT/climate.git"
for _ in $(seq 50); do git ls-remote origin >/dev/null 2>&1 && break; sleep 0.1; done

step tpufab deploy --name "$NAME"          # push to origin, every worker fetches from it
step tpufab exec --name "$NAME" --gather 'git -C ~/climate log -1 --oneline'
echo "print('training v2')" > train.py
git commit -q -am "train: v2"
step tpufab deploy --name "$NAME" --direct # no remote involved: the commit goes over SSH
step tpufab exec --name "$NAME" --gather 'git -C ~/climate log -1 --oneline'
cd - >/dev/null

say "Data on every worker: a bucket in the simulated pod's Cloud Storage, mounted with rclone"
step tpufab sim bucket data
step tpufab mount data --name "$NAME" --driver rclone --at /mnt/data \
  --options '--dir-cache-time 1s --vfs-write-back 0s'
step tpufab exec --name "$NAME" --worker 0 'echo "written on $(hostname)" > /mnt/data/hello.txt'
step tpufab exec --name "$NAME" --worker 3 \
  'timeout 30 sh -c "until cat /mnt/data/hello.txt 2>/dev/null; do sleep 0.2; done"'
step invoke umount --name "$NAME" --at /mnt/data

say "The main job: JAX on every worker (one shared CPU build, not a download per worker)"
step ./scripts/sim-wheels.sh
cd "$WORK/climate"
step invoke setup --name "$NAME"           # the project's scripts/setup.sh: the pod's shared JAX
step tpufab setup --name "$NAME"           # same content: skipped
say "Run the recipe on all 4 workers at once, inside the deployed checkout (output folded)"
step invoke run recipes/hello.sh --name "$NAME"
step tpufab logs --name "$NAME"                # worker 0's lines once; only differences shown
step tpufab runs --name "$NAME"
cd "$REPO"

say "A crashed job leaves processes holding the TPU (one ignores SIGTERM) and the lockfile"
step tpufab sim zombie --name "$NAME" --worker 0-2
step tpufab status --name "$NAME"              # the TPU is busy on w[0-2]
if step tpufab kill --name "$NAME" --grace 2; then
  echo "expected kill to say the protected tpu-runtime still holds /dev/accel0" >&2; exit 1
fi
say "kill left the protected tpu-runtime running (status says the same); --force stops it too"
step tpufab status --name "$NAME"
step tpufab kill --name "$NAME" --grace 2 --force
step tpufab status --name "$NAME"

step tpufab delete --name "$NAME" --yes

say "TPU7x (Ironwood) exists only on Compute Engine: a tpu7x-8 is one VM instance (tpu7x-standard-4t)"
step tpufab create --name "$NAME-7x" --type tpu7x-8
step tpufab list                               # the ON column says which control plane
step tpufab exec --name "$NAME-7x" -- 'echo "$(hostname): $(nproc) CPUs, a Compute Engine TPU VM"'
step tpufab delete --name "$NAME-7x" --yes
echo
echo "Demo finished: create -> tpufab init -> deploy (remote and --direct) -> mount (written on"
echo "w0, read on w3) -> umount -> setup -> run hello on 4 workers -> zombie -> kill -> status -> delete,"
echo "then a TPU7x VM on Compute Engine (create -> exec -> delete), on the simulated pod."
