"""invoke tasks: the same verbs as the `tpufab` command, with the same flags.

Thin: each task calls one function in tpufab.verbs (imported inside the task so that
`invoke --list` stays instant) and exits non-zero with one sentence on failure.
"""

from invoke import Collection, task
from invoke.exceptions import Exit

HELP = {
    "name": "TPU node name",
    "type": "accelerator type: v4-32, v6e-8, tpu-v6e-8 ...",
    "accelerator-type": "alias of --type",
    "zone": "zone (default: settings)",
    "project": "Google Cloud project",
    "version": "runtime version (default: by generation)",
    "spot": "spot capacity",
    "preemptible": "preemptible",
    "reserved": "reserved capacity",
    "queued": "create a queued resource",
    "num-slices": "slices of a multislice queued resource",
    "async": "return without waiting",
    "label": "key=value label (repeatable)",
    "yes": "do not ask for confirmation",
    "json": "print JSON instead of a table",
    "debug": "show tracebacks",
}


def _help(table, *names):
    return {n: table[n] for n in names}


WHERE = {'create': 'nodes', 'delete': 'nodes', 'list_': 'nodes', 'describe': 'nodes', 'types': 'nodes', 'known_hosts_forget': 'nodes', 'exec_': 'workers', 'setup': 'workers', 'ssh': 'workers', 'deploy': 'data', 'mount': 'data', 'umount': 'data', 'run': 'jobs', 'ask_on_interrupt': 'jobs', 'logs': 'jobs', 'runs': 'jobs', 'kill': 'jobs', 'status': 'status', 'babysit': 'status', 'sim_up': 'sim', 'sim_down': 'sim', 'sim_status': 'sim', 'sim_admin': 'sim', 'sim_preempt': 'sim', 'sim_unreachable': 'sim', 'sim_fail_create': 'sim', 'sim_burst': 'sim', 'sim_zombie': 'sim', 'sim_bucket': 'sim'}


def _run(verb_name, *args, **kwargs):
    import importlib

    from tpufab.console import run

    verbs = importlib.import_module("tpufab.verbs." + WHERE[verb_name])

    debug = kwargs.pop("debug", False)
    code = run(getattr(verbs, verb_name), *args, debug=debug, **kwargs)
    if code:
        raise Exit(code=code)


@task(auto_shortflags=False, help=_help(HELP, "name", "type", "accelerator-type", "zone", "project", "version", "spot",
                 "preemptible", "reserved", "queued", "num-slices", "async", "label", "debug"),
      iterable=["label"])
def create(c, name=None, type=None, accelerator_type=None, zone=None, project=None, version=None,
           spot=False, preemptible=False, reserved=False, queued=False, num_slices=1,
           async_=False, label=None, debug=False):
    """Create a TPU VM node (or queued resource) and wait until it is READY."""
    _run("create", name=name, type=type, accelerator_type=accelerator_type, zone=zone,
         project=project, version=version, spot=spot, preemptible=preemptible, reserved=reserved,
         queued=queued, num_slices=int(num_slices), async_=async_, labels=label, debug=debug)


@task(auto_shortflags=False, help=_help(HELP, "name", "yes", "zone", "project", "debug"))
def delete(c, name=None, yes=False, zone=None, project=None, debug=False):
    """Delete a TPU node (or its queued resource)."""
    _run("delete", name=name, yes=yes, zone=zone, project=project, debug=debug)


@task(name="list", auto_shortflags=False, help=_help(HELP, "json", "zone", "project", "debug"))
def list_(c, json=False, zone=None, project=None, debug=False):
    """List the TPU nodes in a zone."""
    _run("list_", as_json=json, zone=zone, project=project, debug=debug)


@task(auto_shortflags=False, help=_help(HELP, "name", "json", "zone", "project", "debug"))
def describe(c, name=None, json=False, zone=None, project=None, debug=False):
    """Show one TPU node: state, health, workers and their IPs."""
    _run("describe", name=name, as_json=json, zone=zone, project=project, debug=debug)


@task(auto_shortflags=False, help=_help(HELP, "json", "debug"))
def types(c, json=False, debug=False):
    """The accelerator types tpufab knows: hosts, chips, runtime, device files."""
    _run("types", as_json=json, debug=debug)


