#!/usr/bin/env python3
"""Benchmark a served model: N requests, C at a time, against a forwarded port.

    tpufab run recipes/serve_jax.sh --wait-port 9000 && tpufab forward 9000 &
    python recipes/bench_serve.py --url http://127.0.0.1:9000 --requests 200 --concurrency 16

Runs here (stdlib only), not on the pod. Prints what JetStream's benchmark_serving prints in
SkyPilot's TPU serving guide: successful requests, duration, request and token throughput,
and latency percentiles. Exits non-zero if no request succeeded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPTS = ["The TPU pod", "Once upon a time", "def main():", "JAX compiles", "Hello, world",
           "Attention is all", "In the beginning", "import numpy as np"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def one(url: str, n: int, max_tokens: int, timeout: float) -> tuple[bool, float, int, int, str]:
    prompt = PROMPTS[n % len(PROMPTS)]
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "seed": n}).encode()
    request = urllib.request.Request(url.rstrip("/") + "/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            data = json.loads(answer.read())
        return True, time.perf_counter() - started, len(prompt), int(data.get("tokens", 0)), ""
    except (urllib.error.URLError, OSError, ValueError) as err:
        return False, time.perf_counter() - started, len(prompt), 0, str(err)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:9000")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        with urllib.request.urlopen(args.url.rstrip("/") + "/healthz", timeout=10) as answer:
            health = json.loads(answer.read())
    except (urllib.error.URLError, OSError, ValueError) as err:
        print(f"bench_serve: {args.url}/healthz does not answer ({err}); is the server up and "
              "the port forwarded (`tpufab forward PORT`)?", file=sys.stderr)
        return 1
    print(f"Benchmarking {health.get('model', '?')} at {args.url}: {args.requests} requests, "
          f"{args.concurrency} at a time, {args.max_tokens} tokens each", flush=True)
    lock = threading.Lock()
    results = []
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        for result in pool.map(lambda n: one(args.url, n, args.max_tokens, args.timeout),
                               range(args.requests)):
            with lock:
                results.append(result)
    duration = time.perf_counter() - started
    ok = [r for r in results if r[0]]
    latencies = [r[1] * 1e3 for r in ok]
    input_tokens = sum(r[2] for r in ok)
    output_tokens = sum(r[3] for r in ok)
    print(f"Successful requests: {len(ok)}")
    if len(ok) < len(results):
        errors = sorted({r[4] for r in results if not r[0]})
        print(f"Failed requests: {len(results) - len(ok)} ({'; '.join(errors)[:200]})")
    print(f"Benchmark duration: {duration:f} s")
    print(f"Total input tokens: {input_tokens}")
    print(f"Total generated tokens: {output_tokens}")
    print(f"Request throughput: {len(ok) / duration:.2f} requests/s")
    print(f"Input token throughput: {input_tokens / duration:.2f} tokens/s")
    print(f"Output token throughput: {output_tokens / duration:.2f} tokens/s")
    if latencies:
        print(f"Mean latency: {statistics.fmean(latencies):.2f} ms")
        print(f"Median latency (P50): {percentile(latencies, 50):.2f} ms")
        print(f"P99 latency: {percentile(latencies, 99):.2f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
