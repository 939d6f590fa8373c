"""`tpufab`: the Typer front end. Each command parses flags and calls one verb in tpufab.verbs.

Keep this file free of logic and of heavy imports (google-cloud-tpu, fabric): `tpufab --help`
must start instantly. To add a verb: write it in verbs.py, add a thin command here and a task
in tasks.py with the same flags.
"""

from __future__ import annotations

from typing import Annotated

import typer

from tpufab.console import run as run_verb
from tpufab.verbs import data as data_verbs
from tpufab.verbs import jobs as jobs_verbs
from tpufab.verbs import nodes as nodes_verbs
from tpufab.verbs import sim as sim_verbs
from tpufab.verbs import status as status_verbs
from tpufab.verbs import workers as workers_verbs

app = typer.Typer(
    name="tpufab",
    help="Make a Cloud TPU pod feel like one machine.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
sim_app = typer.Typer(help="The simulated TPU pod: a local TPU API with real SSH workers.",
                      no_args_is_help=True, rich_markup_mode=None)
app.add_typer(sim_app, name="sim")

_state = {"debug": False}


def _run(fn, /, *args, **kwargs) -> None:
    code = run_verb(fn, *args, debug=_state["debug"], **kwargs)
    if code:
        raise typer.Exit(code)


# Shared option shapes.
Name = Annotated[str | None, typer.Option("--name", "-n", help="TPU node name.")]
Zone = Annotated[str | None, typer.Option("--zone", "-z", help="Zone (default: settings).")]
Project = Annotated[str | None, typer.Option("--project", "-p", help="Google Cloud project.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False) -> None:
    """Make a Cloud TPU pod feel like one machine."""
    _state["debug"] = debug


@app.command()
def create(
    name: Name = None,
    type: Annotated[str | None, typer.Option(
        "--type", "--accelerator-type", "-t", help="Accelerator type: v4-32, v6e-8, tpu-v6e-8 ...")] = None,
    zone: Zone = None,
    project: Project = None,
    version: Annotated[str | None, typer.Option(
        "--version", help="Runtime version (default: by generation).")] = None,
    spot: Annotated[bool, typer.Option("--spot", help="Spot capacity.")] = False,
    preemptible: Annotated[bool, typer.Option("--preemptible", help="Preemptible.")] = False,
    reserved: Annotated[bool, typer.Option("--reserved", help="Reserved capacity.")] = False,
    queued: Annotated[bool, typer.Option("--queued", help="Create a queued resource.")] = False,
    num_slices: Annotated[int, typer.Option(
        "--num-slices", min=1, help="Slices of a multislice queued resource.")] = 1,
    async_: Annotated[bool, typer.Option("--async", help="Return without waiting.")] = False,
    label: Annotated[list[str] | None, typer.Option(
        "--label", metavar="KEY=VALUE", help="Label (repeatable).")] = None,
) -> None:
    """Create a TPU VM node (or queued resource) and wait until it is READY."""
    _run(nodes_verbs.create, name=name, type=type, zone=zone, project=project, version=version,
         spot=spot, preemptible=preemptible, reserved=reserved, queued=queued,
         num_slices=num_slices, async_=async_, labels=label)


@app.command()
def delete(
    name: Name = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Delete a TPU node (or its queued resource)."""
    _run(nodes_verbs.delete, name=name, yes=yes, zone=zone, project=project)


@app.command("list")
def list_(json: Json = False, zone: Zone = None, project: Project = None) -> None:
    """List the TPU nodes in a zone."""
    _run(nodes_verbs.list_, as_json=json, zone=zone, project=project)


@app.command()
def describe(name: Name = None, json: Json = False, zone: Zone = None,
             project: Project = None) -> None:
    """Show one TPU node: state, health, workers and their IPs."""
    _run(nodes_verbs.describe, name=name, as_json=json, zone=zone, project=project)


@app.command()
def types(json: Json = False) -> None:
    """The accelerator types tpufab knows: hosts, chips, runtime, device files."""
    _run(nodes_verbs.types, as_json=json)


# ---------------------------------------------------------------------------------------------
# on the workers

Worker = Annotated[str, typer.Option(
    "--worker", "-w", help="Workers: all, 0, 0,3-5 or w[0-3,7].")]
Timeout = Annotated[float | None, typer.Option(
    "--timeout", help="Per-command timeout in seconds.")]


@app.command("exec")
def exec_(
    command: Annotated[str, typer.Argument(help="Shell command, quoted as one argument.")],
    name: Name = None,
    worker: Worker = "all",
    gather: Annotated[bool, typer.Option(
        "--gather", "-b", help="Print each distinct output once under its workers.")] = False,
    timeout: Timeout = None,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Run a shell command on every (or the selected) worker."""
    _run(workers_verbs.exec_, command=command, name=name, worker=worker, gather=gather, timeout=timeout,
         zone=zone, project=project)


@app.command()
def setup(
    name: Name = None,
    script: Annotated[str, typer.Option("--script", help="Setup script to run.")] = "scripts/setup.sh",
    force: Annotated[bool, typer.Option("--force", help="Run even where it already ran.")] = False,
    worker: Worker = "all",
    timeout: Timeout = None,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Ship a setup script and run it on every worker (once per script content)."""
    _run(workers_verbs.setup, name=name, script=script, force=force, worker=worker, timeout=timeout,
         zone=zone, project=project)


@app.command()
def ssh(
    name: Name = None,
    worker: Annotated[int, typer.Option("--worker", "-w", help="Worker index.")] = 0,
    command: Annotated[list[str] | None, typer.Argument(help="Command (default: a shell).")] = None,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """An interactive shell (or one command) on one worker, with the right key and host key."""
    _run(workers_verbs.ssh, name=name, worker=worker, command=command, zone=zone, project=project)


@app.command()
def deploy(
    name: Name = None,
    ref: Annotated[str, typer.Option("--ref", help="Commit, branch or tag to deploy.")] = "HEAD",
    remote: Annotated[str, typer.Option(
        "--remote", help="Git remote the workers fetch from.")] = "origin",
    dir: Annotated[str | None, typer.Option(
        "--dir", help="Checkout on the workers (default: remote_dir, else ~/<repo name>).")] = None,
    direct: Annotated[bool, typer.Option(
        "--direct", help="Send the commit over SSH; no remote, no credentials on workers.")] = False,
    wip: Annotated[bool, typer.Option(
        "--wip", help="Deploy the working tree as it is (a snapshot commit on a side ref).")] = False,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Put exactly one commit of this repository on every worker, verified."""
    _run(data_verbs.deploy, name=name, ref=ref, remote=remote, dir=dir, direct=direct, wip=wip,
         zone=zone, project=project)


@app.command()
def mount(
    bucket: Annotated[str, typer.Argument(help="gs://BUCKET[/PREFIX] or BUCKET[/PREFIX].")],
    name: Name = None,
    at: Annotated[str | None, typer.Option(
        "--at", help="Mount point on the workers (default /mnt/gcs/BUCKET).")] = None,
    driver: Annotated[str | None, typer.Option(
        "--driver", help="gcsfuse (default: mount_driver) or rclone.")] = None,
    options: Annotated[list[str] | None, typer.Option(
        "--options", metavar="'FLAGS'", help="Extra driver flags, quoted (repeatable).")] = None,
    install: Annotated[bool, typer.Option(
        "--install", help="Install a missing driver on the workers.")] = False,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Mount a Cloud Storage bucket (or a prefix of it) on every worker, verified."""
    _run(data_verbs.mount, bucket=bucket, name=name, at=at, driver=driver, options=options,
         install=install, zone=zone, project=project)


@app.command()
def umount(
    name: Name = None,
    at: Annotated[str | None, typer.Option(
        "--at", help="Mount point (default: every mount tpufab made).")] = None,
    lazy: Annotated[bool, typer.Option(
        "--lazy", help="Detach now even if files are open there.")] = False,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Unmount --at (or every mount tpufab made) on every worker."""
    _run(data_verbs.umount, name=name, at=at, lazy=lazy, zone=zone, project=project)


# ---------------------------------------------------------------------------------------------
# jobs: run, logs, runs, kill, status, babysit

Recipe = Annotated[str, typer.Argument(help="Recipe: an executable file, e.g. recipes/jax_hello.sh.")]
Args = Annotated[str, typer.Option("--args", help="The recipe's arguments, as one quoted string.")]
Env = Annotated[list[str] | None, typer.Option(
    "--env", "-e", metavar="K=V|K", help="Set K=V, or forward the local K (repeatable).")]
RunId = Annotated[str | None, typer.Option("--run", help="Run id (default: the latest).")]


@app.command()
def run(
    recipe: Recipe,
    name: Name = None,
    args: Args = "",
    detach: Annotated[bool, typer.Option("--detach", help="Start it and return.")] = False,
    no_deploy: Annotated[bool, typer.Option("--no-deploy", help="Skip deploying the current commit.")] = False,
    direct: Annotated[bool, typer.Option("--direct", help="Deploy straight to the workers over SSH.")] = False,
    wip: Annotated[bool, typer.Option("--wip", help="Deploy uncommitted work as a snapshot.")] = False,
    env: Env = None,
    local: Annotated[bool, typer.Option("--local", help="Run on this machine instead.")] = False,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, help="With --local: how many processes.")] = None,
    on_interrupt: Annotated[str | None, typer.Option(
        "--on-interrupt", help="Ctrl-C: kill the run everywhere, or detach (default: ask).")] = None,
    spmd: Annotated[bool, typer.Option("--spmd", help="torch_xla SPMD (XLA_USE_SPMD=1).")] = False,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Run a recipe on every worker at once (deploying first) and follow its logs."""
    _run(jobs_verbs.run, recipe, name=name, args=args, detach=detach, no_deploy=no_deploy,
         direct=direct, wip=wip, env=env, local=local, workers=workers,
         on_interrupt=on_interrupt, spmd=spmd, zone=zone, project=project)


@app.command()
def logs(
    run: RunId = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep following.")] = False,
    worker: Worker = "all",
    raw: Annotated[bool, typer.Option("--raw", help="Every line, prefixed by its worker.")] = False,
    name: Name = None,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """A run's logs: worker 0's lines once, plus only the lines where others differ."""
    _run(jobs_verbs.logs, run=run, follow=follow, worker=worker, raw=raw, name=name, zone=zone,
         project=project)


@app.command()
def runs(name: Name = None, worker: Worker = "all", json: Json = False, zone: Zone = None,
         project: Project = None) -> None:
    """The runs the workers know, with each worker's state."""
    _run(jobs_verbs.runs, name=name, worker=worker, as_json=json, zone=zone, project=project)


@app.command()
def kill(
    name: Name = None,
    run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
    grace: Annotated[float, typer.Option("--grace", min=0, help="Seconds between TERM and KILL.")] = 5.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Also stop protected holders.")] = False,
    worker: Worker = "all",
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Free the TPU everywhere: stop runs and stale holders, then remove the lockfile."""
    _run(jobs_verbs.kill, name=name, run=run, grace=grace, dry_run=dry_run, force=force,
         worker=worker, zone=zone, project=project)


@app.command()
def status(name: Name = None, json: Json = False, zone: Zone = None,
           project: Project = None) -> None:
    """The node and every worker: reachable, TPU free or busy, runs, commit, mounts, disk."""
    _run(status_verbs.status, name=name, as_json=json, zone=zone, project=project)


@app.command()
def babysit(
    recipe: Recipe,
    name: Name = None,
    max_restarts: Annotated[int, typer.Option("--max-restarts", min=0, help="Recoveries allowed.")] = 3,
    args: Args = "",
    restart_on_failure: Annotated[bool, typer.Option(
        "--restart-on-failure", help="Also restart when the recipe itself fails.")] = False,
    env: Env = None,
    setup_script: Annotated[str | None, typer.Option(
        "--setup-script", help="Setup a recreated node runs (default: the last one).")] = None,
    no_deploy: Annotated[bool, typer.Option("--no-deploy", help="Skip deploying.")] = False,
    direct: Annotated[bool, typer.Option("--direct", help="Deploy straight to the workers.")] = False,
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Run a recipe and keep it running through preemptions (recreate, set up, restart)."""
    _run(status_verbs.babysit, recipe, name=name, max_restarts=max_restarts, args=args,
         restart_on_failure=restart_on_failure, env=env, setup_script=setup_script,
         no_deploy=no_deploy, direct=direct, zone=zone, project=project)


known_hosts_app = typer.Typer(help="tpufab's pinned worker host keys.", no_args_is_help=True,
                              rich_markup_mode=None)
app.add_typer(known_hosts_app, name="known-hosts")


@known_hosts_app.command("forget")
def known_hosts_forget(
    node: Annotated[str, typer.Argument(help="Node name, or the node id an error named.")],
    zone: Zone = None,
    project: Project = None,
) -> None:
    """Forget a node's pinned host keys (after a rebuild you trust)."""
    _run(nodes_verbs.known_hosts_forget, node=node, zone=zone, project=project)


# ---------------------------------------------------------------------------------------------
# tpufab sim ...

StateDir = Annotated[str | None, typer.Option(
    "--state-dir", help="Where the simulated pod keeps its state (TPUFAB_SIM_DIR).")]


@sim_app.command("up")
def sim_up(port: Annotated[int | None, typer.Option("--port", help="API port.")] = None,
           state_dir: StateDir = None) -> None:
    """Start the simulated pod in the background and print the lines to export."""
    _run(sim_verbs.sim_up, port=port, state_dir=state_dir)


@sim_app.command("down")
def sim_down(state_dir: StateDir = None) -> None:
    """Stop the simulated pod (its nodes are kept on disk)."""
    _run(sim_verbs.sim_down, state_dir=state_dir)


@sim_app.command("status")
def sim_status(state_dir: StateDir = None, json: Json = False) -> None:
    """Is the simulated pod up, and where."""
    _run(sim_verbs.sim_status, state_dir=state_dir, as_json=json)


@sim_app.command("preempt")
def sim_preempt(name: Annotated[str, typer.Argument(help="Node to preempt.")]) -> None:
    """Preempt a node: state PREEMPTED, workers stopped."""
    _run(sim_verbs.sim_preempt, name=name)


@sim_app.command("unreachable")
def sim_unreachable(
    name: Annotated[str, typer.Argument(help="Node.")],
    worker: Annotated[int, typer.Option("--worker", "-w", help="Worker index.")],
    restore: Annotated[bool, typer.Option("--restore", help="Make it reachable again.")] = False,
) -> None:
    """Make one worker unreachable over SSH (or reachable again)."""
    _run(sim_verbs.sim_unreachable, name=name, worker=worker, restore=restore)


@sim_app.command("fail-create")
def sim_fail_create(
    quota: Annotated[bool, typer.Option("--quota", help="Quota exceeded, not stockout.")] = False,
) -> None:
    """Make the next create fail with RESOURCE_EXHAUSTED."""
    _run(sim_verbs.sim_fail_create, quota=quota)


@sim_app.command("burst")
def sim_burst(
    count: Annotated[int, typer.Option("--count", min=1, help="How many calls fail.")],
    code: Annotated[int, typer.Option("--code", help="503 or 429.")] = 503,
) -> None:
    """Make the next COUNT API calls fail with 503 (or 429)."""
    _run(sim_verbs.sim_burst, count=count, code=code)


@sim_app.command("zombie")
def sim_zombie(name: Name = None, worker: Worker = "all") -> None:
    """Leave a crashed job's mess on workers: TPU holders (some ignore TERM), the lockfile,
    and a protected system process."""
    _run(sim_verbs.sim_zombie, name=name, worker=worker)


@sim_app.command("bucket")
def sim_bucket(name: Annotated[str, typer.Argument(help="Bucket name.")]) -> None:
    """Create a bucket in the simulated pod's Cloud Storage (a no-op if it exists)."""
    _run(sim_verbs.sim_bucket, name=name)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
