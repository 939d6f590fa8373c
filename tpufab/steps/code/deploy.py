"""Deploy: put exactly one commit of the user's repository on every worker, verified.

Default path: push the commit to the remote, then every worker fetches it from there (one SSH
round trip per worker: the worker script clones if absent, fetches only if the commit is
missing, checks out, updates submodules and reports). ``direct``: no remote involved; the
commit travels as a git bundle over the same SSH connections (no credentials on workers).

Pure planning (``worker_command``, ``deploy_summary``) is separate from ``deploy`` (the apply step),
which talks to workers only through a ``Workers`` transport (the fan-out group).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpufab import nodeset
from tpufab.errors import TpufabError
from tpufab.quoting import Secret
from tpufab.reports import Column, Outcome, Report, Workers, answer_row, count, seconds_range, text
from tpufab.ssh.remote_files import RemoteFile, run_script
from tpufab.steps.code import codelock, gitops
from tpufab.steps.code.codelock import SCRIPT

TOKEN_ENV = "TPUFAB_GIT_TOKEN"  # read by the worker script's credential helper
USERNAME_ENV = "TPUFAB_GIT_USERNAME"  # its username (default x-access-token)


class DeployError(TpufabError):
    """Deploy failed on some workers; ``details`` holds every worker's outcome."""


# --- records --------------------------------------------------------------------------------

@dataclass
class DeployRow:
    worker: int
    ok: bool
    commit: str | None = None
    before: str | None = None
    action: str | None = None     # clone | update | noop
    seconds: float | None = None
    error: str | None = None      # unreachable | disk_full | ... | ssh
    message: str | None = None
    cpu_seconds: float | None = None  # the worker script's CPU time, git included

    @property
    def changed(self) -> bool:
        return self.ok and self.action != "noop"


DEPLOY_COLUMNS = (Column("COMMIT", lambda r: (r.commit or "-")[:12]),
                  Column("RESULT", lambda r: r.action or "-"),
                  Column("TIME", over=seconds_range))


@dataclass(kw_only=True)
class DeployReport(Report):
    """The per-worker rows of a deploy (``tpufab.reports.Report``) and what was deployed."""

    step: str = "deploy"
    columns: tuple[Column, ...] = DEPLOY_COLUMNS
    commit: str
    dir: str
    pushed: str | None = None       # "pushed" | "up to date" | None (direct)
    wip_ref: str | None = None
    seconds: float = 0.0
    branch: str | None = None       # checked out on the workers; None: detached
    remote: str | None = None       # the remote the workers fetched from; None: --direct


def deploy_summary(report: DeployReport) -> str:
    """``Deployed 1a2b3c4d5e6f (main) to 4 workers in ~/repo through origin (pushed): 4
    changed (1.2s).``"""
    changed = sum(r.changed for r in report.rows)
    what = report.commit[:12] + (f" ({report.branch})" if report.branch else "")
    if report.wip_ref:
        what += f" (work-in-progress snapshot, {report.wip_ref})"
    how = ("over SSH (--direct)" if report.remote is None
           else f"through {report.remote} "
                f"({'pushed' if report.pushed == 'pushed' else 'already there'})")
    same = len(report.rows) - changed
    outcome = ("every worker was already there" if not changed
               else f"{changed} changed" + (f", {same} already there" if same else ""))
    return (f"Deployed {what} to {count(len(report.rows), 'worker')} in {report.dir} "
            f"{how}: {outcome} ({report.seconds:.1f}s).")


def parse_outcome(worker: int, outcome: Outcome) -> DeployRow:
    """A worker script's JSON line (or the transport's failure) as a row."""
    return answer_row(DeployRow, worker, outcome)


ERROR_SENTENCES = {
    "unreachable": "{who} cannot reach the remote {source}: give the workers access (a deploy "
                   "key, or an HTTPS token sent as a secret; see docs/deploy.md) or deploy "
                   "with --direct.",
    "auth_failed": "The remote {source} refused {who} (authentication failed): give the "
                   "workers a deploy key or pass an HTTPS token (see docs/deploy.md), or "
                   "deploy with --direct.",
    "disk_full": "{who} ran out of disk space in {dir}: free space there (or pick another "
                 "--dir), then deploy again.",
    "local_changes": "{who} {have} local changes in {dir} that the checkout would overwrite: "
                     "commit or discard them on the worker, then deploy again.",
    "not_a_repo": "{who} already {have} {dir} and it is not a git checkout: move it away or "
                  "deploy to another --dir.",
    "missing_commit": "{who} could not find commit {commit} on the remote {source}: make sure "
                      "the push reached it, then deploy again.",
    "no_git": "{who} {have} no git: install it there (apt-get install git) and deploy again.",
    "no_python": "{who} {have} no python3: install it there and deploy again.",
    "ssh": "{who} could not run the deploy step over SSH: check that the workers are up "
           "(tpufab status) and deploy again.",
    "git_failed": "The checkout failed on {who} in {dir}: see the per-worker messages below "
                  "and fix those workers, then deploy again.",
}


