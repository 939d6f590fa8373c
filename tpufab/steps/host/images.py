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
"""

from __future__ import annotations

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


def jitter_for(hosts: int) -> float:
    return 0.0 if hosts <= 1 else min(JITTER_CAP, JITTER_PER_HOST * hosts)


def pull_command(image: str, *, if_missing: bool = False, jitter: float = 0.0,
                 attempts: int = ATTEMPTS, backoff: float = BACKOFF, cap: float = CAP):
    args: list = ["pull", "--image", image, "--attempts", attempts, "--backoff", f"{backoff:g}",
                  "--cap", f"{cap:g}", "--jitter", f"{jitter:g}"]
    if if_missing:
        args.append("--if-missing")
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


def problem(report: ImageReport) -> str:
    failed = [r for r in report.rows if r.error]
    out = []
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


def host_image(worker: int, result) -> HostImage:
    from tpufab.steps.runs.running import failure_reason

    data = read_answer(result.stdout) if result.stdout else None
    if not isinstance(data, Mapping):
        return HostImage(worker, error=failure_reason(result))
    if data.get("error"):
        return HostImage(worker, error=str(data["error"]), attempts=int(data.get("attempts") or 0),
                         retries=tuple(data.get("retries") or ()))
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
         timeout: float | None = None, wave: int = WAVE) -> ImageReport:
    """Every host of ``workers`` pulls ``image`` (``if_missing``: only where it is not there),
    at most ``wave`` at once; the folded ImageReport (``.check()`` raises ImageError)."""
    image = check_image(image)
    line = pull_command(image, if_missing=if_missing, jitter=jitter_for(len(workers)))
    rows: list[HostImage] = []
    workers = list(workers)
    for start in range(0, len(workers), wave):
        part = workers[start:start + wave]
        results = run_with_files(fanout, [RemoteFile.bundled(SCRIPT)], line, part,
                                 timeout=timeout)
        rows += [host_image(w, results[w]) for w in part]
    return fold_digests(image, rows)
