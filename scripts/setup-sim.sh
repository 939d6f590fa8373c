#!/usr/bin/env bash
# Setup for simulated workers: `tpufab setup --script scripts/setup-sim.sh`.
#
# Makes JAX (CPU), and torch + torch_xla + Lightning when the host built them
# (scripts/sim-wheels.sh --torch), importable from ~/.venv/bin/python in seconds: the venv is
# made with the worker's /usr/bin/python3 and a .pth file points it at the pod-wide,
# read-only site that the host built once and the sim binds at /opt/tpufab-sim/share.
# Idempotent.
set -euo pipefail

share=${TPUFAB_SIM_SHARE:-/opt/tpufab-sim/share}
site=$share/site
venv=${TPUFAB_VENV:-$HOME/.venv}
python=/usr/bin/python3
[ -x "$python" ] || python=python3

if [ ! -d "$site" ]; then
    echo "setup-sim: no shared site at $site; on the host run scripts/sim-wheels.sh, then" \
         "restart the simulated pod (tpufab sim down; tpufab sim up)" >&2
    exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
    # --without-pip: Debian's python3 has no ensurepip, and the pod has no index anyway.
    "$python" -m venv --without-pip "$venv"
    echo "setup-sim: created $venv"
fi
purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pth=$purelib/tpufab-sim-share.pth
paths=$site
# xprof's trace client (for `tpufab profile`), when scripts/sim-wheels.sh put it there.
[ -d "$share/xprof" ] && paths=$(printf '%s\n%s' "$paths" "$share/xprof")
# Ray (for `tpufab ray`), when scripts/sim-wheels.sh --ray put it there, with the `ray` command
# a pip install into the venv would have made.
if [ -d "$share/ray" ]; then
    paths=$(printf '%s\n%s' "$paths" "$share/ray")
    cat > "$venv/bin/ray.new" <<RAY
#!$venv/bin/python
import sys
from ray.scripts.scripts import main
sys.exit(main())
RAY
    chmod 755 "$venv/bin/ray.new"
    mv "$venv/bin/ray.new" "$venv/bin/ray"
fi
# Google's tpu-info (libtpu's runtime metrics), when scripts/sim-wheels.sh put it there, with the
# command `pip install tpu-info` would have made.
if [ -d "$share/tpu-info" ]; then
    paths=$(printf '%s\n%s' "$paths" "$share/tpu-info")
    cat > "$venv/bin/tpu-info.new" <<TPUINFO
#!$venv/bin/python
import sys
from tpu_info.cli import print_chip_info
sys.exit(print_chip_info())
TPUINFO
    chmod 755 "$venv/bin/tpu-info.new"
    mv "$venv/bin/tpu-info.new" "$venv/bin/tpu-info"
fi
if [ "$(cat "$pth" 2>/dev/null)" != "$paths" ]; then
    printf '%s\n' "$paths" > "$pth"
fi

if [ "${TPUFAB_SIM_SETUP_CHECK:-1}" = 0 ]; then
    # bench/top.py at hundreds of workers: the venv alone (a JAX import costs ~0.5 GiB each)
    echo "setup-sim: $venv ready (TPUFAB_SIM_SETUP_CHECK=0: nothing imported)"
    exit 0
fi
JAX_PLATFORMS=cpu "$venv/bin/python" - <<'PYTHON'
import jax
import jax.numpy as jnp
assert float(jnp.arange(4.0).sum()) == 6.0
print(f"setup-sim: jax {jax.__version__} on {jax.default_backend()} ready in {jax.__file__.rsplit('/jax/', 1)[0]}")
PYTHON
if [ -d "$site/torch_xla" ]; then
    # Imported, not run on a device: the check stays quick (torch alone takes seconds to load).
    PJRT_DEVICE=CPU "$venv/bin/python" - <<'PYTHON'
from importlib.metadata import version

import torch
import torch_xla

print(f"setup-sim: torch {torch.__version__}, torch_xla {torch_xla.__version__}, "
      f"lightning {version('lightning')} ready")
PYTHON
fi
