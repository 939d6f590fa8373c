"""The environment built once (`tpufab setup`, `tpufab env build|status`; docs/environment.md).

``environment:`` in tpufab.yaml names a requirements file (or a uv.lock), optionally a Python,
and a path (``~/.venv``). Its hash (:func:`environment_hash`: the spec files' bytes, the
Python, the architecture, the path) decides whether anything happens: hosts whose marker
holds it are skipped. Otherwise one host (worker 0 of the selection) builds it with uv,
resolving once (``uv pip compile``, then ``uv pip sync`` of that resolution; or the lock),
packs it, and every other host gets *that* archive: through the environment's bucket where
one is set (``bucket: gs://B/PREFIX``: the build host uploads, every other host downloads at
once with its VM's own token), else host to host inside the pod (put's relay:
``tpufab.ssh.transfer``); each unpacks it at the same path and checks the tree's hash against
the build's. A host that fails is retried once, then named. Only the build host talks to
the package index; the laptop sends the spec files (and uv, where worker 0 has none and
this machine's uv runs there). A requirements file ships with the files it includes (``-r``,
``-c``), each by its path in the project and part of the hash. ``put_environment`` is what
`tpufab setup`, `env build`, launch and babysit's recovery call; ``environment_status`` is
what `env status` and `check` read. The worker side is ``remote/env_worker.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tpufab import nodeset
from tpufab.config import DEFAULT_ENVIRONMENT_PATH
from tpufab.errors import ConfigError, TpufabError
from tpufab.reports import Column, Report, last_line
from tpufab.ssh.remote_files import RemoteFile, python_command, read_answer, run_with_files
from tpufab.steps.runs.env import virtual_env as virtual_env

FORMAT = 1                       # of the archive and the hash: a new format builds again
ARCHIVES = ".tpufab/env"         # where archives land, relative to the home directory
SHIPPED_UV = ".cache/tpufab/uv/uv"


@dataclass(frozen=True)
class EnvSpec:
    """What the environment is made of, read here: ``kind`` requirements or lock, the spec
    files' bytes by name (``spec`` is the main one), the Python asked for, the path."""

    kind: str
    spec: str
    files: Mapping[str, bytes]
    python: str | None = None
    path: str = DEFAULT_ENVIRONMENT_PATH
    bucket: str | None = None     # gs://B/PREFIX the archive goes through (not in the hash)

    def to_record(self) -> dict:
        """As JSON holds it (the files are UTF-8 text: env_spec read them so): a supervised
        job carries the environment as the laptop read it at the hand-over."""
        return {"kind": self.kind, "spec": self.spec,
                "files": {name: data.decode("utf-8") for name, data in self.files.items()},
                "python": self.python, "path": self.path, "bucket": self.bucket}

    @classmethod
    def from_record(cls, data: Mapping) -> EnvSpec:
        return cls(data["kind"], data["spec"],
                   {name: text.encode("utf-8") for name, text in data["files"].items()},
                   data.get("python"), data.get("path") or DEFAULT_ENVIRONMENT_PATH,
                   data.get("bucket"))

    def setting(self) -> dict:
        """The ``environment`` setting that names this environment (its path, for the runs'
        VIRTUAL_ENV: tpufab.steps.runs.env.virtual_env), where no tpufab.yaml says it."""
        return {self.kind: self.spec, "python": self.python, "path": self.path,
                "bucket": self.bucket}


def env_spec(settings, cwd: Path | None = None) -> EnvSpec | None:
    """The configured environment's spec, its files read (relative to the tpufab.yaml that
    named them, else here; a requirements file with the files it includes, ``-r``/``-c``,
    each named by its path in the project); None when there is none; one sentence for a
    file not there or an include outside the project."""
    environment = settings.environment or {}
    kind = "requirements" if environment.get("requirements") else \
        "lock" if environment.get("lock") else None
    if kind is None:
        return None
    source = settings.source_of("environment")
    base = Path(source).parent if source and Path(source).is_file() else (cwd or Path.cwd())
    main = Path(environment[kind]).expanduser()
    main = Path(os.path.normpath(main if main.is_absolute() else base / main))
    if kind == "lock":
        files = {path.name: _read_spec(path, kind)
                 for path in (main, main.with_name("pyproject.toml"))}
        name = main.name
    else:
        root = base if _inside(main, base) else main.parent
        files = _requirement_files(main, root)
        name = _relative(main, root)
    return EnvSpec(kind, name, files, environment.get("python") or None,
                   environment.get("path") or DEFAULT_ENVIRONMENT_PATH,
                   environment.get("bucket") or None)


