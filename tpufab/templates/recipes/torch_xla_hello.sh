#!/usr/bin/env bash
# torch_xla_hello: every process of the job joins one world; prints the world size, an
# all-reduce of (rank + 1) whose value proves every rank took part, and one data-parallel SGD
# step after which every replica holds the same weights.
#
# On a TPU VM (TPU device files and libtpu present): PJRT_DEVICE=TPU, one process per chip
# (xmp.spawn), collectives through torch_xla's runtime (xm.all_reduce); setup with
# `tpufab setup --framework torch`.
# Anywhere else (the simulated pod, `run --local --workers N`): PJRT_DEVICE=CPU, one process
# per worker; the math runs on the XLA CPU device, and the processes form one world with
# torch.distributed over gloo from tpufab's MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK
# (torch_xla's own collectives do not cross processes on CPU). Every worker prints the same
# lines, so `tpufab logs` shows them once.
set -euo pipefail

# The job's Python: `tpufab run` (and `run --local`) name it in TPUFAB_PYTHON (the venv
# `tpufab setup` made, else python3).
PY=${TPUFAB_PYTHON:-python3}

# xmp.spawn starts fresh interpreters that import the main module: it must be a file.
work=${TPUFAB_RUN_DIR:-}
if [ -z "$work" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
cat > "$work/torch_xla_hello.py" <<'PYTHON'
import glob
import importlib.util
import os
import sys
from datetime import timedelta


def on_tpu():
    if os.environ.get("PJRT_DEVICE", "TPU").upper() not in ("TPU", ""):
        return False
    devices = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) and importlib.util.find_spec("libtpu") is not None


TPU = on_tpu()
os.environ["PJRT_DEVICE"] = "TPU" if TPU else "CPU"     # before torch_xla is imported

try:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.runtime as xr
except ImportError as err:
    print(f"torch_xla_hello: torch_xla is not installed for {sys.executable} ({err}); "
          "run `tpufab setup --framework torch` (scripts/setup.sh --framework torch; "
          "on the simulated pod scripts/sim-wheels.sh --torch, then scripts/setup-sim.sh).",
          file=sys.stderr)
    sys.exit(2)


def device():
    return torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()


def sync():
    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:
        xm.mark_step()


def one_sgd_step(rank, dev, average_gradients):
    """Same initial weights, different data per rank; gradients averaged across the world,
    so every replica ends with the same weights. Returns the sum of the weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.full((8, 16), float(rank + 1), device=dev)
    loss = model(inputs).pow(2).mean()
    loss.backward()
    average_gradients(model, optimizer)
    sync()
    return model.weight.detach().sum().item()


def report(world, ranks, total, weights, spread, backend):
    expected = world * (world + 1) // 2
    print(f"torch_xla_hello: torch {torch.__version__} torch_xla {torch_xla.__version__} "
          f"device={xr.device_type()} world_size={world} ({backend})", flush=True)
    print(f"torch_xla_hello: ranks = {ranks}", flush=True)
    print(f"torch_xla_hello: all-reduce of (rank + 1) = {total:.0f} (expected {expected})",
          flush=True)
    print(f"torch_xla_hello: weight sum after one step = {weights:.6f} "
          f"(replica spread {spread:.1e})", flush=True)
    ok = round(total) == expected and ranks == list(range(world)) and abs(spread) < 1e-5
    print("torch_xla_hello: OK" if ok else "torch_xla_hello: MISMATCH", flush=True)
    return ok


# -- on a TPU VM: torch_xla's runtime, one process per chip ------------------------------------

def hello_tpu(index):
    dev = device()
    rank, world = xr.global_ordinal(), xr.world_size()
    total = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([rank + 1.0], device=dev))
    ranks = xm.all_gather(torch.tensor([rank], device=dev)).cpu().tolist()

    def average_gradients(model, optimizer):
        xm.optimizer_step(optimizer)       # all-reduces the gradients, then steps

    weights = one_sgd_step(rank, dev, average_gradients)
    spread = xm.all_reduce(xm.REDUCE_MAX, torch.tensor([weights], device=dev)) + \
        xm.all_reduce(xm.REDUCE_MAX, torch.tensor([-weights], device=dev))
    sync()
    if xr.local_ordinal() == 0:            # one report per host, identical on every host
        if not report(world, ranks, total.item(), weights, spread.item(), "xla"):
            sys.exit(1)


# -- elsewhere: XLA CPU device for the math, gloo across processes -----------------------------

def hello_cpu():
    import torch.distributed as dist

    timeout = timedelta(seconds=int(os.environ.get("TPUFAB_INIT_TIMEOUT", "120")))
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()

    contribution = (torch.ones(1, device=dev) * (rank + 1)).cpu()   # computed on XLA
    dist.all_reduce(contribution)
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank]))

    def average_gradients(model, optimizer):
        for param in model.parameters():
            grad = param.grad.cpu()
            dist.all_reduce(grad)
            param.grad.copy_((grad / world).to(dev))
        optimizer.step()

    weights = one_sgd_step(rank, dev, average_gradients)
    high, low = torch.tensor([weights]), torch.tensor([-weights])
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MAX)
    ok = report(world, [int(t.item()) for t in gathered], contribution.item(), weights,
                (high + low).item(), "gloo across processes")
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    if TPU:
        xmp.spawn(hello_tpu, args=())
    else:
        hello_cpu()
PYTHON
"$PY" "$work/torch_xla_hello.py" "$@"
