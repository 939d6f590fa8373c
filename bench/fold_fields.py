"""Lines that differ only in their fields, folded (issue 26): lines printed and client CPU.

    .venv/bin/python bench/fold_fields.py [--workers 64 1024] [--steps 200] [--before DIR]

For each pod size: the `tpufab init --framework jax` hello recipe's output as it is printed on
every host (the ranks, host names, addresses, a loss that differs in its last digits), folded
by `logs` (runs.fold_logs) and by the live view (FoldingView): how many lines are shown. Then
the cost per input line, in client CPU (process time), of folding a training log of `--steps`
step lines a worker: lines identical on every worker (what folding did before: the baseline)
against lines whose step time and loss differ per worker (what only field folding folds).
With ``--before DIR`` (a checkout of an older tpufab, e.g. ``git worktree add /tmp/before
18459b9``: the commit before field folding), both are also folded by that tpufab's live view,
in a child process of this run: the goal's baseline, side by side.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpufab.ssh.results import WorkerResult  # noqa: E402
from tpufab.steps.runs.env import fold_logs, render_folded  # noqa: E402

try:
    from tpufab.views.folding import FoldingView  # noqa: E402
except ImportError:   # a tpufab from before the views band (--before)
    from tpufab.steps.runs.running import FoldingView  # noqa: E402


def hello(workers: int) -> dict[int, list[str]]:
    n = workers
    return {w: [f"jax_hello: jax 0.10.2 backend=cpu processes={n} devices={n} local_devices=1",
                f"[Gloo] Rank {w} is connected to {n - 1} peer ranks. Expected number of "
                f"connected peer ranks is : {n - 1}",
                f"jax_hello: process {w} of {n} on t1v-n-17ffbce8-w-{w} (127.16.1.{w % 254 + 1})",
                f"jax_hello: all-gather of process ids = [0, 1, ..., {n - 1}]",
                f"jax_hello: sum of (process index + 1) over all devices = {n * (n + 1) // 2}",
                "jax_hello: OK"] for w in range(workers)}


def training(workers: int, steps: int, same: bool) -> dict[int, list[str]]:
    def line(w: int, i: int) -> str:
        if same:
            return f"step {i} loss {2.31 + i / 1000:.4f} tokens/s 123456"
        return f"step {i} loss {2.31 + i / 1000 + (w % 7) / 10000:.4f} tokens/s {123000 + w}"
    return {w: [line(w, i) for i in range(steps)] for w in range(workers)}


def live(logs: dict[int, list[str]]) -> list[str]:
    out = io.StringIO()
    view = FoldingView(logs, out, delay=3.0)
    for w in sorted(logs, reverse=True):
        view.lines(w, "stdout", "".join(f"{line}\n" for line in logs[w]).encode())
    for w in logs:
        view.done(WorkerResult(w, exit_code=0))
    view.close()
    return out.getvalue().splitlines()


def cpu(fn, *args) -> float:
    start = time.process_time()
    fn(*args)
    return time.process_time() - start


def before(root: str, workers: int, steps: int, same: bool = True) -> float:
    """Client CPU per line of the live fold (identical lines, or with ``same=False`` lines
    differing in fields) of the tpufab checked out in ``root`` (this file's functions, that
    checkout's FoldingView), in a child process."""
    code = (f"import sys; sys.path[:0] = [{root!r}, {str(Path(__file__).parent)!r}]; "
            "import tpufab, fold_fields as f; "
            f"assert tpufab.__file__.startswith({root!r}); "
            f"logs = f.training({workers}, {steps}, {same}); "
            f"print(min(f.cpu(f.live, logs) for _ in range(3)) / {workers * steps})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=root)
    return float(out.stdout) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--before", help="a checkout of an older tpufab: its identical-line "
                        "live fold, side by side")
    args = parser.parse_args()
    print("| workers | hello lines as printed | `logs` shows | `run` (live) shows |")
    print("|---|---|---|---|")
    for n in args.workers:
        logs = hello(n)
        shown = render_folded(fold_logs(logs), logs)
        print(f"| {n} | {sum(map(len, logs.values()))} | {len(shown)} | {len(live(logs))} |")
    print()
    print("| workers | fold | identical lines (before) us/line | lines differing in fields "
          "us/line | ratio |")
    print("|---|---|---|---|---|")
    for n in args.workers:
        same, varied = training(n, args.steps, True), training(n, args.steps, False)
        lines = n * args.steps
        for name, fn in (("logs", fold_logs), ("live", live)):
            a = min(cpu(fn, same) for _ in range(3)) / lines * 1e6
            b = min(cpu(fn, varied) for _ in range(3)) / lines * 1e6
            print(f"| {n} | {name} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
        if args.before:
            a, b = before(args.before, n, args.steps), before(args.before, n, args.steps, False)
            print(f"| {n} | live, {args.before} | {a:.2f} | {b:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
