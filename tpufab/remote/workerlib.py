"""The worker-side library: what several worker scripts need, once (stdlib only, Python 3.8+).

A worker script runs alone (``python3 -I -S FILE``, or from stdin on a full disk), so it
cannot import a sibling. It imports from here on one top-level line, ``from
tpufab.remote.workerlib import a, b``: locally (tests, tpufab.steps.health.status) that is a plain import;
``RemoteFile.bundled`` puts this file's body in place of that line when it builds the bytes
it ships, so the shipped script stands alone and its content hash covers this file too. A
script may not define a top-level name this file defines (checked when it is bundled).
"""

import glob
import json
import os
import re
import stat
import sys
import time

DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")   # both TPU device families
COMMAND_CHARS = 200
EXITED = ("Z", "X", "x")                             # /proc/<pid>/stat states of the dead
MOUNTS_DIR = "~/.cache/tpufab/mounts"   # where tpufab records its mounts: a record and a log each
SUPERVISOR_NAME = "tpufab-run"                       # the comm run_worker.py's supervisor takes
IDLE_AGENT_NAME = "tpufab-idle"    # the comm of a fan-out agent no command holds (a kept connection)
END_RESERVED = 4096                                  # the bytes of a run's end.json
# A secret's value is masked inside output only from this many characters on: a shorter one
# ("1", "128", "abc") is a word that output holds anyway, and masking it garbles every line
# ("step *** loss 2.***"). tpufab.quoting uses this too (one rule, docs/reliability.md).
MIN_SECRET_LENGTH = 8


# -- answers: the one codec of what a worker script tells the host --------------------------------

# A worker script's answer is one line, ``ANSWER_TAG KIND {json object}``: ``answer`` writes it,
# ``read_answer``/``read_answers``/``parse_answer`` (the host's readers, tpufab.ssh.remote_files)
# read it, wherever else the output holds (a recipe's prints, a tool's warnings, a line cut
# short): the tag may follow other text on its line, the last complete answer of a kind wins.
ANSWER_TAG = "@tpufab-answer"
ANSWER = "answer"   # the kind of a script's final answer; streamed ones name their own


def answer(kind, payload, stream=None):
    """Write one typed answer (``payload``: a JSON object) on ``stream`` (default stdout) as
    one flushed line; streamed answers (progress, a port) are several calls."""
    out = sys.stdout if stream is None else stream
    out.write(f"{ANSWER_TAG} {kind} {json.dumps(payload, sort_keys=True)}\n")
    out.flush()


def serve_ops(name, ops, argv=None):
    """A script of operations (``name OP`` with a JSON request on stdin): OP's answer on
    stdout; an exit code (2 for an unknown OP)."""
    argv = sys.argv if argv is None else argv
    op = argv[1] if len(argv) > 1 else ""
    if op not in ops:
        sys.stderr.write(f"{name}: unknown operation {op!r}\n")
        return 2
    answer(ANSWER, ops[op](json.loads(sys.stdin.read() or "{}")))
    return 0


def parse_answer(line):
    """(kind, payload) of one line holding an answer, else None (a torn or foreign line)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    at = line.rfind(ANSWER_TAG + " ")
    if at < 0:
        return None
    kind, _, text = line[at + len(ANSWER_TAG) + 1:].strip().partition(" ")
    try:
        payload = json.loads(text)
    except ValueError:
        return None
    return (kind, payload) if kind and isinstance(payload, dict) else None


def read_answers(text, kind=None):
    """Every answer in ``text`` (of ``kind``, if given), in order, as (kind, payload)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    found = (parse_answer(line) for line in (text or "").splitlines())
    return [a for a in found if a is not None and (kind is None or a[0] == kind)]


def read_answer(text, kind=ANSWER):
    """The payload of the last answer of ``kind`` in ``text``, else None."""
    found = read_answers(text, kind)
    return found[-1][1] if found else None


# -- secrets -------------------------------------------------------------------------------------


