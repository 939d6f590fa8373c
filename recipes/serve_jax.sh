#!/usr/bin/env bash
# serve_jax: a small JAX language model served over HTTP from worker 0.
#
#   tpufab run recipes/serve_jax.sh --wait-port 9000 [--args "--port 9000 --threads 8"]
#   tpufab forward 9000            # then: curl localhost:9000/healthz
#   python recipes/bench_serve.py --url http://127.0.0.1:9000 --requests 200 --concurrency 16
#
# The model is a byte-level MLP language model (context 16, 2 hidden layers, ~1.3 M params)
# with fixed random weights: it produces text-shaped noise, and exists to exercise the path
# a real server (JetStream, on port 9000 in SkyPilot's TPU guide) takes: a jitted forward
# pass per token, batched HTTP requests, a health endpoint. It fits on one host, so worker
# 0 serves and the other workers say so and exit. Endpoints:
#   GET  /healthz   -> {"status": "ok", "model": ..., "backend": ...}
#   POST /generate  {"prompt": "...", "max_tokens": 32} -> {"text": ..., "tokens": N, ...}
# It also starts JAX's profiler server on $TPUFAB_PROFILER_PORT for `tpufab profile`.
set -euo pipefail

# The job's Python: `tpufab run` (and `run --local`) name it in TPUFAB_PYTHON (the venv
# `tpufab setup` made, else python3).
PY=${TPUFAB_PYTHON:-python3}

exec "$PY" - "$@" <<'PYTHON'
import argparse
import glob
import importlib.util
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser(prog="serve_jax")
parser.add_argument("--port", type=int, default=9000)
parser.add_argument("--host", default="0.0.0.0")
parser.add_argument("--threads", type=int, default=8, help="requests decoded at once")
parser.add_argument("--max-tokens", type=int, default=256, help="upper bound per request")
args = parser.parse_args()

rank = int(os.environ.get("TPUFAB_WORKER_ID", "0"))
if rank != 0:
    print(f"serve_jax: worker {rank} idle: the model fits on one host, worker 0 serves it "
          f"on port {args.port}", flush=True)
    sys.exit(0)

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
except ImportError as err:
    print(f"serve_jax: JAX is not installed for {sys.executable} ({err}); run `tpufab setup`.",
          file=sys.stderr)
    sys.exit(2)


def on_tpu():
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    devices = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) and importlib.util.find_spec("libtpu") is not None


if not on_tpu():
    jax.config.update("jax_platforms", "cpu")

profiler_port = os.environ.get("TPUFAB_PROFILER_PORT")
if profiler_port:
    jax.profiler.start_server(int(profiler_port))
    print(f"serve_jax: profiler server on port {profiler_port}", flush=True)

VOCAB, CONTEXT, EMBED, HIDDEN = 256, 16, 32, 512
MODEL = f"byte-mlp-c{CONTEXT}-h{HIDDEN}"


def init(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    scale = lambda n: 1.0 / np.sqrt(n)  # noqa: E731
    return {"embed": jax.random.normal(k1, (VOCAB, EMBED)) * 0.5,
            "w1": jax.random.normal(k2, (CONTEXT * EMBED, HIDDEN)) * scale(CONTEXT * EMBED),
            "w2": jax.random.normal(k3, (HIDDEN, HIDDEN)) * scale(HIDDEN),
            "out": jax.random.normal(k4, (HIDDEN, VOCAB)) * scale(HIDDEN)}


params = init(jax.random.PRNGKey(0))
n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))


@jax.jit
def next_token(params, window, key):
    """One decoding step: the last CONTEXT bytes -> a sampled next byte (printable range)."""
    x = params["embed"][window].reshape(-1)
    x = jax.nn.gelu(x @ params["w1"])
    x = jax.nn.gelu(x @ params["w2"])
    logits = x @ params["out"]
    mask = (jnp.arange(VOCAB) >= 32) & (jnp.arange(VOCAB) < 127)
    return jax.random.categorical(key, jnp.where(mask, logits, -1e9))


def generate(prompt: str, max_tokens: int, seed: int) -> str:
    data = list(prompt.encode("utf-8", "replace")[-CONTEXT:])
    window = np.zeros(CONTEXT, dtype=np.int32)
    window[CONTEXT - len(data):] = data
    key = jax.random.PRNGKey(seed)
    out = []
    for _ in range(max_tokens):
        key, sub = jax.random.split(key)
        token = int(next_token(params, window, sub))
        out.append(token)
        window = np.roll(window, -1)
        window[-1] = token
    return bytes(out).decode("ascii", "replace")


began = time.monotonic()
generate("warm up", 2, 0)   # compile before the port opens, so the first request is fast
print(f"serve_jax: {MODEL} ({n_params / 1e6:.1f} M params) compiled in "
      f"{time.monotonic() - began:.1f} s on {jax.default_backend()} (jax {jax.__version__})",
      flush=True)
slots = threading.BoundedSemaphore(args.threads)
served = [0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path in ("/healthz", "/health", "/"):
            self._send(200, {"status": "ok", "model": MODEL, "backend": jax.default_backend(),
                             "served": served[0]})
        else:
            self._send(404, {"error": f"no route {self.path}; try /healthz or POST /generate"})

    def do_POST(self):
        if self.path not in ("/generate", "/predict"):
            self._send(404, {"error": f"no route {self.path}; try POST /generate"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            prompt = str(body.get("prompt", ""))
            max_tokens = max(1, min(int(body.get("max_tokens", 32)), args.max_tokens))
            seed = int(body.get("seed", served[0]))
        except (ValueError, TypeError) as err:
            self._send(400, {"error": f"bad request: {err}"})
            return
        started = time.monotonic()
        with slots:
            text = generate(prompt, max_tokens, seed)
        served[0] += 1
        self._send(200, {"text": text, "tokens": max_tokens, "model": MODEL,
                         "latency_ms": round((time.monotonic() - started) * 1e3, 2)})

    def log_message(self, fmt, *fmt_args):  # one line per request would drown the run log
        pass


server = ThreadingHTTPServer((args.host, args.port), Handler)
server.daemon_threads = True
print(f"serve_jax: serving on port {args.port} ({args.threads} decode threads; GET /healthz, "
      "POST /generate)", flush=True)
try:
    server.serve_forever()
except KeyboardInterrupt:
    pass
PYTHON
