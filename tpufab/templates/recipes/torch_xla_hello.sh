#!/usr/bin/env bash
# torch_xla_hello: PJRT world size, an all-reduce and one data-parallel SGD step on every
# TPU chip of the pod (one process per chip, started by xmp.spawn on each host).
#
# Needs a TPU VM with torch_xla: `tpufab setup --framework torch`. tpufab sets
# PJRT_DEVICE=TPU; every host prints the same lines, so `tpufab logs` shows them once.
set -euo pipefail
export PJRT_DEVICE=${PJRT_DEVICE:-TPU}

PY=""
for candidate in "${TPUFAB_PYTHON:-}" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" \
                 "$HOME/.venv/bin/python" python3; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1; then
        PY=$candidate
        break
    fi
done
if [ -z "$PY" ]; then
    echo "torch_xla_hello: no python found (looked for \$TPUFAB_PYTHON, ~/.venv/bin/python, python3)" >&2
    exit 2
fi

# xmp.spawn starts fresh interpreters that import the main module: it must be a file.
work=${TPUFAB_RUN_DIR:-}
if [ -z "$work" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
cat > "$work/torch_xla_hello.py" <<'PYTHON'
import sys

try:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.runtime as xr
except ImportError as err:
    print(f"torch_xla_hello: torch_xla is not installed for {sys.executable} ({err}); "
          "run `tpufab setup --framework torch` (scripts/setup.sh --framework torch).",
          file=sys.stderr)
    sys.exit(2)


def device():
    return torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()


def sync():
    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:
        xm.mark_step()


def hello(index):
    dev = device()
    rank, world = xr.global_ordinal(), xr.world_size()

    # All-reduce: every chip contributes rank + 1.
    total = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([rank + 1.0], device=dev))

    # One data-parallel step: same initial weights, different data per chip; optimizer_step
    # all-reduces the gradients, so every replica ends with the same weights.
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.full((8, 16), float(rank + 1), device=dev)
    loss = model(inputs).pow(2).mean()
    loss.backward()
    xm.optimizer_step(optimizer)
    sync()
    weights = model.weight.detach().sum().item()
    # Check agreement across replicas: the max and min of the weight sum must match.
    spread = xm.all_reduce(xm.REDUCE_MAX, torch.tensor([weights], device=dev)) + \
        xm.all_reduce(xm.REDUCE_MAX, torch.tensor([-weights], device=dev))
    sync()

    if xr.local_ordinal() == 0:   # one report per host, identical on every host
        expected = world * (world + 1) // 2
        print(f"torch_xla_hello: torch_xla {torch_xla.__version__} device={xr.device_type()} "
              f"world_size={world} devices={xr.global_runtime_device_count()}", flush=True)
        print(f"torch_xla_hello: all-reduce of (rank + 1) = {total.item():.0f} "
              f"(expected {expected})", flush=True)
        print(f"torch_xla_hello: weight sum after one step = {weights:.6f} "
              f"(replica spread {spread.item():.1e})", flush=True)
        ok = round(total.item()) == expected and abs(spread.item()) < 1e-5
        print("torch_xla_hello: OK" if ok else "torch_xla_hello: MISMATCH", flush=True)
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    xmp.spawn(hello, args=())
PYTHON
"$PY" "$work/torch_xla_hello.py" "$@"
