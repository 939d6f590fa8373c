#!/usr/bin/env bash
# lightning_train: a LightningModule (a small regression MLP on synthetic data) trained
# across every worker of the pod; each rank reports when `fit` finished, with a checksum of
# its weights (the same on every rank: DDP kept the replicas in step).
#
#   lightning_train.sh [--steps N] [--batch B] [--lr LR]
#
# Anywhere without a TPU (the simulated pod, `run --local --workers N`):
# Trainer(accelerator="cpu", devices=1, num_nodes=<workers>, strategy="ddp"); Lightning reads
# tpufab's MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK and, since LOCAL_RANK is set, takes
# the processes tpufab started on every worker as its world instead of spawning its own.
# On a TPU VM (torch_xla sees a TPU): Trainer(accelerator="tpu", devices="auto",
# strategy="xla"); Lightning's XLA strategy starts one process per chip on every host and
# torch_xla's runtime forms the world (Lightning's "ddp" is the CUDA/CPU strategy).
set -euo pipefail

# The job's Python: `tpufab run` (and `run --local`) name it in TPUFAB_PYTHON (the venv
# `tpufab setup` made, else python3).
PY=${TPUFAB_PYTHON:-python3}

# Lightning's XLA strategy spawns fresh interpreters that import the main module: a file.
work=${TPUFAB_RUN_DIR:-}
if [ -z "$work" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
cat > "$work/lightning_train.py" <<'PYTHON'
import argparse
import glob
import importlib.util
import os
import sys


def on_tpu():
    if os.environ.get("PJRT_DEVICE", "TPU").upper() not in ("TPU", ""):
        return False
    devices = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) and importlib.util.find_spec("libtpu") is not None


TPU = on_tpu()
if not TPU:
    os.environ["PJRT_DEVICE"] = "CPU"

try:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
except ImportError as err:
    print(f"lightning_train: Lightning is not installed for {sys.executable} ({err}); "
          "run `tpufab setup --framework torch --extra lightning` (on the simulated pod: "
          "scripts/sim-wheels.sh --torch, then scripts/setup-sim.sh).", file=sys.stderr)
    sys.exit(2)

parser = argparse.ArgumentParser(prog="lightning_train")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch", type=int, default=16, help="samples per process per step")
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()


class Regression(L.LightningModule):
    """y = x @ w_true + noise, learnt by a two-layer MLP."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))
        self.first = self.last = None

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        value = float(loss.detach().cpu())
        self.first = value if self.first is None else self.first
        self.last = value
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=args.lr)


def dataset(seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(args.batch * args.steps, 8, generator=generator)
    w_true = torch.linspace(-1, 1, 8).unsqueeze(1)
    return TensorDataset(x, x @ w_true + 0.01 * torch.randn(len(x), 1, generator=generator))


def main():
    workers = int(os.environ.get("TPUFAB_NUM_WORKERS", os.environ.get("WORLD_SIZE", "1")))
    if TPU:
        trainer_args = {"accelerator": "tpu", "devices": "auto", "strategy": "xla"}
    else:
        trainer_args = {"accelerator": "cpu", "devices": 1, "num_nodes": workers,
                        "strategy": "ddp"}
    L.seed_everything(0, verbose=False)            # the same initial weights on every rank
    model = Regression()
    trainer = L.Trainer(max_steps=args.steps, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        default_root_dir=os.environ.get("TPUFAB_OUTPUT_DIR"),
                        **trainer_args)
    rank = int(os.environ.get("NODE_RANK", "0"))
    # Each rank its own data (DDP's sampler would split one dataset; here each rank makes
    # only its own rows, as each host of a pod reads its own shard).
    loader = DataLoader(dataset(rank), batch_size=args.batch, shuffle=False)
    trainer.fit(model, loader)
    checksum = sum(float(p.detach().double().sum().cpu()) for p in model.parameters())
    print(f"lightning_train: rank {trainer.global_rank} of {trainer.world_size} "
          f"({trainer_args['accelerator']}, {type(trainer.strategy).__name__}) finished fit "
          f"after {trainer.global_step} steps: loss {model.first:.4f} -> {model.last:.4f}, "
          f"weights checksum {checksum:.6f}", flush=True)


if __name__ == "__main__":
    main()
PYTHON
"$PY" "$work/lightning_train.py" "$@"
