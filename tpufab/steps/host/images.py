"""Images on every host: pull (pre-heat), each host's digest, the one digest a run uses.

The worker side is ``tpufab/remote/image_worker.py`` (run as root, one JSON answer per host).
Here: the command (pure), the pull across the pod (``pull``: hosts in waves of at most
``WAVE`` at once, each waiting a random part of a jitter that grows with the host count
before it asks the registry), the folded report (pure) and the check a run makes
(``agreed``: one digest on every host, or ImageError naming the hosts that differ).

Retry numbers (the worker's): auth and pull are retried together up to ``ATTEMPTS`` (8)
times, ``BACKOFF`` (1 s) before the second try, doubling up to ``CAP`` (16 s), each wait drawn
from its [half, all]: at most ~63 s of waiting on a host before it is named with the
registry's last sentence. Start jitter: ``JITTER_PER_HOST`` (0.02 s) times the host count,
at most ``JITTER_CAP`` (30 s): 0.04 s for 2 hosts, 5 s for 256, 30 s from 1,500.

Room: a host that does not have the image yet is refused before it pulls when its runtime's
storage has less free space than ``ROOM_FACTOR`` (3) times the image's compressed size (read
from the manifest); ``no_room`` folds those hosts into one sentence.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tpufab import nodeset
from tpufab.errors import ConfigError, TpufabError
from tpufab.reports import Column, Report
from tpufab.ssh.remote_files import RemoteFile, python_command, read_answer, run_with_files

SCRIPT = "image_worker.py"
ATTEMPTS = 8
BACKOFF = 1.0
CAP = 16.0
JITTER_PER_HOST = 0.02
JITTER_CAP = 30.0
WAVE = 64
ROOM_FACTOR = 3       # the worker's: free space >= 3 x the image's compressed size
# REGISTRY/PATH[:TAG][@sha256:HEX], as docker names it (lower case path components)
IMAGE_REF = re.compile(r"^(?:[a-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9._/-]+"
                       r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")


class ImageError(TpufabError):
    """An image is missing, could not be pulled, or differs between hosts."""


def check_image(image: str) -> str:
    """``image`` if it is an image reference (ConfigError in one sentence if not)."""
    image = (image or "").strip()
    if image.startswith("docker:"):
        image = image[len("docker:"):]
    if not image or not IMAGE_REF.match(image) or "//" in image:
        raise ConfigError(f"{image!r} is not an image reference: give one such as "
                          "us-docker.pkg.dev/PROJECT/REPO/IMAGE:TAG (or ...@sha256:DIGEST).")
    return image


LOGIN_SPEC = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):([A-Za-z_][A-Za-z0-9_]*)$")


def registry_login(spec: str | None, environ: Mapping[str, str] = os.environ) -> dict | None:
    """The credentials the ``registry_login`` setting names (``USER_VAR:PASSWORD_VAR``: two
    environment variables of this machine), ``{"username", "password"}``; None without the
    setting; ConfigError in one sentence for a malformed setting or a variable not set."""
    if not spec:
        return None
    found = LOGIN_SPEC.match(spec.strip())
    if not found:
        raise ConfigError(f"registry_login {spec!r} does not name two environment variables: "
                          "give USER_VAR:PASSWORD_VAR (e.g. REGISTRY_USER:REGISTRY_TOKEN), "
                          "the names, never the values.")
    unset = [name for name in found.groups() if not environ.get(name)]
    if unset:
        raise ConfigError(f"registry_login names {' and '.join(unset)}, which "
                          f"{'is' if len(unset) == 1 else 'are'} not set here: export "
                          f"{' and '.join(unset)} (the registry's user and password or token) "
                          "before this command.")
    return {"username": environ[found.group(1)], "password": environ[found.group(2)]}


def jitter_for(hosts: int) -> float:
    return 0.0 if hosts <= 1 else min(JITTER_CAP, JITTER_PER_HOST * hosts)


def pull_command(image: str, *, if_missing: bool = False, jitter: float = 0.0,
                 attempts: int = ATTEMPTS, backoff: float = BACKOFF, cap: float = CAP,
                 login: bool = False):
    """The worker's pull; ``login``: credentials come on stdin (never in this line)."""
    args: list = ["pull", "--image", image, "--attempts", attempts, "--backoff", f"{backoff:g}",
                  "--cap", f"{cap:g}", "--jitter", f"{jitter:g}",
                  "--room-factor", f"{ROOM_FACTOR:g}"]
    if if_missing:
        args.append("--if-missing")
    if login:
        args.append("--login-stdin")
    return python_command(RemoteFile.bundled(SCRIPT), args, as_root=True)