# -- on the workers

POD_HELP = {"command": "shell command, quoted as one argument", "name": "TPU node name",
            "worker": "workers: all, 0, 0,3-5 or w[0-3,7]",
            "gather": "print each distinct output once under its workers",
            "timeout": "per-command timeout in seconds", "script": "setup script to run",
            "force": "run even where it already ran", "zone": "zone", "project": "project",
            "debug": "show tracebacks"}


@task(name="exec", positional=["command"], auto_shortflags=False,
      help=_help(POD_HELP, "command", "name", "worker", "gather", "timeout", "zone", "project", "debug"))
def exec_(c, command, name=None, worker="all", gather=False, timeout=None, zone=None,
          project=None, debug=False):
    """Run a shell command on every (or the selected) worker."""
    _run("exec_", command=command, name=name, worker=worker, gather=gather,
         timeout=float(timeout) if timeout else None, zone=zone, project=project, debug=debug)


@task(auto_shortflags=False,
      help=_help(POD_HELP, "name", "script", "force", "worker", "timeout", "zone", "project", "debug"))
def setup(c, name=None, script="scripts/setup.sh", force=False, worker="all", timeout=None,
          zone=None, project=None, debug=False):
    """Ship a setup script and run it on every worker (once per script content)."""
    _run("setup", name=name, script=script, force=force, worker=worker,
         timeout=float(timeout) if timeout else None, zone=zone, project=project, debug=debug)


@task(auto_shortflags=False, help=_help(POD_HELP, "name", "worker", "zone", "project", "debug"))
def ssh(c, name=None, worker=0, zone=None, project=None, debug=False):
    """An interactive shell on one worker, with the right key and host key."""
    _run("ssh", name=name, worker=int(worker), zone=zone, project=project, debug=debug)


DATA_HELP = {"name": "TPU node name", "ref": "commit, branch or tag to deploy (default HEAD)",
             "remote": "git remote the workers fetch from (default origin)",
             "dir": "checkout on the workers (default: remote_dir, else ~/<repo name>)",
             "direct": "send the commit over SSH: no remote, no credentials on workers",
             "wip": "deploy the working tree as it is (snapshot on a side ref)",
             "bucket": "gs://BUCKET[/PREFIX] or BUCKET[/PREFIX]",
             "at": "mount point on the workers",
             "driver": "gcsfuse (default: mount_driver) or rclone",
             "options": "extra driver flags, quoted, e.g. --options='--dir-cache-time 10s'",
             "install": "install a missing driver on the workers",
             "lazy": "detach now even if files are open there",
             "zone": "zone", "project": "project", "debug": "show tracebacks"}


@task(auto_shortflags=False,
      help=_help(DATA_HELP, "name", "ref", "remote", "dir", "direct", "wip", "zone", "project",
                 "debug"))
def deploy(c, name=None, ref="HEAD", remote="origin", dir=None, direct=False, wip=False,
           zone=None, project=None, debug=False):
    """Put exactly one commit of this repository on every worker, verified."""
    _run("deploy", name=name, ref=ref, remote=remote, dir=dir, direct=direct, wip=wip,
         zone=zone, project=project, debug=debug)


@task(positional=["bucket"], iterable=["options"], auto_shortflags=False,
      help=_help(DATA_HELP, "bucket", "name", "at", "driver", "options", "install", "zone",
                 "project", "debug"))
def mount(c, bucket, name=None, at=None, driver=None, options=None, install=False, zone=None,
          project=None, debug=False):
    """Mount a Cloud Storage bucket (or a prefix of it) on every worker, verified."""
    _run("mount", bucket=bucket, name=name, at=at, driver=driver, options=options,
         install=install, zone=zone, project=project, debug=debug)


@task(auto_shortflags=False,
      help={**_help(DATA_HELP, "name", "lazy", "zone", "project", "debug"),
            "at": "mount point (default: every mount tpufab made)"})
def umount(c, name=None, at=None, lazy=False, zone=None, project=None, debug=False):
    """Unmount --at (or every mount tpufab made) on every worker."""
    _run("umount", name=name, at=at, lazy=lazy, zone=zone, project=project, debug=debug)


