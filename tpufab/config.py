"""Layered settings, like invoke/fabric: defaults < user file < project file < TPUFAB_* env < flags.

- user file: ``$TPUFAB_USER_CONFIG`` or ``~/.config/tpufab/config.yaml``
- this project's current pod (tpufab.current): its name, zone and project, when one is set
- project file: ``tpufab.yaml`` (or ``.yml``) in the working directory or an ancestor, else the
  ``tpufab:`` section of ``invoke.yaml``/``invoke.yml`` there
- invoke's config stack, when a verb runs as an invoke task: its ``tpufab:`` section (from
  /etc/invoke.yaml, ~/.invoke.yaml, the project's invoke.yaml, ``-f FILE``)
- environment: ``TPUFAB_<KEY>`` (upper case), e.g. ``TPUFAB_API_ENDPOINT``, ``TPUFAB_SPOT=1``
- flags: whatever the CLI or invoke task was given (``None`` means "not given")
"""

from __future__ import annotations

import dataclasses
import difflib
import getpass
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tpufab.errors import ConfigError

ENV_PREFIX = "TPUFAB_"

# Forwarded env vars whose values are secrets: masked everywhere, never in argv on a worker.
DEFAULT_SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "GITHUB_TOKEN",
                   "GH_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY")


@dataclass
class Settings:
    """Every tpufab setting. Field names are the keys in files and (upper-cased) in env vars."""

    # control plane
    project: str | None = None
    zone: str = "us-central2-b"
    name: str | None = None
    type: str | None = None
    runtime_version: str | None = None
    spot: bool = False
    preemptible: bool = False
    reserved: bool = False
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    api_endpoint: str | None = None
    control_plane: str | None = None    # "tpu" or "compute" (Compute Engine); default: by type
    flex_start: bool = False            # Compute Engine FLEX_START (with max_run_duration)
    max_run_duration: str | None = None  # e.g. "8h": how long a flex-start slice may run
    flex_start_renew: bool = False      # babysit: a new flex-start request when one ends
    # create: how long a MIG may stay short of VMs that Compute Engine reports it could not create
    mig_short_wait: float = 300.0
    api_timeout: float = 60.0           # seconds per API call
    api_retries: int = 8                # attempts for transient API failures (429/503/...)
    api_retry_seconds: float = 120.0    # give up retrying after this long
    wait_timeout: float = 3600.0        # how long create/delete wait for READY/ACTIVE/gone
    # reaching workers
    ssh_user: str = field(default_factory=lambda: _local_user())
    ssh_key: str = "~/.ssh/tpufab_ed25519"
    internal_ip: bool = False
    jump: str | None = None             # user@host[:port]: reach workers through this bastion
    known_hosts: str = "~/.tpufab/known_hosts"
    concurrency: int = 64
    fanout_processes: int = 0            # client processes sharing the connections; 0: automatic
    ssh_transport: str = "auto"          # libssh2 where it can (a quarter of paramiko's CPU), or paramiko
    connect_timeout: float = 20.0
    command_timeout: float | None = None
    keep_alive: str = "5m"               # how long a pod's connections stay open after a command (tpufab.ssh.keeper); 0: not kept
    ssh_config: str = "auto"             # create/delete keep a pod's entries in ~/.ssh/config once `tpufab config-ssh` wrote them; off: never
    # OS Login (tpufab.cloud.oslogin): auto = as the node's (else the project's) enable-oslogin says
    os_login: str = "auto"               # or true / false (--no-os-login)
    os_login_account: str | None = None  # your Google account's email; default: from credentials
    os_login_ttl: float = 86400.0        # seconds tpufab's key stays registered (renewed early)
    os_login_endpoint: str | None = None  # default: beside api_endpoint when set, else Google's
    compute_endpoint: str | None = None   # project metadata; the same default rule
    # jobs
    env: list[str] = field(default_factory=list)
    secrets: list[str] = field(default_factory=lambda: list(DEFAULT_SECRETS))
    remote_dir: str | None = None
    image: str | None = None             # every run's container image (docs/images.md)
    registry_login: str | None = None    # "USER_VAR:PASSWORD_VAR": environment variables (here) holding another registry's credentials
    state_dir: str = "~/.tpufab"
    keep_runs: int = 20                  # local log copies (./.tpufab/runs/<id>/) kept ...
    keep_logs_gib: float = 5.0           # ... and their total size at most (newest first)
    # the Python environment `tpufab setup` builds once and puts on every host (docs/environment.md):
    # requirements: FILE or lock: uv.lock; python: "3.12" (optional); path: ~/.venv (default)
    environment: dict[str, str] = field(default_factory=dict)
    # data
    storage_endpoint: str | None = None  # a GCS-compatible JSON API, e.g. the simulated pod's
    mount_driver: str = "gcsfuse"        # or rclone
    # autostop (the watchdog on the workers)
    autostop_port: int = 8479            # where each worker's watchdog answers its peers
    autostop_check: float = 30.0         # seconds between the leader's checks
    # the supervisor (docs/supervisor.md): jobs kept going off the laptop, their state in a bucket
    supervisor_bucket: str | None = None       # default: <project>-tpufab
    supervisor_name: str = "tpufab-supervisor"  # its Compute Engine VM
    supervisor_machine_type: str = "e2-small"
    supervisor_idle: str = "1h"                # it deletes itself after this long with no live job
    supervisor_vm: bool = True                 # false: no VM made; the service runs where you start it

    def source_of(self, key: str) -> str:
        """Where ``key``'s value came from: "command line", "environment", a file ..."""
        return getattr(self, "sources", {}).get(key, "default")

    def bounded(self, timeout: float | None) -> Settings:
        """These settings for one call that ``timeout`` seconds bound (None: as they are):
        every command on the workers at most that long, connecting at most that or
        connect_timeout, whichever is shorter. A copy: these stay as they are."""
        if timeout is None:
            return self
        out = dataclasses.replace(self)
        out.sources = getattr(self, "sources", {})
        out.connect_timeout = min(self.connect_timeout, timeout)
        out.command_timeout = timeout
        return out

    @property
    def ssh_key_path(self) -> Path:
        return Path(self.ssh_key).expanduser()

    @property
    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts).expanduser()

    @property
    def keep_alive_seconds(self) -> float:
        """``keep_alive`` in seconds; 0 when connections are not kept (tpufab.ssh.keeper)."""
        return keep_alive_seconds(self.keep_alive, "keep_alive")

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser()

    def require(self, key: str, flag: str | None = None) -> Any:
        """The value of ``key``, or a ConfigError saying every way to set it."""
        value = getattr(self, key)
        if value in (None, ""):
            flag = flag or "--" + key.replace("_", "-")
            raise ConfigError(
                f"No {key.replace('_', ' ')} given: pass {flag}, set {ENV_PREFIX}{key.upper()}, "
                f"or put `{key}: ...` in tpufab.yaml.")
        return value


