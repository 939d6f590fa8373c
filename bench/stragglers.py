"""Straggler detection (tpufab/steps/runs/stragglers.py): delay and false alarms.

    python bench/stragglers.py [--steps 200] [--hosts 64] [--seeds 50] [--jitter 0.01,0.02]

A synchronous job (a barrier every step: every host's step line appears when the slowest
host's work is done) of ``--hosts`` hosts over ``--steps`` steps, each host's work per step
0.5 s x (1 + N(0, jitter)); from step 50 on one host works 0%, 5%, 10% or 20% longer. For each
case, over ``--seeds`` runs: how often that host was named (and how many steps after the
slowdown began, median and worst), and how many verdicts named another host (false alarms)
or anybody with no slowdown. The detector's client CPU per step is measured too.

    python bench/stragglers.py --live [--hosts 64,256] [--steps 200]

The live path instead (tpufab/steps/runs/livesteps.py, what `run`, `launch` and `babysit`
wrap the follower's view in): every host's step line as the follower delivers it, with a
log line between steps, and one metrics sample per host per step (the sampler's 0.5 s
against a 0.5 s step), one host 20% slower from step 50; the client CPU per step (lines
cut and matched, samples parsed, rows judged) and the step at which it was named.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from tpufab.steps.runs import stragglers as s


def job(steps: int, hosts: int, slow: int | None, by: float, jitter: float, seed: int,
        start: int = 50) -> list[s.Step]:
    rng = random.Random(seed)
    at, out = 0.0, []
    for n in range(steps):
        work = [0.5 * (1 + rng.gauss(0, jitter)) * (1 + by if h == slow and n >= start else 1)
                for h in range(hosts)]
        at += max(work) + 0.05
        for h in range(hosts):
            out.append(s.Step(h, n, at, work[h], 100 * work[h] / (max(work) + 0.05)))
    return out


def live(hosts: int, steps: int, slow: int = 7, by: float = 0.20) -> tuple[float, str]:
    """Client CPU (s) a step of the live watch over ``hosts``, and what it said."""
    import io

    from tpufab.remote.workerlib import answer
    from tpufab.steps.runs.livesteps import StragglerWatch

    class View:
        def lines(self, worker, stream, data):
            pass

        def done(self, result):
            pass

    now = [1000.0]
    said: list[str] = []
    watch = StragglerWatch(View(), range(hosts), pattern=None, say=said.append,
                           clock=lambda: now[0])
    watch.metrics = True
    rng = random.Random(1)
    programs = [0] * hosts
    busy = [0.0] * hosts
    lines = []
    for n in range(1, steps + 1):
        work = [0.5 * (1 + rng.gauss(0, 0.01)) * (1 + by if h == slow and n >= 50 else 1)
                for h in range(hosts)]
        for h in range(hosts):
            programs[h] += 1
            busy[h] += work[h]
            out = io.StringIO()
            answer("sample", {"at": 0, "available": True, "chips": [
                {"chip": c, "duty_cycle_percent": 90.0, "programs": programs[h],
                 "programs_seconds": busy[h]} for c in range(4)]}, stream=out)
            lines.append((h, f"step {n} loss 2.{n} lr 3e-4\n".encode(),
                          out.getvalue().strip(), max(work) + 0.05))
    began = time.process_time()
    for h, line, sample, step in lines:
        if h == 0:
            now[0] += step
        watch.lines(h, "stdout", b"INFO data loader: 1024 examples\n")
        watch.lines(h, "stdout", line)
        watch.sampled(h, sample)
    watch.close()
    return (time.process_time() - began) / steps, said[0] if said else "(none)"


def main() -> None:
    parser = argparse.ArgumentParser()
    if "--live" in sys.argv:
        parser.add_argument("--live", action="store_true")
        parser.add_argument("--hosts", default="64,256")
        parser.add_argument("--steps", type=int, default=200)
        args = parser.parse_args()
        for hosts in (int(h) for h in args.hosts.split(",")):
            cpu, said = live(hosts, args.steps)
            print(f"{hosts} hosts: {1e3 * cpu:.1f} ms client CPU a step "
                  f"({1e6 * cpu / hosts:.0f} us a host); said: {said}")
        return
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hosts", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--jitter", default="0.01,0.02")
    args = parser.parse_args()
    print(f"{args.hosts} hosts, {args.steps} steps, slowdown from step 50, {args.seeds} seeds")
    print("jitter  slowdown  named  delay (median, worst)  false alarms  CPU/step")
    for jitter in (float(j) for j in args.jitter.split(",")):
        for by in (0.0, 0.05, 0.10, 0.20):
            slow = 7 if by else None
            named, delays, false, cpu = 0, [], 0, 0.0
            for seed in range(args.seeds):
                steps = job(args.steps, args.hosts, slow, by, jitter, seed)
                began = time.process_time()
                verdicts = s.detect(steps, range(args.hosts))
                cpu += time.process_time() - began
                mine = [v for v in verdicts if v.worker == slow and slow is not None]
                false += sum(1 for v in verdicts if v.worker is not None and v.worker != slow)
                if mine:
                    named += 1
                    delays.append(mine[0].last - 50 + 1)
            delay = (f"{statistics.median(delays):.0f}, {max(delays)} steps" if delays
                     else "-")
            print(f"{jitter:6.0%}  {by:8.0%}  {named:2d}/{args.seeds}  {delay:>21}  "
                  f"{false:12d}  {1e6 * cpu / (args.seeds * args.steps):.0f} us")


if __name__ == "__main__":
    main()