def failure_sentence(rows: Sequence[DeployRow], *, source: str, dir: str,
                     commit: str) -> str:
    """One sentence for the most common failure kind, naming its workers."""
    failed = [r for r in rows if not r.ok]
    kinds: dict[str, list[int]] = {}
    for row in failed:
        kinds.setdefault(row.error or "git_failed", []).append(row.worker)
    kind, who = max(kinds.items(), key=lambda kv: len(kv[1]))
    noun = "Worker" if len(who) == 1 else "Workers"
    text = ERROR_SENTENCES.get(kind, ERROR_SENTENCES["git_failed"])
    sentence = text.format(who=f"{noun} {nodeset.fold(who)}", source=source, dir=dir,
                           commit=commit[:12], have="has" if len(who) == 1 else "have")
    for noun in ("Workers", "Worker"):  # mid-sentence
        sentence = sentence.replace(f"on {noun}", f"on {noun.lower()}").replace(
            f"refused {noun}", f"refused {noun.lower()}")
    sentence = sentence[0].upper() + sentence[1:]
    others = len(failed) - len(who)
    if others:
        sentence += f" ({others} more failed otherwise; see below.)"
    return sentence


def verify_same_commit(report: DeployReport) -> None:
    """Raise if any worker ended on another commit than the one deployed."""
    off = [r for r in report.rows if r.ok and r.commit != report.commit]
    if off:
        seen = sorted({r.commit[:12] for r in off if r.commit})
        raise DeployError(f"Workers disagree after deploy: {nodeset.fold([r.worker for r in off])} are "
                          f"at {', '.join(seen)} instead of {report.commit[:12]}; deploy again "
                          f"and check those workers for processes that change {report.dir}.",
                          details="\n".join(text(report)))


# --- the operation --------------------------------------------------------------------------

def default_dir(root: Path) -> str:
    return f"~/{gitops.repo_name(root)}"


def default_cwd(settings_dir: str | None, cwd: Path | None = None) -> str | None:
    """Where a ``--no-deploy`` run starts: the deploy directory of this checkout, if any."""
    if settings_dir:
        return settings_dir
    try:
        return default_dir(gitops.repo_root(cwd))
    except gitops.GitError:
        return None


def worker_command(*, dir: str, source: str, commit: str, fetch_ref: str | None,
                   branch: str | None, origin: str | None = None,
                   remove_source: bool = False) -> list[str]:
    """Arguments of ``deploy_worker.py checkout`` (pure)."""
    args = ["checkout", "--dir", dir, "--source", source, "--commit", commit]
    if fetch_ref:
        args += ["--fetch-ref", fetch_ref]
    if branch:
        args += ["--branch", branch]
    if origin:
        args += ["--origin", origin]
    if remove_source:
        args.append("--remove-source")
    return args


def deploy_checkout(pod, *, cwd: Path | str | None = None, ref: str = "HEAD",
                    remote: str = "origin", dir: str | None = None, direct: bool = False,
                    wip: bool = False, progress: Callable[[str], None] | None = None,
                    sink=None, lease: bool = True,
                    timeout: float | None = None) -> DeployReport:
    """The one way tpufab deploys (`tpufab deploy` and ``Pod.deploy``, the start of `run`,
    babysit's first attempt and its restores, launch's deploy step, `ray submit`): the
    repository at ``cwd`` (default: here) checked before ``pod`` connects (a dirty tree, an
    unknown ref, a missing remote: one sentence), the HTTPS token for a private remote read
    here, once, from ``TPUFAB_GIT_TOKEN``, then ``deploy`` on ``pod.fanout`` (``lease``,
    ``timeout``: as there)."""
    import os

    root = gitops.repo_root(Path(cwd) if cwd else None)
    if not wip:
        gitops.refuse_dirty(root)
        gitops.resolve(root, ref)
    if not direct:
        gitops.remote_url(root, remote)
    token = os.environ.get(TOKEN_ENV)
    return deploy(pod.fanout, ref=ref, remote=remote, dir=dir, direct=direct, wip=wip,
                  cwd=root, token=Secret(token) if token else None, progress=progress,
                  sink=sink, lease=lease, timeout=timeout)


