"""Simulated TPU pod workers: a real sshd per worker, each in its own PID/mount/UTS namespace.

A worker is a PID 1 forked by one spawner per process (``setpriv --pdeathsig KILL --
/usr/bin/python3 -I -S worker_init.py --spawner``) into new PID, mount, UTS and time
namespaces, with its sshd under it (see worker_init.py). The network namespace is shared: each
worker's sshd listens on its own loopback address.

State under ``state_dir``::

    uids.json                   user name -> uid, the same on every node and worker
    nodes/<node_id>/node.json   the worker specs of the last start
    nodes/<node_id>/keys.json   users whose keys came from metadata (so removed keys go away)
    nodes/<node_id>/w<i>/       one worker's disk: home/ root/ tmp/ etc/, host key, sshd_config,
                                config.json (for worker_init), init.json (its PID 1 on the host),
                                sshd.log, init.log, and the ``unreachable`` fault flag
"""

from __future__ import annotations

import fcntl
import grp
import os
import pwd
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path

from tpufab.errors import SimError
from tpufab.sim import tpumetrics
from tpufab.sim.registry import prepare_containers, registry_hosts_line
from tpufab.sim.worker_accounts import (
    SUDOERS_GROUP,
    SUDOERS_RULE,
    ensure_os_login_users,
    ensure_sudoers,
    ensure_users,
    exe,
    host_user,
    make_host_key,
    sync_authorized_keys,
)
from tpufab.sim.worker_files import (
    KEYS_COMMAND,
    STD_PATH,
    TPU_PCI_VENDOR,
    VM_SYSTEMCTL,
    HostTools,
    WorkerSpec,
    find_host_tools,
    fold_workers,
    hosts_text,
    parse_ssh_keys,
    sshd_config_text,
)
from tpufab.sim.worker_procs import (
    TRASH,
    Launcher,
    alive,
    empty_in_background,
    listening_addresses,
    namespace_processes,
    proc_stat,
    read_json,
    send_signal,
    tail,
    tcp_table,
    wait_for,
    write_json,
)