@dataclass(frozen=True)
class Timeout:
    """One row of the timeout table: the default in seconds (None: no limit) and what it
    bounds. ``commands``: it bounds commands on the workers, so the ``command_timeout``
    setting stands in for it when no timeout is given, and a verb's --timeout also bounds
    connecting (the call's connect_timeout, if shorter) and every command of the call."""

    seconds: float | None
    bounds: str
    commands: bool = True
    plus: str = ""          # a parameter added to the default (kill: the grace period)

    @property
    def text(self) -> str:
        """The default as docs/reliability.md's table says it: "600 s", "none", "grace + 34 s"."""
        if self.seconds is None:
            return "none"
        return f"{self.plus} + {self.seconds:g} s" if self.plus else f"{self.seconds:g} s"


# Every timeout default of tpufab in one table (as invoke's Config.global_defaults holds
# timeouts.command), read by one resolver, ``timeout_for``: the verbs' --timeout, the Pod
# methods' ``timeout=`` and the steps' own bounds. docs/reliability.md's table is generated
# from it (tests/test_config.py checks).
TIMEOUTS: dict[str, Timeout] = {
    "exec": Timeout(None, "the command on each worker"),
    "setup": Timeout(None, "shipping and running the script (installs take long)"),
    "env build": Timeout(None, "each step: building the environment, copying it to the "
                               "hosts, unpacking it"),
    "env status": Timeout(60.0, "every worker's answer"),
    "deploy": Timeout(600.0, "each step: lease, push/bundle, checkout, verification"),
    "mount": Timeout(300.0, "each step, installing the driver included"),
    "umount": Timeout(300.0, "each step"),
    "run": Timeout(600.0, "deploy and start; following the logs afterwards has no limit"),
    "run --wait-port": Timeout(600.0, "waiting for the port (`--wait-timeout`) before the "
                                      "logs are shown", commands=False),
    "run --stall-progress-file": Timeout(30.0, "each look at the progress file's mtime",
                                         commands=False),
    "run --stall: last output": Timeout(30.0, "asking the workers when they last wrote, "
                                              "before a silence counts as a stall",
                                        commands=False),
    "run --stall: TPU activity": Timeout(30.0, "each look at every worker's TPU metrics (a "
                                                "pod at work on its TPUs is never stalled)",
                                         commands=False),
    "logs": Timeout(300.0, "fetching the logs so far"),
    "logs --follow": Timeout(None, "following; with --timeout S, following stops after S "
                                   "(exit 124, the run untouched)", commands=False),
    "runs": Timeout(60.0, "every worker's answer"),
    "stragglers": Timeout(300.0, "fetching every worker's log"),
    "status": Timeout(60.0, "every worker's answer"),
    "kill": Timeout(34.0, "TERM, the grace, KILL and the lockfile's settle time",
                    plus="grace"),
    "babysit": Timeout(600.0, "each step (setup, deploy, start, a check); never following "
                              "the recipe"),
    "babysit --before-maintenance": Timeout(60.0, "sending the signal to the recipe"),
    "put": Timeout(300.0, "each step, and each read or write of the copy (no progress for "
                          "that long)"),
    "get": Timeout(300.0, "each step, and each read or write of the copy (no progress for "
                          "that long)"),
    "forward": Timeout(20.0, "the worker's answer when connecting",
                       commands=False),
    "check": Timeout(120.0, "the collective across every host; connecting too",
                     commands=False),
    "top": Timeout(30.0, "every worker's answer, each frame"),
    "stacks": Timeout(60.0, "each worker's py-spy dump"),
    "image pull": Timeout(1800.0, "each host's pull, its retries with backoff included"),
    "stacks: install py-spy": Timeout(180.0, "a `pip install py-spy` where it is missing",
                                      commands=False),
    "autostop": Timeout(60.0, "every worker's answer to arming or cancelling"),
    "ray up": Timeout(300.0, "each step on the workers (`ray start` installs Ray if "
                             "missing)"),
    "ray up: joined": Timeout(120.0, "the joined hosts showing up alive in the head's view",
                              commands=False),
    "ray status": Timeout(60.0, "every host's answer"),
    "ray submit": Timeout(300.0, "each step before the job runs (deploy, submit); following "
                                 "its logs has no limit"),
    "ray down": Timeout(300.0, "each host's `ray stop`"),
    "supervisor up": Timeout(600.0, "making the supervisor VM (or resetting it for an "
                                    "upgrade) and its startup script's install",
                             commands=False),
    "supervisor down": Timeout(600.0, "deleting the supervisor VM", commands=False),
    "jobs secrets": Timeout(60.0, "handing a job's secrets to the supervisor VM over SSH",
                            commands=False),
    # a verb on the workers that has no row of its own yet (docs/architecture.md, "Add a verb")
    "worker verb": Timeout(300.0, "each step on the workers"),
}
GENERIC = "worker verb"