def deploy(fanout: Workers, *, ref: str = "HEAD", remote: str = "origin", dir: str | None = None,
           direct: bool = False, wip: bool = False, cwd: Path | str | None = None,
           worker_url: str | None = None, token: str | Secret | None = None,
           progress: Callable[[str], None] | None = None, sink=None,
           lease: bool = True, timeout: float | None = None) -> DeployReport:
    """Deploy ``ref`` (or a ``wip`` snapshot) of the repository at ``cwd`` to every worker of
    ``fanout`` and verify they all report the same commit (tpufab itself deploys through
    ``deploy_checkout``, which reads the token).

    ``lease``: hold the pod's code lease (``codelock``) from the push to the verification,
    and refuse while a live run reads the target checkout; pass False when the caller holds
    it already (``run``). So two deploys at once never both report success: the second is
    refused with one sentence naming the first.

    ``worker_url``: the URL workers fetch from, when it differs from the remote's local URL
    (e.g. https for workers, ssh for you). ``token``: an HTTPS token for a private remote,
    handed to git on the workers as a secret environment variable (it travels on the fan-out's
    stdin) read by a credential helper: never in argv, files or logs. ``timeout``: seconds
    each step on the workers may take (None: the fan-out's command_timeout).
    """
    say = progress or (lambda _msg: None)
    start = time.monotonic()
    root = gitops.repo_root(cwd)
    if wip:
        resolved = gitops.wip_snapshot(root)
    else:
        gitops.refuse_dirty(root)
        resolved = gitops.resolve(root, ref)
    target_dir = dir or default_dir(root)
    report = DeployReport(commit=resolved.commit, dir=target_dir,
                          wip_ref=resolved.push_ref if resolved.wip else None,
                          branch=resolved.branch, remote=None if direct else remote)
    workers = list(fanout.workers)
    if lease:
        with codelock.hold(fanout, workers, purpose=f"deploy {resolved.commit[:12]}",
                           timeout=timeout) as held:
            # a worker the lease could not reach is reported as failed and left out of the
            # later steps (each would wait on it again); the others deploy
            reached = held.reached(workers)
            lost = {w: parse_outcome(w, r) for w, r in held.lost.items()}
            codelock.refuse_deploy_under_a_run(fanout, reached, held, target_dir)
            _apply(fanout, root, resolved, report, reached, remote=remote, direct=direct,
                   worker_url=worker_url, token=token, say=say, start=start, sink=sink,
                   lost=lost, timeout=timeout)
    else:
        _apply(fanout, root, resolved, report, workers, remote=remote, direct=direct,
               worker_url=worker_url, token=token, say=say, start=start, sink=sink,
               timeout=timeout)
    report.summary = deploy_summary(report)
    return report


def _apply(fanout: Workers, root: Path, resolved: gitops.Resolved, report: DeployReport,
           workers: list[int], *, remote: str, direct: bool, worker_url: str | None,
           token: str | Secret | None, say: Callable[[str], None], start: float,
           sink=None, lost: Mapping[int, DeployRow] | None = None,
           timeout: float | None = None) -> None:
    """Push (or bundle), check out on every worker, verify: the part the lease covers.

    ``lost``: rows of workers an earlier step could not reach (not in ``workers``)."""
    target_dir = report.dir
    if not workers:
        source = "your machine (direct)" if direct else gitops.without_credentials(
            worker_url or gitops.remote_url(root, remote))[0]
        report.rows = []
    elif direct:
        source = "your machine (direct)"
        _deploy_direct(fanout, root, resolved, target_dir, workers, report, say, sink,
                       timeout=timeout)
    else:
        url = gitops.remote_url(root, remote)
        source, secrets = worker_credentials(worker_url or url, token)
        say(f"pushing {resolved.commit[:12]} to {remote} ({resolved.push_ref})")
        report.pushed = gitops.push(root, remote, resolved.commit, resolved.push_ref)
        args = worker_command(dir=target_dir, source=source, commit=resolved.commit,
                              fetch_ref=resolved.push_ref, branch=resolved.branch,
                              origin=source)
        say(f"checking out {resolved.commit[:12]} on {len(workers)} workers")
        outcomes = run_script(fanout, SCRIPT, args, workers, secrets=secrets, sink=sink,
                              timeout=timeout)
        report.rows = [parse_outcome(w, outcomes[w]) for w in workers]
    report.rows = sorted([*report.rows, *(lost or {}).values()], key=lambda r: r.worker)
    report.seconds = round(time.monotonic() - start, 3)
    if any(not r.ok for r in report.rows):
        raise DeployError(failure_sentence(report.rows, source=source, dir=target_dir,
                                           commit=resolved.commit), details="\n".join(text(report)))
    verify_same_commit(report)


