"""`run --local --workers N`: a recipe as N processes on this machine, same env contract.

Each process gets the environment a pod worker gets (its own TPUFAB_WORKER_ID, the
coordinator on 127.0.0.1 at a free port, JAX on CPU), so multi-host code is exercised before
paying for a pod. Output is prefixed per worker (``w2: ...``); the result has every
worker's exit code and output, and names the workers that failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from tpufab.errors import ConfigError, TpufabError, shown
from tpufab.ssh.results import GroupResult, WorkerResult
from tpufab.steps.runs.env import Forwarded, local_environments, new_run_id

POLL = 0.05


class LocalRunResult(GroupResult):
    """Every local process's result, ``{worker: WorkerResult}``: the fan-out's one command-result
    container (``.succeeded``, ``.failed``, ``.ok``, ``.check()``), with the fields of a local
    run added: its ``run_id``, the worker that failed first and whether it timed out.
    ``summary()`` is one sentence naming every worker that did not exit 0; ``exit_codes`` and
    ``output`` read each worker's outcome and lines in worker order."""

    def __init__(self, run_id: str, results: Mapping[int, WorkerResult], *,
                 first_failure: int | None = None, timed_out: bool = False):
        super().__init__(results, command=f"run --local {run_id}")
        self.run_id = run_id
        self.first_failure = first_failure
        self.timed_out = timed_out

    @property
    def ok(self) -> bool:
        return not self.timed_out and super().ok

    @property
    def exit_codes(self) -> tuple[int, ...]:
        """Each worker's exit code (negative: killed by that signal)."""
        return tuple(-r.signal if r.signal else r.exit_code for r in self.values())

    @property
    def output(self) -> dict[int, tuple[str, ...]]:
        """Each worker's lines (stdout and stderr as they came), without their newlines."""
        return {w: tuple(r.stdout[:-1].split("\n")) if r.stdout else () for w, r in self.items()}

    def summary(self) -> str:
        """One sentence naming every worker that did not exit 0."""
        codes = self.exit_codes
        failed = [w for w, code in enumerate(codes) if code != 0]
        n = len(codes)
        if self.ok:
            return f"All {n} workers exited 0."
        if self.timed_out:
            return f"Run {self.run_id} timed out; stopped workers {_ids(failed)}."
        first = self.first_failure if self.first_failure is not None else failed[0]
        text = f"Worker {first} failed ({_describe(codes[first])})"
        others = [w for w in failed if w != first]
        stopped = [w for w in others if codes[w] < 0]
        failed_too = [w for w in others if codes[w] > 0]
        if failed_too:
            text += "; also failed: " + ", ".join(
                f"worker {w} ({_describe(codes[w])})" for w in failed_too)
        if stopped:
            text += f"; stopped after it: workers {_ids(stopped)}"
        return text + "."

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise TpufabError(self.summary(), exit_code=1)


def _worker_result(worker: int, code: int | None, lines: Sequence[str], seconds: float,
                   timed_out: bool, timeout: float | None) -> WorkerResult:
    """One process's outcome as the fan-out's WorkerResult (a signal as 128+N, as a worker's)."""
    killed = code is not None and code < 0
    result = WorkerResult(worker, 128 - code if killed else code, seconds,
                          signal=-code if killed else None)
    if code is None:
        result.error = "still running after it was stopped"
    elif killed and timed_out and timeout:
        result.error = f"timed out after {timeout:g} s"
    for line in lines:
        result.stdout_output.write(line.encode("utf-8", "replace") + b"\n")
    return result


def _ids(workers: Sequence[int]) -> str:
    return ",".join(str(w) for w in workers)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def recipe_command(recipe: Path, args: Sequence[str],
                   env: Mapping[str, str] | None = None) -> list[str]:
    """How a recipe file runs: a .py file with the job's Python (``$TPUFAB_PYTHON``, else
    ``$VIRTUAL_ENV/bin/python``, else this Python), as on a worker; anything else by its own
    shebang, else sh."""
    if recipe.suffix == ".py":
        env = os.environ if env is None else env
        python = env.get("TPUFAB_PYTHON") or (
            f"{env['VIRTUAL_ENV']}/bin/python" if env.get("VIRTUAL_ENV") else sys.executable)
        return [python, str(recipe), *args]
    with recipe.open("rb") as fh:
        head = fh.read(2)
    if head == b"#!" and os.access(recipe, os.X_OK):
        return [str(recipe), *args]
    if head == b"#!":
        with recipe.open("rb") as fh:
            interpreter = fh.readline()[2:].decode().split()
        return [*interpreter, str(recipe), *args]
    return ["/bin/sh", str(recipe), *args]


