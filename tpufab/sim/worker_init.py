"""PID 1 of every simulated TPU worker, and the spawner that forks them (stdlib only).

The pool (tpufab.sim.workers) starts one spawner per process:
``setpriv --pdeathsig KILL -- python3 -I -S worker_init.py --spawner``. It reads one JSON
request a line on stdin (``{"id": N, "dir": WORKER_DIR}``) and for each forks the worker's
PID 1 into new PID and time namespaces (its boot clock starting at zero); PID 1 makes its own
mount and UTS namespaces. Forked rather than exec'd, every worker shares the spawner's
interpreter pages (copy on write): a PID 1 costs ~1.5 MiB of PSS instead of a Python start-up's
~5 MiB and ~25 ms of CPU, and no `unshare` process stands between it and the spawner.

PID 1 builds the worker's private view of the machine from the files the pool wrote into
WORKER_DIR, then keeps sshd running, reaps orphans, and on SIGTERM ends every process in the
namespace. On stdout the spawner answers each request with ``{"id": N, "forked": PID}`` at once
and ``{"id": N, "forked": PID, "pid": PID}`` or ``{"id": N, "forked": PID, "error": ...}`` once
the worker is set up (PID is PID 1's host pid).

Deaths cascade: the pool's process dies -> the spawner gets SIGKILL (or reads the end of its
stdin and exits) -> every PID 1 gets SIGKILL -> the kernel ends its whole namespace. Nothing
lingers.

Host protocol: the file ``WORKER_DIR/unreachable`` means "no sshd listener" (a fault);
SIGUSR1 tells PID 1 to look at it again, and at ``WORKER_DIR/sshd_config``: a changed config is
put in place and sshd reloads it (SIGHUP), as the guest agent does when OS Login is turned on
or off.
"""

import ctypes
import gc
import grp
import json
import os
import pwd
import selectors
import signal
import stat
import sys
import time