def worker_credentials(url: str, token: str | Secret | None
                       ) -> tuple[str, dict[str, Secret] | None]:
    """The URL workers fetch from, without any userinfo (it would be in their argv and
    ``.git/config``), and the secrets their credential helper gets (on the fan-out's stdin):
    ``token`` (``TPUFAB_GIT_TOKEN``), else the URL's own credentials. Credentials go over
    https only: either over plain http is refused in one sentence."""
    from tpufab.errors import ConfigError

    clean, carried = gitops.without_credentials(url)
    https = clean.lower().startswith("https://")
    if (carried or token is not None) and clean.lower().startswith("http://"):
        what = "The remote URL carries credentials" if carried else \
            f"{TOKEN_ENV} is set"
        raise ConfigError(f"{what}, and the workers would fetch {clean} over plain http; "
                          "tpufab sends git credentials only over https: use an https URL, a "
                          "deploy key, or --direct.")
    secrets: dict[str, Secret] = {}
    if token is not None:
        secrets[TOKEN_ENV] = token if isinstance(token, Secret) else Secret(token)
    elif carried and https:
        username, password = carried
        secrets[TOKEN_ENV] = Secret(password)
        if username:
            secrets[USERNAME_ENV] = Secret(username)
    return clean, secrets or None


def _deploy_direct(fanout: Workers, root: Path, resolved: gitops.Resolved, target_dir: str,
                   workers: list[int], report: DeployReport,
                   say: Callable[[str], None], sink=None, *,
                   timeout: float | None = None) -> None:
    """Probe each worker's HEAD, ship one bundle per distinct HEAD (only the missing objects),
    then check out from the bundle."""
    probes = run_script(fanout, SCRIPT, ["status", "--dir", target_dir], workers,
                        timeout=timeout)
    rows: dict[int, DeployRow] = {}
    heads: dict[int, str | None] = {}
    for w in workers:
        row = parse_outcome(w, probes[w])
        if not row.ok:
            rows[w] = row
        elif row.commit == resolved.commit:
            rows[w] = DeployRow(w, True, row.commit, row.commit, "noop", 0.0)
        else:
            heads[w] = row.commit
    by_head: dict[str | None, list[int]] = {}
    for w, head in heads.items():
        by_head.setdefault(head, []).append(w)
    with tempfile.TemporaryDirectory(prefix="tpufab-bundle-") as tmp:
        for n, (head, ids) in enumerate(by_head.items()):
            local = gitops.bundle(root, resolved.commit, Path(tmp) / f"{n}.bundle",
                                  exclude=[head] if head else [])
            # next to the shipped script: that folder exists once the probe ran
            script_dir = Path(RemoteFile.bundled(SCRIPT).path).parent
            remote = f"{script_dir}/{resolved.commit[:16]}-{n}.bundle"
            say(f"sending {local.stat().st_size} bytes to {nodeset.fold(ids)}")
            put = fanout.put(local, remote, workers=ids, check=False)
            sent = []
            for w in ids:
                if put[w].error or put[w].exit_code not in (0, None):
                    rows[w] = parse_outcome(w, put[w])
                else:
                    sent.append(w)
            if not sent:
                continue
            args = worker_command(dir=target_dir, source=remote, commit=resolved.commit,
                                  fetch_ref=gitops.DIRECT_REF, branch=resolved.branch,
                                  remove_source=True)
            outcomes = run_script(fanout, SCRIPT, args, sent, sink=sink, timeout=timeout)
            rows.update({w: parse_outcome(w, outcomes[w]) for w in sent})
    report.rows = [rows[w] for w in workers]