def timeout_for(name: str, given: float | None = None, setting: float | None = None, *,
                plus: float = 0.0) -> float:
    """The one resolver of the timeout table (invoke's ``_unify_kwargs_with_config``): the
    timeout ``given`` (a flag or keyword; None: not given), else the ``command_timeout``
    ``setting`` where TIMEOUTS[name] bounds commands, else the table's default (``plus``
    added: kill's grace period). ``math.inf``: no limit."""
    entry = TIMEOUTS[name]
    if given is not None:
        return float(given)
    if setting is not None and entry.commands:
        return float(setting)
    return math.inf if entry.seconds is None else entry.seconds + plus


def timeouts_table() -> list[str]:
    """TIMEOUTS as docs/reliability.md's Markdown table (tests/test_config.py compares)."""
    rows = ["| timeout | default | what it bounds | `command_timeout` stands in |",
            "|---|---|---|:-:|"]
    for name, entry in TIMEOUTS.items():
        rows.append(f"| `{name}` | {entry.text} | {entry.bounds} | "
                    f"{'yes' if entry.commands else '-'} |")
    return rows


DEFAULT_REMOTE_USER = "tpufab"
KEEP_ALIVE_OFF = ("0", "0s", "off", "no", "false", "")


# Names a forwarded variable may not take: tpufab sets them per worker.
RESERVED = ("TPUFAB_RUN_ID", "TPUFAB_RUN_DIR", "TPUFAB_WORKER_ID", "TPU_WORKER_ID",
            "TPU_WORKER_HOSTNAMES", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY",
            "TPUFAB_NUM_WORKERS", "TPUFAB_WORKER_IPS", "TPUFAB_COORDINATOR",
            "TPUFAB_SLICE_ID", "TPUFAB_NUM_SLICES", "TPUFAB_TASK", "TPUFAB_PROFILER_PORT",
            "MASTER_ADDR", "WORLD_SIZE", "RANK", "NODE_RANK", "LOCAL_RANK")


