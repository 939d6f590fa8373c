#!/usr/bin/env bash
# jax_train: train a small decoder-only transformer LM on every chip of the pod.
#
#   tpufab run recipes/jax_train.sh --args "--steps 500 --batch 16 --fsdp"
#
# One process per host, one global device mesh over every chip: the batch is split over
# the "data" axis (each host feeds only its own shard), parameters are replicated or, with
# --fsdp, sharded over the same axis (ZeRO-3 style; XLA inserts the all-gathers and
# reduce-scatters). AdamW with warmup + cosine decay and gradient clipping, written out in
# plain JAX so the recipe needs nothing but jax. Data is synthetic (Zipf-distributed tokens
# whose second half repeats the first), so no dataset download is needed; swap
# `synthetic_batch` for a real loader. Every host prints the same step lines.
#
# On a TPU VM: jax.distributed.initialize() discovers the pod. Anywhere else (simulated pod,
# `run --local --workers N`): JAX on CPU, joined through TPUFAB_COORDINATOR with gloo.
# Useful TPU knobs travel with `--env`: LIBTPU_INIT_ARGS, XLA_FLAGS, TPU_STDERR_LOG_LEVEL.
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

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
except ImportError as err:
    print(f"jax_train: JAX is not installed for {sys.executable} ({err}); run `tpufab setup` "
          "(scripts/setup.sh, or scripts/setup-sim.sh on the simulated pod).", file=sys.stderr)
    sys.exit(2)

parser = argparse.ArgumentParser(prog="jax_train")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=8, help="sequences per device per step")
parser.add_argument("--seq", type=int, default=256)
parser.add_argument("--vocab", type=int, default=512)
parser.add_argument("--dim", type=int, default=512)
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--heads", type=int, default=8)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup", type=int, default=20)
parser.add_argument("--weight-decay", type=float, default=0.01)
parser.add_argument("--clip", type=float, default=1.0)
parser.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state")
parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="activation dtype (default: bfloat16 on TPU, float32 elsewhere)")
parser.add_argument("--log-every", type=int, default=10)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--checkpoint", help="write the final parameters here (.npz, from host 0)")
args = parser.parse_args()


def on_tpu():
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    devices = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) and importlib.util.find_spec("libtpu") is not None


timeout = int(os.environ.get("TPUFAB_INIT_TIMEOUT", "300"))
if on_tpu():
    jax.distributed.initialize(initialization_timeout=timeout)
else:
    jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, KeyError, ValueError):
        jax.config.update("jax_cpu_enable_gloo_collectives", True)
    if int(os.environ.get("TPUFAB_NUM_WORKERS", "1")) > 1:
        jax.distributed.initialize(coordinator_address=os.environ["TPUFAB_COORDINATOR"],
                                   num_processes=int(os.environ["TPUFAB_NUM_WORKERS"]),
                                   process_id=int(os.environ["TPUFAB_WORKER_ID"]),
                                   initialization_timeout=timeout)

dtype = jnp.dtype(args.dtype or ("bfloat16" if jax.default_backend() == "tpu" else "float32"))
mesh = Mesh(np.array(jax.devices()), ("data",))
n_devices = jax.device_count()
replicated = NamedSharding(mesh, P())
batch_sharding = NamedSharding(mesh, P("data"))
global_batch = args.batch * n_devices
if args.dim % args.heads:
    sys.exit("jax_train: --dim must be a multiple of --heads")
head_dim = args.dim // args.heads


# -- model -------------------------------------------------------------------------------

def init_params(key):
    keys = iter(jax.random.split(key, 4 + 4 * args.layers))
    d, f = args.dim, 4 * args.dim

    def dense(shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)

    blocks = [{"norm1": jnp.ones((d,)), "qkv": dense((d, 3 * d), d), "out": dense((d, d), d),
               "norm2": jnp.ones((d,)), "up": dense((d, f), d), "down": dense((f, d), f)}
              for _ in range(args.layers)]
    return {"embed": jax.random.normal(next(keys), (args.vocab, d)) * 0.02,
            "pos": jax.random.normal(next(keys), (args.seq, d)) * 0.01,
            "blocks": blocks, "norm": jnp.ones((d,))}


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(x.dtype)


def forward(params, tokens):
    batch, length = tokens.shape
    x = (params["embed"][tokens] + params["pos"][:length]).astype(dtype)
    causal = jnp.tril(jnp.ones((length, length), bool))
    for block in params["blocks"]:
        h = rms_norm(x, block["norm1"])
        q, k, v = jnp.split(h @ block["qkv"].astype(dtype), 3, axis=-1)
        q, k, v = (t.reshape(batch, length, args.heads, head_dim) for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(dtype)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, args.dim)
        x = x + attended @ block["out"].astype(dtype)
        h = rms_norm(x, block["norm2"])
        x = x + jax.nn.gelu(h @ block["up"].astype(dtype)) @ block["down"].astype(dtype)
    x = rms_norm(x, params["norm"])
    return (x @ params["embed"].T.astype(dtype)).astype(jnp.float32)