def secret_forms(values):
    """Each secret value of at least MIN_SECRET_LENGTH characters in every form worth masking,
    longest first: as is, URL-encoded (quote, quote keeping "/", quote_plus; upper- and
    lower-case hex) and JSON-escaped. The one definition: tpufab.quoting imports it, worker
    scripts get it inlined (encode the forms for Masker)."""
    from urllib.parse import quote, quote_plus

    forms = set()
    for value in values:
        if not value or len(value) < MIN_SECRET_LENGTH:
            continue
        for form in (value, quote(value, safe=""), quote(value), quote_plus(value),
                     json.dumps(value)[1:-1]):
            forms.add(form)
            forms.add(re.sub("%[0-9A-F]{2}", lambda m: m.group(0).lower(), form))
    return sorted((f for f in forms if f), key=lambda f: (-len(f.encode()), f.encode()))


class Masker:
    """Masks secret forms (bytes) in a byte stream fed in arbitrary pieces: only the end of
    what was fed that could still grow into a secret (a prefix of one) is held back for the
    next piece."""

    MASKED = b"***"

    def __init__(self, forms):
        self.forms = list(forms)
        self.held = b""

    def feed(self, data):
        if not self.forms:
            return data
        data = self.held + data
        for form in self.forms:
            if form in data:
                data = data.replace(form, self.MASKED)
        keep = self._partial(data)
        self.held = data[len(data) - keep:] if keep else b""
        return data[:len(data) - keep]

    def flush(self):
        out, self.held = self.held, b""
        return out

    def _partial(self, data):
        best = 0
        last = data[-1:]
        for form in self.forms:
            for k in range(min(len(form) - 1, len(data)), best, -1):
                if form[k - 1:k] == last and data.endswith(form[:k]):
                    best = k
                    break
        return best


# -- files ---------------------------------------------------------------------------------------