def keep_alive_seconds(value: object, source: str) -> float:
    """A keep_alive value (``5m``, ``90s``, ``0``) in seconds; a ConfigError naming ``source``."""
    from tpufab.durations import parse_duration

    if str(value).strip().lower() in KEEP_ALIVE_OFF:
        return 0.0
    return parse_duration(str(value), source) or 0.0


def _local_user() -> str:
    """The worker login: the local user name, as gcloud uses it; where that is root (CI,
    containers) an ordinary user instead, because TPU VMs are entered as an ordinary user with
    passwordless sudo (``ssh_user: root`` still works where root login is allowed)."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (containers): fall back to a safe name
        return DEFAULT_REMOTE_USER
    return DEFAULT_REMOTE_USER if user == "root" else user


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
# TPUFAB_* variables that are not settings: tpufab's own switches, the simulated pod's and the
# setup scripts'; the job contract every recipe sees is RESERVED (above; a recipe may call tpufab).
OTHER_ENV = frozenset({
    "USER_CONFIG", "DEBUG", "GIT_TOKEN", "GIT_USERNAME", "PYTHON", "PIP_PYTHON", "VENV",
    "FRAMEWORK", "JAX_VERSION", "TORCH_VERSION", "INIT_TIMEOUT", "BABYSIT_RUN",
    "RESTART_COUNT", "TEST_SIM_CACHE", "PREBUILT_SITE", "RESIDENT", "SUPERVISED_JOB"})
OTHER_ENV_PREFIXES = ("SIM_",)
_WARNED: set[str] = set()
ALIASES = {"accelerator_type": "type", "version": "runtime_version", "runtime": "runtime_version",
           "endpoint": "api_endpoint", "user": "ssh_user"}


def _kind(name: str) -> str:
    t = str(FIELDS[name].type)
    for kind in ("bool", "int", "float", "dict", "list"):
        if t.startswith(kind) or t == f"{kind} | None":
            return kind
    return "str"


def _given(value: Any) -> str:
    """A value of the wrong type, in a few words (a file's mapping is not repeated whole)."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return repr(value)


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


# Text settings whose words include true/false (YAML reads `off`, `no`, `true` as bools)
TAKES_BOOL_WORDS = frozenset({"os_login", "keep_alive"})


def _coerce(name: str, value: Any, source: str) -> Any:
    """Turn a file or env value into the field's type, with a clear sentence on failure: a
    value of another type (a mapping for a zone, a number for a list, a fraction for a whole
    number, a bool for a number, inf or nan) is refused, never ``str()``-ed."""
    import math

    kind = _kind(name)
    if value is None:
        return None
    try:
        if kind == "str" and isinstance(value, bool) and name in TAKES_BOOL_WORDS:
            return str(value).lower()        # YAML's `os_login: true`, `keep_alive: off`
        if kind != "bool" and isinstance(value, bool):
            raise ValueError
        if kind in ("str", "int", "float") and not _scalar(value):
            raise ValueError
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind == "float":
            number = float(value)
            if not math.isfinite(number):
                raise ValueError
            return number
        if kind == "dict":
            if isinstance(value, Mapping):
                if not all(_scalar(k) and (_scalar(v) or v is None) for k, v in value.items()):
                    raise ValueError
                return {str(k): "" if v is None else str(v) for k, v in value.items()}
            if not _scalar(value):
                raise ValueError
            pairs = [p for p in str(value).split(",") if p.strip()]
            out = {}
            for pair in pairs:
                k, sep, v = pair.partition("=")
                if not sep or not k.strip():
                    raise ValueError
                out[k.strip()] = v.strip()
            return out
        if kind == "list":
            if isinstance(value, list | tuple):
                if not all(_scalar(v) for v in value):
                    raise ValueError
                return [str(v) for v in value]
            if not isinstance(value, str):
                raise ValueError
            return [p.strip() for p in str(value).split(",") if p.strip()]
        return str(value)
    except (TypeError, ValueError, OverflowError):
        example = {"bool": "true or false", "int": "a whole number",
                   "float": "a finite number", "dict": "key=value,key2=value2 (or a mapping)",
                   "list": "a,b,c (or a list)"}.get(kind, "text")
        raise ConfigError(f"{source}: {name} must be {example}, not {_given(value)}.") from None


def _canonical_key(key: str, source: str) -> str:
    norm = key.strip().lower().replace("-", "_")
    norm = ALIASES.get(norm, norm)
    if norm not in FIELDS:
        close = difflib.get_close_matches(norm, list(FIELDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{source}: unknown setting {key!r}.{hint}")
    return norm


def _read_yaml(path: Path) -> dict:
    import yaml  # lazily: only when a file exists

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (YAML in UTF-8 is expected); fix or "
                          "remove it.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML ({err.__class__.__name__}); fix or remove it.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings (key: value).")
    return data


def user_config_path(env: Mapping[str, str]) -> Path:
    explicit = env.get(ENV_PREFIX + "USER_CONFIG")
    return Path(explicit).expanduser() if explicit else Path("~/.config/tpufab/config.yaml").expanduser()


def project_config(cwd: Path) -> tuple[Path, dict] | None:
    """The nearest project file: tpufab.yaml, else invoke.yaml's `tpufab:` section."""
    for folder in (cwd, *cwd.parents):
        for name in ("tpufab.yaml", "tpufab.yml"):
            if (folder / name).is_file():
                return folder / name, _read_yaml(folder / name)
        for name in ("invoke.yaml", "invoke.yml"):
            if (folder / name).is_file():
                section = _read_yaml(folder / name).get("tpufab")
                if section is not None:
                    if not isinstance(section, dict):
                        raise ConfigError(f"{folder / name}: the tpufab: section must be a mapping.")
                    return folder / name, section
    return None


_INVOKE_LAYER: ContextVar[dict | None] = ContextVar("tpufab_invoke_layer", default=None)


@contextmanager
def invoke_layer(section: dict | None) -> Iterator[None]:
    """While a verb runs as an invoke task: the `tpufab:` section of invoke's merged config."""
    token = _INVOKE_LAYER.set(section)
    try:
        yield
    finally:
        _INVOKE_LAYER.reset(token)


def layers(overrides: Mapping[str, Any] | None = None, *, cwd: Path | None = None,
           env: Mapping[str, str] | None = None) -> list[tuple[str, dict]]:
    """The settings sources in merge order, each as (description, {key: value})."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    found: list[tuple[str, dict]] = []
    user = user_config_path(env)
    if user.is_file():
        found.append((str(user), _read_yaml(user)))
    from tpufab import current

    pod = current.read(cwd)
    if pod is not None:
        found.append((f"current pod ({pod.path})", pod.layer()))
    project = project_config(cwd)
    if project:
        found.append((str(project[0]), project[1]))
    section = _INVOKE_LAYER.get()
    if section:
        found.append(("invoke config (tpufab: section)", section))
    env_layer = {}
    for key, value in env.items():
        if key.startswith(ENV_PREFIX) and key != ENV_PREFIX + "USER_CONFIG":
            short = key[len(ENV_PREFIX):].lower()
            if ALIASES.get(short, short) in FIELDS:
                env_layer[short] = value
            else:
                _unknown_env(key)
    found.append(("environment", env_layer))
    found.append(("command line", {k: v for k, v in (overrides or {}).items() if v is not None}))
    return found


def _unknown_env(key: str) -> None:
    """A TPUFAB_* variable that is no setting: refused when it looks like a misspelt one (a
    zone silently left at its default creates a pod in the wrong place), else warned once."""

    short = key[len(ENV_PREFIX):]
    if short in OTHER_ENV or short.startswith(OTHER_ENV_PREFIXES) or key in RESERVED:
        return
    close = difflib.get_close_matches(short.lower(), list(FIELDS) + list(ALIASES), n=1,
                                      cutoff=0.75)
    if close:
        raise ConfigError(f"{key} is not a tpufab setting; did you mean "
                          f"{ENV_PREFIX}{ALIASES.get(close[0], close[0]).upper()}? Rename "
                          "or unset it.")
    if key not in _WARNED:
        _WARNED.add(key)
        import sys

        print(f"tpufab: ignoring {key}: not a tpufab setting (README.md, Configuration, "
              "lists them).", file=sys.stderr)


# Bounds of numeric settings: (smallest allowed, whether the smallest is excluded, what it is).
LIMITS = {
    "concurrency": (1, False, "SSH connections at once"),
    "fanout_processes": (0, False, "client processes for the SSH connections, 0 for automatic"),
    "connect_timeout": (0, True, "seconds to wait for a worker to answer"),
    "command_timeout": (0, True, "seconds a command may run"),
    "api_timeout": (0, True, "seconds per TPU API call"),
    "api_retries": (1, False, "attempts per TPU API call"),
    "api_retry_seconds": (0, False, "seconds of TPU API retries"),
    "wait_timeout": (0, True, "seconds to wait for a node"),
    "mig_short_wait": (0, False, "seconds to wait for the VMs a MIG could not create"),
    "os_login_ttl": (0, True, "seconds tpufab's key stays registered with OS Login"),
    "keep_runs": (0, False, "local run log copies kept"),
    "keep_logs_gib": (0, False, "GiB of local run log copies kept"),
}   # (autostop_port and autostop_check: tpufab.steps.host.autostop.check_settings)
# ... and the largest (a port is a port; no wait needs a year).
UPPER = {"concurrency": 100_000, "connect_timeout": 86400 * 7,
         "command_timeout": 86400 * 366, "api_timeout": 86400, "wait_timeout": 86400 * 31,
         "api_retry_seconds": 86400 * 7, "mig_short_wait": 86400 * 31,
         "os_login_ttl": 86400 * 366}
# Google Cloud labels: keys start with a lower-case letter; keys and values hold lower-case
# letters, digits, _ and -, at most 63 characters (values may be empty).
_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


_ZONE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def check_zone(zone: str, where: str) -> str:
    """A zone's name (lower-case letters, digits and -: us-central2-b), or one sentence naming
    ``where`` it came from (shell text or a typo never reaches the API)."""
    if not _ZONE.match(zone or ""):
        raise ConfigError(f"{where}: {zone!r} is not a zone name (such as us-central2-b: "
                          "lower-case letters, digits and -).")
    return zone


def parse_zones(text: str | Sequence[str] | None, flag: str = "--zones") -> list[str]:
    """``--zones us-east5-a,us-east5-b`` -> the zones in order, each checked; a value that
    names none (``,``) is refused rather than read as "no --zones"."""
    if text is None:
        return []
    items = text.split(",") if isinstance(text, str) else [str(z) for z in text]
    zones = [z.strip() for z in items if z.strip()]
    if not zones and (text if isinstance(text, str) else list(text)):
        raise ConfigError(f"{flag} names no zone ({text!r}); give the zones to try in order, "
                          "such as us-east5-a,us-east5-b.")
    for zone in zones:
        check_zone(zone, flag)
    return zones


def check_labels(labels: Mapping[str, str], where: str) -> None:
    """Labels Google Cloud takes, or one sentence naming ``where`` they came from."""
    for key, value in labels.items():
        if not _LABEL_KEY.match(key):
            raise ConfigError(f"{where}: label key {key!r} is not one Google Cloud takes (a "
                              "lower-case letter, then lower-case letters, digits, _ or -; at "
                              "most 63).")
        if not _LABEL_VALUE.match(value):
            raise ConfigError(f"{where}: the value of label {key}, {value!r}, is not one "
                              "Google Cloud takes (lower-case letters, digits, _ or -; at most "
                              "63; no = or ,).")
# Settings that take one of a few words; booleans are accepted for the true/false ones.
CHOICES = {"os_login": ("auto", "true", "false"),
           "ssh_transport": ("auto", "libssh2", "paramiko"),
           "ssh_config": ("auto", "off")}
URL_SETTINGS = {"api_endpoint": "http://127.0.0.1:8475 (the simulated pod) or "
                                "https://tpu.googleapis.com",
                "storage_endpoint": "http://127.0.0.1:PORT (the simulated pod's) or "
                                    "https://storage.googleapis.com",
                "os_login_endpoint": "https://oslogin.googleapis.com",
                "compute_endpoint": "https://compute.googleapis.com/compute/v1"}


ENVIRONMENT_KEYS = ("requirements", "lock", "python", "path", "bucket")
DEFAULT_ENVIRONMENT_PATH = "~/.venv"
# 3.8 to 3.19 (YAML reads an unquoted 3.10 as 3.1, refused here), or an interpreter's path
_PYTHON_REQUEST = re.compile(r"^(?:3\.(?:[89]|1\d)(?:\.\d{1,3})?|/[A-Za-z0-9_./+-]+)$")
_ENV_PATH = re.compile(r"^(?:~|/)[A-Za-z0-9_./+@-]*$")
_ENV_BUCKET = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](?:/[A-Za-z0-9_.+@=-]+)*/?$")


def check_environment(environment: Mapping[str, str], where: str) -> None:
    """The ``environment:`` setting (requirements: FILE or lock: uv.lock; python: a version or
    an interpreter's path; path: where it lives, ~/.venv by default; bucket: gs://B/PREFIX the
    build's archive goes through, else host to host), or one sentence naming
    ``where`` it came from and the fix. An empty mapping: no environment."""
    if not environment:
        return
    for key in environment:
        if key not in ENVIRONMENT_KEYS:
            close = difflib.get_close_matches(key, ENVIRONMENT_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: environment has no key {key!r}{hint}; it takes "
                              "requirements (or lock), python, path and bucket.")
    given = [k for k in ("requirements", "lock") if environment.get(k)]
    if len(given) != 1:
        raise ConfigError(f"{where}: environment needs exactly one of requirements: FILE "
                          "(such as requirements.txt) or lock: uv.lock, not "
                          f"{' and '.join(given) or 'neither'}.")
    spec = environment[given[0]]
    if given == ["lock"] and Path(spec).name != "uv.lock":
        raise ConfigError(f"{where}: environment's lock must be a uv.lock (with its "
                          f"pyproject.toml beside it), not {spec!r}.")
    python = environment.get("python")
    if python and not _PYTHON_REQUEST.match(python):
        raise ConfigError(f"{where}: environment's python must be a version such as \"3.12\" "
                          f"(quoted in YAML) or an interpreter's absolute path, not {python!r}.")
    path = environment.get("path", DEFAULT_ENVIRONMENT_PATH)
    if not _ENV_PATH.match(path) or path.rstrip("/") in ("", "~") or \
            ".." in path.split("/") or (path.startswith("~") and not path.startswith("~/")):
        raise ConfigError(f"{where}: environment's path must be a folder of its own under ~/ "
                          f"or an absolute path (such as ~/.venv), not {path!r}.")
    bucket = environment.get("bucket")
    if bucket and (not _ENV_BUCKET.match(bucket) or ".." in bucket.split("/")):
        raise ConfigError(f"{where}: environment's bucket must be gs://BUCKET or "
                          f"gs://BUCKET/PREFIX (where the build's archive goes), not {bucket!r}.")


def check_limits(settings: Settings, origin: Mapping[str, str]) -> None:
    """Out-of-range numbers and endpoints that are no URL: one sentence naming where they
    came from (``origin``: setting -> TPUFAB_X, a file, or --flag)."""
    from urllib.parse import urlsplit

    for name, words in CHOICES.items():
        value = str(getattr(settings, name)).strip().lower()
        value = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false",
                 "off": "false"}.get(value, value)
        if "off" in words:  # a choice spelt off (YAML reads a bare off as false)
            value = {"false": "off"}.get(value, value)
        if value not in words:
            raise ConfigError(f"{origin.get(name, name)}: {name} must be one of "
                              f"{', '.join(words)}, not {getattr(settings, name)!r}.")
        setattr(settings, name, value)
    for name, (low, exclusive, what) in LIMITS.items():
        value = getattr(settings, name)
        if value is None or (value > low if exclusive else value >= low):
            continue
        bound = f"more than {low:g}" if exclusive else f"at least {low:g}"
        raise ConfigError(f"{origin.get(name, name)}: {name} ({what}) must be {bound}, "
                          f"not {value:g}.")
    for name, high in UPPER.items():
        value = getattr(settings, name)
        if value is not None and value > high:
            raise ConfigError(f"{origin.get(name, name)}: {name} must be at most {high:g}, "
                              f"not {value:g}.")
    check_labels(settings.labels, origin.get("labels", "labels"))
    check_environment(settings.environment, origin.get("environment", "environment"))
    check_zone(settings.zone, origin.get("zone", "zone"))
    keep_alive_seconds(settings.keep_alive, origin.get("keep_alive", "keep_alive"))
    for name, example in URL_SETTINGS.items():
        value = getattr(settings, name)
        if value is None:
            continue
        try:
            parts = urlsplit(value)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname)
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            valid = False
        if not valid:
            raise ConfigError(f"{origin.get(name, name)}: {name} must be a URL such as "
                              f"{example}, not {value!r}.")


def load_settings(overrides: Mapping[str, Any] | None = None, *, cwd: Path | None = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Merge every layer into one Settings (later layers win, key by key)."""
    settings = Settings()
    sources: dict[str, str] = {}
    origin: dict[str, str] = {}
    for source, values in layers(overrides, cwd=cwd, env=env):
        for key, value in values.items():
            name = _canonical_key(key, source)
            setattr(settings, name, _coerce(name, value, source))
            sources[name] = source
            origin[name] = {"environment": f"{ENV_PREFIX}{key.upper()}",
                            "command line": f"--{key.replace('_', '-')}"}.get(
                                source, f"{source} ({key})")
    settings.sources = sources
    check_limits(settings, origin)
    if settings.jump:
        parse_jump(settings.jump, origin.get("jump", "jump"))
    if settings.type:
        from tpufab.topology import parse_accelerator_type

        settings.type = parse_accelerator_type(settings.type).name
    return settings


# -- the jump setting: a bastion (SSH jump host) as users name it, [user@]host[:port], parsed
# into a plain, picklable description (the connections through it are tpufab.ssh.jump's) ------
_JUMP_RE = re.compile(r"^(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})@)?"
                      r"(?P<host>[A-Za-z0-9_.][A-Za-z0-9_.-]*|\[[0-9A-Fa-f:.]+\])(?::(?P<port>\d{1,5}))?$")

@dataclass(frozen=True)
class Jump:
    """Where the bastion is and how to log in (no live objects: picklable). ``user`` is ""
    until :meth:`for_user` fills it in: ``--jump HOST`` logs in as the user tpufab logs into
    the workers as."""

    user: str
    host: str
    port: int = 22
    key_filename: str | None = None

    def for_user(self, login_user: str) -> Jump:
        """This jump with ``login_user`` where it names no user of its own."""
        return self if self.user else replace(self, user=login_user)

    @property
    def key_alias(self) -> str:
        """Its name in known_hosts, as OpenSSH writes it."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def __str__(self) -> str:
        return (f"{self.user}@" if self.user else "") + self.host + (
            "" if self.port == 22 else f":{self.port}")


def parse_jump(text: str, source: str = "jump", *, key_filename: str | None = None) -> Jump:
    """``[user@]host[:port]`` -> Jump (user "" when not given), or a ConfigError naming
    ``source`` and the fix."""
    m = _JUMP_RE.match(str(text).strip())
    port = int(m.group("port")) if m and m.group("port") else 22
    if not m or not 0 < port < 65536:
        raise ConfigError(f"{source}: jump must be the bastion as host, user@host or "
                          "user@host:port (for example bastion.example.com, or "
                          f"alice@bastion.example.com:2222), not {text!r}.")
    return Jump(user=m.group("user") or "", host=m.group("host").strip("[]"), port=port,
                key_filename=key_filename)