@dataclass(frozen=True)
class HostImage:
    """One host's answer."""

    worker: int
    digest: str | None = None
    image_id: str | None = None
    present: bool = False       # it was there already (not pulled)
    checked: bool = False       # ... and the registry said it is still the tag's
    pulled: bool = False
    attempts: int = 0
    retries: tuple[str, ...] = ()
    seconds: float | None = None
    error: str | None = None
    differs: bool = False
    no_room: Mapping | None = None   # refused before the pull: {path, free_bytes, need_bytes, ...}

    @property
    def ok(self) -> bool:
        """It has the image (a digest that differs is the report's problem, shown as such)."""
        return self.error is None and self.digest is not None

    @property
    def how(self) -> str:
        if self.present:
            return "present (re-checked)" if self.checked else "present"
        tries = len(self.retries)
        return "pulled" + (f" after {tries} retr{'y' if tries == 1 else 'ies'}" if tries else "")


def _short(digest: str | None) -> str:
    return f"{digest[:19]}..." if digest else "-"


def _seconds(rows: list[HostImage]) -> str:
    times = sorted(r.seconds for r in rows if r.seconds is not None)
    if not times:
        return "-"
    return f"{times[0]:.1f}s" if times[-1] - times[0] < 0.05 else \
        f"{times[0]:.1f}-{times[-1]:.1f}s"


COLUMNS = (Column("DIGEST", lambda r: _short(r.digest) + (" (differs)" if r.differs else "")),
           Column("HOW", lambda r: r.how), Column("TIME", over=_seconds))


@dataclass
class ImageReport(Report):
    """Every host's digest of ``image``, folded (``w[0-255] sha256:ab12... pulled``)."""

    image: str = ""
    digest: str | None = None            # the one most hosts have
    step: str = field(default="image pull", kw_only=True)
    columns: tuple[Column, ...] = field(default=COLUMNS, kw_only=True)

    def __post_init__(self) -> None:
        self.summary = summary(self) if self.ok else ""
        self.notes = retry_notes(self.rows)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and not self.differing

    @property
    def differing(self) -> list[int]:
        return [r.worker for r in self.rows if r.differs]

    def check(self) -> ImageReport:
        if not self.ok:
            raise ImageError(problem(self))
        return self

    @property
    def pinned(self) -> str:
        """``image`` pinned by its digest (``REPO@sha256:...``)."""
        return pinned(self.image, self.digest)


def pinned(image: str, digest: str | None) -> str:
    if "@" in image or digest is None:
        return image
    repo = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    return f"{repo}@{digest}"


def retry_notes(rows: Sequence[HostImage]) -> list[str]:
    """``w1: auth/pull retried 2 times (...the registry's sentence...)``, folded by reason."""
    by: dict[tuple[int, str], list[int]] = {}
    for r in rows:
        if r.retries and r.error is None:
            by.setdefault((len(r.retries), r.retries[-1]), []).append(r.worker)
    return [f"{nodeset.fold(ws)}: auth and pull retried {n} time{'s' if n != 1 else ''} "
            f"before it came up (last: {why})" for (n, why), ws in by.items()]


