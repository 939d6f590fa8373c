#!/usr/bin/env bash
# torch_xla_train: a small decoder-only (causal) language model trained data-parallel with
# torch_xla, printing the metrics SkyPilot's Llama example prints (train_loss, train_runtime,
# train_samples_per_second) once, from rank 0.
#
#   torch_xla_train.sh [--steps N] [--batch B] [--seq L] [--dim D] [--layers K] [--heads H]
#                      [--vocab V] [--lr LR] [--log-every N] [--seed S]
#
# The model (token + position embeddings, pre-norm attention/MLP blocks, tied output) is
# defined here, so the recipe needs nothing but torch and torch_xla; data is synthetic
# (Zipf-distributed tokens whose second half repeats the first, so the loss has somewhere to
# go), each process building only its own rows of the global batch. AdamW, gradient clipping.
#
# On a TPU VM (TPU device files and libtpu present): PJRT_DEVICE=TPU and SPMD (one process
# per host, XLA_USE_SPMD semantics through xr.use_spmd()): the global batch is sharded over a
# "data" mesh axis spanning every chip of the pod, parameters are replicated, and XLA
# inserts the gradient all-reduce.
# Anywhere else (the simulated pod, `run --local --workers N`): PJRT_DEVICE=CPU, one process
# per worker; forward and backward run on the XLA CPU device and the gradients are averaged
# across workers with torch.distributed over gloo (tpufab's MASTER_ADDR, MASTER_PORT,
# WORLD_SIZE, RANK), since torch_xla's collectives do not cross processes on CPU.
set -euo pipefail

# The job's Python: `tpufab run` (and `run --local`) name it in TPUFAB_PYTHON (the venv
# `tpufab setup` made, else python3).
PY=${TPUFAB_PYTHON:-python3}

exec "$PY" - "$@" <<'PYTHON'
import argparse
import glob
import importlib.util
import math
import os
import sys
import time
from datetime import timedelta


def on_tpu():
    if os.environ.get("PJRT_DEVICE", "TPU").upper() not in ("TPU", ""):
        return False
    devices = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) and importlib.util.find_spec("libtpu") is not None


TPU = on_tpu()
os.environ["PJRT_DEVICE"] = "TPU" if TPU else "CPU"     # before torch_xla is imported

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
except ImportError as err:
    print(f"torch_xla_train: torch_xla is not installed for {sys.executable} ({err}); run "
          "`tpufab setup --framework torch` (on the simulated pod: scripts/sim-wheels.sh "
          "--torch, then scripts/setup-sim.sh).", file=sys.stderr)
    sys.exit(2)

parser = argparse.ArgumentParser(prog="torch_xla_train")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch", type=int, default=8, help="sequences per process per step")
parser.add_argument("--seq", type=int, default=32)
parser.add_argument("--vocab", type=int, default=128)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--clip", type=float, default=1.0)
parser.add_argument("--log-every", type=int, default=10)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
if args.dim % args.heads:
    sys.exit("torch_xla_train: --dim must be a multiple of --heads")


def sync():
    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:
        xm.mark_step()


# -- the world ---------------------------------------------------------------------------

if TPU:
    import torch_xla.distributed.spmd as xs

    xr.use_spmd()
    n_devices = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n_devices), (n_devices,), ("data",))
    rank, world = xr.process_index(), xr.process_count()
    rows = args.batch * n_devices // world          # this host's share of the global batch
    global_batch = args.batch * n_devices
else:
    import torch.distributed as dist

    timeout = timedelta(seconds=int(os.environ.get("TPUFAB_INIT_TIMEOUT", "300")))
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = args.batch
    global_batch = args.batch * world
dev = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()


# -- model -------------------------------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x, causal):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        x = x + self.out((weights @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CausalLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(args.vocab, args.dim)
        torch.nn.init.normal_(self.embed.weight, std=0.02)     # small logits at the start
        self.pos = torch.nn.Parameter(torch.randn(args.seq, args.dim) * 0.01)
        self.blocks = torch.nn.ModuleList(Block(args.dim, args.heads)
                                          for _ in range(args.layers))
        self.norm = torch.nn.LayerNorm(args.dim)

    def forward(self, tokens):
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        for block in self.blocks:
            x = block(x, causal)
        return self.norm(x) @ self.embed.weight.T          # tied output projection


torch.manual_seed(args.seed)                              # the same initial weights everywhere
model = CausalLM().to(dev)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
params = [p for p in model.parameters()]


# -- data: each process builds only its own rows of the global batch ---------------------

zipf = 1.0 / np.arange(1, args.vocab + 1)
zipf /= zipf.sum()


def synthetic_batch(step):
    rng = np.random.default_rng([args.seed, step, rank])
    half = (args.seq + 2) // 2
    first = rng.choice(args.vocab, size=(rows, half), p=zipf)
    tokens = np.concatenate([first, first], axis=1)[:, :args.seq + 1]
    return torch.from_numpy(tokens.astype(np.int64))


def batches():
    """This process's rows, step after step, on the device: under SPMD the loader puts each
    host's rows into one global batch sharded over the "data" axis."""
    local = (synthetic_batch(step) for step in range(args.steps))
    if TPU:
        import torch_xla.distributed.parallel_loader as pl

        return pl.MpDeviceLoader(local, dev,
                                 input_sharding=xs.ShardingSpec(mesh, ("data", None)))
    return (batch.to(dev) for batch in local)


def average_gradients():
    """CPU: one flat all-reduce of every gradient over gloo (TPU: XLA does it under SPMD)."""
    if TPU:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params]).cpu()
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].reshape(p.grad.shape).to(dev))
        offset += n


def global_mean(value):
    if TPU or world == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / world


count = sum(p.numel() for p in params)
if rank == 0:
    print(f"torch_xla_train: {world} processes, device={xr.device_type()}, "
          f"{count / 1e6:.2f}M parameters, global batch {global_batch} x {args.seq} tokens",
          flush=True)

losses = []
started = None
for step, tokens in enumerate(batches()):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    average_gradients()
    torch.nn.utils.clip_grad_norm_(params, args.clip)
    optimizer.step()
    sync()
    losses.append(global_mean(loss.item()))
    if step == 0:
        started = time.perf_counter()                     # after compilation
    if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
        print(f"step {step + 1:5d}  loss {losses[-1]:.4f}", flush=True)

runtime = time.perf_counter() - started if started else 0.0
if rank == 0:
    timed = max(args.steps - 1, 1)
    metrics = {"train_runtime": round(runtime, 4),
               "train_samples_per_second": round(timed * global_batch / max(runtime, 1e-9), 3),
               "train_steps_per_second": round(timed / max(runtime, 1e-9), 3),
               "train_loss": round(sum(losses) / len(losses), 4)}
    print(metrics, flush=True)
if not TPU:
    dist.destroy_process_group()
PYTHON