FIRST_UID = 2000
BOOT_TIMEOUT = 30.0  # one worker's namespace setup; normally tens of milliseconds
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class WorkerPool:
    """The simulated pod's workers, kept under ``state_dir`` (see the module docstring)."""

    stop_grace = 2.0  # seconds a worker's processes get between SIGTERM and the end
    boot_window = 8  # workers setting up their namespaces at once (a bounded start rate)

    def __init__(self, state_dir: Path, share_dir: Path | None = None):
        self.state_dir = Path(state_dir)
        # Read-only on every worker at /opt/tpufab-sim/share (scripts/sim-wheels.sh fills it).
        self.share_dir = Path(share_dir) if share_dir is not None else self.state_dir / "share"
        self.share_dir.mkdir(parents=True, exist_ok=True)
        self.registry: str | None = None  # HOST:PORT of the pod's registry (tpufab.sim.registry)
        self._guard = threading.Lock()  # the dict below
        self._node_locks: dict[str, threading.RLock] = {}
        self._uid_lock = threading.Lock()
        if (self.state_dir / TRASH).is_dir():  # left by a daemon that stopped mid-removal
            empty_in_background(self.state_dir / TRASH)

    def _node_lock(self, node_id: str) -> threading.RLock:
        """Serializes changes to one node; other nodes (and read-only calls) go on meanwhile."""
        with self._guard:
            return self._node_locks.setdefault(node_id, threading.RLock())

    def capacity_problem(self, what: str, workers: int) -> str | None:
        """Why ``workers`` more workers would not fit on this machine (None: they would)."""
        from tpufab.sim import capacity

        return capacity.check(what, workers)

    # paths and records

    def _node_dir(self, node_id: str) -> Path:
        if not NODE_ID.fullmatch(node_id):
            raise SimError(f"Node id {node_id!r} is not valid: use letters, digits, '-', '_', '.'.")
        return self.state_dir / "nodes" / node_id

    def _worker_dir(self, node_id: str, index: int) -> Path:
        return self._node_dir(node_id) / f"w{index}"

    def keep_host_key(self, node_id: str, index: int, store: Path, comment: str) -> None:
        """Worker ``index`` of ``node_id`` (before it starts) gets the host key kept in
        ``store``, made there first if missing: a VM whose identity outlives the node records
        it is started for (an internal node's bastion, which a real project keeps while its
        TPU nodes are preempted and recreated)."""
        key = store / "ssh_host_ed25519_key"
        if not key.exists():
            store.mkdir(mode=0o700, parents=True, exist_ok=True)
            make_host_key(key, comment)
        wdir = self._worker_dir(node_id, index)
        wdir.mkdir(parents=True, exist_ok=True)
        for name in (key.name, key.name + ".pub"):
            if not (wdir / name).exists():
                shutil.copy2(store / name, wdir / name)

    def node_specs(self, node_id: str) -> list[WorkerSpec]:
        data = read_json(self._node_dir(node_id) / "node.json", {"workers": []})
        return [WorkerSpec(**{**w, "device_files": tuple(w["device_files"])})
                for w in data["workers"]]

    def _spec(self, node_id: str, index: int) -> WorkerSpec:
        for spec in self.node_specs(node_id):
            if spec.index == index:
                return spec
        raise SimError(f"Node {node_id} has no worker {index}.")

    def init_pid(self, node_id: str, index: int) -> int | None:
        """Host pid of the worker's PID 1 if it is running (also after a daemon restart)."""
        record = read_json(self._worker_dir(node_id, index) / "init.json", None)
        if record and alive(record["pid"], record["start_time"]):
            return record["pid"]
        return None

    def require_init(self, node_id: str, index: int) -> int:
        pid = self.init_pid(node_id, index)
        if pid is None:
            raise SimError(f"Worker {index} of node {node_id} is not running; start the node first.")
        return pid

    # lifecycle

    def start_node(self, node_id: str, specs: list[WorkerSpec], ssh_keys: str, *,
                   delay: float = 0.0) -> None:
        """Start every worker not already running; their sshd comes up ``delay`` s from now."""
        tools = find_host_tools()
        node_dir = self._node_dir(node_id)
        with self._node_lock(node_id):
            node_dir.mkdir(parents=True, exist_ok=True)
            write_json(node_dir / "node.json", {"workers": [asdict(s) for s in specs]})
            to_start = [s for s in specs if self.init_pid(node_id, s.index) is None]
            busy = listening_addresses()
            if "0.0.0.0" in busy and any(not s.netns for s in to_start):
                raise SimError("Something listens on 0.0.0.0:22, so workers cannot listen on their "
                               "own addresses: make that sshd listen on a specific address.")
            for spec in to_start:
                if spec.ip in listening_addresses(table=tcp_table(spec), seen=busy):
                    raise SimError(f"Worker {spec.index} of node {node_id} cannot listen on "
                                   f"{spec.ip}:22 because something else already does; stop it "
                                   "or use another address.")
            sshd_at = time.monotonic() + max(0.0, delay)
            for spec in to_start:
                self._prepare_worker(node_id, spec, specs, tools, sshd_at)
            if len(to_start) < len(specs):  # a worker came back elsewhere (a recreated VM)
                self._update_hosts(node_id, [s for s in specs if s not in to_start], specs)
            self.sync_keys(node_id, ssh_keys)
            if not to_start:
                return
            failures = Launcher.call(self._boot_all, node_id, to_start, tools, sshd_at)
        tpumetrics.serve(self)  # each worker's localhost:8431, as libtpu's (sim/tpumetrics.py)
        if failures:  # the failed ones are gone already; the others keep running
            details = "\n".join(f"w{i}: {why}" for i, why in sorted(failures.items()))
            raise SimError(f"Worker(s) {fold_workers(failures)} of node {node_id} failed to start; "
                           f"see init.log under {node_dir}.", details=details)

    def _hosts_text(self, spec: WorkerSpec, node_specs: list[WorkerSpec]) -> str:
        """hosts_text, and Artifact Registry's hosts at the pod's registry (its DNS stand-in)."""
        text = hosts_text(spec, node_specs)
        return text + registry_hosts_line(self.registry) if self.registry else text

    def _update_hosts(self, node_id: str, running: list[WorkerSpec],
                      node_specs: list[WorkerSpec]) -> None:
        """The running workers' /etc/hosts name every worker at its address now, as a VPC's
        DNS answers a VM's name with its current IP (rewritten in place: the file is
        bind-mounted into the worker by inode)."""
        for spec in running:
            path = self._worker_dir(node_id, spec.index) / "etc" / "hosts"
            text = self._hosts_text(spec, node_specs)
            try:
                with open(path, "r+") as f:
                    if f.read() == text:
                        continue
                    f.seek(0)
                    f.write(text)
                    f.truncate()
            except FileNotFoundError:
                continue

    def _prepare_worker(self, node_id: str, spec: WorkerSpec, node_specs: list[WorkerSpec],
                        tools: HostTools, sshd_at: float) -> None:
        wdir = self._worker_dir(node_id, spec.index)
        (wdir / "etc").mkdir(parents=True, exist_ok=True)
        for sub, mode in (("home", 0o755), ("root", 0o700), ("mnt", 0o755), ("log", 0o755)):
            (wdir / sub).mkdir(exist_ok=True)
            os.chmod(wdir / sub, mode)
        tmp = wdir / "tmp"  # cleared at every start, like a reboot
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        os.chmod(tmp, 0o1777)
        for name in ("passwd", "group", "shadow"):
            if not (wdir / "etc" / name).exists():
                shutil.copy2(f"/etc/{name}", wdir / "etc" / name)
        (wdir / "log" / "apt").mkdir(exist_ok=True)  # apt (setup scripts) logs there
        sudoers = wdir / "etc" / "sudoers.d"
        sudoers.mkdir(mode=0o755, exist_ok=True)
        rule = sudoers / "google_sudoers"
        rule.write_text(SUDOERS_RULE)
        os.chmod(rule, 0o440)  # sudo ignores rule files that others may write
        (wdir / "etc" / "hostname").write_text(spec.hostname + "\n")
        (wdir / "etc" / "hosts").write_text(self._hosts_text(spec, node_specs))
        if not (wdir / "ssh_host_ed25519_key").exists():
            make_host_key(wdir / "ssh_host_ed25519_key", f"root@{spec.hostname}")
        os_login = self._os_login(node_id)
        if os_login["enabled"]:
            ensure_os_login_users(wdir, os_login["accounts"])
        shutil.copyfile(KEYS_COMMAND, wdir / KEYS_COMMAND.name)
        if spec.vm:  # a general-purpose VM's systemctl and journalctl (worker_init's Units)
            shutil.copyfile(VM_SYSTEMCTL, wdir / "systemctl.py")
        (wdir / "sshd_config").write_text(sshd_config_text(spec, os_login=os_login["enabled"]))
        write_json(wdir / "config.json", {
            "hostname": spec.hostname,
            "devices": list(spec.device_files),
            "sshd": tools.sshd,
            "sshd_at": sshd_at,
            "stop_grace": self.stop_grace,
            "tty_gid": grp.getgrnam("tty").gr_gid,
            "share": None if spec.vm else str(self.share_dir),  # a VM: only its image
            "vm": spec.vm,
            "pci": [{"vendor": TPU_PCI_VENDOR, "device": spec.pci_device}
                    for _ in spec.device_files] if spec.pci_device else [],
        })
        prepare_containers(wdir, self.registry)
        (wdir / "init.json").unlink(missing_ok=True)

    def _boot_all(self, node_id: str, specs: list[WorkerSpec], tools: HostTools,
                  sshd_at: float) -> dict[int, str]:
        """Runs on the launcher thread: have the spawner fork the workers, at most boot_window
        setting up at once; returns {worker: why} for those that failed."""
        spawner = Launcher.current_spawner(tools)
        pending = list(specs)
        booting: dict[int, tuple[WorkerSpec, float]] = {}  # request id -> (spec, deadline)
        forked: dict[int, int] = {}  # request id -> its PID 1's host pid, once forked
        failures: dict[int, str] = {}
        while pending or booting:
            while pending and len(booting) < self.boot_window:
                spec = pending.pop(0)
                try:
                    request = spawner.request(self._worker_dir(node_id, spec.index), spec.netns)
                except OSError as err:  # the spawner is gone (it died, or so did we)
                    failures[spec.index] = f"cannot start: {err}"
                    continue
                booting[request] = (spec, time.monotonic() + BOOT_TIMEOUT)
            answers = spawner.answers(0.5)
            if answers is None:
                for spec, _ in booting.values():
                    failures[spec.index] = "the worker spawner exited; see the daemon's log"
                booting.clear()
                for spec in pending:
                    failures[spec.index] = "the worker spawner exited; see the daemon's log"
                pending.clear()
                break
            for answer in answers:
                request = answer.get("id")
                if request not in booting:
                    continue  # a late answer to a request given up on before
                if "forked" in answer:
                    forked[request] = answer["forked"]
                if "pid" not in answer and "error" not in answer:
                    continue
                spec, _ = booting.pop(request)
                error = self._booted(node_id, spec, answer, sshd_at)
                if error:
                    failures[spec.index] = error
            now = time.monotonic()
            for request, (spec, deadline) in list(booting.items()):
                if now > deadline:
                    del booting[request]
                    if request in forked:  # its namespace goes with it
                        send_signal(forked[request], signal.SIGKILL)
                    failures[spec.index] = f"no ready report within {BOOT_TIMEOUT:g} s"
        return failures

    def _booted(self, node_id: str, spec: WorkerSpec, answer: dict, sshd_at: float
                ) -> str | None:
        wdir = self._worker_dir(node_id, spec.index)
        stat = proc_stat(answer["pid"]) if "pid" in answer else None
        if stat is None:
            if "forked" in answer:
                send_signal(answer["forked"], signal.SIGKILL)
            error = answer.get("error", "PID 1 vanished right after setup")
            last = tail(wdir / "init.log")
            return f"{error} ({last})" if last and last not in error else error
        write_json(wdir / "init.json", {"pid": answer["pid"], "start_time": stat[2],
                                         "owner_pid": os.getpid(), "sshd_at": sshd_at})
        return None

    def wait_listening(self, node_id: str, timeout: float = 30.0) -> None:
        """Wait (bounded) until every reachable worker's sshd listens on ip:22."""
        deadline = time.monotonic() + timeout
        waiting = self.node_specs(node_id)
        while True:
            # Only the workers still waiting are looked at again: a round costs what is left.
            tables = {t: listening_addresses(table=t) for t in {tcp_table(s) for s in waiting}}
            waiting = [s for s in waiting if s.ip not in tables[tcp_table(s)] and not
                       (self._worker_dir(node_id, s.index) / "unreachable").exists()]
            down = [s.index for s in waiting if self.init_pid(node_id, s.index) is None]
            if down:
                raise SimError(f"Worker(s) {fold_workers(down)} of node {node_id} are not running, "
                               "so their sshd will never listen; start the node first.")
            if not waiting:
                return
            if time.monotonic() >= deadline:
                names = fold_workers(s.index for s in waiting)
                last = tail(self._worker_dir(node_id, waiting[0].index) / "sshd.log", 1)
                raise SimError(f"sshd on worker(s) {names} of node {node_id} did not listen within "
                               f"{timeout:g} s; see sshd.log under {self._node_dir(node_id)}"
                               + (f" (w{waiting[0].index}: {last})." if last else "."))
            time.sleep(0.02)

    def stop_node(self, node_id: str) -> None:
        """End every process of the node's workers (whole PID namespaces); disks stay."""
        node_dir = self._node_dir(node_id)
        with self._node_lock(node_id):
            records = {}
            for spec in self.node_specs(node_id):
                pid = self.init_pid(node_id, spec.index)
                if pid is not None:
                    records[spec.index] = read_json(node_dir / f"w{spec.index}" / "init.json", {})
                    send_signal(pid, signal.SIGTERM)

            def all_gone() -> bool:
                return not any(alive(r["pid"], r["start_time"]) for r in records.values())

            if not wait_for(all_gone, self.stop_grace + 3.0):
                for record in records.values():
                    if alive(record["pid"], record["start_time"]):
                        send_signal(record["pid"], signal.SIGKILL)  # takes the namespace with it
                if not wait_for(all_gone, 10.0):
                    raise SimError(f"Workers of node {node_id} did not stop even after SIGKILL.")
            for index in records:
                (node_dir / f"w{index}" / "init.json").unlink(missing_ok=True)

    def end_worker(self, node_id: str, index: int) -> None:
        """End worker ``index`` of ``node_id``: its whole PID namespace (every process, as a
        VM's reset ends them); its files stay. ``start_node`` brings it up again."""
        with self._node_lock(node_id):
            wdir = self._worker_dir(node_id, index)
            record = read_json(wdir / "init.json", None)
            if self.init_pid(node_id, index) is None or not record:
                return
            send_signal(record["pid"], signal.SIGTERM)

            def gone() -> bool:
                return not alive(record["pid"], record["start_time"])

            if not wait_for(gone, self.stop_grace + 3.0):
                send_signal(record["pid"], signal.SIGKILL)  # takes the namespace with it
                if not wait_for(gone, 10.0):
                    raise SimError(f"Worker {index} of node {node_id} did not stop even "
                                   "after SIGKILL.")
            (wdir / "init.json").unlink(missing_ok=True)

    def remove_worker(self, node_id: str, index: int) -> None:
        """End worker ``index`` of ``node_id`` (its whole PID namespace) and remove its files:
        a VM that Compute Engine recreates comes back from a new boot disk (a new host key, an
        empty home and /tmp). ``start_node`` brings it up again."""
        with self._node_lock(node_id):
            wdir = self._worker_dir(node_id, index)
            self.end_worker(node_id, index)
            trash = self.state_dir / TRASH / f"{node_id}-w{index}-{time.time_ns()}"
            try:
                trash.parent.mkdir(parents=True, exist_ok=True)
                os.rename(wdir, trash)
            except FileNotFoundError:
                return
            except OSError:
                shutil.rmtree(wdir, ignore_errors=True)
                return
            empty_in_background(trash.parent)

    def delete_node(self, node_id: str) -> None:
        """Stop the node's workers, then remove all their files: moved aside at once, removed
        in the background (a used 1,024-worker node holds ~10^5 files: minutes on a busy
        disk, which a delete need not wait for)."""
        with self._node_lock(node_id):
            self.stop_node(node_id)
            node_dir = self._node_dir(node_id)
            trash = self.state_dir / TRASH / f"{node_id}-{time.time_ns()}"
            try:
                trash.parent.mkdir(parents=True, exist_ok=True)
                os.rename(node_dir, trash)
            except FileNotFoundError:
                return
            except OSError:  # e.g. another filesystem: remove it where it is
                shutil.rmtree(node_dir, ignore_errors=True)
                return
            empty_in_background(trash.parent)

    def stop_all(self) -> None:
        """Stop every node under state_dir, including workers left by an earlier owner."""
        errors = []
        nodes = self.state_dir / "nodes"
        for node_dir in sorted(nodes.iterdir()) if nodes.is_dir() else []:
            try:
                self.stop_node(node_dir.name)
            except SimError as err:
                errors.append(str(err))
        if errors:
            raise SimError(errors[0], details="\n".join(errors[1:]) or None)

    def running(self, node_id: str) -> dict[int, bool]:
        return {s.index: self.init_pid(node_id, s.index) is not None for s in self.node_specs(node_id)}

    def pids(self, node_id: str, index: int) -> list[int]:
        """Host pids of every process in the worker (its PID 1 first); [] if it is not running."""
        init = self.init_pid(node_id, index)
        if init is None:
            return []
        return [init, *sorted(p for p in namespace_processes(init) if p != init)]

    def host_keys(self, node_id: str) -> dict[int, str]:
        """Worker -> ``ssh-ed25519 AAAA...``; made at a worker's first start, kept until delete."""
        keys = {}
        for spec in self.node_specs(node_id):
            pub = self._worker_dir(node_id, spec.index) / "ssh_host_ed25519_key.pub"
            if pub.exists():
                keys[spec.index] = " ".join(pub.read_text().split()[:2])
        return keys

    def console_log(self, node_id: str, index: int) -> str:
        """What the worker's serial console shows since it booted (a VM's
        getSerialPortOutput): its boot lines, then the startup-script runner's."""
        wdir = self._worker_dir(node_id, index)
        record = read_json(wdir / "init.json", None)
        spec = next((s for s in self.node_specs(node_id) if s.index == index), None)
        if record is None or spec is None:
            return ""
        lines = ["[    0.000000] Linux version simulated (tpufab sim) #1 SMP",
                 f"[    0.100000] {spec.hostname} login: booted, sshd on {spec.ip}:22"]
        try:
            startup = (wdir / "log" / "google-startup-scripts.log").read_text(errors="replace")
        except OSError:
            startup = ""
        return "\n".join(lines) + "\n" + startup

    def sshd_log(self, node_id: str, index: int) -> Path:
        """The worker's sshd log file on the host (LogLevel ERROR)."""
        return self._worker_dir(node_id, index) / "sshd.log"

    # users and keys

    def sync_keys(self, node_id: str, ssh_keys: str) -> None:
        """Metadata ``ssh-keys`` -> each user's authorized_keys on every worker of the node."""
        keys = parse_ssh_keys(ssh_keys)
        node_dir = self._node_dir(node_id)
        with self._node_lock(node_id):
            specs = self.node_specs(node_id)
            if not specs:
                return  # never started: start_node applies the keys
            managed = set(read_json(node_dir / "keys.json", {"users": []})["users"])
            users = sorted(set(keys) | managed)
            uids = self._allocate_uids([*sorted(keys), SUDOERS_GROUP])

            for spec in specs:
                wdir = self._worker_dir(node_id, spec.index)
                if not (wdir / "etc" / "passwd").exists():
                    continue
                accounts = ensure_users(wdir / "etc", sorted(keys), uids)
                ensure_sudoers(wdir / "etc", sorted(set(keys) - {"root"}), uids[SUDOERS_GROUP])
                for user in users:
                    if user in accounts:
                        sync_authorized_keys(wdir, accounts[user], keys.get(user, []))
                pid = self.init_pid(node_id, spec.index) if spec.vm else None
                if pid is not None:  # a VM's accounts are its own files: PID 1 merges these
                    send_signal(pid, signal.SIGUSR1)
            write_json(node_dir / "keys.json", {"users": users})

    def _allocate_uids(self, users: list[str]) -> dict[str, int]:
        """Stable uid per new user name (from FIRST_UID), shared by all nodes and workers."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self._uid_lock, open(self.state_dir / "uids.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table: dict[str, int] = read_json(self.state_dir / "uids.json", {})
            taken = set(table.values())
            taken |= {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
            next_uid = FIRST_UID
            for user in users:
                if user in table or host_user(user):
                    continue
                while next_uid in taken:
                    next_uid += 1
                table[user] = next_uid
                taken.add(next_uid)
            write_json(self.state_dir / "uids.json", table)
        return table

    # OS Login (what the guest environment does when enable-oslogin is on)

    def _os_login(self, node_id: str) -> dict:
        return read_json(self._node_dir(node_id) / "oslogin.json",
                          {"enabled": False, "accounts": []})

    def set_os_login(self, node_id: str, accounts: list[dict] | None) -> None:
        """OS Login on (``accounts``: the project's POSIX accounts, from its profiles) or off
        (None) for a node's workers: sshd asks the metadata server for an OS Login user's keys
        (AuthorizedKeysCommand), and the accounts exist (the guest's NSS module lists them).
        Running workers reload sshd when this changes; it persists across restarts."""
        node_dir = self._node_dir(node_id)
        wanted = {"enabled": accounts is not None, "accounts": accounts or []}
        with self._node_lock(node_id):
            node_dir.mkdir(parents=True, exist_ok=True)
            write_json(node_dir / "oslogin.json", wanted)
            for spec in self.node_specs(node_id):
                wdir = self._worker_dir(node_id, spec.index)
                if not (wdir / "etc" / "passwd").exists():
                    continue
                if accounts:
                    ensure_os_login_users(wdir, accounts)
                text = sshd_config_text(spec, os_login=accounts is not None)
                config = wdir / "sshd_config"
                if config.exists() and config.read_text() == text:
                    continue
                config.write_text(text)
                pid = self.init_pid(node_id, spec.index)
                if pid is not None:
                    send_signal(pid, signal.SIGUSR1)  # its PID 1 reloads sshd with the new config

    # faults and access

    def set_reachable(self, node_id: str, index: int, reachable: bool) -> None:
        """Fault: unreachable = nothing listens on ip:22 (refused); other processes keep running.

        Persists across worker restarts until set back to True.
        """
        with self._node_lock(node_id):
            spec = self._spec(node_id, index)
            flag = self._worker_dir(node_id, index) / "unreachable"
            if reachable:
                flag.unlink(missing_ok=True)
            else:
                flag.touch()
            pid = self.init_pid(node_id, index)
            if pid is None:
                return
            send_signal(pid, signal.SIGUSR1)
            record = read_json(self._worker_dir(node_id, index) / "init.json", {})
            if reachable and time.monotonic() < record.get("sshd_at", 0):
                return  # its start delay has not passed yet; wait_listening covers it
            if not wait_for(lambda: (spec.ip in listening_addresses(table=tcp_table(spec)))
                            == reachable, 10.0):
                state = "listen" if reachable else "stop listening"
                raise SimError(f"sshd on worker {index} of node {node_id} did not {state} within "
                               f"10 s; see {self.sshd_log(node_id, index)}.")

    def kill_sshd(self, node_id: str, index: int) -> None:
        """Fault: SIGKILL the worker's sshd and every session under it (mid-command).

        Processes that detached from their session (setsid, nohup ... &) survive, and the
        worker's PID 1 starts a new listener at once (as systemd would) unless the worker is
        unreachable.
        """
        sshd = find_host_tools().sshd
        with self._node_lock(node_id):
            init = self.require_init(node_id, index)
            victims: dict[int, int] = {}
            for _ in range(50):  # SIGSTOP the tree first so nothing forks away from us
                procs = namespace_processes(init)
                tree = {p for p, (ppid, _) in procs.items() if ppid == init and exe(p) == sshd}
                grew = True
                while grew:
                    more = {p for p, (ppid, _) in procs.items() if ppid in tree} - tree
                    tree |= more
                    grew = bool(more)
                new = {p: procs[p][1] for p in tree if p not in victims}
                if not new:
                    break
                for pid in new:
                    send_signal(pid, signal.SIGSTOP)
                victims.update(new)
            for pid in victims:
                send_signal(pid, signal.SIGKILL)
            if not wait_for(lambda: not any(alive(p, t) for p, t in victims.items()), 10.0):
                raise SimError(f"sshd on worker {index} of node {node_id} survived SIGKILL.")

    def exec_in(self, node_id: str, index: int, argv: list[str], **popen_kw
                ) -> subprocess.CompletedProcess:
        """Run argv as root inside the worker (nsenter: its PID, mount, UTS, network and time
        namespaces, so its uptime is the worker's); output captured as text by default."""
        init = self.require_init(node_id, index)
        popen_kw.setdefault("env", {"PATH": STD_PATH, "HOME": "/root", "LANG": "C.UTF-8"})
        if not {"stdout", "stderr", "capture_output"} & popen_kw.keys():
            popen_kw["capture_output"] = True
        popen_kw.setdefault("text", True)
        nsenter = find_host_tools().nsenter
        return subprocess.run([nsenter, "--target", str(init), "--pid", "--mount", "--uts",
                               "--net", "--time", "--", *argv], **popen_kw)