def summary(report: ImageReport) -> str:
    rows = report.rows
    pulled = [r.worker for r in rows if r.pulled]
    present = [r.worker for r in rows if r.present]
    parts = []
    if pulled:
        parts.append(f"pulled on {nodeset.fold(pulled)}")
    if present:
        parts.append(f"already on {nodeset.fold(present)}")
    return (f"{report.image} is {report.digest} on {nodeset.fold(r.worker for r in rows)} "
            f"({', '.join(parts)}; {_seconds(list(rows))}).")


def size_text(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def no_room(image: str, rows: Sequence[HostImage]) -> list[str]:
    """``w[1,3] lack room for IMAGE: ...``, one sentence per storage folder and need."""
    by: dict[tuple[str, int, int], list[HostImage]] = {}
    for r in rows:
        if r.no_room:
            room = r.no_room
            key = (str(room.get("path")), int(room.get("need_bytes") or 0),
                   int(room.get("compressed_bytes") or 0), float(room.get("factor") or 0))
            by.setdefault(key, []).append(r)
    out = []
    for (path, need, size, factor), hosts in by.items():
        free = sorted(int(r.no_room.get("free_bytes") or 0) for r in hosts if r.no_room)
        has = size_text(free[0]) if free[0] == free[-1] else \
            f"{size_text(free[0])}-{size_text(free[-1])}"
        ws = [r.worker for r in hosts]
        out.append(f"{nodeset.fold(ws)} {'has' if len(ws) == 1 else 'have'} no room for "
                   f"{image}, refused before the pull: it needs {size_text(need)} free in "
                   f"{path} ({factor:g} x its {size_text(size)} compressed) and "
                   f"{'it has' if len(ws) == 1 else 'they have'} {has}; free space there or "
                   "give the host a larger disk")
    return out


def problem(report: ImageReport) -> str:
    failed = [r for r in report.rows if r.error and not r.no_room]
    out = no_room(report.image, report.rows)
    by: dict[str, list[int]] = {}
    for r in failed:
        by.setdefault(r.error or "", []).append(r.worker)
    for why, ws in by.items():
        out.append(f"{nodeset.fold(ws)} could not get {report.image}: {why}")
    if report.differing:
        others = ", ".join(f"{nodeset.label(r.worker)}: {r.digest} (differs)"
                           for r in report.rows if r.differs)
        agreed = [r.worker for r in report.rows if r.ok and not r.differs]
        out.append(f"The hosts' digests of {report.image} differ ({nodeset.fold(agreed)} "
                   f"{report.digest}; {others}): the tag moved between pulls; pull it again "
                   f"everywhere (`tpufab image pull {report.image}`) or pin one digest "
                   "(IMAGE@sha256:...)")
    return "; ".join(out) + "."


NOT_HERE = "not on this host"


def digest_command(image: str):
    return python_command(RemoteFile.bundled(SCRIPT), ["digest", "--image", image], as_root=True)


def on_hosts(fanout, workers: Sequence[int], image: str, *,
             timeout: float | None = None) -> ImageReport:
    """Which hosts of ``workers`` have ``image`` and its digest on each (one round trip each,
    no registry asked): what `status` shows for the ``image`` setting. A host without it has
    the error NOT_HERE."""
    from tpufab.steps.runs.running import failure_reason

    image = check_image(image)
    workers = list(workers)
    results = run_with_files(fanout, [RemoteFile.bundled(SCRIPT)], digest_command(image),
                             workers, timeout=timeout)
    rows = []
    for w in workers:
        data = read_answer(results[w].stdout) if results[w].stdout else None
        if not isinstance(data, Mapping):
            rows.append(HostImage(w, error=failure_reason(results[w])))
        elif data.get("present") and data.get("digest"):
            rows.append(HostImage(w, digest=str(data["digest"]), image_id=data.get("image_id"),
                                  present=True))
        else:
            rows.append(HostImage(w, error=str(data.get("error") or NOT_HERE)))
    return fold_digests(image, rows)


def status_line(report: ImageReport) -> str:
    """``Image REF: sha256:ab12... on w[0-1]; not on w2 (...); w3: sha256:cd34... (differs)``."""
    agreed = [r.worker for r in report.rows if r.ok and not r.differs]
    parts = [f"{_short(report.digest)} on {nodeset.fold(agreed)}"] if agreed else []
    missing = [r.worker for r in report.rows if r.error == NOT_HERE]
    if missing:
        parts.append(f"not on {nodeset.fold(missing)} (`tpufab image pull {report.image}`)")
    parts += [f"{nodeset.label(r.worker)}: {_short(r.digest)} (differs)"
              for r in report.rows if r.differs]
    by: dict[str, list[int]] = {}
    for r in report.rows:
        if r.error and r.error != NOT_HERE:
            by.setdefault(r.error, []).append(r.worker)
    parts += [f"{nodeset.fold(ws)}: unknown ({why})" for why, ws in by.items()]
    return f"Image {report.image}: " + "; ".join(parts) + "."


def host_image(worker: int, result) -> HostImage:
    from tpufab.steps.runs.running import failure_reason

    data = read_answer(result.stdout) if result.stdout else None
    if not isinstance(data, Mapping):
        return HostImage(worker, error=failure_reason(result))
    if data.get("error"):
        room = data.get("no_room")
        return HostImage(worker, error=str(data["error"]), attempts=int(data.get("attempts") or 0),
                         retries=tuple(data.get("retries") or ()),
                         no_room=room if isinstance(room, Mapping) else None)
    return HostImage(worker, digest=data.get("digest"), image_id=data.get("image_id"),
                     present=bool(data.get("present")), checked=bool(data.get("checked")),
                     pulled=bool(data.get("pulled")),
                     attempts=int(data.get("attempts") or 0),
                     retries=tuple(data.get("retries") or ()), seconds=data.get("seconds"))


def fold_digests(image: str, rows: list[HostImage]) -> ImageReport:
    """The report, with the hosts whose digest is not the most common one marked."""
    counts: dict[str, int] = {}
    for r in rows:
        if r.digest and not r.error:
            counts[r.digest] = counts.get(r.digest, 0) + 1
    if "@" in image:
        agreed = image.split("@", 1)[1]
    else:   # the most common; a tie: the one of the lowest worker
        agreed = max(counts, key=lambda d: (counts[d], -min(r.worker for r in rows
                                                             if r.digest == d)), default=None)
    marked = [HostImage(**{**r.__dict__, "differs": bool(r.digest and r.digest != agreed
                                                          and not r.error)}) for r in rows]
    return ImageReport(image=image, digest=agreed, rows=sorted(marked, key=lambda r: r.worker))


def pull(fanout, workers: Sequence[int], image: str, *, if_missing: bool = False,
         timeout: float | None = None, wave: int = WAVE,
         login: Mapping[str, str] | None = None) -> ImageReport:
    """Every host of ``workers`` pulls ``image`` (``if_missing``: only where it is not there),
    at most ``wave`` at once; the folded ImageReport (``.check()`` raises ImageError).
    ``login``: another registry's ``{"username", "password"}`` (``registry_login``), sent to
    each host on stdin, never in a command line."""
    image = check_image(image)
    line = pull_command(image, if_missing=if_missing, jitter=jitter_for(len(workers)),
                        login=login is not None)
    stdin = json.dumps(dict(login)).encode() if login is not None else None
    rows: list[HostImage] = []
    workers = list(workers)
    for start in range(0, len(workers), wave):
        part = workers[start:start + wave]
        results = run_with_files(fanout, [RemoteFile.bundled(SCRIPT)], line, part,
                                 timeout=timeout, stdin=stdin)
        rows += [host_image(w, results[w]) for w in part]
    return fold_digests(image, rows)