def _beside(name):
    """A stdlib-only module beside this file: run as ``python3 -I -S worker_init.py``, the
    tpufab package is not importable, so it is loaded from its path (before any mount)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


parse_unit = _beside("vm_units").parse_unit

RUN_DIR = "/run/tpufab-worker"  # sshd config and host key, readable by sshd's re-exec
KEYS_COMMAND = "authorized_keys_command.py"  # sshd's AuthorizedKeysCommand (OS Login)
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_DEVICES = ("null", "zero", "full", "random", "urandom", "tty", "fuse")
OPEN_TO_ALL = ("fuse",)
# target in the worker -> path in WORKER_DIR
BINDS = (
    ("/home", "home"),
    ("/root", "root"),
    ("/tmp", "tmp"),
    ("/mnt", "mnt"),
    ("/etc/passwd", "etc/passwd"),
    ("/etc/group", "etc/group"),
    ("/etc/shadow", "etc/shadow"),
    ("/etc/hostname", "etc/hostname"),
    ("/etc/hosts", "etc/hosts"),
    ("/var/log", "log"),  # the worker's own logs (startup scripts), not the host's
)
# Bound only where WORKER_DIR has them: the container runtime's images and containers
# (tpufab.sim.registry.prepare_containers), on the host's filesystem, not an overlay.
OPTIONAL_WORKER_BINDS = (("/var/lib/containers", "containers"),)
# Bound only where the host has them (sudo installed): the worker's sudo rules.
OPTIONAL_BINDS = (("/etc/sudoers.d", "etc/sudoers.d"),)
# The worker's own root filesystem where installs write: each of these is an overlay whose
# lower layer is the host's and whose upper layer lives in WORKER_DIR/rootfs/<name>, so `sudo
# apt-get install`, `sudo pip install` and dpkg change this worker only, never the host.
OVERLAID = ("/usr", "/etc", "/var", "/opt")
# Debian marks its Python externally managed (PEP 668: pip refuses to install); Ubuntu 22.04,
# the TPU VM image, does not. Inside a worker the marker is removed (in its upper layer only).
PEP668_MARKERS = "/usr/lib/python3{}/EXTERNALLY-MANAGED"
PCI_DEVICES = "/sys/bus/pci/devices"
HANDLED = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# Python starts with these ignored; sshd and user shells must get the defaults back.
RESET_FOR_CHILDREN = (*HANDLED, signal.SIGPIPE, signal.SIGXFSZ)
QUICK_DEATH = 1.0  # an sshd that dies sooner than this is restarted with a growing pause
MAX_BACKOFF = 5.0

CLONE_NEWTIME, CLONE_NEWNS = 0x80, 0x20000
CLONE_NEWUTS, CLONE_NEWPID, CLONE_NEWNET = 0x4000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_RDONLY, MS_REMOUNT = 1, 32
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # pivot_root(2): glibc has no wrapper
# Entries of the worker's / that are mounts of its own by now (bound from WORKER_DIR, its
# tmpfs, its overlays) or the host's kernel filesystems: carried into its new root as they are.
OWN_TOP = ("dev", "run", "tmp", "home", "root", "mnt", "sys", "usr", "etc", "var", "opt")
TOP_FILE_LIMIT = 1 << 20  # a top-level file of the host's is copied into the worker's / ...
# The pool's read-only share (a wheel cache, datasets): the same folder on every worker.
SHARE_AT = "/opt/tpufab-sim/share"
# A general-purpose VM (config "vm"): its / holds only what an OS image has (none of the host's
# other top-level entries, such as a checkout under /work), its accounts are files of its own
# (so useradd works), and its init runs its own systemd units (Units below).
IMAGE_TOP = frozenset({"bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32",
                       "media", "mnt", "opt", "proc", "root", "run", "sbin", "srv", "sys", "tmp",
                       "usr", "var", "lost+found"})
ACCOUNT_FILES = ("passwd", "group", "shadow")
UNITS_DIR = "/etc/systemd/system"
INIT_DIR = "/run/tpufab-init"  # systemctl's requests and answers, each unit's status
UNIT_LOGS = "/var/log/units"  # each unit's output (what the journal keeps on a real VM)
SYSTEMCTL = "systemctl.py"  # systemctl and journalctl of a general-purpose VM (vm_systemctl.py)

_libc = ctypes.CDLL(None, use_errno=True)


def log(message):
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} worker_init: {message}\n")
    sys.stderr.flush()


def mount(source, target, fstype=None, flags=0, data=None):
    encoded = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    rc = _libc.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3])
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


def bind(fd, target):
    # /proc/self/fd/N reaches the opened file even after its path has been covered by a mount.
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)


def write_file(path, data, mode):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def read_at(dir_fd, name):
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def setup(worker_dir):
    """Build the worker's mounts; return (host pid, worker dir fd, config, sshd log fd)."""
    host_pid = int(os.readlink("/proc/self"))  # the host's /proc is still the one mounted
    dir_fd = os.open(worker_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    config = json.loads(read_at(dir_fd, "config.json"))
    # Open every source before mounting anything: WORKER_DIR may sit under /tmp, /root or /run,
    # which the mounts below cover.
    vm = bool(config.get("vm"))
    binds = [(t, rel) for t, rel in BINDS if not (vm and rel[4:] in ACCOUNT_FILES)]
    sources = {t: os.open(rel, os.O_PATH | os.O_CLOEXEC, dir_fd=dir_fd) for t, rel in binds}
    systemctl = read_at(dir_fd, SYSTEMCTL) if vm else None
    for target, rel in OPTIONAL_WORKER_BINDS:
        try:
            sources[target] = os.open(rel, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY,
                                      dir_fd=dir_fd)
        except FileNotFoundError:
            pass
    for target, rel in OPTIONAL_BINDS:
        if os.path.isdir(target):
            sources[target] = os.open(rel, os.O_PATH | os.O_CLOEXEC, dir_fd=dir_fd)
        else:
            log(f"{target} is missing on the host (apt-get install sudo); workers have no sudo")
    host_pci = {}
    if config.get("pci") and os.path.isdir(PCI_DEVICES):
        host_pci = {name: os.readlink(f"{PCI_DEVICES}/{name}") for name in os.listdir(PCI_DEVICES)}
    share = config.get("share")
    share_fd = os.open(share, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if share else None
    devices = {}
    for name in HOST_DEVICES:
        try:
            devices[name] = os.open(f"/dev/{name}", os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            log(f"/dev/{name} is missing on the host; the worker will not have it")
    sshd_config = read_at(dir_fd, "sshd_config")
    host_key = read_at(dir_fd, "ssh_host_ed25519_key")
    try:
        keys_command = read_at(dir_fd, KEYS_COMMAND)
    except FileNotFoundError:
        keys_command = None
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    sshd_log = os.open("sshd.log", flags, 0o644, dir_fd=dir_fd)

    mount(None, "/", None, MS_REC | MS_PRIVATE)
    overlay_root(worker_dir, dir_fd)
    mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    os.mkdir(RUN_DIR, 0o700)
    write_file(f"{RUN_DIR}/sshd_config", sshd_config, 0o600)
    write_file(f"{RUN_DIR}/ssh_host_ed25519_key", host_key, 0o600)
    if keys_command is not None:
        write_file(f"{RUN_DIR}/{KEYS_COMMAND}", keys_command, 0o600)
    for path, mode in (("/run/sshd", 0o755), ("/run/lock", 0o1777)):
        os.mkdir(path)
        os.chmod(path, mode)
    build_dev(devices, config["devices"], config["tty_gid"])
    for target, fd in sources.items():
        bind(fd, target)
    if vm:
        merge_accounts(dir_fd)
        install_systemctl(systemctl)
    if share_fd is not None:
        os.makedirs(SHARE_AT, exist_ok=True)
        bind(share_fd, SHARE_AT)
        mount(None, SHARE_AT, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
        os.close(share_fd)
    if config.get("pci") and os.path.isdir(PCI_DEVICES):
        build_pci(host_pci, config["pci"])
    with open("/proc/sys/kernel/hostname", "w") as f:  # our own UTS namespace
        f.write(config["hostname"])
    own_root(worker_dir, dir_fd, image_only=vm)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for fd in (*sources.values(), *devices.values()):
        os.close(fd)
    os.chdir("/")
    return host_pid, dir_fd, config, sshd_log


def overlay_root(worker_dir, dir_fd):
    """/usr, /etc, /var and /opt as overlays: the host's below, this worker's changes above
    (WORKER_DIR/rootfs/<name>/upper). The layer paths go through /proc/self/fd, so a state dir
    under a path mounted over later is still reached. A target that holds WORKER_DIR itself
    (a state dir under /var or /opt) is left as the host's, with a log line."""
    real = os.path.realpath(worker_dir)
    os.makedirs(os.path.join(real, "rootfs"), exist_ok=True)
    overlaid = set()
    for target in OVERLAID:
        if real == target or real.startswith(target + "/"):
            log(f"{target} holds the worker's state dir; it stays the host's (not overlaid)")
            continue
        layer = os.path.join(real, "rootfs", target.strip("/"))
        for part in ("upper", "work"):
            os.makedirs(os.path.join(layer, part), mode=0o755, exist_ok=True)
        via = f"/proc/self/fd/{dir_fd}/rootfs/{target.strip('/')}"
        mount("overlay", target, "overlay", 0,
              f"lowerdir={target},upperdir={via}/upper,workdir={via}/work")
        overlaid.add(target)
    if "/usr" not in overlaid:
        return  # the marker is the host's then: leave it
    for minor in range(6, 20):
        try:
            os.unlink(PEP668_MARKERS.format(f".{minor}"))
        except FileNotFoundError:
            pass


def merge_accounts(dir_fd):
    """A general-purpose VM's passwd, group and shadow are files of its own /etc (useradd
    works); the pool's users from ssh-keys (WORKER_DIR/etc) are added, at boot and SIGUSR1."""
    for name in ACCOUNT_FILES:
        try:
            pool = read_at(dir_fd, f"etc/{name}").decode().splitlines()
            with open(f"/etc/{name}") as f:
                own = f.read().splitlines()
        except OSError as err:
            log(f"cannot merge /etc/{name}: {err}")
            continue
        index = {line.split(":")[0]: i for i, line in enumerate(own) if line}
        merged = list(own)
        for line in pool:
            key = line.split(":")[0]
            if not line or key not in index:
                merged.append(line)
                index[key] = len(merged) - 1
            elif name == "group":
                mine, theirs = merged[index[key]].split(":"), line.split(":")
                if len(mine) == 4 and len(theirs) == 4:
                    members = [m for m in mine[3].split(",") if m]
                    members += [m for m in theirs[3].split(",") if m and m not in members]
                    merged[index[key]] = ":".join([*mine[:3], ",".join(members)])
        if merged != own:
            tmp, st = f"/etc/.{name}.tpufab", os.stat(f"/etc/{name}")
            write_file(tmp, "".join(f"{x}\n" for x in merged).encode(), stat.S_IMODE(st.st_mode))
            os.chown(tmp, st.st_uid, st.st_gid)  # /etc/shadow stays the shadow group's
            os.rename(tmp, f"/etc/{name}")


def install_systemctl(text):
    """systemctl and journalctl of a general-purpose VM (vm_systemctl.py) over the image's."""
    os.makedirs(f"{RUN_DIR}/bin", exist_ok=True)
    write_file(f"{RUN_DIR}/bin/systemctl", text, 0o755)
    for name in ("systemctl", "journalctl"):
        target = f"/usr/bin/{name}"
        if not os.path.exists(target):
            write_file(target, b"", 0o755)
        mount(f"{RUN_DIR}/bin/systemctl", target, None, MS_BIND)
    for path in (INIT_DIR, f"{INIT_DIR}/requests", f"{INIT_DIR}/answers", f"{INIT_DIR}/units"):
        os.makedirs(path, mode=0o755, exist_ok=True)


def own_root(worker_dir, dir_fd, image_only=False):
    """The worker's / becomes its own: a tmpfs holding every top-level entry of the host's
    root (its own mounts made above as they are; every other directory as an overlay whose
    upper layer is WORKER_DIR/rootfs/<name>, like /usr's; the host's symlinks; a copy of its
    small top-level files), then pivot_root into it. So no write of the worker's root, sudo's
    included (`mkdir /data`, /srv, /boot), reaches the host; new entries of / are the
    worker's own until it boots again. A directory that holds WORKER_DIR itself stays the
    host's (overlaying it would put its own upper layer inside it), with a log line."""
    real = os.path.realpath(worker_dir)
    try:
        os.mkdir("rootfs/.new-root", 0o755, dir_fd=dir_fd)
    except FileExistsError:
        pass
    # Paths into WORKER_DIR go through /proc/self/fd: the binds above may cover its path.
    new = f"/proc/self/fd/{dir_fd}/rootfs/.new-root"
    mount("tmpfs", new, "tmpfs", MS_NODEV, "mode=0755")
    for name in sorted(os.listdir("/")):
        source, target = f"/{name}", f"{new}/{name}"
        if image_only and name not in IMAGE_TOP and not os.path.islink(source):
            continue  # a general-purpose VM: none of the host's own top-level entries
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
            continue
        if not os.path.isdir(source):
            if os.path.isfile(source) and os.path.getsize(source) <= TOP_FILE_LIMIT:
                with open(source, "rb") as f:
                    write_file(target, f.read(), stat.S_IMODE(os.stat(source).st_mode))
            continue
        os.mkdir(target)
        os.chmod(target, stat.S_IMODE(os.stat(source).st_mode))
        if name == "proc":
            continue  # mounted anew below
        if name in OWN_TOP:
            mount(source, target, None, MS_BIND | MS_REC)
        elif real == source or real.startswith(source + "/"):
            log(f"{source} holds the worker's state dir; it stays the host's (not overlaid)")
            mount(source, target, None, MS_BIND | MS_REC)
        else:
            for part in (name, f"{name}/upper", f"{name}/work"):
                try:
                    os.mkdir(f"rootfs/{part}", 0o755, dir_fd=dir_fd)
                except FileExistsError:
                    pass
            via = f"/proc/self/fd/{dir_fd}/rootfs/{name}"
            try:
                mount("overlay", target, "overlay", 0,
                      f"lowerdir={source},upperdir={via}/upper,workdir={via}/work")
            except OSError as err:  # a filesystem overlayfs cannot sit on: read-only instead
                log(f"{source} cannot be overlaid ({err}); the worker sees it read-only")
                mount(source, target, None, MS_BIND | MS_REC)
                mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    os.mkdir(f"{new}/.old-root")
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {os.uname().machine}")
    if _libc.syscall(number, new.encode(), f"{new}/.old-root".encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root into {new}: {os.strerror(err)}")
    os.chdir("/")
    if _libc.umount2(b"/.old-root", MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount the host's root: {os.strerror(err)}")
    os.rmdir("/.old-root")


def build_dev(host_devices, placeholders, tty_gid):
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID, "mode=0755,size=4m")
    for name, fd in host_devices.items():
        if name in OPEN_TO_ALL:
            # A node of our own, not the host's (a container's may be 0600): as on a TPU VM,
            # ordinary users mount FUSE filesystems (fusermount3 needs /dev/fuse read-write).
            os.mknod(f"/dev/{name}", 0o666 | stat.S_IFCHR, os.fstat(fd).st_rdev)
            os.chmod(f"/dev/{name}", 0o666)
            continue
        write_file(f"/dev/{name}", b"", 0o600)
        bind(fd, f"/dev/{name}")
    os.mkdir("/dev/pts")
    mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
          f"newinstance,ptmxmode=0666,mode=0620,gid={tty_gid}")
    os.symlink("pts/ptmx", "/dev/ptmx")
    os.mkdir("/dev/shm")
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    for path in placeholders:  # TPU device files: nothing behind them, but they are there
        if not path.startswith("/dev/") or "/../" in path + "/":
            raise ValueError(f"device file {path!r} is not under /dev")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file(path, b"", 0o666)


def build_pci(host_links, chips):
    """The host's PCI devices plus the worker's TPU chips (vendor and device id files only).

    Software that decides "am I on a TPU VM?" (JAX's cloud_tpu_init, libtpu) counts Google PCI
    devices; the simulated chips are as real as the /dev/accel placeholders.
    """
    mount("tmpfs", PCI_DEVICES, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=1m")
    for name, target in host_links.items():
        os.symlink(target, f"{PCI_DEVICES}/{name}")
    for i, chip in enumerate(chips):
        path = f"{PCI_DEVICES}/0000:f{i // 32:x}:{i % 32:02x}.0"
        os.mkdir(path)
        # class 0x1200: processing accelerator (gloo and lspci read it for every device)
        # subsystem_device tells v2 from v3; iommu_group names the chip's /dev/vfio/N (what
        # tpu-info reads for every Google device)
        for field, value in (("vendor", chip["vendor"]), ("device", chip["device"]),
                             ("subsystem_device", chip.get("subsystem", "0x0000")),
                             ("class", "0x120000")):
            write_file(f"{path}/{field}", (value + "\n").encode(), 0o444)
        os.symlink(f"../../../kernel/iommu_groups/{i}", f"{path}/iommu_group")


class Sshd:
    """The listener: started when due and wanted, restarted when it dies, stopped on fault."""

    def __init__(self, config, dir_fd, log_fd):
        self.argv = [config["sshd"], "-D", "-e", "-f", f"{RUN_DIR}/sshd_config"]
        self.dir_fd = dir_fd
        self.log_fd = log_fd
        self.pid = None
        self.stopping = False
        self.started_at = 0.0
        self.not_before = config["sshd_at"]  # time.monotonic(); CLOCK_MONOTONIC is system-wide
        self.backoff = 0.2

    def refresh_config(self):
        """Put a changed WORKER_DIR/sshd_config in place; a running sshd reloads it."""
        try:
            config = read_at(self.dir_fd, "sshd_config")
        except OSError as err:
            log(f"cannot read sshd_config: {err}")
            return
        with open(f"{RUN_DIR}/sshd_config", "rb") as f:
            if f.read() == config:
                return
        write_file(f"{RUN_DIR}/sshd_config", config, 0o600)
        if self.pid is not None and not self.stopping:
            os.kill(self.pid, signal.SIGHUP)  # sshd re-executes itself with the new config

    def wanted(self):
        try:
            os.stat("unreachable", dir_fd=self.dir_fd)
            return False
        except FileNotFoundError:
            return True

    def reconcile(self):
        if not self.wanted():
            if self.pid is not None and not self.stopping:
                os.kill(self.pid, signal.SIGTERM)  # closes the listening socket; sessions stay
                self.stopping = True
        elif self.pid is None and time.monotonic() >= self.not_before:
            self.start()

    def start(self):
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
            (os.POSIX_SPAWN_DUP2, self.log_fd, 2),
        ]
        env = {"PATH": STD_PATH, "LANG": "C.UTF-8"}
        self.started_at = time.monotonic()
        try:
            self.pid = os.posix_spawn(self.argv[0], self.argv, env, file_actions=actions,
                                      setsid=True, setsigmask=(), setsigdef=RESET_FOR_CHILDREN)
        except OSError as err:
            log(f"cannot start sshd: {err}; retry in {self.backoff:g} s")
            self.not_before = self.started_at + self.backoff
            self.backoff = min(self.backoff * 2, MAX_BACKOFF)

    def exited(self, status):
        now = time.monotonic()
        if not self.stopping and now - self.started_at < QUICK_DEATH:
            log(f"sshd exited at once (status {status}); see sshd.log; retry in {self.backoff:g} s")
            self.not_before = now + self.backoff
            self.backoff = min(self.backoff * 2, MAX_BACKOFF)
        elif not self.stopping:
            self.backoff = 0.2
        self.pid = None
        self.stopping = False

    def wait_time(self):
        if self.pid is None and self.wanted():
            return max(0.0, self.not_before - time.monotonic())
        return 3600.0


class Units:
    """A general-purpose VM's systemd as this init plays it (docs/simulated-pod.md): enabled
    units written on the VM start at boot; systemctl (vm_systemctl.py) asks through INIT_DIR
    and SIGUSR2; Restart= starts the main process again RestartSec after it ends."""

    def __init__(self, dir_fd):
        self.dir_fd = dir_fd
        self.running = {}  # unit -> pid
        self.due = {}  # unit -> time.monotonic() of its restart
        self.state = {}  # unit -> its status record (INIT_DIR/units/NAME.json)

    def own(self, name):  # written on the VM: in its own /etc layer, not the image's
        layer = f"/proc/self/fd/{self.dir_fd}/rootfs/etc/upper"
        return not os.path.isdir(layer) or os.path.exists(f"{layer}/systemd/system/{name}")

    def boot(self):
        enabled = set()
        try:
            for folder in os.listdir(UNITS_DIR):
                if folder.endswith(".wants") and os.path.isdir(f"{UNITS_DIR}/{folder}"):
                    enabled.update(os.listdir(f"{UNITS_DIR}/{folder}"))
        except OSError:
            return
        for name in sorted(enabled):
            if name.endswith(".service") and self.own(name):
                self.start(name)

    def write_state(self, name, **fields):
        record = self.state.setdefault(name, {"NRestarts": 0})
        record.update(fields)
        write_file(f"{INIT_DIR}/units/{name}.json", json.dumps(record).encode(), 0o644)

    def start(self, name):
        if name in self.running:
            return 0, ""
        path = f"{UNITS_DIR}/{name}"
        if not self.own(name):
            return 5, f"Unit {name} not found.\n"
        try:
            with open(path) as f:
                unit = parse_unit(f.read())
            account = pwd.getpwnam(unit["user"]) if unit["user"] else None
            if not unit["argv"]:
                raise ValueError("it has no ExecStart")
        except (OSError, KeyError, ValueError) as err:
            self.write_state(name, ActiveState="failed", SubState="failed", MainPID=0)
            return 1, f"Job for {name} failed: {err}\n"
        os.makedirs(UNIT_LOGS, exist_ok=True)
        out = os.open(f"{UNIT_LOGS}/{name}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        pid = os.fork()
        if pid == 0:
            self.exec_child(unit, account, out)
        os.close(out)
        self.running[name] = pid
        self.due.pop(name, None)
        self.write_state(name, ActiveState="active", SubState="running", MainPID=pid,
                         ActiveEnterTimestamp=time.time(), ExecStart=" ".join(unit["argv"]),
                         Restart=unit["restart"], RestartSec=unit["restart_sec"])
        return 0, ""

    @staticmethod
    def exec_child(unit, account, out):
        try:
            os.setsid()
            for sig in RESET_FOR_CHILDREN:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, ())
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            env = {"PATH": STD_PATH, "LANG": "C.UTF-8", "INVOCATION_ID": os.urandom(16).hex()}
            if account is not None:
                env.update(HOME=account.pw_dir, USER=account.pw_name,
                           LOGNAME=account.pw_name, SHELL=account.pw_shell)
            env.update(unit["env"])
            cwd = unit["cwd"].replace("~", account.pw_dir if account else "/root", 1) or "/"
            if account is not None:
                gid = grp.getgrnam(unit["group"]).gr_gid if unit["group"] else account.pw_gid
                os.initgroups(account.pw_name, gid)
                os.setgid(gid)
                os.setuid(account.pw_uid)
            os.chdir(cwd)
            os.closerange(3, 1 << 16)
            os.execvpe(unit["argv"][0], unit["argv"], env)
        except BaseException as err:  # noqa: BLE001 - said in the unit's log
            os.write(2, f"init: cannot start {unit['argv'][0]}: {err}\n".encode())
        os._exit(203)  # systemd's EXIT_EXEC

    def stop(self, name, grace=10.0):
        self.due.pop(name, None)
        pid = self.running.get(name)
        if pid is not None:
            self.state.setdefault(name, {})["stopping"] = True
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + wait
                while name in self.running and time.monotonic() < deadline:
                    signal.sigtimedwait((signal.SIGCHLD,), 0.05)
                    reap(None, self)
                if name not in self.running:
                    break
        self.write_state(name, ActiveState="inactive", SubState="dead", MainPID=0,
                         stopping=False)
        return 0, ""

    def exited(self, pid, status):
        name = next((n for n, p in self.running.items() if p == pid), None)
        if name is None:
            return False
        del self.running[name]
        record = self.state.get(name, {})
        failed = not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
        again = record.get("Restart") == "always" or (
            failed and record.get("Restart") in ("on-failure", "on-abnormal"))
        if record.pop("stopping", False) or not again:
            self.write_state(name, ActiveState="failed" if failed else "inactive",
                             SubState="failed" if failed else "dead", MainPID=0)
            return True
        self.due[name] = time.monotonic() + float(record.get("RestartSec", 0.1))
        self.write_state(name, ActiveState="activating", SubState="auto-restart", MainPID=0,
                         NRestarts=record.get("NRestarts", 0) + 1)
        return True

    def tick(self):
        for name in [n for n, at in self.due.items() if at <= time.monotonic()]:
            self.start(name)

    def wait_time(self):
        return max(0.0, min(self.due.values()) - time.monotonic()) if self.due else 3600.0

    def requests(self):
        """Answer systemctl's requests (INIT_DIR/requests/ID.json: verb and units)."""
        folder = f"{INIT_DIR}/requests"
        for entry in sorted(os.listdir(folder)):
            if not entry.endswith(".json"):
                continue
            try:
                with open(f"{folder}/{entry}") as f:
                    request = json.load(f)
                os.unlink(f"{folder}/{entry}")
            except (OSError, ValueError):
                continue
            code, text, verb = 0, "", request.get("verb")
            for name in request.get("units") or []:
                was = name in self.running
                if verb in ("stop", "restart", "reload-or-restart") or (verb == "try-restart"
                                                                       and was):
                    code, text = self.stop(name)
                if verb in ("start", "restart", "reload-or-restart") or (verb == "try-restart"
                                                                        and was):
                    code, text = self.start(name)
                if code:
                    break
            write_file(f"{INIT_DIR}/answers/.{entry}", json.dumps(
                {"code": code, "err": text}).encode(), 0o644)
            os.rename(f"{INIT_DIR}/answers/.{entry}", f"{INIT_DIR}/answers/{entry}")


def reap(sshd=None, units=None):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if sshd is not None and pid == sshd.pid:
            sshd.exited(status)
        elif units is not None:
            units.exited(pid, status)


def others_alive():
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if f.read().rpartition(b")")[2].split()[0] != b"Z":
                        return True
            except OSError:
                pass
    return False


def shutdown(grace):
    try:
        os.kill(-1, signal.SIGTERM)  # everyone in this namespace but us
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while others_alive() and time.monotonic() < deadline:
        signal.sigtimedwait((signal.SIGCHLD,), 0.05)
        reap()
    os._exit(0)  # the kernel SIGKILLs whatever is left when a namespace's PID 1 exits


def report(fd, message):
    os.write(fd, json.dumps(message).encode() + b"\n")
    os.close(fd)


def run_worker(worker_dir, ready_fd):
    """PID 1: set the worker up, report on ready_fd, then supervise sshd until SIGTERM."""
    os.umask(0o022)
    for sig in HANDLED:
        # A handler, not SIG_DFL: a namespace's PID 1 never receives signals it leaves at default.
        signal.signal(sig, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    try:
        host_pid, dir_fd, config, sshd_log = setup(worker_dir)
    except Exception as err:  # noqa: BLE001 - reported to the pool, which raises SimError
        log(f"setup failed: {err}")
        report(ready_fd, {"error": str(err)})
        return 1
    report(ready_fd, {"pid": host_pid})
    sshd = Sshd(config, dir_fd, sshd_log)
    units = Units(dir_fd) if config.get("vm") else None
    if units is not None:
        units.boot()
    while True:
        sshd.reconcile()
        if units is not None:
            units.tick()
        wait = sshd.wait_time() if units is None else min(sshd.wait_time(), units.wait_time())
        info = signal.sigtimedwait(HANDLED, wait)
        reap(sshd, units)
        if info is not None and info.si_signo == signal.SIGUSR1:
            sshd.refresh_config()
            if units is not None:
                merge_accounts(dir_fd)  # the pool added users from metadata ssh-keys
        if info is not None and info.si_signo == signal.SIGUSR2 and units is not None:
            units.requests()
        if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
            shutdown(config.get("stop_grace", 2.0))


def _die_with_parent():
    # PID 1 of a new namespace sees no parent (getppid() is 0), so there is nothing to compare
    # against; the spawner outlives the workers it forked unless it is killed.
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(1)


def _unshare(flags):
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _setns(fd, flags):
    if _libc.setns(fd, ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def become_pid1(worker_dir, ready_w, netns=""):
    """In the forked child: our own session, files, mount and UTS namespaces (and the node's
    network namespace for an internal-IP node, sim/network.py); then PID 1's work. Never
    returns."""
    code = 1
    try:
        _die_with_parent()
        os.setsid()  # no terminal's signals reach a worker
        null_fd = os.open(os.devnull, os.O_RDONLY)
        log_fd = os.open(os.path.join(worker_dir, "init.log"),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for source, target in ((null_fd, 0), (log_fd, 1), (log_fd, 2)):
            os.dup2(source, target, inheritable=False)
        keep = os.dup2(ready_w, 3, inheritable=False)
        os.closerange(keep + 1, 1 << 16)  # the spawner's pipes and other workers' ready pipes
        if netns:
            net_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            _setns(net_fd, CLONE_NEWNET)
            os.close(net_fd)
        _unshare(CLONE_NEWNS | CLONE_NEWUTS)
        code = run_worker(worker_dir, keep)
    except BaseException as err:  # noqa: BLE001 - said on the ready pipe while it is open
        log(f"cannot become the worker's PID 1: {err}")
        try:
            report(3, {"error": f"cannot become the worker's PID 1: {err}"})
        except OSError:
            pass
    finally:
        os._exit(code or 0)


class Spawner:
    """Forks a PID 1 per request read on stdin, in new PID and time namespaces, and relays
    each one's ready report to stdout; ends (and its workers with it) when stdin closes."""

    def __init__(self):
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.own_time_ns = os.open("/proc/self/ns/time", os.O_RDONLY | os.O_CLOEXEC)
        self.selector = selectors.DefaultSelector()
        self.requests = b""
        self.booting = {}  # ready pipe fd -> (request id, pid, bytes so far)

    def answer(self, message):
        os.write(1, json.dumps(message).encode() + b"\n")

    def fork_worker(self, request):
        ready_r, ready_w = os.pipe()
        pid = -1
        try:
            # New PID and time namespaces for our next child only (we stay where we are)...
            _unshare(CLONE_NEWPID | CLONE_NEWTIME)
            try:
                with open("/proc/uptime") as f:  # the worker's boot clock starts now
                    uptime = int(float(f.read().split()[0]))
                with open("/proc/self/timens_offsets", "w") as f:
                    f.write(f"boottime {-uptime} 0\n")
                pid = os.fork()
            finally:
                if pid != 0:  # ... then ours again for the children after it
                    _setns(self.own_pid_ns, CLONE_NEWPID)
                    _setns(self.own_time_ns, CLONE_NEWTIME)
        except OSError as err:
            os.close(ready_r)
            os.close(ready_w)
            self.answer({"id": request["id"], "error": f"cannot start the worker: {err}"})
            return
        if pid == 0:
            become_pid1(request["dir"], ready_w, request.get("netns") or "")
        os.close(ready_w)
        self.booting[ready_r] = (request["id"], pid, b"")
        self.selector.register(ready_r, selectors.EVENT_READ)
        self.answer({"id": request["id"], "forked": pid})

    def ready(self, fd):
        request, pid, got = self.booting[fd]
        chunk = os.read(fd, 4096)
        got += chunk
        if chunk and b"\n" not in got:
            self.booting[fd] = (request, pid, got)
            return
        self.selector.unregister(fd)
        os.close(fd)
        del self.booting[fd]
        try:
            message = json.loads(got.split(b"\n")[0])
        except ValueError:
            message = {"error": "PID 1 exited during setup; see init.log"}
        self.answer({**message, "id": request, "forked": pid})

    def requested(self):
        chunk = os.read(0, 65536)
        if not chunk:
            return False
        self.requests += chunk
        *lines, self.requests = self.requests.split(b"\n")
        for line in lines:
            try:
                request = json.loads(line)
            except ValueError:
                request = None
            if not isinstance(request, dict) or "id" not in request or "dir" not in request:
                log(f"spawner: bad request {line[:200]!r}")
                continue
            self.fork_worker(request)
        return True

    def run(self):
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.selector.register(0, selectors.EVENT_READ)
        gc.collect()
        gc.freeze()  # what is here now is never traversed again: forked pages stay shared
        while True:
            for key, _ in self.selector.select():
                if key.fd != 0:
                    self.ready(key.fd)
                elif not self.requested():
                    return 0


def main(argv):
    if argv[1:] == ["--spawner"]:
        return Spawner().run()
    sys.stderr.write("usage: worker_init.py --spawner (started by tpufab.sim.workers)\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
