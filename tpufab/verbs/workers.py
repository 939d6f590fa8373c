"""Verbs on the workers: exec, setup, ssh, disconnect, image pull."""

from __future__ import annotations

from pathlib import Path

from tpufab.errors import ConfigError
from tpufab.verbs.declare import Call, Opt, verb

PLACE = 4   # where this family's verbs show in `tpufab --help`
GROUPS = {"image": "Container images on every host: pull (pre-heat) and digests "
                   "(docs/images.md).",
          "env": "The Python environment built once and put on every host (docs/environment.md)."}

# Above this many workers exec's live view folds (each identical line once) unless --raw.
FOLD_ABOVE = 32


@verb(options={"command": "Shell command, quoted as one argument.",
               "gather": Opt("Print each distinct output once under its workers.", short="-b"),
               "raw": f"Every worker's lines, prefixed (the default up to {FOLD_ABOVE} "
                      "workers; above, lines are folded live)."},
      pod_method="run", api_only=("warn", "cwd", "one_shot"))
def exec_(call: Call, *, gather: bool = False, raw: bool = False, color: bool = False) -> None:
    """Run a shell command on every (or the selected) worker.

    ``timeout``: seconds the command may run on each worker (then it is stopped there and
    that worker fails); connecting waits at most connect_timeout (20 s) or this, if
    shorter."""
    from tpufab.views.live import print_gathered
    from tpufab.views.runlogs import follow_view

    command = call.args["command"]
    if not command or not command.strip():
        raise ConfigError("No command given: tpufab exec 'CMD' (quote it as one argument).")
    chosen = call.pod.select(call.args["workers"])
    prefixed = raw or len(chosen) <= FOLD_ABOVE
    sink = None if gather else follow_view(chosen, raw=prefixed, color=color)
    try:
        # --env as for run: secrets travel in the request (never argv) and are masked in
        # output; one_shot: on fresh connections a plain exec channel, no agent (docs/fanout.md)
        result = call(workers=chosen, sink=sink, one_shot=True, warn=True)
    finally:
        if sink is not None and not prefixed:
            sink.close()   # the folded view's last lines
    try:
        if gather:
            print_gathered(result, worker_colors=color)
        result.check()
    finally:
        result.close()


@verb(options={"script": "Setup script to run.", "force": "Run even where it already ran.",
               "image": Opt("Then pull this container image on every host (as `image pull`), "
                            "so the first run with it starts at once.", metavar="IMAGE"),
               "raw": "Every worker's lines, prefixed (default: folded, each line once)."},
      pod_method="setup")
def setup(call: Call, *, raw: bool = False) -> None:
    """Build the environment once (`environment:` in tpufab.yaml), then ship a setup script
    and run it on every worker (once per script content).

    With `environment:`, worker 0 builds it with uv and every other host gets that build
    from it (skipped where the hash is there already; docs/environment.md); the script then
    sees it (VIRTUAL_ENV, on PATH). The workers' output is folded live (each identical line once; lines where workers differ
    under their workers), with a progress line on a terminal. ``timeout``: seconds each step
    on a worker may take (connecting at most connect_timeout); by default no limit, since
    installing a framework may take long. ``env``/``secret`` as for run: a secret (by name,
    such as WANDB_API_KEY, or --secret) reaches the script on stdin only and is masked in its
    output and log; neither counts as the script's content.
    """
    from tpufab.views.progress import WorkerProgress
    from tpufab.views.report import show
    from tpufab.views.runlogs import follow_view, tee

    script = call.args["script"]
    call.pod.setup_script(script)  # a missing script: before connecting
    chosen = call.pod.select(call.args["workers"])
    view = follow_view(chosen, raw=raw)
    try:
        with WorkerProgress(f"setup {Path(script).name}", len(chosen)) as progress:
            report = call(script=script, workers=chosen, sink=tee(view, progress))
    finally:
        if not raw:
            view.close()   # the folded view's last lines
    show(report)


@verb(name="build", group="env", pod_method="env_build",
      options={"force": "Build again even where the hash is unchanged."})
def env_build(call: Call, *, as_json: bool = False) -> None:
    """Build the configured environment once and put that build on every host that lacks it.

    Worker 0 resolves and installs it with uv (the only host that talks to the package
    index), packs it, and every other host copies it from worker 0 inside the pod, unpacks
    it at the same path and checks its tree hash; a host that fails is retried once, then
    named. Hosts that have the environment's hash are skipped."""
    from tpufab.views.report import show

    show(call(), as_json=as_json)


@verb(name="status", group="env", pod_method="env_status")
def env_status(call: Call, *, as_json: bool = False) -> int:
    """Which hosts have which environment (its hash), folded; exits 3 when a host lacks
    the configured one."""
    from tpufab.views.report import show

    report = call()
    show(report, as_json=as_json)
    lacking = report.expected and any(r.hash != report.expected for r in report.rows)
    return 3 if lacking or not report.ok else 0


@verb(options={"workers": Opt("Worker index.", flag="--worker", short="-w"),
               "command": Opt("Command (default: a shell; with invoke, after --).", rest=True),
               "forward": Opt("Forward a local port: PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE "
                              "(repeatable).", short="-L")},
      pod_method="ssh", api_only=("replace",))
def ssh(call: Call) -> None:
    """An interactive shell (or one command) on one worker, with the right key and host key.

    ``--forward`` adds ``-L``-style port forwards (PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE),
    bound to 127.0.0.1 here.
    """
    call(replace=True)


@verb(pod_method="disconnect")
def disconnect(call: Call) -> None:
    """Close the pod's kept connections (the background process holding them between
    commands); the next command connects again."""
    from tpufab.term.console import stdout

    stopped = call()
    pod = call.pod.name
    stdout().print(f"Closed {pod}'s kept connections." if stopped else
                   f"{pod} had no kept connections.", markup=False, highlight=False)


@verb(name="pull", group="image",
      options={"image": "Image reference (us-docker.pkg.dev/PROJECT/REPO/IMAGE:TAG or "
                        "...@sha256:DIGEST).",
               "if_missing": "Only where it is not there already (no registry request)."},
      pod_method="image_pull")
def image_pull(call: Call) -> int:
    """Every host pulls IMAGE (pre-heat): a folded report of digests and times.

    Artifact Registry is reached with the VM's own service-account token (no key files);
    auth and pull are retried together with backoff (8 tries, 1 s doubling to 16 s), after a
    start jitter that grows with the host count. A host that still fails is named with the
    registry's sentence; hosts whose digests differ are named. ``timeout``: seconds each
    host may take (default 1800)."""
    from tpufab.views.report import show

    report = call()
    show(report)
    report.check()
    return 0