def run_local(recipe: str | Path, workers: int = 1, args: Sequence[str] = (),
              env: Mapping[str, str] | None = None, *, forwarded: Forwarded | None = None,
              run_id: str | None = None, cwd: str | Path | None = None,
              out: TextIO | None = None, echo: bool = True, timeout: float | None = None,
              failure_grace: float = 5.0, coordinator_port: int | None = None,
              spmd: bool = False) -> LocalRunResult:
    """Run `recipe` as `workers` local processes and wait for all of them.

    `env` is the base environment (default: this process's); `forwarded` is what `--env`
    adds. When a worker fails, the others get `failure_grace` seconds to finish (collective
    code usually cannot), then their process groups are stopped.
    """
    recipe = Path(recipe)
    if not recipe.is_file():
        raise ConfigError(f"No recipe at {shown(recipe)}; pass a file such as recipes/jax_hello.sh.")
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, not {workers}.")
    run_id = run_id or new_run_id()
    port = coordinator_port or free_port()
    base = dict(os.environ if env is None else env)
    base.pop("TPUFAB_TASK", None)
    if "TPUFAB_PYTHON" not in base:    # the job's Python, as on a worker: the active venv's,
        venv = base.get("VIRTUAL_ENV")  # else the one running tpufab
        base["TPUFAB_PYTHON"] = os.path.join(venv, "bin", "python") if venv else sys.executable
    base.setdefault("PYTHONUNBUFFERED", "1")
    envs = local_environments(run_id, workers, port, master_port=free_port(),
                              forwarded=forwarded, spmd=spmd)
    outputs = _output_dirs(Path(cwd or Path.cwd()), run_id)
    out = out if out is not None else sys.stdout
    lock = threading.Lock()
    output: dict[int, list[str]] = {w: [] for w in range(workers)}

    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    started = time.monotonic()
    try:
        for worker, job_env in enumerate(envs):
            proc = subprocess.Popen(
                recipe_command(recipe.resolve(), args, base), cwd=cwd,
                env={**base, **outputs, **job_env.merged()},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)
            procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc, worker, output[worker], out, lock,
                                                        echo, workers > 1), daemon=True)
            pump.start()
            pumps.append(pump)
        ended: dict[int, float] = {}
        first_failure, timed_out = _wait_all(procs, timeout, failure_grace, ended)
    except BaseException:
        _stop(procs)
        raise
    for pump in pumps:
        pump.join(timeout=5)
    now = time.monotonic()
    return LocalRunResult(run_id, {
        w: _worker_result(w, p.returncode, output[w], ended.get(w, now) - started, timed_out,
                          timeout) for w, p in enumerate(procs)},
        first_failure=first_failure, timed_out=timed_out)


def _output_dirs(cwd: Path, run_id: str) -> dict[str, str]:
    """TPUFAB_OUTPUT_DIR and TPUFAB_PROFILE_DIR of a local run, shared by its processes as a
    bucket is on a pod: ``./.tpufab/runs/<run-id>/{output,profile}``."""
    from tpufab.steps.runs.running import local_log_dir

    run_dir = local_log_dir(run_id, cwd)
    dirs = {"TPUFAB_OUTPUT_DIR": run_dir / "output", "TPUFAB_PROFILE_DIR": run_dir / "profile"}
    for path in dirs.values():
        path.mkdir(exist_ok=True)
    return {key: str(path) for key, path in dirs.items()}


def _pump(proc, worker, lines, out, lock, echo, prefixed):
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        lines.append(line)
        if echo:
            with lock:
                out.write(f"w{worker}: {line}\n" if prefixed else line + "\n")
                out.flush()
    proc.stdout.close()


def _wait_all(procs, timeout, failure_grace, ended):
    deadline = time.monotonic() + timeout if timeout else None
    first_failure = None
    give_up = None
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for worker, code in enumerate(codes):
            if code is not None:
                ended.setdefault(worker, now)
        if all(code is not None for code in codes):
            return first_failure, False
        if first_failure is None:
            for worker, code in enumerate(codes):
                if code not in (None, 0):
                    first_failure, give_up = worker, now + failure_grace
                    break
        if deadline is not None and now >= deadline:
            _stop(procs)
            return first_failure, True
        if give_up is not None and now >= give_up:
            _stop(procs)
            return first_failure, False
        time.sleep(POLL)


def _stop(procs, grace: float = 2.0):
    """TERM every worker's process group, KILL what is left after `grace`.

    Waits for every member of each group, not only its leader: a recipe's background
    children (`sleep 300 &`, a data loader) must be gone when the run returns.
    """
    live = _live_groups([p.pid for p in procs])
    for signum in (signal.SIGTERM, signal.SIGKILL):
        if not live:
            break
        for pgid in live:
            try:
                os.killpg(pgid, signum)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while live and time.monotonic() < deadline:
            time.sleep(POLL)
            for proc in procs:
                proc.poll()                                # reap our own leaders
            live = _live_groups(live)
    for proc in procs:                                     # collect every leader's code
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def _live_groups(groups):
    """The process groups in `groups` that still have a member that is not a zombie."""
    wanted = set(groups)
    found = set()
    try:
        entries = os.listdir("/proc")
    except OSError:                                         # no procfs: ask the kernel
        return [g for g in groups if _killable(g)]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] not in (b"Z", b"X") and int(fields[2]) in wanted:
            found.add(int(fields[2]))
    return [g for g in groups if g in found]


def _killable(pgid):
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return True