# -- jobs: run, logs, runs, kill, status, babysit

JOB_HELP = {"recipe": "executable recipe file, e.g. recipes/jax_hello.sh", "name": "TPU node name",
            "args": "the recipe's arguments, as one quoted string", "detach": "start it and return",
            "no-deploy": "skip deploying the current commit",
            "direct": "deploy straight to the workers over SSH",
            "wip": "deploy uncommitted work as a snapshot",
            "env": "K=V sets, K forwards the local value (repeatable)",
            "local": "run on this machine instead", "workers": "with --local: how many processes",
            "on-interrupt": "Ctrl-C: kill or detach (default: ask)",
            "spmd": "torch_xla SPMD (XLA_USE_SPMD=1)", "run": "run id (default: the latest)",
            "follow": "keep following", "worker": "workers: all, 0, 0,3-5 or w[0-3,7]",
            "raw": "every line, prefixed by its worker", "json": "print JSON",
            "grace": "seconds between TERM and KILL", "dry-run": "only report",
            "force": "also stop protected holders", "max-restarts": "recoveries allowed",
            "restart-on-failure": "also restart when the recipe itself fails",
            "setup-script": "setup a recreated node runs (default: the last one)",
            "zone": "zone", "project": "project", "debug": "show tracebacks"}


def _float(value):
    return float(value) if value not in (None, "") else None


@task(positional=["recipe"], iterable=["env"], auto_shortflags=False,
      help=_help(JOB_HELP, "recipe", "name", "args", "detach", "no-deploy", "direct", "wip", "env",
                 "local", "workers", "on-interrupt", "spmd", "zone", "project", "debug"))
def run(c, recipe, name=None, args="", detach=False, no_deploy=False, direct=False, wip=False,
        env=None, local=False, workers=None, on_interrupt=None, spmd=False, zone=None,
        project=None, debug=False):
    """Run a recipe on every worker at once (deploying first) and follow its logs."""
    _run("run", recipe, name=name, args=args, detach=detach, no_deploy=no_deploy, direct=direct,
         wip=wip, env=env, local=local, workers=int(workers) if workers else None,
         on_interrupt=on_interrupt, spmd=spmd, zone=zone, project=project, debug=debug)


@task(auto_shortflags=False,
      help=_help(JOB_HELP, "run", "follow", "worker", "raw", "name", "zone", "project", "debug"))
def logs(c, run=None, follow=False, worker="all", raw=False, name=None, zone=None, project=None,
         debug=False):
    """A run's logs: worker 0's lines once, plus only the lines where others differ."""
    _run("logs", run=run, follow=follow, worker=worker, raw=raw, name=name, zone=zone,
         project=project, debug=debug)


@task(auto_shortflags=False, help=_help(JOB_HELP, "name", "worker", "json", "zone", "project", "debug"))
def runs(c, name=None, worker="all", json=False, zone=None, project=None, debug=False):
    """The runs the workers know, with each worker's state."""
    _run("runs", name=name, worker=worker, as_json=json, zone=zone, project=project, debug=debug)


@task(auto_shortflags=False,
      help=_help(JOB_HELP, "name", "run", "grace", "dry-run", "force", "worker", "zone", "project",
                 "debug"))
def kill(c, name=None, run=None, grace=5.0, dry_run=False, force=False, worker="all", zone=None,
         project=None, debug=False):
    """Free the TPU everywhere: stop runs and stale holders, then remove the lockfile."""
    _run("kill", name=name, run=run, grace=float(grace), dry_run=dry_run, force=force,
         worker=worker, zone=zone, project=project, debug=debug)


@task(auto_shortflags=False, help=_help(JOB_HELP, "name", "json", "zone", "project", "debug"))
def status(c, name=None, json=False, zone=None, project=None, debug=False):
    """The node and every worker: reachable, TPU free or busy, runs, commit, mounts, disk."""
    _run("status", name=name, as_json=json, zone=zone, project=project, debug=debug)


