"""Kept connections (tpufab.ssh.keeper): a cold `tpufab exec true` against the second one.

    sudo .venv/bin/python bench/keeper.py [--size 64 --size 256] [--rounds 5]

For each size: a simulated pod in a temporary state dir and a node of that many workers made
with `tpufab create` (64: v4-512, 256: v4-2048), then ``rounds`` times, in turn:

- ``cold``: `tpufab --keep-alive 0 exec true` (connects itself, as before kept connections);
- ``first``: `tpufab exec true` with no keeper running (it starts one and runs through it);
- ``second``: `tpufab exec true` again, 0.5 s later (through the kept connections);
- ``settled``: the same once the machine is quiet again (the keeper starts every worker's
  agent after the first command: on a simulated pod that loads the cores the next command
  runs on; at 1,024 workers for tens of seconds);
- ``status cold`` / ``status second``: `tpufab status` the same two ways.

``--no-status``: the ``exec`` rounds only (at 1,024 workers a `status` starts 1,024 Pythons on
the simulated workers at once, more memory than a 24 GiB machine holding 1,024 kept
connections has left).

``--floor N``: then, with the keeper warm, N rounds of what a second `exec true` is made of,
alternately: a bare `python -c pass`, `import typer`, `import tpufab.cli`, importing every
tpufab module a warm `exec true` loads (listed by running it under ``-X importtime``),
`import tpufab.entry`, and the whole command without and with the resident command server;
medians, printed as a second table.

``--jump``: the node has internal IPs only (`create --internal-ips`), and every command
reaches its workers through the node's bastion (`TPUFAB_JUMP`).

``--compare BIN``: each ``second`` is also run with the `tpufab` in ``BIN`` (another install of
the same tpufab, e.g. with another typer), labelled ``(compare)``, in the same rounds.

Whole process, wall time and the client's CPU (user + sys of `tpufab` and its children, from
getrusage; the keeper and the resident command server are not the command's children: their
CPU, with the commands the resident server ran for it, is given apart, from /proc), and the
keeper's resident memory at the end. ``(no resident)``: the same command with
``TPUFAB_RESIDENT=0`` (it loads the CLI itself). Prints medians as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import BIN, TYPES, project, timed  # noqa: E402


def keeper_pids(runtime: Path, module: bytes = b"tpufab.ssh.keeper") -> list[int]:
    """The keepers (``module``'s processes: also b"tpufab.resident") under ``runtime``."""
    mine = str(runtime).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(module in a for a in argv) and any(a.startswith(mine) for a in argv):
                found.append(int(entry))
    return found


def background_pids(runtime: Path) -> list[int]:
    """The keepers and the resident command server."""
    return keeper_pids(runtime) + keeper_pids(runtime, b"tpufab.resident")


def cpu_of(pids: list[int]) -> dict[int, float]:
    """{pid: user + sys CPU s so far} of the ``pids`` still there, with their children's that
    they waited for (the resident server's: the commands it ran)."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[pid] = sum(int(fields[i]) for i in (11, 12, 13, 14)) / tick
    return found


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def used_mib() -> float:
    """The machine's memory in use (MemTotal - MemAvailable), MiB."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) / 1024


def busy_share(window: float = 1.0) -> float:
    """The machine's CPU busy share (0-1) over ``window`` s, from /proc/stat."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]   # total, idle + iowait
    total0, idle0 = sample()
    time.sleep(window)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def settle(limit: float = 300.0, below: float = 0.2) -> float:
    """Wait (at most ``limit`` s) until the machine is quiet (busy share under ``below``:
    the keeper has started every worker's agent and they are idle); returns the wait."""
    began = time.monotonic()
    while time.monotonic() - began < limit and busy_share() >= below:
        pass
    return time.monotonic() - began


def warm_modules(argv: list[str], env: dict[str, str], cwd: Path) -> list[str]:
    """The tpufab modules ``argv`` (a `tpufab` command) imports, from ``-X importtime``."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tpufab.cli", *argv[1:]],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    names = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
             if line.startswith("import time:") and "|" in line]
    return sorted({n for n in names if n.startswith("tpufab") and not n.endswith("__main__")})


def floor(rounds: int, env: dict[str, str], cwd: Path, tpufab: str,
          runtime: Path) -> dict[str, list]:
    """What a warm `exec true` costs, part by part (see --floor). CPU: the command's, and the
    resident server's children's (the command it ran) where it ran it."""
    modules = warm_modules([tpufab, "exec", "true"], env, cwd)
    off = {**env, "TPUFAB_RESIDENT": "0"}
    parts = {
        "`python -c pass`": ([sys.executable, "-c", "pass"], env),
        "`python -c 'import typer'`": ([sys.executable, "-c", "import typer"], env),
        "`python -c 'import tpufab.cli'`": ([sys.executable, "-c", "import tpufab.cli"], env),
        f"importing the {len(modules)} tpufab modules a warm `exec true` loads":
            ([sys.executable, "-c", "import " + ", ".join(modules)], env),
        "`python -c 'import tpufab.entry'` (what a command run by the resident server loads)":
            ([sys.executable, "-c", "import tpufab.entry"], env),
        "`tpufab exec true` (second, TPUFAB_RESIDENT=0)": ([tpufab, "exec", "true"], off),
        "`tpufab exec true` (second, run by the resident server)": ([tpufab, "exec", "true"], env),
    }
    found: dict[str, list] = {label: [] for label in parts}
    for _ in range(rounds):
        for label, (argv, with_env) in parts.items():
            before = cpu_of(keeper_pids(runtime, b"tpufab.resident"))
            wall, cpu, code, tail = timed(argv, with_env, cwd, 600)
            after = cpu_of(keeper_pids(runtime, b"tpufab.resident"))
            if code != 0:
                raise SystemExit(f"{label}: exit {code}\n{tail}")
            found[label].append((wall, cpu + sum(t - before.get(p, 0.0) for p, t in after.items())))
    return found


def one_size(size: int, rounds: int, compare: Path | None = None, status: bool = True,
             floor_rounds: int = 0, through_jump: bool = False
             ) -> dict[str, list[tuple[float, float, float]]]:
    from tpufab.sim.daemon import down, up

    base = Path(tempfile.mkdtemp(prefix=f"bench-keeper-{size}-"))
    home, runtime = base / "home", base / "run"
    home.mkdir()
    runtime.mkdir(mode=0o700)
    info = up(base / "state", port=0, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(info.env(), HOME=str(home), COLUMNS="200", TPUFAB_NAME=f"keep{size}",
               TPUFAB_USER_CONFIG=str(home / "none.yaml"), TPUFAB_WAIT_TIMEOUT="1800",
               XDG_RUNTIME_DIR=str(runtime), TPUFAB_KEEP_ALIVE="5m")
    repo = project(base)
    tpufab = str(BIN / "tpufab")
    samples: dict[str, list[tuple[float, float, float]]] = {}

    def run(label: str, argv: list[str], program: str = tpufab, **extra: str) -> None:
        before = cpu_of(background_pids(runtime))
        wall, cpu, code, tail = timed([program, *argv], {**env, **extra}, repo, 1800)
        after = cpu_of(background_pids(runtime))  # one this command started counts whole
        kept_cpu = sum(t - before.get(pid, 0.0) for pid, t in after.items())
        if code != 0:
            raise SystemExit(f"{size} {label}: exit {code}\n{tail}")
        samples.setdefault(label, []).append((wall, cpu, kept_cpu))
        print(f"{size} {label}: {wall:.2f} s wall, {cpu:.2f} s client CPU, "
              f"{kept_cpu:.2f} s keeper CPU", flush=True)

    try:
        wall, _, code, tail = timed([tpufab, "--keep-alive", "0", "create", "--type",
                                     TYPES[size], *(["--internal-ips"] if through_jump else [])],
                                    env, repo, 3600)
        print(f"{size} create: {wall:.1f} s, exit {code}", flush=True)
        if code != 0:
            raise SystemExit(tail)
        if through_jump:  # every later command reaches the workers through the node's bastion
            listed = subprocess.run([tpufab, "sim", "status", "--json", "--state-dir",
                                     str(base / "state")], env=env, cwd=repo, check=True,
                                    capture_output=True, text=True, timeout=120)
            node = next(n for n in json.loads(listed.stdout)["nodes"]
                        if n["name"].endswith(f"/keep{size}"))
            env["TPUFAB_JUMP"] = node["bastion"]
            print(f"{size}: through the bastion at {node['bastion']}", flush=True)
        for _ in range(rounds):
            # no keeper, and the last one's agents gone, before the cold and the first command
            # alike (a keeper stopping under the first command would slow it alone)
            timed([tpufab, "disconnect"], env, repo, 600)
            give_up = time.monotonic() + 60
            while background_pids(runtime) and time.monotonic() < give_up:
                time.sleep(0.1)
            run("exec cold", ["--keep-alive", "0", "exec", "true"])
            run("exec first", ["exec", "true"])
            time.sleep(0.5)  # a user's pause between two commands
            run("exec second", ["exec", "true"])
            # and once the agents the keeper starts after the first command are all up (on a
            # simulated pod they load the same 2 cores the commands run on)
            print(f"{size}: quiet after {settle():.1f} s", flush=True)
            run("exec settled", ["exec", "true"])
            # the same without the resident command server: this command loads the CLI
            run("exec settled (no resident)", ["exec", "true"], TPUFAB_RESIDENT="0")
            if compare:
                run("exec second (compare)", ["exec", "true"], str(compare / "tpufab"))
            if not status:
                continue
            run("status cold", ["--keep-alive", "0", "status"])
            run("status second", ["status"])
            run("status second (no resident)", ["status"], TPUFAB_RESIDENT="0")
            if compare:
                run("status second (compare)", ["status"], str(compare / "tpufab"))
        samples["keeper RSS MiB"] = [(rss_mib(keeper_pids(runtime)), 0.0, 0.0)]
        samples["resident RSS MiB"] = [(rss_mib(keeper_pids(runtime, b"tpufab.resident")),
                                        0.0, 0.0)]
        if floor_rounds:
            settle()
            parts = floor(floor_rounds, env, repo, tpufab, runtime)
            print(f"\n{size} workers, a warm `exec true` part by part (medians of "
                  f"{floor_rounds}, alternately)")
            print("| what | wall s | CPU s |\n|---|--:|--:|")
            for label, rows in parts.items():
                print(f"| {label} | {statistics.median(r[0] for r in rows):.3f} | "
                      f"{statistics.median(r[1] for r in rows):.3f} |")
        held = used_mib()
        timed([tpufab, "disconnect"], env, repo, 600)
        give_up = time.monotonic() + 120
        while background_pids(runtime) and time.monotonic() < give_up:
            time.sleep(0.1)
        # what the kept connections cost the machine: the keeper, and on the workers' side
        # one sshd session and one agent each (on a real pod that is each worker's memory)
        samples["kept MiB"] = [(held - used_mib(), 0.0, 0.0)]
    finally:
        timed([tpufab, "disconnect"], env, repo, 600)
        subprocess.run([tpufab, "delete", "--yes"], env=env, cwd=repo, capture_output=True,
                       timeout=600)
        down(base / "state", timeout=300)
        shutil.rmtree(base, ignore_errors=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, action="append", choices=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", type=Path, help="a bin/ folder with another tpufab install")
    parser.add_argument("--no-status", dest="status", action="store_false",
                        help="the exec rounds only")
    parser.add_argument("--jump", action="store_true",
                        help="an internal-IP node, every command through its bastion")
    parser.add_argument("--floor", type=int, default=0, metavar="N",
                        help="N rounds of a warm exec's parts (see the docstring)")
    args = parser.parse_args()
    results = {size: one_size(size, args.rounds, args.compare, args.status, args.floor,
                              args.jump) for size in args.size or [64]}
    print(f"\nmachine: {os.cpu_count()} cores; load average at the end "
          f"{os.getloadavg()[0]:.1f}; medians of {args.rounds} rounds")
    print("| command | workers | wall s | vs cold | client CPU s | CPU vs cold | "
          "keeper + resident CPU s |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for size, samples in results.items():
        for label, rows in samples.items():
            if label in ("keeper RSS MiB", "resident RSS MiB", "kept MiB"):
                continue
            wall = statistics.median(r[0] for r in rows)
            cpu = statistics.median(r[1] for r in rows)
            kept = statistics.median(r[2] for r in rows)
            colds = samples[label.split()[0] + " cold"]
            cold = statistics.median(r[0] for r in colds)
            cold_cpu = statistics.median(r[1] for r in colds)
            print(f"| `{label}` | {size:,} | {wall:.2f} | {wall / cold:.2f}x | {cpu:.2f} | "
                  f"{cpu / cold_cpu:.2f}x | {kept:.2f} |")
        print(f"| keeper resident memory | {size:,} | {samples['keeper RSS MiB'][0][0]:.0f} MiB "
              "| | | | |")
        print(f"| resident command server's memory | {size:,} | "
              f"{samples['resident RSS MiB'][0][0]:.0f} MiB | | | | |")
        print(f"| the machine's memory freed by `disconnect` (keeper + workers' sessions) | "
              f"{size:,} | {samples['kept MiB'][0][0]:.0f} MiB | | | | |")


if __name__ == "__main__":
    main()
