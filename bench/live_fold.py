"""Benchmark: the live folded view (`tpufab.views.folding.FoldingView`), client CPU per line and lines shown.

    .venv/bin/python bench/live_fold.py [--before DIR] [--repeat 3]

Feeds the view, with its injectable clock, the lines of synthetic runs in the order a client
would receive them (each worker's lines in order, chunks interleaved by arrival time), then
ends every worker. Shapes: many workers printing the same lines, or each naming itself now
and then, with worker 0 on time or lagging; four workers streaming a big log at the rate
`logs --follow` reads a finished run, with worker 0 the fastest or the slowest. Reports the
CPU time of the feeding (median of --repeat), per line, and how many lines the view printed
(the fewest is the fold `logs` prints). `--before DIR` runs the same in a fresh process
with the tpufab in DIR first on sys.path (e.g. `git archive main tpufab | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import random
import statistics
import subprocess
import sys
import time

SHAPES = {
    # name: (workers, lines per worker, a worker names itself every N lines (0: never),
    #        worker 0's lag in s, chunking)
    "1024 workers, same lines": (1024, 50, 0, 0.0, "line"),
    "1024 workers, same lines, w0 0.2 s late": (1024, 50, 0, 0.2, "line"),
    "1024 workers, own line every 10": (1024, 50, 10, 0.0, "line"),
    "1024 workers, every line its own": (1024, 20, 1, 0.0, "line"),
    "64 workers x 2000 lines, own line every 7": (64, 2000, 7, 0.0, "line"),
    "4 workers x 300k lines, w0 fastest": (4, 300_000, 0, "fastest", "big"),
    "4 workers x 300k lines, w0 slowest": (4, 300_000, 0, "slowest", "big"),
}


def arrivals(workers: int, lines: int, own_every: int, lag, chunking: str, seed: int = 0):
    """[(time, worker, first line, last line)] in arrival order, and each worker's lines."""
    rng = random.Random(seed)

    def text(w: int, i: int) -> str:
        if own_every and i % own_every == 0:
            return f"worker {w} says {i}\n"
        return f"step {i} loss {1.0 / (i + 1):.6f} lr 3e-4 tokens/s 98765\n"

    logs = {w: [text(w, i) for i in range(lines)] for w in range(workers)}
    events = []
    if chunking == "line":          # a line every 10 ms, each worker up to 50 ms late
        for w in range(workers):
            t = 0.0
            for i in range(lines):
                t = max(t, i * 0.01 + rng.random() * 0.05 + (lag if w == 0 else 0.0))
                events.append((t, w, i, i + 1))
    else:                           # chunks of up to 12,000 lines at ~100k lines/s each
        rates = {w: 100_000 + 10_000 * w for w in range(workers)}
        rates[0] = 150_000 if lag == "fastest" else 90_000
        for w in range(workers):
            i, t = 0, 0.0
            while i < lines:
                n = rng.randint(1, 12_000)
                t += n / rates[w]
                events.append((t, w, i, min(lines, i + n)))
                i += n
    events.sort()
    return events, logs


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def measure(shape: str, repeat: int) -> dict:
    from tpufab.ssh.results import WorkerResult
    try:
        from tpufab.views.folding import FoldingView
    except ImportError:   # a tpufab from before the views band (--before)
        from tpufab.steps.runs.running import FoldingView

    workers, lines, own_every, lag, chunking = SHAPES[shape]
    events, logs = arrivals(workers, lines, own_every, lag, chunking)
    cpu, shown = [], 0
    for _ in range(repeat):
        clock = Clock()
        out = io.StringIO()
        view = FoldingView(range(workers), out, clock=clock)
        began = time.process_time()
        for t, w, first, last in events:
            clock.now = t
            view.lines(w, "stdout", "".join(logs[w][first:last]).encode())
        for w in range(workers):
            view.done(WorkerResult(w, exit_code=0))
        view.close()
        cpu.append(time.process_time() - began)
        shown = len(out.getvalue().splitlines())
    total = workers * lines
    return {"shape": shape, "cpu": statistics.median(cpu), "per_line_us":
            statistics.median(cpu) / total * 1e6, "lines": total, "shown": shown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a directory holding the tpufab to compare with")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    results = [measure(shape, args.repeat) for shape in SHAPES]
    if args.json:
        print(json.dumps(results))
        return
    before = {}
    if args.before:
        code = ("import sys; sys.path.insert(0, sys.argv[1]); sys.argv[1:] = sys.argv[2:]; "
                f"exec(open({__file__!r}).read())")
        done = subprocess.run([sys.executable, "-c", code, args.before, "--json", "--repeat",
                               str(args.repeat)], capture_output=True, text=True, check=True)
        before = {r["shape"]: r for r in json.loads(done.stdout)}
    print("| shape | lines fed | CPU per line | lines shown |" + (
        " before: CPU per line | before: lines shown |" if before else ""))
    print("|---|--:|--:|--:|" + ("--:|--:|" if before else ""))
    for r in results:
        row = f"| {r['shape']} | {r['lines']:,} | {r['per_line_us']:.1f} us | {r['shown']:,} |"
        if before:
            b = before[r["shape"]]
            row += f" {b['per_line_us']:.1f} us | {b['shown']:,} |"
        print(row)
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    print(f"\nmachine: {platform.machine()}, Python {platform.python_version()}, "
          f"load average {load}")


if __name__ == "__main__":
    main()
