"""A fan-out's limits (pure but for ``ensure_fds``): the file descriptors it needs, and how
many client processes share its connections, each owning a fixed block of workers
(tpufab.ssh.shards)."""

from __future__ import annotations

import os
from collections.abc import Sequence

FDS_PER_CONNECTION = 2  # its socket, and libssh2's eventfd
FDS_PER_WORKER = 2    # the two output spools once they spill to a file
FDS_SPARE = 64        # the interpreter, logs, terminals, the shard processes' pipes


def fd_budget(connections: int, workers: int) -> int:
    """File descriptors a fan-out needs: ``connections`` here, spools for ``workers`` (pure)."""
    return FDS_PER_CONNECTION * connections + FDS_PER_WORKER * workers + FDS_SPARE


def ensure_fds(needed: int, *, limits: tuple[int, int] | None = None, setter=None) -> int:
    """Raise the soft RLIMIT_NOFILE to ``needed`` (up to the hard limit); a ConfigError saying
    what to do when the hard limit is lower. Returns the soft limit now in force."""
    import resource

    soft, hard = limits or resource.getrlimit(resource.RLIMIT_NOFILE)
    if needed <= soft:
        return soft
    if hard != resource.RLIM_INFINITY and needed > hard:
        from tpufab.errors import ConfigError

        raise ConfigError(
            f"Fanning out needs about {needed} open files in this process but its hard limit is "
            f"{hard}: raise it (`ulimit -Hn {needed}` as root, or nofile in "
            "/etc/security/limits.conf), or spread the connections over more client processes "
            "(fanout_processes, TPUFAB_FANOUT_PROCESSES).")
    (setter or resource.setrlimit)(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


WORKERS_PER_PROCESS = 256   # paramiko, measured: at 256 workers a 2nd process cost 0.3 s more CPU, no faster
# libssh2 runs its handshakes in C outside the GIL: at 1,024 workers one process took less CPU
# and less wall time than two, in every run side by side (docs/benchmarks.md).
WORKERS_PER_LIBSSH2_PROCESS = 1024


def auto_processes(workers: int, cpus: int | None = None,
                   per_process: int = WORKERS_PER_PROCESS) -> int:
    """Client processes for ``workers`` connections when not set (pure): one per core at most,
    and one per ``per_process`` workers (WORKERS_PER_PROCESS over paramiko,
    WORKERS_PER_LIBSSH2_PROCESS over libssh2)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(cpus, workers // per_process))


def shard_of(workers: Sequence[int], processes: int) -> dict[int, int]:
    """Worker -> client process (0 is this one): contiguous blocks of the sorted workers, so
    each process owns a fixed share and keeps its connections warm (pure)."""
    ordered = sorted(workers)
    count = len(ordered)
    processes = max(1, min(processes, count or 1))
    return {w: i * processes // count for i, w in enumerate(ordered)}