def loss_fn(params, tokens):
    logits = forward(params, tokens[:, :-1])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(picked)


# -- sharding ----------------------------------------------------------------------------

def param_sharding(leaf):
    if args.fsdp and leaf.ndim >= 2 and leaf.shape[0] % n_devices == 0:
        return NamedSharding(mesh, P("data", *([None] * (leaf.ndim - 1))))
    return replicated


shapes = jax.eval_shape(init_params, jax.random.PRNGKey(0))
param_shardings = jax.tree.map(param_sharding, shapes)


# -- optimizer: AdamW, warmup + cosine, global-norm clipping ------------------------------

def learning_rate(step):
    warm = args.lr * (step + 1) / max(args.warmup, 1)
    progress = jnp.clip((step - args.warmup) / max(args.steps - args.warmup, 1), 0.0, 1.0)
    cosine = args.lr * (0.1 + 0.9 * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
    return jnp.where(step < args.warmup, warm, cosine)


def init_state(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params), "step": jnp.zeros((), jnp.int32)}


def train_step(params, state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, args.clip / (norm + 1e-6)), grads)
    step = state["step"]
    lr = learning_rate(step)
    b1, b2 = 0.9, 0.95
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    t = step + 1

    def update(p, m, v):
        adam = (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + 1e-8)
        decay = args.weight_decay * p if p.ndim >= 2 else 0.0
        return p - lr * (adam + decay)

    params = jax.tree.map(update, params, m, v)
    return params, {"m": m, "v": v, "step": t}, {"loss": loss, "grad_norm": norm, "lr": lr}


state_shardings = {"m": param_shardings, "v": param_shardings, "step": replicated}
metric_shardings = {"loss": replicated, "grad_norm": replicated, "lr": replicated}
params = jax.jit(init_params, out_shardings=param_shardings)(jax.random.PRNGKey(args.seed))
state = jax.jit(init_state, out_shardings=state_shardings)(params)
step_fn = jax.jit(train_step, in_shardings=(param_shardings, state_shardings, batch_sharding),
                  out_shardings=(param_shardings, state_shardings, metric_shardings),
                  donate_argnums=(0, 1))


# -- data: each host builds only its own rows of the global batch ---------------------------

zipf = 1.0 / np.arange(1, args.vocab + 1)
zipf /= zipf.sum()


def synthetic_batch(step):
    rows = args.batch * jax.local_device_count()
    rng = np.random.default_rng([args.seed, step, jax.process_index()])
    half = (args.seq + 1) // 2
    first = rng.choice(args.vocab, size=(rows, half), p=zipf)
    tokens = np.concatenate([first, first], axis=1)[:, :args.seq].astype(np.int32)
    return jax.make_array_from_process_local_data(batch_sharding, tokens)


count = sum(x.size for x in jax.tree.leaves(shapes))
print(f"jax_train: {jax.process_count()} processes, {n_devices} {jax.default_backend()} devices, "
      f"{count / 1e6:.2f}M parameters ({'fsdp' if args.fsdp else 'replicated'}), "
      f"global batch {global_batch} x {args.seq} tokens, {dtype.name}", flush=True)

started = None
for step in range(args.steps):
    params, state, metrics = step_fn(params, state, synthetic_batch(step))
    if step == 0:
        jax.block_until_ready(metrics)
        started = time.perf_counter()   # after compilation
    if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
        values = {k: float(v.addressable_data(0)) for k, v in metrics.items()}
        print(f"step {step + 1:5d}  loss {values['loss']:.4f}  "
              f"grad_norm {values['grad_norm']:.3f}  lr {values['lr']:.2e}", flush=True)

jax.block_until_ready(params)
if jax.process_index() == 0 and args.steps > 1:
    elapsed = time.perf_counter() - started
    rate = (args.steps - 1) * global_batch * args.seq / elapsed
    print(f"jax_train: {rate:,.0f} tokens/s over {args.steps - 1} steps", flush=True)

if args.checkpoint:
    host = multihost_utils.process_allgather(params, tiled=True)   # full arrays everywhere
    if jax.process_index() == 0:
        flat = {jax.tree_util.keystr(path): np.asarray(leaf)
                for path, leaf in jax.tree_util.tree_leaves_with_path(host)}
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
        np.savez(args.checkpoint, **flat)
        print(f"jax_train: wrote {args.checkpoint}", flush=True)
    multihost_utils.sync_global_devices("checkpoint written")

print("jax_train: done", flush=True)
if jax.process_count() > 1:
    jax.distributed.shutdown()
PYTHON
