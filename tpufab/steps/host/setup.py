"""`tpufab setup` / `Pod.setup`: ship a script and run it on every worker once per content.

The script, ``remote/setup_runner.sh`` and ``remote/masktee.py`` are shipped by content hash
(tpufab.ssh.remote_files, the seam every worker-side script uses, each verified before it
runs); the worker keeps ``~/.tpufab/setup/<hash>.log`` (0600 in a 0700 directory, ``secrets``
masked as it is written) and a ``<hash>.done`` marker, so a second run of the same content is
skipped (unless ``force``).

Honest caching: the marker is written only when the script exited 0 *and* recorded no failed
command (a task's setup records every command ``set -e`` would stop at, with its line:
tpufab.flows.launch). A script without a shebang runs under ``/bin/sh -e``. A run that exited 0
with a failure recorded is ``incomplete`` (SkyPilot's setups run to the end): not done, so it
runs again. When a worker failed or is incomplete, its log is copied back to
``./.tpufab/setup/<hash>/w<N>.log`` (masked, as on the worker) before anything else happens
(``launch --down`` deletes the pod after), and the error names the log on the worker, the
copy, and the failed command and its line where they are known.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpufab import nodeset, quoting
from tpufab.quoting import Secret
from tpufab.reports import Report
from tpufab.ssh.fanout import Fanout
from tpufab.ssh.results import FanoutError, GroupResult, OutputSink, WorkerResult


@dataclass(frozen=True)
class SetupRow:
    worker: int
    status: str  # "ran", "skipped", "incomplete" (exit 0, a command failed) or "failed"
    exit_code: int | None
    log: str | None                  # the log on the worker
    failed: dict | None = None       # {"line", "exit_code", "command"}: the first failure
    saved: str | None = None         # the log copied here (a failed or incomplete worker)

    def failure(self) -> str:
        """``at line 3 (`pip install x` exited 1)``, or ``with exit status 2`` when the
        command is not known (a script of your own)."""
        f = self.failed
        if f and f.get("command"):
            where = f"at line {f['line']} " if f.get("line") else "at "
            return f"{where}(`{f['command']}` exited {f.get('exit_code')})"
        return f"with exit status {self.exit_code}"

    @property
    def ok(self) -> bool:
        return self.status != "failed"


SetupOutcome = SetupRow   # the 0.1 name (docs/api.md), until 0.2


@dataclass(kw_only=True)
class SetupReport(Report):
    """Every worker's setup outcome (``tpufab.reports.Report``); the workers' output was
    shown live, so it says one line: ``Setup setup.sh: w[0-3] ran (log: ...).``"""

    step: str = "setup"
    script: str
    # `setup --image`: every host's digest of the image pulled after the script (steps.host.images)
    image: Any = field(default=None, metadata={"json": False})
    # the environment built first (tpufab.steps.host.environment.EnvReport), if configured
    environment: Report | None = field(default=None, metadata={"json": False})

    def __post_init__(self) -> None:
        first = self.environment.summary + " " if self.environment else ""
        if not self.script:
            self.summary = first.strip()
        else:
            by_status: dict[str, list[int]] = {}
            for outcome in sorted(self.rows, key=lambda o: o.worker):
                by_status.setdefault(outcome.status, []).append(outcome.worker)
            parts = [f"{nodeset.fold(ws)} {status}" for status, ws in sorted(by_status.items())]
            log = next((o.log for o in self.rows if o.log), None)
            self.summary = (f"{first}Setup {self.script}: {'; '.join(parts)}"
                            + (f" (log: {log})" if log else "") + ".")
        if self.image:
            self.summary += f" Image: {self.image.summary}"
            self.notes = [*self.notes, *self.image.notes]


class SetupFailed(FanoutError):
    """A setup failed on some workers; the message names the log and the failed command."""


def local_setup_dir(digest: str, base: Path | None = None) -> Path:
    """``./.tpufab/setup/<hash>/`` (0700, with the .gitignore runs' logs have)."""
    root = (base or Path.cwd()) / ".tpufab"
    root.mkdir(mode=0o700, exist_ok=True)
    if not (root / ".gitignore").exists():
        (root / ".gitignore").write_text("*\n")
    path = root / "setup" / digest
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    os.chmod(path, 0o700)
    return path


def copy_logs(fanout: Fanout, outcomes: Mapping[int, SetupRow], digest: str,
              base: Path | None = None) -> dict[int, SetupRow]:
    """Copy the logs of the failed and incomplete workers here; the outcomes with ``saved``."""
    from dataclasses import replace

    wanted = [w for w, o in outcomes.items() if o.status in ("failed", "incomplete") and o.log]
    if not wanted:
        return dict(outcomes)
    into = local_setup_dir(digest, base)
    got = fanout.run(["cat", "--", f".tpufab/setup/{digest}.log"], workers=wanted, timeout=60)
    out = dict(outcomes)
    try:
        for w in wanted:
            r = got[w]
            if r.ok and r.error is None:
                path = into / f"w{w}.log"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(r.stdout_bytes)
                out[w] = replace(out[w], saved=str(_shown(path)))
    finally:
        got.close()
    return out


def _shown(path: Path) -> Path:
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def failure_sentence(outcomes: Mapping[int, SetupRow], name: str) -> str:
    """One sentence for the failed (or incomplete) workers: where, what, which log."""
    from tpufab.nodeset import fold

    bad = {w: o for w, o in outcomes.items() if o.status in ("failed", "incomplete")}
    first = bad[min(bad)]
    others = [w for w in bad if bad[w].failure() != first.failure()]
    same = [w for w in bad if w not in others]
    text = f"{name} failed on {fold(same)} {first.failure()}"
    if others:
        text += f" (and on {fold(others)} otherwise)"
    if first.log:
        text += f"; its log is {first.log} on the worker"
        if first.saved:
            text += f", copied to {first.saved}"
    return text


class _HideStatus:
    """The setup runner's closing answer is for tpufab, not for the user's view."""

    def __init__(self, sink: OutputSink):
        self.sink = sink

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        from tpufab.ssh.remote_files import parse_answer

        kept = b"".join(line for line in data.splitlines(keepends=True)
                        if parse_answer(line) is None)
        if kept:
            self.sink.lines(worker, stream, kept)

    def done(self, result: WorkerResult) -> None:
        from tpufab.ssh.remote_files import missing_files

        if missing_files(result):
            return      # the guard's answer: the files are shipped and it runs again
        self.sink.done(result)


def run_setup(fanout: Fanout, script: bytes | str | os.PathLike[str], *, workers=None,
              force: bool = False, sink: OutputSink | None = None,
              timeout: float | None = None, env: Mapping[str, str] | None = None,
              secrets: Mapping[str, str | Secret] | None = None,
              name: str = "setup", save_to: Path | None = None,
              ) -> tuple[GroupResult, dict[int, SetupRow]]:
    """Run a setup script on every selected worker unless it already ran this exact content.

    Returns ``(GroupResult, {worker: SetupRow})``; raises :class:`SetupFailed` (a
    ``PodError`` of the API) naming ``name``, the failed command and the log if any worker
    fails; an ``incomplete`` worker (exit 0, a command failed) is returned, its log copied.
    ``save_to``: the folder holding ``.tpufab`` (default: here).
    """
    from tpufab.ssh.remote_files import RemoteFile, read_answer, run_with_files, shell_command

    content = script if isinstance(script, bytes) else open(script, "rb").read()
    user_script = RemoteFile("setup.sh", content, 0o700)
    digest = user_script.sha256[:16]
    runner = RemoteFile.bundled("setup_runner.sh")
    masktee = RemoteFile.bundled("masktee.py")
    files = [runner, user_script, masktee]
    # the names (never the values) of the secrets, for masktee.py to mask the log as written
    names = sorted({*(secrets or {}),
                    *(k for k, v in (env or {}).items() if isinstance(v, Secret))})
    line = shell_command(runner, [digest, user_script.path, masktee.path,
                                  "--force" if force else "-",
                                  *(quoting.check_env_name(n) for n in names)],
                         needs=[user_script, masktee])
    chosen = fanout.select(workers)
    result = GroupResult(run_with_files(fanout, files, line, chosen,
                                        sink=_HideStatus(sink) if sink else None,
                                        timeout=timeout, env=env, secrets=secrets))
    outcomes = {}
    for worker, r in result.items():
        info = (read_answer(r.stdout) or {}) if r.error is None else {}
        status = info.get("status", "failed") if r.ok else "failed"
        failed = info.get("failed") if isinstance(info.get("failed"), dict) else None
        outcomes[worker] = SetupRow(worker, status, r.exit_code, info.get("log"), failed)
    result.command = f"setup {digest}"
    script_failed = [w for w, r in result.items() if r.error is None and outcomes[w].log
                     and outcomes[w].status == "failed"]
    if any(o.status in ("failed", "incomplete") for o in outcomes.values()):
        try:
            outcomes = copy_logs(fanout, outcomes, digest, save_to)
        except (OSError, FanoutError):
            pass    # the sentence still names the log on the worker
    if script_failed:
        shown = {w: o for w, o in outcomes.items() if w in script_failed}
        raise SetupFailed(failure_sentence(shown, name) + ".", result,
                          details=result.details(), exit_code=result.exit_code)
    result.check()
    return result, outcomes