def _read_spec(path: Path, kind: str, *, included: str | None = None) -> bytes:
    """A spec file's bytes (UTF-8 text), or one sentence naming it."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        if included:
            raise ConfigError(f"{included}, which does not exist at {path}; add it or fix "
                              "that line.") from None
        what = "the pyproject.toml beside the lock" if path.name == "pyproject.toml" \
            else f"environment's {kind} file"
        raise ConfigError(f"{what} {path} does not exist; fix `environment: {kind}:` in "
                          "tpufab.yaml or add the file.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (UTF-8); environment's {kind} "
                          "must be one.") from None
    return data


_INCLUDES = (("--requirement", "-r"), ("--constraint", "-c"), ("-r", "-r"), ("-c", "-c"))


def requirement_includes(text: str) -> list[tuple[str, str]]:
    """The files a requirements file includes, as pip and uv read them: ``(flag, path)``
    for each ``-r``/``--requirement`` and ``-c``/``--constraint`` line (pure)."""
    import shlex

    found = []
    for line in text.replace("\\\r\n", "").replace("\\\n", "").splitlines():
        line = line.strip()
        if line.startswith("#") or not line.startswith("-"):
            continue
        line = line.split(" #", 1)[0].split("\t#", 1)[0]
        for option, flag in _INCLUDES:
            if not line.startswith(option):
                continue
            rest = line[len(option):]
            if option.startswith("--"):
                if rest.startswith("="):
                    rest = rest[1:]
                elif not rest[:1].isspace():
                    break               # another option (--requirements-foo): not ours
            try:
                words = shlex.split(rest)
            except ValueError:
                words = rest.split()
            if words:
                found.append((flag, words[0]))
            break
    return found


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _relative(path: Path, root: Path) -> str:
    return Path(os.path.relpath(path, root)).as_posix()


def _requirement_files(main: Path, root: Path) -> dict[str, bytes]:
    """The requirements file and every file it includes, each once, by its path under
    ``root`` (pip's rule: an include is relative to the file that names it)."""
    files: dict[str, bytes] = {}
    todo: list[tuple[Path, str | None]] = [(main, None)]
    while todo:
        path, included = todo.pop(0)
        name = _relative(path, root)
        if name in files:
            continue
        files[name] = data = _read_spec(path, "requirements", included=included)
        for flag, target in requirement_includes(data.decode("utf-8")):
            said = f"The environment's {name} includes {target} ({flag})"
            if "://" in target:
                raise ConfigError(f"{said}, a URL: tpufab ships only the project's files to "
                                  "the build host; download it into the project and include "
                                  "that instead.")
            found = Path(target).expanduser()
            found = Path(os.path.normpath(found if found.is_absolute() else path.parent / found))
            if not _inside(found, root) or _relative(found, root).startswith("../"):
                raise ConfigError(f"{said}, which is outside the project ({root}): tpufab "
                                  "ships only the files under it; copy it into the project "
                                  "and include that instead.")
            todo.append((found, said))
    return files


def environment_hash(spec: EnvSpec, *, arch: str, python: str) -> str:
    """The environment's identity: the spec files' bytes, the Python (the version asked for,
    else the host's own), the architecture, the path and the format (pure)."""
    digest = hashlib.sha256()
    digest.update(json.dumps({
        "format": FORMAT, "kind": spec.kind, "path": spec.path, "arch": arch,
        "python": python,
        "files": {name: hashlib.sha256(data).hexdigest()
                  for name, data in sorted(spec.files.items())}}, sort_keys=True).encode())
    return digest.hexdigest()


# -- the report ------------------------------------------------------------------------------


@dataclass
class EnvRow:
    worker: int
    ok: bool = True
    action: str = ""          # built, copied, skipped, failed
    hash: str = ""
    tries: int = 0
    error: str | None = None
    message: str | None = None


def _short(digest: str | None) -> str:
    return (digest or "")[:12] or "-"


@dataclass(kw_only=True)
class EnvReport(Report):
    """Every host's part in one environment build (``tpufab.reports.Report``)."""

    step: str = "env build"
    hash: str = ""
    path: str = DEFAULT_ENVIRONMENT_PATH
    builder: int | None = None
    source: str | None = None     # the bucket the other hosts downloaded it from (else w0)
    resolved: str | None = field(default=None, metadata={"json": False})
    columns: tuple[Column, ...] = (Column("ENVIRONMENT", lambda r: r.action),
                                   Column("HASH", lambda r: _short(r.hash)))

    def __post_init__(self) -> None:
        by: dict[str, list[int]] = {}
        for row in sorted(self.rows, key=lambda r: r.worker):
            by.setdefault(row.action, []).append(row.worker)
        origin = self.source or nodeset.label(self.builder or 0)
        words = {"built": "built", "copied": f"copied from {origin}",
                 "skipped": "already had it", "failed": "failed"}
        parts = [f"{nodeset.fold(ws)} {words.get(a, a)}" for a, ws in by.items()]
        self.summary = (f"Environment {_short(self.hash)} at {self.path}: "
                        f"{'; '.join(parts)}.")


@dataclass
class EnvStatusRow:
    worker: int
    ok: bool = True
    hash: str = ""
    python: str = ""
    error: str | None = None
    message: str | None = None


@dataclass(kw_only=True)
class EnvStatusReport(Report):
    """Which hosts have which environment (``tpufab env status``), folded by hash."""

    step: str = "env status"
    path: str = DEFAULT_ENVIRONMENT_PATH
    expected: str = ""        # the hash the configured spec has on these hosts ("" unknown)
    columns: tuple[Column, ...] = (Column("HASH", lambda r: _short(r.hash) if r.hash
                                          else "none"),
                                   Column("PYTHON", lambda r: r.python or "-"))

    def __post_init__(self) -> None:
        hashes = {r.hash for r in self.rows if r.ok}
        have = [r.worker for r in self.rows if r.ok and r.hash and r.hash == self.expected]
        if self.expected and len(have) == len(self.rows):
            self.summary = f"Every host has the environment {_short(self.expected)} at {self.path}."
        elif self.expected:
            lacking = [r.worker for r in self.rows if r.worker not in have]
            verb = "lacks" if len(lacking) == 1 else "lack"
            self.summary = (f"{nodeset.fold(lacking)} {verb} the environment "
                            f"{_short(self.expected)} at {self.path}: run `tpufab env build`.")
        else:
            self.summary = f"{len(hashes - {''})} environment(s) at {self.path} across the hosts."


class EnvError(TpufabError):
    """The environment could not be built or put on some hosts; ``report`` has every row."""

    def __init__(self, message: str, report: EnvReport | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.report = report


# -- the worker side calls -------------------------------------------------------------------


def _call(fanout, op: str, requests: Mapping[int, dict], *,
          timeout: float | None = None) -> dict[int, dict]:
    """``env_worker.py OP`` with a JSON request per worker; {worker: answer or error}."""
    script = RemoteFile.bundled("env_worker.py")
    line = python_command(script, [op])
    by_body: dict[str, list[int]] = {}
    for worker, request in requests.items():
        by_body.setdefault(json.dumps(request, sort_keys=True), []).append(worker)
    answers = {}
    for body, workers in by_body.items():
        result = run_with_files(fanout, [script], line, workers, stdin=body.encode(),
                                timeout=timeout)
        try:
            for worker, r in result.items():
                got = read_answer(r.stdout) if r.error is None else None
                answers[worker] = got if isinstance(got, dict) else {
                    "error": r.error or last_line(r.stderr) or f"exit {r.exit_code}",
                    "transport": True}
        finally:
            result.close()
    return answers


def local_uv() -> Path | None:
    """The uv this machine runs (beside this Python, else on PATH)."""
    beside = Path(sys.executable).parent / "uv"
    found = beside if beside.is_file() else (Path(p) if (p := shutil.which("uv")) else None)
    return found


def _ship_uv(fanout, worker: int, facts: dict) -> str:
    """This machine's uv on ``worker`` (it has none): when it runs there (same system and
    architecture), put it at ~/.cache/tpufab/uv/uv; else one sentence."""
    from tpufab.ssh.transfer import put

    mine = local_uv()
    same = (facts.get("system"), facts.get("arch")) == (platform.system(), platform.machine())
    if mine is None or not same:
        raise EnvError(f"{nodeset.label(worker)} has no uv to build the environment with; "
                       "install it there (`tpufab exec --worker 0 'python3 -m pip install "
                       "--user uv'`, or in your image), then run `tpufab setup` again.")
    put(fanout, mine, SHIPPED_UV, workers=[worker]).check()
    return SHIPPED_UV


def _spread(fanout, seed: int, build: dict, workers: Sequence[int],
            peers: Mapping[int, str]) -> dict[int, str | None]:
    """The build host's archive to ``workers`` over the pod's network (put's relay),
    verified by sha256 as it lands; {worker: None or why not}."""
    from tpufab.ssh.transfer import LocalFile, Progress, TransferRow, _PutPlan, _relay

    archive = build["archive"]
    files = [LocalFile("", Path(archive), int(build["size"]), 0o600, build["sha256"])]
    relayed = {w: _PutPlan(w, archive, files, 0) for w in workers}
    rows = {w: TransferRow(w) for w in (seed, *workers)}
    fallback = _relay(fanout, _PutPlan(seed, archive, files, 0), files, relayed, peers[seed],
                      os.urandom(8).hex(), rows, Progress())
    out = {w: rows[w].error for w in workers}
    for w in fallback:
        out[w] = out[w] or f"could not reach {nodeset.label(seed)} at {peers[seed]}"
    return out


# -- the step --------------------------------------------------------------------------------


def _sentence(stage: str, error: str, spec: EnvSpec, builder: int) -> str:
    who = nodeset.label(builder)
    error = error.removeprefix("error: ").rstrip(". ")
    if stage == "resolve" and spec.kind == "lock":
        return (f"The environment's {spec.spec} does not install as locked ({who} asked uv): "
                f"{error}; run `uv lock` here, then `tpufab setup` again.")
    if stage == "resolve":
        return (f"The environment's {spec.spec} does not resolve ({who} asked uv): {error}; "
                f"fix {spec.spec} and run `tpufab setup` again.")
    if stage == "python":
        want = spec.python or "the host's python3"
        return (f"No Python {want} for the environment on {who}, and uv could not install "
                f"one: {error}; name an interpreter the image has (python: \"3.11\") or let "
                "the host reach uv's Python downloads.")
    return f"Building the environment on {who} failed ({stage}): {error}."


def _fetch(fanout, where: dict, workers: Sequence[int],
           timeout: float | None) -> dict[int, str | None]:
    """The archive from the environment's bucket onto ``workers``, all at once, each with
    its VM's own token, verified by sha256; {worker: None or why not}."""
    answers = _call(fanout, "fetch", {w: where for w in workers}, timeout=timeout)
    return {w: answers[w].get("error") for w in workers}


def _through_bucket(fanout, spec: EnvSpec, digest: str, build: dict, builder: int,
                    endpoint: str, timeout: float | None) -> dict:
    """The build host puts its archive in the bucket (``spec.bucket``); what every other
    host fetches it with. One sentence where the VMs cannot write there."""
    bucket, _, prefix = spec.bucket.removeprefix("gs://").partition("/")
    name = "/".join(p for p in (prefix.strip("/"), f"{digest}.tar.gz") if p)
    where = {"endpoint": endpoint.rstrip("/"), "bucket": bucket, "object": name,
             "archive": build["archive"], "sha256": build["sha256"]}
    up = _call(fanout, "upload", {builder: where}, timeout=timeout)[builder]
    if up.get("error"):
        raise EnvError(f"{nodeset.label(builder)} could not put the environment's archive in "
                       f"gs://{bucket}/{name}: {up['error']}; let the VMs' service account "
                       f"write there (roles/storage.objectUser on gs://{bucket}), or remove "
                       "`bucket:` from `environment:` in tpufab.yaml to copy it host to host.")
    return where


def build_environment(fanout, spec: EnvSpec, *, workers: Sequence[int],
                      peers: Mapping[int, str], force: bool = False,
                      timeout: float | None = None,
                      endpoint: str | None = None) -> EnvReport:
    """Build ``spec`` once and put it on every host of ``workers`` that lacks it (above);
    ``endpoint``: Cloud Storage's, where ``spec.bucket`` is set."""
    chosen = list(workers)
    probes = _call(fanout, "probe", {w: {"path": spec.path, "python": spec.python}
                                     for w in chosen}, timeout=timeout)
    unreachable = {w: a["error"] for w, a in probes.items() if a.get("error")}
    builder = min(chosen)
    if builder in unreachable:
        raise EnvError(f"{nodeset.label(builder)}, which builds the environment, did not "
                       f"answer: {unreachable[builder]}.")
    facts = probes[builder]
    if not facts.get("python"):
        raise EnvError(_sentence("python", f"{spec.python} does not run there", spec, builder))
    digest = environment_hash(spec, arch=facts["arch"], python=facts["python"])
    rows = {w: EnvRow(w, ok=False, action="failed", hash="", error="unreachable",
                      message=unreachable[w]) for w in unreachable}
    have = {w for w, a in probes.items() if w not in unreachable
            and (a.get("marker") or {}).get("hash") == digest}
    for w in have if not force else ():
        rows[w] = EnvRow(w, action="skipped", hash=digest)
    todo = [w for w in chosen if w not in rows]
    if not todo:
        return _finished(rows, digest, spec, builder, None, None)
    marker = probes[builder].get("marker") or {}
    build = marker.get("build") if builder in have and not force else None
    if build is None or not probes[builder].get("archive_present", True):
        uv = facts.get("uv") or _ship_uv(fanout, builder, facts)
        request = {"hash": digest, "path": spec.path, "python": spec.python, "kind": spec.kind,
                   "spec": spec.spec, "uv": uv,
                   "files": {n: d.decode("utf-8") for n, d in spec.files.items()}}
        build = _call(fanout, "build", {builder: request}, timeout=timeout)[builder]
        if build.get("error"):
            raise EnvError(_sentence(build.get("stage") or "build", build["error"], spec,
                                     builder))
        installed = _install(fanout, [builder], digest, spec, build, keep=True,
                             timeout=timeout)
        if installed[builder]:
            raise EnvError(f"{nodeset.label(builder)} could not install the environment it "
                           f"built: {installed[builder]}.")
        rows[builder] = EnvRow(builder, action="built", hash=digest, tries=1)
    others = [w for w in todo if w != builder]
    where = None
    if spec.bucket and others:      # through the bucket, every host at once; else host to host
        from tpufab.cloud.storage import GOOGLE_STORAGE

        where = _through_bucket(fanout, spec, digest, build, builder,
                                endpoint or GOOGLE_STORAGE, timeout)
    errors: dict[int, str | None] = {w: "not tried" for w in others}
    for attempt in (1, 2):          # a host that failed is tried once more, then named
        again = [w for w in others if errors[w]]
        if not again:
            break
        pulled = _fetch(fanout, where, again, timeout) if where else \
            _spread(fanout, builder, build, again, peers)
        got = [w for w in again if not pulled[w]]
        errors.update({w: pulled[w] for w in again if pulled[w]})
        errors.update(_install(fanout, got, digest, spec, build, keep=False, timeout=timeout)
                      if got else {})
        for w in again:
            rows[w] = EnvRow(w, ok=not errors[w], action="failed" if errors[w] else "copied",
                             hash="" if errors[w] else digest, tries=attempt,
                             error="install" if errors[w] else None,
                             message=errors[w] and f"{errors[w]} (tried {attempt} times)")
    return _finished(rows, digest, spec, builder, build.get("resolved"),
                     spec.bucket.rstrip("/") if where else None)


def put_environment(hosts, spec: EnvSpec, *, workers: Sequence[int] | None = None,
                    force: bool = False, timeout: float | None = None) -> EnvReport:
    """``spec`` on ``workers`` of ``hosts`` (a ``tpufab.hosts.connect.Hosts``; every host by
    default) as `tpufab setup` puts it there: built once, copied host to host, skipped where
    its hash is. What `Pod.env_build`, babysit's recovery and launch's steps call."""
    from tpufab.config import timeout_for

    return build_environment(hosts.fanout, spec,
                             workers=list(hosts.workers if workers is None else workers),
                             peers=dict(enumerate(hosts.internal_ips())), force=force,
                             timeout=timeout_for("env build", timeout,
                                                 hosts.settings.command_timeout),
                             endpoint=hosts.settings.storage_endpoint)


def _finished(rows: Mapping[int, EnvRow], digest: str, spec: EnvSpec, builder: int,
              resolved: str | None, source: str | None) -> EnvReport:
    """The report; an EnvError naming every host that failed, with why."""
    out = EnvReport(rows=sorted(rows.values(), key=lambda r: r.worker), hash=digest,
                    path=spec.path, builder=builder, source=source, resolved=resolved)
    failed = [r for r in out.rows if not r.ok]
    if failed:
        groups: dict[str, list[int]] = {}
        for r in failed:
            groups.setdefault(r.message or r.error or "", []).append(r.worker)
        what = "; ".join(f"{nodeset.fold(ws)}: {why}" for why, ws in groups.items())
        raise EnvError(f"The environment {_short(digest)} did not reach {len(failed)} of "
                       f"{len(out.rows)} hosts: {what}; run `tpufab env build` again once "
                       "they are fixed.", out)
    return out


def _install(fanout, workers: Sequence[int], digest: str, spec: EnvSpec, build: dict, *,
             keep: bool, timeout: float | None) -> dict[int, str | None]:
    request = {"hash": digest, "path": spec.path, "archive": build["archive"],
               "sha256": build["sha256"], "tree": build["tree"], "python": spec.python,
               "keep": keep, "build": {k: build[k] for k in ("archive", "sha256", "size",
                                                            "tree")}}
    answers = _call(fanout, "install", {w: request for w in workers}, timeout=timeout)
    return {w: answers[w].get("error") for w in workers}


def environment_status(fanout, spec: EnvSpec | None, path: str, *, workers: Sequence[int],
                       timeout: float | None = None) -> EnvStatusReport:
    """Every host's environment at ``path``, folded by hash; ``expected``: the configured
    spec's hash on these hosts (worker 0's architecture and Python)."""
    answers = _call(fanout, "probe", {w: {"path": path, "python": spec.python if spec else
                                          None} for w in workers}, timeout=timeout)
    rows = []
    for w in workers:
        a = answers[w]
        if a.get("error"):
            rows.append(EnvStatusRow(w, ok=False, error="unreachable", message=a["error"]))
            continue
        marker = a.get("marker") or {}
        rows.append(EnvStatusRow(w, hash=marker.get("hash", ""),
                                 python=marker.get("python_version", "") or ""))
    expected = ""
    first = answers.get(min(workers)) if workers else None
    if spec is not None and first and not first.get("error") and first.get("python"):
        expected = environment_hash(spec, arch=first["arch"], python=first["python"])
    return EnvStatusReport(rows=rows, path=path, expected=expected)
