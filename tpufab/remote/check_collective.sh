#!/usr/bin/env bash
# tpufab check, worker side: one real collective across every host of the pod.
#
#   check_collective.sh --expect-processes N --expect-devices D [--local-devices L]
#                       [--bytes B] [--iterations K] [--timeout S]
#
# Started on every worker at once by `tpufab check` through tpufab's run machinery (so it
# gets the job environment: TPUFAB_COORDINATOR, TPUFAB_NUM_WORKERS, TPUFAB_WORKER_ID). It
# joins one JAX runtime (jax.distributed.initialize), compares jax.process_count() and
# jax.device_count() with what the accelerator type promises, checks and times an all-reduce
# over every device, and answers in one line `@tpufab-answer answer {json}` (also on failure, with
# "error" and the stage it failed in). On a TPU VM the devices are the chips (v4 and later)
# or TensorCores (v2/v3); elsewhere (the simulated pod) JAX runs on CPU with L devices per
# process and gloo collectives between processes.
set -euo pipefail

# The job's Python: tpufab's launcher names it in TPUFAB_PYTHON (the venv setup made, else
# python3).
PY=${TPUFAB_PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
    # the answer codec (tpufab/remote/workerlib.py answer()), written out: a shell script
    # cannot import it; tests/test_spine.py holds this tag to ANSWER_TAG
    echo "@tpufab-answer answer {\"stage\": \"python\", \"error\": \"no python at $PY\"}"
    exit 2
fi

exec "$PY" - "$@" <<'PYTHON'
import argparse
import glob
import importlib.util
import json
import os
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--expect-processes", type=int, required=True)
parser.add_argument("--expect-devices", type=int, required=True)
parser.add_argument("--local-devices", type=int, default=1)
parser.add_argument("--bytes", type=int, default=1 << 20)
parser.add_argument("--iterations", type=int, default=10)
parser.add_argument("--timeout", type=float, default=120.0)
args = parser.parse_args()
stage = ["import"]


def emit(**fields):
    fields.setdefault("stage", stage[0])
    fields["worker"] = os.environ.get("TPUFAB_WORKER_ID")
    sys.stdout.write("@tpufab-answer answer " + json.dumps(fields, sort_keys=True) + "\n")
    sys.stdout.flush()


def give_up():
    emit(error=f"gave up after {args.timeout:g} s (a peer that never joined, or a hung "
               "collective)")
    os._exit(3)


watchdog = threading.Timer(args.timeout, give_up)
watchdog.daemon = True
watchdog.start()


def on_tpu():
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    devices = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) and importlib.util.find_spec("libtpu") is not None


tpu = on_tpu()
if not tpu:
    # Before JAX starts: L CPU devices per process stand in for a host's chips.
    flag = f"--xla_force_host_platform_device_count={args.local_devices}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
try:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
except ImportError as err:
    emit(error=f"JAX is not importable by {sys.executable} ({err})")
    sys.exit(2)

try:
    stage[0] = "initialize"
    init_timeout = max(10, int(args.timeout) - 10)
    if tpu:
        jax.distributed.initialize(initialization_timeout=init_timeout)
    else:
        jax.config.update("jax_platforms", "cpu")
        for name, value in (("jax_cpu_collectives_implementation", "gloo"),
                            ("jax_cpu_enable_gloo_collectives", True)):
            try:
                jax.config.update(name, value)
                break
            except (AttributeError, KeyError, ValueError):
                continue
        jax.distributed.initialize(coordinator_address=os.environ["TPUFAB_COORDINATOR"],
                                   num_processes=int(os.environ["TPUFAB_NUM_WORKERS"]),
                                   process_id=int(os.environ["TPUFAB_WORKER_ID"]),
                                   initialization_timeout=init_timeout)
    stage[0] = "count"
    processes, me = jax.process_count(), jax.process_index()
    devices, local = jax.device_count(), jax.local_device_count()
    found = {"process_index": me, "process_count": processes, "device_count": devices,
             "local_device_count": local, "backend": jax.default_backend(),
             "jax": jax.__version__, "on_tpu": tpu}
    if processes != args.expect_processes or devices != args.expect_devices:
        emit(error=f"JAX sees {processes} processes and {devices} devices, the accelerator "
                   f"type promises {args.expect_processes} and {args.expect_devices}", **found)
        sys.exit(1)

    stage[0] = "allreduce"
    per_device = max(1, args.bytes // 4)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = np.full((local, per_device), me + 1, dtype=np.float32)
    array = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")),
                                                   rows)
    reduce = jax.jit(lambda x: jnp.sum(x, axis=0),
                     out_shardings=NamedSharding(mesh, PartitionSpec()))
    out = reduce(array)
    out.block_until_ready()
    got = float(np.asarray(out.addressable_data(0))[0])
    want = float(local * processes * (processes + 1) // 2)
    times = []
    for _ in range(max(1, args.iterations)):
        started = time.perf_counter()
        reduce(array).block_until_ready()
        times.append(round((time.perf_counter() - started) * 1e3, 3))
    emit(ok=got == want, sum=got, expected_sum=want, bytes=per_device * 4, times_ms=times,
         **found)
    stage[0] = "shutdown"
    jax.distributed.shutdown()
    sys.exit(0 if got == want else 1)
except SystemExit:
    raise
except BaseException as err:  # noqa: BLE001 - any failure is reported as this worker's result
    emit(error=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}")
    os._exit(1)
PYTHON