def read_text(path):
    """The stripped text of a small file (undecodable bytes replaced), or None."""
    try:
        with open(path, errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def read_int(path):
    return read_number(path, int)


def read_number(path, kind):
    """The number (``kind``: int or float) a small file holds, or None."""
    text = read_text(path)
    try:
        return kind(text) if text else None
    except ValueError:
        return None


def read_json(path):
    """The JSON value in ``path``, or None when it is missing or not JSON."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def write_atomic(path, text, mode=0o644):
    """Replace ``path`` with ``text`` in one step: a reader sees the old or the new, never
    half (the temporary name is per process, so two writers never share one)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def unescape(field):
    """/proc/mounts and mountinfo escape space, tab, newline and backslash as \\ooo."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1:i + 4]) == 3 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_records(state_dir):
    """[(state file, record)] of each mount mount_worker.py recorded in ``state_dir`` (a JSON
    object with its mount point, "at"), in file name order."""
    folder = os.path.expanduser(state_dir)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        if name.endswith(".json"):
            record = read_json(os.path.join(folder, name))
            if isinstance(record, dict) and record.get("at"):
                found.append((os.path.join(folder, name), record))
    return found


# -- processes -----------------------------------------------------------------------------------


class Proc:
    """One process as /proc/<pid>/stat shows it (``proc_stat``)."""

    __slots__ = ("pid", "comm", "state", "ppid", "pgid", "sid", "start_time")

    def __init__(self, pid, comm, state, ppid, pgid, sid, start_time):
        self.pid = pid
        self.comm = comm
        self.state = state
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid
        self.start_time = start_time

    @property
    def exited(self):
        return self.state in EXITED


def proc_stat(pid):
    """``pid`` as a Proc, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: it ends at the last ')'.
    left, right = data.index(b"("), data.rindex(b")")
    fields = data[right + 2:].split()
    return Proc(pid, data[left + 1:right].decode("utf-8", "replace"), fields[0].decode(),
                int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def alive(pid, start_time):
    """``pid`` is still the very process that started at ``start_time`` (field 22 of its
    stat), and it has not exited: a reused pid is never taken for it."""
    proc = proc_stat(pid)
    return proc is not None and proc.start_time == start_time and not proc.exited


def is_live(pid):
    proc = proc_stat(pid)
    return proc is not None and not proc.exited


def all_pids():
    return sorted(int(name) for name in os.listdir("/proc") if name.isdigit())


def argv_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


RAY_DAEMONS = ("raylet", "gcs_server")


def _option(argv, name):
    """The value of ``--name=value`` or ``--name value`` in ``argv``, else None."""
    for i, word in enumerate(argv):
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def ray_daemons():
    """Ray's daemons on this host, from /proc alone (no `ray status`): None when neither a
    raylet nor a GCS runs here; else {"raylet": pid or None, "head": a GCS runs here,
    "gcs_address": the GCS the raylet (else the GCS) names, "node_ip": the raylet's}."""
    me = os.getpid()
    raylet, gcs = None, None
    for pid in all_pids():
        if pid == me:
            continue
        comm = read_text(f"/proc/{pid}/comm")
        if comm not in RAY_DAEMONS:
            continue
        proc = proc_stat(pid)
        if proc is None or proc.exited:
            continue
        if comm == "raylet" and raylet is None:
            raylet = (pid, argv_of(pid))
        elif comm == "gcs_server" and gcs is None:
            gcs = (pid, argv_of(pid))
    if raylet is None and gcs is None:
        return None
    address = None
    node_ip = None
    if raylet is not None:
        address = _option(raylet[1], "--gcs-address")
        node_ip = _option(raylet[1], "--node_ip_address") or _option(raylet[1],
                                                                      "--node-ip-address")
    if address is None and gcs is not None:
        ip = _option(gcs[1], "--node-ip-address") or _option(gcs[1], "--node_ip_address")
        port = _option(gcs[1], "--gcs_server_port")
        address = f"{ip}:{port}" if ip and port else None
    return {"raylet": raylet[0] if raylet else None, "head": gcs is not None,
            "gcs_address": address, "node_ip": node_ip}


def program_names(comm, argv):
    """The names a process goes by: its comm and its program's (argv[0]'s) base name."""
    names = [comm]
    # "sshd: user@notty" style titles: the program name is the first word.
    words = argv[0].split(":")[0].split() if argv else []
    if words:
        names.append(os.path.basename(words[0]))
    return names


def command_of(proc, argv=None, say_renamed=False):
    """Its command line, cut to COMMAND_CHARS (``[comm]`` without one). ``say_renamed``: a
    process that renamed itself (prctl) shows as ``comm: argv``, for a report that gives no
    name beside the command."""
    argv = argv_of(proc.pid) if argv is None else argv
    text = " ".join(argv) or f"[{proc.comm}]"
    if say_renamed and argv and os.path.basename(argv[0])[:15] != proc.comm:
        text = f"{proc.comm}: {text}"
    return text if len(text) <= COMMAND_CHARS else text[:COMMAND_CHARS - 3] + "..."


# -- tpufab sessions on this worker ---------------------------------------------------------------

TASK_MARKER = b"TPUFAB_TASK="


def tpufab_sessions(ignore=("autostop_worker.py",)):
    """What tpufab (or a person over ssh) is doing on this worker now: [(pid, what)].

    A fan-out agent a tpufab command holds (its loader is named ``tpufab-agent``; one kept
    between commands, which names itself IDLE_AGENT_NAME, is no work: what a command runs
    through it counts by its marker), a one-shot wrapper (``tpufab-oneshot``), any process
    carrying the ``TPUFAB_TASK`` marker (a command either runs: exec, setup, deploy, get's
    reads, launch's steps, and what they start), and an interactive ssh session (sshd's
    ``USER@pts/N``: `tpufab ssh`, plain ssh). Processes whose command line names one of
    ``ignore`` (the autostop watchdog and its own queries) do not count; the caller itself
    never does."""
    found = []
    me = os.getpid()
    for pid in all_pids():
        if pid == me:
            continue
        argv = argv_of(pid)
        text = " ".join(argv)
        if not text or any(word in text for word in ignore):
            continue
        what = None
        if "tpufab-agent" in text and "python" in os.path.basename(argv[0]):
            if read_text(f"/proc/{pid}/comm") == IDLE_AGENT_NAME:
                continue
            what = "tpufab connection"
        elif "tpufab-oneshot" in argv:
            what = "tpufab command"
        elif text.startswith(("sshd: ", "sshd-session: ")) and "@pts/" in text:
            what = "ssh session"
        else:
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = fh.read()
            except OSError:
                env = b""
            if env.startswith(TASK_MARKER) or b"\0" + TASK_MARKER in env:
                what = "tpufab command"
        if what is not None and is_live(pid):
            found.append((pid, what))
    return found


# -- who holds the TPU ---------------------------------------------------------------------------


def expand_globs(globs):
    """The paths ``globs`` match, in order, each once."""
    paths = []
    for pattern in globs:
        for path in sorted(glob.glob(os.path.expanduser(pattern))):
            if path not in paths:
                paths.append(path)
    return paths


def common_rdevs():
    """Device numbers of /dev/null and friends: a placeholder device made as a copy of one
    of them must never make every process holding /dev/null look like a TPU holder."""
    found = set()
    for name in ("null", "zero", "full", "random", "urandom", "tty", "console", "ptmx"):
        try:
            found.add(os.stat("/dev/" + name).st_rdev)
        except OSError:
            pass
    return found


class Watched:
    """Files whose open descriptors mean "holds the TPU": matched by path, or for character
    devices by device number (the same chip seen through another path or namespace)."""

    def __init__(self, paths):
        self.by_path = {}
        self.by_rdev = {}
        common = common_rdevs()
        for path in paths:
            self.by_path[path] = path
            self.by_path[os.path.realpath(path)] = path
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_rdev not in common:
                self.by_rdev[st.st_rdev] = path

    def match(self, fd_path, link):
        if link in self.by_path:
            return self.by_path[link]
        if self.by_rdev and link.startswith("/dev/"):
            try:
                return self.by_rdev.get(os.stat(fd_path).st_rdev)
            except OSError:
                return None
        return None


def scan_holders(watched):
    """{pid: set of watched paths it holds open} (from /proc/*/fd, this process left out),
    and how many processes could not be read (other users' ones, unless root)."""
    holders = {}
    unreadable = 0
    me = os.getpid()
    for pid in all_pids():
        if pid == me:
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            unreadable += 1
            continue
        except OSError:
            continue
        for fd in fds:
            fd_path = fd_dir + "/" + fd
            try:
                link = os.readlink(fd_path)
            except OSError:
                continue
            path = watched.match(fd_path, link)
            if path is not None:
                holders.setdefault(pid, set()).add(path)
    return holders, unreadable


# -- tpufab runs (run_worker.py writes them; run_worker.py, facts_worker.py and kill_worker.py read them) -----------


class EndRecord:
    """How a run ended, in ``end.json``: its space is taken when the run starts and overwritten
    in place at the end, so a disk that fills up meanwhile cannot lose the record. The
    one-value files (``exit_code``, ``killed``, ``ended_at``) follow when there is room."""

    def __init__(self, rundir):
        self.rundir = rundir
        self.fd = os.open(os.path.join(rundir, "end.json"), os.O_RDWR | os.O_CREAT, 0o644)
        os.write(self.fd, b" " * END_RESERVED)

    def write(self, exit_code=None, killed=None, disk_full=None):
        record = {"ended_at": time.time()}
        if killed:
            record["killed"] = killed
        else:
            record["exit_code"] = exit_code
        if disk_full:
            record["disk_full"] = disk_full
        data = json.dumps(record, sort_keys=True).encode()[:END_RESERVED - 1] + b"\n"
        os.pwrite(self.fd, data.ljust(END_RESERVED), 0)
        os.close(self.fd)
        try:
            if killed:
                write_atomic(os.path.join(self.rundir, "killed"), killed + "\n")
            else:
                write_atomic(os.path.join(self.rundir, "exit_code"), f"{exit_code}\n")
            write_atomic(os.path.join(self.rundir, "ended_at"), "{}\n".format(record["ended_at"]))
        except OSError:
            pass    # end.json has it


def read_end(rundir):
    """How a run ended ({"exit_code"|"killed", "ended_at", "disk_full"?}), or None while it
    runs (end.json is all spaces then). Runs recorded before end.json existed have only the
    one-value files."""
    try:
        with open(os.path.join(rundir, "end.json"), "rb") as fh:
            text = fh.read(END_RESERVED).strip()
        record = json.loads(text.decode()) if text else None
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict):
        return record
    exit_code = read_int(os.path.join(rundir, "exit_code"))
    killed = read_text(os.path.join(rundir, "killed"))
    if exit_code is None and not killed:
        return None
    found = {"ended_at": read_number(os.path.join(rundir, "ended_at"), float)}
    if exit_code is not None:
        found["exit_code"] = exit_code
    else:
        found["killed"] = killed
    return found


def run_id_of(pid):
    """The TPUFAB_RUN_ID a process carries (run_worker.py sets it for every run), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read()
    except OSError:
        return None
    for entry in env.split(b"\0"):
        if entry.startswith(b"TPUFAB_RUN_ID="):
            return entry[len(b"TPUFAB_RUN_ID="):].decode("utf-8", "replace")
    return None


CONTAINER_ID = "container-id"   # in a run's folder: its container's id (docker run --cidfile)
CONTAINER_HEX = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


def container_pids(rundirs):
    """{run folder: [pid]}: the processes inside each run's container (`run --image`), seen
    from the host: those whose cgroup is the container's own (named by the id `docker run
    --cidfile` wrote in the folder; /proc/PID/cgroup is readable by every user). The
    runtime's monitor (podman's conmon) sits in a cgroup of its own beside it: not one."""
    ids = {}
    for rundir in rundirs:
        found = CONTAINER_HEX.search(read_text(os.path.join(rundir, CONTAINER_ID)) or "")
        if found:
            ids[found.group(0)] = rundir
    inside = {rundir: [] for rundir in ids.values()}
    for pid in all_pids() if ids else ():
        for part in (read_text(f"/proc/{pid}/cgroup") or "").replace(":", "/").split("/"):
            hit = CONTAINER_HEX.search(part)
            if hit and hit.group(0) in ids and "conmon" not in part:
                inside[ids[hit.group(0)]].append(pid)
                break
    return inside


def run_processes(runs):
    """Live processes of runs, {run id: [Proc]}, for ``runs`` {run id: its process group if
    the caller verified the group's leader by start time, else None}. A process belongs to a
    run when it carries the run's TPUFAB_RUN_ID (wherever it went: setsid, nohup), or is in
    its verified group. This process is never one of them."""
    found = {name: [] for name in runs}
    groups = {pgid: name for name, pgid in runs.items() if pgid is not None}
    me = os.getpid()
    for pid in all_pids():
        if pid == me:
            continue
        proc = proc_stat(pid)
        if proc is None or proc.exited:
            continue
        name = groups.get(proc.pgid)
        if name is None:
            marker = run_id_of(pid)
            name = marker if marker in found else None
        if name is not None:
            found[name].append(proc)
    return found


class CarriedRunIds:
    """The TPUFAB_RUN_IDs live processes carry, read on first use: one scan of /proc answers
    for every run whose state is read (``state_of_run(..., carried=)``)."""

    def __init__(self):
        self.ids = None

    def __contains__(self, run_id):
        if self.ids is None:
            procs = (proc_stat(pid) for pid in all_pids() if pid != os.getpid())
            self.ids = {run_id_of(proc.pid) for proc in procs if proc and not proc.exited}
        return run_id in self.ids


def supervisor_alive(rundir):
    """The run's supervisor still lives: verified by the start time run_worker.py records, or by
    its name for runs recorded before it did."""
    pid = read_int(os.path.join(rundir, "supervisor"))
    if pid is None:
        return False
    start_time = read_int(os.path.join(rundir, "supervisor_start_time"))
    if start_time is not None:
        return alive(pid, start_time)
    proc = proc_stat(pid)
    return proc is not None and not proc.exited and proc.comm == SUPERVISOR_NAME


def state_of_run(rundir, carried=None):
    """How a run stands: {"state", "exit_code" or "signal", "disk_full"?, "ended_at"}, state
    one of running, starting, exited, killed, lost. ``carried``: a CarriedRunIds shared by
    the runs read together (else this run's processes are looked for on their own).

    Running while its recipe lives (verified by start time), its supervisor lives (the recipe
    just ended; the supervisor is recording that) or a process of it lives on (the recipe
    left it behind). The end record is read again after those checks: the supervisor writes
    it, then exits, so a run that ends in between is never "lost"; only a run with neither a
    live process nor a record is (a reboot, a killed supervisor).
    """
    pid = read_int(os.path.join(rundir, "pid"))
    start_time = read_int(os.path.join(rundir, "start_time"))
    recorded = pid is not None and start_time is not None
    state = {}
    end = read_end(rundir)
    if end is None:
        name = os.path.basename(rundir)
        if (recorded and alive(pid, start_time)) or supervisor_alive(rundir) or \
                (recorded and _left_behind(name, carried)):
            state["state"] = "running"
        else:
            end = read_end(rundir)
            if end is None:
                state["state"] = "starting" if pid is None and _young(rundir) else "lost"
    if end is not None:
        if end.get("killed"):
            state.update(state="killed", signal=end["killed"])
        else:
            state.update(state="exited", exit_code=end.get("exit_code"))
        if end.get("disk_full"):
            state["disk_full"] = end["disk_full"]
    state["ended_at"] = end.get("ended_at") if end else None
    return state


def _left_behind(name, carried):
    if carried is not None:
        return name in carried
    return bool(run_processes({name: None})[name])


def _young(rundir):
    """Made under 30 s ago and no supervisor recorded yet: run_worker.py is still starting it."""
    if read_int(os.path.join(rundir, "supervisor")) is not None:
        return False
    try:
        return time.time() - os.path.getmtime(rundir) < 30
    except OSError:
        return False


# -- libtpu's runtime metrics (top_worker.py reads them) ----------------------------------------
# The service tpu-info reads: gRPC on localhost:8431 (local credentials: plain HTTP/2 on a
# loopback connection), served by libtpu in the process that holds the chips. gRPC comes from
# grpcio: this Python's, else the Python of the `tpu-info` command (which has it by
# construction), else ~/.venv's; the messages are decoded here (no protobuf package).

TPU_METRICS_ADDR = "localhost:8431"
TPU_METRIC_SERVICE = "/tpu.monitoring.runtime.RuntimeMetricService/GetRuntimeMetric"
TPU_METRIC_NAMES = {
    "hbm_total": "tpu.runtime.hbm.memory.total.bytes",
    "hbm_used": "tpu.runtime.hbm.memory.usage.bytes",
    "duty": "tpu.runtime.tensorcore.dutycycle.percent",
    "idle": "tpu.runtime.tensorcore.idle_duration.seconds",
    "programs": "hlo.execution.timing.distribution.microseconds",
    "collectives": "megascale.collective_end_to_end_latencies.microsecond.cumulative.distribution",
}


def pb_fields(data):
    """A protobuf message's fields: {number: [value, ...]} (varints as int, 64-bit values as
    8 bytes, length-delimited ones as bytes); ValueError when it is no protobuf message."""
    fields = {}
    i, n = 0, len(data)
    while i < n:
        key, i = pb_varint(data, i)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if kind == 0:
            value, i = pb_varint(data, i)
        elif kind == 1:
            value, i = data[i:i + 8], i + 8
        elif kind == 2:
            size, i = pb_varint(data, i)
            value, i = data[i:i + size], i + size
        elif kind == 5:
            value, i = data[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {kind}")
        if i > n:
            raise ValueError(f"truncated field {number}")
        fields.setdefault(number, []).append(value)
    return fields


def pb_varint(data, i):
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def pb_double(raw):
    import struct
    return struct.unpack("<d", raw)[0] if isinstance(raw, bytes) and len(raw) == 8 else 0.0


def pb_int(raw):
    if not isinstance(raw, int):
        return 0
    return raw - (1 << 64) if raw >= 1 << 63 else raw


def pb_first(fields, number, default=None):
    values = fields.get(number)
    return values[-1] if values else default


def metric_device(metric):
    """A Metric's device: ``attribute.value.int_attr``, or the ``device_ordinal`` of its
    key-value list (libtpu labels the HLO metrics so)."""
    attr = pb_fields(pb_first(metric, 1, b""))
    value = pb_fields(pb_first(attr, 2, b""))
    if 3 in value:
        return pb_int(pb_first(value, 3))
    for item in pb_fields(pb_first(value, 6, b"")).get(1, []):
        entry = pb_fields(item)
        if pb_first(entry, 1, b"") == b"device_ordinal":
            inner = pb_fields(pb_first(entry, 2, b""))
            text = pb_first(inner, 1)
            if isinstance(text, bytes) and text.strip().isdigit():
                return int(text)
            if 3 in inner:
                return pb_int(pb_first(inner, 3))
    return None


def parse_metric_response(data):
    """MetricResponse bytes -> {device: value}: a gauge's number, or a distribution's
    (count, mean) (ValueError when it is not one)."""
    metric = pb_fields(pb_first(pb_fields(data), 1, b""))
    found = {}
    for raw in metric.get(3, []):
        m = pb_fields(raw)
        device = metric_device(m)
        if device is None:
            continue
        if 3 in m:
            gauge = pb_fields(pb_first(m, 3))
            found[device] = pb_double(pb_first(gauge, 1)) if 1 in gauge else \
                float(pb_int(pb_first(gauge, 2, 0)))
        elif 5 in m:
            dist = pb_fields(pb_first(m, 5))
            found[device] = (pb_int(pb_first(dist, 1, 0)), pb_double(pb_first(dist, 2)))
    return found


class TpuMetrics:
    """A channel to libtpu's metrics service; ``read()`` asks for every metric tpufab shows
    and returns one dict (``available``, ``chips``, or ``why``). Needs ``import grpc``."""

    def __init__(self, addr=TPU_METRICS_ADDR, timeout=3.0):
        import grpc
        self.grpc = grpc
        self.timeout = timeout
        creds = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        self.channel = grpc.secure_channel(addr, creds)
        self.call = self.channel.unary_unary(TPU_METRIC_SERVICE)

    def ask(self, name):
        request = b"\x0a" + bytes([len(name)]) + name.encode()
        return parse_metric_response(self.call(request, timeout=self.timeout))

    def read(self, keys=None):
        """Every metric tpufab shows, or only ``keys`` of TPU_METRIC_NAMES (duty's chips
        make the entries; hbm_total says how many devices a chip has)."""
        grpc = self.grpc
        got = {}
        for key, name in TPU_METRIC_NAMES.items():
            if keys is not None and key not in keys:
                continue
            try:
                got[key] = self.ask(name)
            except grpc.RpcError as err:
                if key in ("hbm_total", "hbm_used", "duty"):  # the ones tpu-info needs too
                    detail = (err.details() or "").strip()[:160]
                    return {"available": False, "code": err.code().name,
                            "why": "{}{}".format(err.code().name, ": " + detail if detail else "")}
            except ValueError as err:
                return {"available": False, "code": "GARBAGE",
                        "why": f"the metrics service answered no metrics message ({err})"}
        chips = []
        totals, used, duty = got.get("hbm_total", {}), got.get("hbm_used", {}), got.get("duty", {})
        per_chip = max(1, len(totals) // max(1, len(duty))) if duty else 1
        for chip in sorted(duty) or sorted(totals):
            devices = [chip * per_chip + k for k in range(per_chip)]
            entry = {"chip": chip, "duty_cycle_percent": round(duty.get(chip, 0.0), 2),
                     "hbm_used_bytes": int(sum(used.get(d, 0) for d in devices)),
                     "hbm_total_bytes": int(sum(totals.get(d, 0) for d in devices))}
            idle = [got.get("idle", {}).get(d) for d in devices]
            if all(x is not None for x in idle):
                entry["idle_seconds"] = round(min(idle), 3)
            for key in ("programs", "collectives"):
                dist = [got.get(key, {}).get(d) for d in devices]
                if dist and all(isinstance(x, tuple) for x in dist):
                    entry[key] = sum(c for c, _ in dist)
                    entry[key + "_seconds"] = round(sum(c * m for c, m in dist) / 1e6, 6)
            chips.append(entry)
        return {"available": True, "source": f"libtpu metrics service ({TPU_METRICS_ADDR})",
                "chips": chips}

    def close(self):
        self.channel.close()


def grpc_python():
    """An interpreter that can import grpc, other than this one: the `tpu-info` command's
    (its shebang), else ~/.venv's; None if there is none."""
    import shutil
    import subprocess
    candidates = []
    for found in (shutil.which("tpu-info"), os.path.expanduser("~/.local/bin/tpu-info"),
                  os.path.expanduser("~/.venv/bin/tpu-info")):
        try:
            with open(found or "", "rb") as fh:
                first = fh.readline().decode("utf-8", "replace")
        except OSError:
            continue
        if first.startswith("#!") and first[2:].split():
            candidates.append(first[2:].split()[0])
    candidates.append(os.path.expanduser("~/.venv/bin/python3"))
    for python in candidates:
        if not os.access(python, os.X_OK):  # (a venv's python is this one's binary, with
            continue                          # the venv's site: it counts)
        try:
            if subprocess.run([python, "-c", "import grpc"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=20).returncode == 0:
                return python
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def have_grpc():
    try:
        import grpc  # noqa: F401
    except ImportError:
        return False
    return True
