"""Benchmark: peak RSS of the live folded view (`tpufab.views.folding.FoldingView`) as the output grows.

    .venv/bin/python bench/live_fold_memory.py [--mb 100] [--before DIR] [--cases a,b]

Each case runs in a fresh process: one thread per worker feeds the started view (as the
followers of `run` and `logs --follow` do, each on its own thread) chunks of 256 lines of
about 80 bytes as fast as it can, then ends; the view writes to /dev/null. Reported: peak
RSS of the process (ru_maxrss) and its growth over the process before feeding (the
interpreter with tpufab imported), the most the view held (lines, counted in its own
structures every 64 chunks), how many lines it showed (fewer is better folded) and the wall
time. Cases: every worker printing its own lines ("distinct") or the same lines ("same"),
4 workers x MB each and 64 workers x MB/10 each. `--before DIR` runs the same with the
tpufab in DIR first on sys.path (e.g. `git archive <commit> tpufab | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time

CASES = {
    # name: (workers, MB per worker as a share of --mb, every worker its own lines)
    "4 workers, distinct lines": (4, 1.0, True),
    "4 workers, same lines": (4, 1.0, False),
    "64 workers, distinct lines": (64, 0.1, True),
}
CHUNK = 256
LINE = 80


def held(view) -> int:
    queued = sum(len(q) for q in view.queue.values())
    own = sum(len(e) for anchor in view.extras.values() for e in anchor.values())
    return queued + (view.base + len(view.canon) - view.emitted) + own


def run_case(name: str, mb: float) -> dict:
    from tpufab.ssh.results import WorkerResult
    try:
        from tpufab.views.folding import FoldingView
    except ImportError:   # a tpufab from before the views band (--before)
        from tpufab.steps.runs.running import FoldingView

    workers, share, distinct = CASES[name]
    lines = int(mb * share * (1 << 20) / LINE)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = open(os.devnull, "w")
    view = FoldingView(range(workers), out).start()
    most = [0]
    pad = "x" * (LINE - 40)

    def follower(w: int) -> None:
        tag = f"w{w} " if distinct else ""
        for n, start in enumerate(range(0, lines, CHUNK)):
            data = "".join(f"{tag}step {i:>9} loss {i * 7 % 1000:>4} {pad}\n"
                           for i in range(start, min(lines, start + CHUNK)))
            view.lines(w, "stdout", data.encode())
            if n % 64 == 0:
                with view._lock:
                    most[0] = max(most[0], held(view))
        view.done(WorkerResult(w, exit_code=0))

    shown = [0]
    write = out.write

    def counting(text: str) -> int:
        shown[0] += 1
        return write(text)

    out.write = counting
    began = time.monotonic()
    threads = [threading.Thread(target=follower, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    view.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"case": name, "lines": lines * workers, "mb": round(lines * workers * LINE / 2**20),
            "peak_mib": peak / 1024, "growth_mib": (peak - base_rss) / 1024,
            "held_max": most[0], "shown": shown[0], "seconds": time.monotonic() - began}


def in_process(case: str, mb: float, before: str | None) -> dict:
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); sys.argv[1:] = sys.argv[2:]; "
            f"exec(open({__file__!r}).read())")
    path = before or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code, path, "--one", case, "--mb", str(mb)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="MB per worker (4 workers)")
    parser.add_argument("--before", help="a directory holding the tpufab to compare with")
    parser.add_argument("--cases", help="comma-separated names (default: all)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one, args.mb)))
        return
    cases = args.cases.split(",") if args.cases else list(CASES)
    print("| case | output | lines | peak RSS | growth | most held (lines) | lines shown | wall |"
          + (" before: peak RSS | before: lines shown | before: wall |" if args.before else ""))
    print("|---|--:|--:|--:|--:|--:|--:|--:|" + ("--:|--:|--:|" if args.before else ""))
    for case in cases:
        r = in_process(case, args.mb, None)
        row = (f"| {case} | {r['mb']} MB | {r['lines']:,} | {r['peak_mib']:.0f} MiB | "
               f"{r['growth_mib']:.0f} MiB | {r['held_max']:,} | {r['shown']:,} | "
               f"{r['seconds']:.0f} s |")
        if args.before:
            b = in_process(case, args.mb, args.before)
            row += f" {b['peak_mib']:.0f} MiB | {b['shown']:,} | {b['seconds']:.0f} s |"
        print(row, flush=True)
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, load average {load}")


if __name__ == "__main__":
    main()
