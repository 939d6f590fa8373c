"""Whether this machine can hold a simulated node of N workers: said before anything starts.

The figures per worker are measured (docs/simulated-pod.md, "At scale"; bench/sim_scale.py):

- idle: a worker's PID 1 (forked from the spawner, ~1.3 MiB) and its sshd listener (~1.3 MiB):
  2.6 MiB of PSS per worker on a 256-worker v4-2048, 2026-11-23;
- in use: while a tpufab verb runs on it, the SSH session (sshd's privileged and user
  processes, 2.3 MiB), tpufab's agent (a Python process, 4.5 MiB) and the command add ~7 MiB
  (measured during `tpufab exec 'sleep 6'` on a v4-32, same day).

A node is only useful in use, so the check asks for both: 10 MiB per worker, against the live
MemAvailable (other pods and programs already count there). Processes are checked the same way
(6 per worker in use: PID 1, sshd, two session processes, the agent, the command) against
kernel.pid_max, and the emulator's own file descriptors (one metadata listener per worker).
"""

from __future__ import annotations

import os
import resource

IDLE_MIB = 2.6  # PID 1 + sshd listener, PSS per worker (see above)
IN_USE_MIB = 7.0  # session + agent + command while a verb runs (see above)
WORKER_MIB = IDLE_MIB + IN_USE_MIB
PROCESSES_PER_WORKER = 6
FDS_PER_WORKER = 1  # the emulator's metadata listener on the worker's address
FD_RESERVE = 256  # the emulator's own files, HTTP clients, storage


def mem_available_kib(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def processes_free(pid_max: str = "/proc/sys/kernel/pid_max", proc: str = "/proc") -> int | None:
    """How many more processes the kernel can number (pid_max minus those that exist)."""
    try:
        with open(pid_max) as f:
            limit = int(f.read())
        running = sum(1 for name in os.listdir(proc) if name.isdigit())
    except (OSError, ValueError):
        return None
    return limit - running


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


def capacity_problem(what: str, workers: int, *, available_kib: int | None,
                     free_processes: int | None, fd_limit: int | None) -> str | None:
    """One sentence saying why ``workers`` more simulated workers do not fit (None: they do).

    ``what`` names the request ("v5p-12288", "3 slices of v4-2048"); the other arguments are
    the live figures (None: unknown, not checked). Pure: tests pass the figures in.
    """
    need_mib = workers * WORKER_MIB
    if available_kib is not None and need_mib * 1024 > available_kib:
        return (f"{what} needs {workers:,} simulated workers x {WORKER_MIB:g} MiB = "
                f"{_gib(need_mib)} (each idle {IDLE_MIB:g} MiB, plus {IN_USE_MIB:g} MiB while a "
                f"verb runs on it); this machine has {_gib(available_kib / 1024)} available: "
                "use a smaller type or free memory.")
    need_pids = workers * PROCESSES_PER_WORKER
    if free_processes is not None and need_pids > free_processes:
        return (f"{what} needs about {need_pids:,} processes ({PROCESSES_PER_WORKER} per "
                f"simulated worker in use) and kernel.pid_max leaves room for "
                f"{max(free_processes, 0):,} more: raise it (sysctl -w kernel.pid_max=4194304) "
                "or use a smaller type.")
    need_fds = workers * FDS_PER_WORKER + FD_RESERVE
    if fd_limit is not None and need_fds > fd_limit:
        return (f"{what} needs about {need_fds:,} open files in the simulated pod's emulator "
                f"and its limit is {fd_limit:,}: raise the hard limit (ulimit -Hn, or "
                "LimitNOFILE) before `tpufab sim up`, or use a smaller type.")
    return None


def fd_limit() -> int:
    """The most files this process may open (its hard limit: `raise_fd_limit` lifts the soft
    one to it at start)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def raise_fd_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard one (a big node's metadata listeners need one
    descriptor per worker); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
    return hard


def check(what: str, workers: int) -> str | None:
    """capacity_problem with this machine's live figures."""
    return capacity_problem(what, workers, available_kib=mem_available_kib(),
                            free_processes=processes_free(), fd_limit=fd_limit())
