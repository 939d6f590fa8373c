#!/usr/bin/env bash
# jax_hello: every process of the job joins one JAX runtime and agrees on a collective.
#
# On a TPU VM, jax.distributed.initialize() finds the pod by itself. Anywhere else (the
# simulated pod, `run --local`) there is no TPU: JAX runs on CPU and joins the other
# processes through TPUFAB_COORDINATOR with CPU collectives (gloo). Every worker prints the
# same lines, so `tpufab logs` folds them into one copy.
set -euo pipefail

# The job's Python: `tpufab run` (and `run --local`) name it in TPUFAB_PYTHON (the venv
# `tpufab setup` made, else python3).
PY=${TPUFAB_PYTHON:-python3}

exec "$PY" - "$@" <<'PYTHON'
import glob
import importlib.util
import os
import sys

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
except ImportError as err:
    print(f"jax_hello: JAX is not installed for {sys.executable} ({err}); run "
          "`tpufab setup` (scripts/setup.sh, or scripts/setup-sim.sh on the simulated pod).",
          file=sys.stderr)
    sys.exit(2)


def on_tpu():
    """A usable TPU: device files, libtpu installed, and JAX not pinned to CPU."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    devices = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) and importlib.util.find_spec("libtpu") is not None


def initialize():
    timeout = int(os.environ.get("TPUFAB_INIT_TIMEOUT", "120"))
    if on_tpu():
        jax.distributed.initialize(initialization_timeout=timeout)
        return
    jax.config.update("jax_platforms", "cpu")
    for flag, value in (("jax_cpu_collectives_implementation", "gloo"),   # jax >= 0.4.27
                        ("jax_cpu_enable_gloo_collectives", True)):       # older jax
        try:
            jax.config.update(flag, value)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    missing = [k for k in ("TPUFAB_COORDINATOR", "TPUFAB_NUM_WORKERS", "TPUFAB_WORKER_ID")
               if k not in os.environ]
    if missing:
        print(f"jax_hello: no TPU here and {', '.join(missing)} unset; start it with "
              "`tpufab run` (or `run --local --workers N`).", file=sys.stderr)
        sys.exit(2)
    jax.distributed.initialize(coordinator_address=os.environ["TPUFAB_COORDINATOR"],
                               num_processes=int(os.environ["TPUFAB_NUM_WORKERS"]),
                               process_id=int(os.environ["TPUFAB_WORKER_ID"]),
                               initialization_timeout=timeout)


initialize()
processes, me = jax.process_count(), jax.process_index()
print(f"jax_hello: jax {jax.__version__} backend={jax.default_backend()} "
      f"processes={processes} devices={jax.device_count()} "
      f"local_devices={jax.local_device_count()}", flush=True)

# All-gather: every process contributes its index; everyone gets the full list.
gathered = multihost_utils.process_allgather(np.array([me], dtype=np.int32))
ids = [int(x) for x in np.asarray(gathered).reshape(-1)]
print(f"jax_hello: all-gather of process ids = {ids}", flush=True)

# psum over every device of every process, via a globally sharded array.
mesh = Mesh(np.array(jax.devices()), ("d",))
local = np.full((jax.local_device_count(),), me + 1, dtype=np.int32)
array = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")), local)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(array)
total = int(np.asarray(total.addressable_data(0)))
expected = jax.local_device_count() * processes * (processes + 1) // 2
print(f"jax_hello: sum of (process index + 1) over all devices = {total} "
      f"(expected {expected})", flush=True)

ok = ids == list(range(processes)) and total == expected
print("jax_hello: OK" if ok else "jax_hello: MISMATCH", flush=True)
jax.distributed.shutdown()
sys.exit(0 if ok else 1)
PYTHON