@task(positional=["recipe"], iterable=["env"], auto_shortflags=False,
      help=_help(JOB_HELP, "recipe", "name", "max-restarts", "args", "restart-on-failure", "env",
                 "setup-script", "no-deploy", "direct", "zone", "project", "debug"))
def babysit(c, recipe, name=None, max_restarts=3, args="", restart_on_failure=False, env=None,
            setup_script=None, no_deploy=False, direct=False, zone=None, project=None,
            debug=False):
    """Run a recipe and keep it running through preemptions (recreate, set up, restart)."""
    _run("babysit", recipe, name=name, max_restarts=int(max_restarts), args=args,
         restart_on_failure=restart_on_failure, env=env, setup_script=setup_script,
         no_deploy=no_deploy, direct=direct, zone=zone, project=project, debug=debug)


# -- invoke sim.*

SIM_HELP = {"port": "API port", "state-dir": "where the simulated pod keeps its state",
            "name": "node", "worker": "worker index", "restore": "make it reachable again",
            "quota": "quota exceeded instead of stockout", "count": "how many calls fail",
            "code": "503 or 429", "json": "print JSON", "debug": "show tracebacks"}


@task(name="up", auto_shortflags=False, help=_help(SIM_HELP, "port", "state-dir", "debug"))
def sim_up(c, port=None, state_dir=None, debug=False):
    """Start the simulated pod in the background and print the lines to export."""
    _run("sim_up", port=int(port) if port else None, state_dir=state_dir, debug=debug)


@task(name="down", auto_shortflags=False, help=_help(SIM_HELP, "state-dir", "debug"))
def sim_down(c, state_dir=None, debug=False):
    """Stop the simulated pod (its nodes are kept on disk)."""
    _run("sim_down", state_dir=state_dir, debug=debug)


@task(name="status", auto_shortflags=False, help=_help(SIM_HELP, "state-dir", "json", "debug"))
def sim_status(c, state_dir=None, json=False, debug=False):
    """Is the simulated pod up, and where."""
    _run("sim_status", state_dir=state_dir, as_json=json, debug=debug)


@task(name="preempt", auto_shortflags=False, help=_help(SIM_HELP, "name", "debug"))
def sim_preempt(c, name, debug=False):
    """Preempt a node: state PREEMPTED, workers stopped."""
    _run("sim_preempt", name=name, debug=debug)


@task(name="unreachable", auto_shortflags=False, help=_help(SIM_HELP, "name", "worker", "restore", "debug"))
def sim_unreachable(c, name, worker, restore=False, debug=False):
    """Make one worker unreachable over SSH (or reachable again)."""
    _run("sim_unreachable", name=name, worker=int(worker), restore=restore, debug=debug)


@task(name="fail-create", auto_shortflags=False, help=_help(SIM_HELP, "quota", "debug"))
def sim_fail_create(c, quota=False, debug=False):
    """Make the next create fail with RESOURCE_EXHAUSTED."""
    _run("sim_fail_create", quota=quota, debug=debug)


@task(name="burst", auto_shortflags=False, help=_help(SIM_HELP, "count", "code", "debug"))
def sim_burst(c, count, code=503, debug=False):
    """Make the next COUNT API calls fail with 503 (or 429)."""
    _run("sim_burst", count=int(count), code=int(code), debug=debug)


@task(name="bucket", auto_shortflags=False,
      help={"name": "bucket name", "debug": "show tracebacks"})
def sim_bucket(c, name, debug=False):
    """Create a bucket in the simulated pod's Cloud Storage (a no-op if it exists)."""
    _run("sim_bucket", name=name, debug=debug)


@task(name="zombie", auto_shortflags=False, help=_help(JOB_HELP, "name", "worker", "debug"))
def sim_zombie(c, name=None, worker="all", debug=False):
    """Leave a crashed job's mess on workers: TPU holders, the lockfile, a protected process."""
    _run("sim_zombie", name=name, worker=worker, debug=debug)


sim = Collection("sim", sim_up, sim_down, sim_status, sim_preempt, sim_unreachable,
                 sim_fail_create, sim_burst, sim_bucket, sim_zombie)
ns = Collection(create, delete, list_, describe, types, exec_, setup, ssh, deploy, mount,
                umount, run, logs, runs, kill, status, babysit, sim)
