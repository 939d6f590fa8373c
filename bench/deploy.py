"""Benchmark: deploy a new commit to 1 worker vs 64 workers of the simulated pod.

    sudo .venv/bin/python bench/deploy.py [--workers 1,64] [--rounds 5]

Each round commits a change and deploys it (push to a `git daemon` remote on loopback, every
worker fetches and checks out). "cold" opens new SSH connections for the deploy, as a fresh
`tpufab deploy` does; "warm" reuses open ones. Prints medians and the 64/1 ratio.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_deploy import SimPod  # noqa: E402 - the same simulated pod the tests use

from tpufab.steps.code.deploy import deploy  # noqa: E402

ENV = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
       "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env=ENV).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_repo(root: Path, url: str, files: int = 200) -> Path:
    repo = root / "bench-proj"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for i in range(files):  # a small project: ~200 files, ~1.6 MB
        (repo / f"src{i % 10}").mkdir(exist_ok=True)
        (repo / f"src{i % 10}" / f"mod{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * 1300)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "initial")
    git(repo, "remote", "add", "origin", f"{url}/bench-proj.git")
    return repo


def new_commit(repo: Path, n: int) -> None:
    (repo / "train.py").write_text(f"STEP = {n}\n")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", f"change {n}")


class ColdPod:
    """The pod's Workers surface with fresh SSH connections for every deploy."""

    def __init__(self, pod: SimPod):
        self.pod = pod

    def __enter__(self):
        from tpufab.ssh.fanout import Fanout

        self.fanout = Fanout(list(self.pod.fanout.targets.values()),
                             known_hosts=self.pod.fanout.known_hosts)
        return self.fanout

    def __exit__(self, *exc):
        self.fanout.close()


def measure(workers: int, rounds: int, base: Path, url: str, octet: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-{workers}-"))
    pod = SimPod(root, workers, str(8000 + workers), octet)
    try:
        repo = make_repo(root, url)
        bare = base / "bench-proj.git"
        subprocess.run(["rm", "-rf", str(bare)], check=True)
        git(base, "init", "-q", "--bare", "-b", "main", bare.name)
        start = time.perf_counter()
        deploy(pod, cwd=repo)  # first clone everywhere (and ship the worker script)
        first = time.perf_counter() - start
        cold, warm, worker_cpu = [], [], []
        for n in range(rounds):
            new_commit(repo, 2 * n)
            with ColdPod(pod) as fresh:
                start = time.perf_counter()
                report = deploy(fresh, cwd=repo)
                cold.append(time.perf_counter() - start)
            assert {r.action for r in report.rows} == {"update"}
            new_commit(repo, 2 * n + 1)
            start = time.perf_counter()
            report = deploy(pod, cwd=repo)
            warm.append(time.perf_counter() - start)
            assert {r.action for r in report.rows} == {"update"}
            worker_cpu.append(sum(r.cpu_seconds or 0 for r in report.rows))
        start = time.perf_counter()
        assert {r.action for r in deploy(pod, cwd=repo).rows} == {"noop"}
        noop = time.perf_counter() - start
        return {"first": first, "cold": statistics.median(cold),
                "warm": statistics.median(warm), "noop": noop,
                "worker_cpu": statistics.median(worker_cpu)}
    finally:
        pod.close()
        subprocess.run(["rm", "-rf", str(root)])


def run(fn):
    """Call fn(); on a deploy failure show every worker's outcome before raising."""
    from tpufab.errors import TpufabError

    try:
        return fn()
    except TpufabError as err:
        print(err, err.details or "", sep="\n", file=sys.stderr)
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,64")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/deploy.py needs root (the simulated pod)", file=sys.stderr)
        return 2
    counts = [int(c) for c in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        base = Path(tmp)
        port = free_port()
        daemon = subprocess.Popen(
            ["git", "daemon", "--export-all", "--enable=receive-pack", f"--base-path={base}",
             "--listen=127.0.0.1", f"--port={port}", "--reuseaddr", "--max-connections=0",
             str(base)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            url = f"git://127.0.0.1:{port}"
            results = {n: run(lambda n=n, i=i: measure(n, args.rounds, base, url, 70 + i))
                       for i, n in enumerate(counts)}
        finally:
            daemon.terminate()
            daemon.wait(10)
    cores = os.cpu_count() or 1
    print(f"{'workers':>7}  {'first clone':>11}  {'new commit, cold ssh':>20}  "
          f"{'new commit, warm':>16}  {'no-op':>7}  {'worker CPU (sum)':>16}")
    for n, r in results.items():
        print(f"{n:>7}  {r['first']:>10.2f}s  {r['cold']:>19.2f}s  {r['warm']:>15.2f}s  "
              f"{r['noop']:>6.2f}s  {r['worker_cpu']:>15.2f}s")
    print(f"(the simulated workers share this host's {cores} cores: worker CPU / {cores} is a "
          f"floor no orchestration can beat here; load average {os.getloadavg()[0]:.1f})")
    if len(counts) >= 2:
        lo, hi = results[counts[0]], results[counts[-1]]
        print(f"ratio {counts[-1]}/{counts[0]}: cold {hi['cold'] / lo['cold']:.2f}x, "
              f"warm {hi['warm'] / lo['warm']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
