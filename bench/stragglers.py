"""Straggler detection (tpufab/steps/runs/stragglers.py): delay and false alarms.

    python bench/stragglers.py [--steps 200] [--hosts 64] [--seeds 50] [--jitter 0.01,0.02]

A synchronous job (a barrier every step: every host's step line appears when the slowest
host's work is done) of ``--hosts`` hosts over ``--steps`` steps, each host's work per step
0.5 s x (1 + N(0, jitter)); from step 50 on one host works 0%, 5%, 10% or 20% longer. For each
case, over ``--seeds`` runs: how often that host was named (and how many steps after the
slowdown began, median and worst), and how many verdicts named another host (false alarms)
or anybody with no slowdown. The detector's client CPU per step is measured too.
"""

from __future__ import annotations

import argparse
import random
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser()
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
