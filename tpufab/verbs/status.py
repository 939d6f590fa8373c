"""status and babysit."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tpufab.verbs.common import chosen_name_note, note, settings_from_flags, split_args
from tpufab.verbs.declare import Opt, verb
from tpufab.verbs.jobs import RUN_OPTIONS

STATUS_TIMEOUT = 60.0     # seconds for every worker to answer
BABYSIT_TIMEOUT = 600.0   # seconds per step (setup, deploy, start, a check); never the follow


@verb()
def status(*, name: str | None = None, as_json: bool = False, timeout: float = STATUS_TIMEOUT,
           zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> int:
    """The node and every worker: reachable, TPU free or busy, runs, commit, mounts, disk.

    Exit code 0 when the node is READY and every worker answered, 1 otherwise. ``timeout``:
    seconds a worker has to answer (default 60; connecting at most connect_timeout).
    """
    from tpufab import status as status_mod
    from tpufab.console import stdout

    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                   jump=jump, timeout=timeout)
    if not as_json and settings.name:
        note(f"Pod {chosen_name_note(settings)}", "dim")
    found = status_mod.collect(settings)
    stopping = _autostop_state(found, settings)
    if as_json:
        print(json.dumps({**found.to_json(), "autostop": stopping}, indent=2))
    else:
        status_mod.render(found, stdout())
        if stopping:
            from tpufab.autostop import status_lines

            for line in status_lines(stopping):
                stdout().print(line, markup=False)
    return 0 if found.healthy else 1


def _autostop_state(found, settings) -> dict | None:
    """Worker 0's autostop view when the node says one is armed or the worker has events."""
    from tpufab import autostop
    from tpufab.errors import TpufabError

    nodes = [n for n in found.nodes if n.ready]
    if not nodes or 0 not in found.workers or not found.workers[0].reachable:
        return None
    try:
        from tpufab import pod as pods

        state = autostop.worker_state(pods.shared(settings))
    except TpufabError as err:
        return {"error": str(err)}
    return state if state.get("config") or state.get("events") else None


@verb(options={"recipe": RUN_OPTIONS["recipe"], "args": RUN_OPTIONS["args"],
                 "max_restarts": Opt("Recoveries allowed.", min=0),
                 "restart_on_failure": "Also restart when the recipe itself fails.",
                 "setup_script": "Setup a recreated node runs (default: the last one).",
                 "no_deploy": "Skip deploying.", "direct": "Deploy straight to the workers.",
                 "poll": Opt("Seconds between checks (tests).", hidden=True)})
def babysit(recipe: str, *, name: str | None = None, max_restarts: int = 3, args: str = "",
            restart_on_failure: bool = False, env: Sequence[str] | None = None,
            setup_script: str | None = None, no_deploy: bool = False, direct: bool = False,
            poll: float | None = None, timeout: float = BABYSIT_TIMEOUT,
            zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> int:
    """Run a recipe and keep it running through preemptions (recreate, set up, restart).

    ``args``: the recipe's arguments as one string, split like a shell would (as `run`).
    ``env``: ``K=V`` or ``K`` (forward the local value), as `run`. ``setup_script``: what a
    recreated node runs first (default: the script the workers last ran with `tpufab setup`).
    ``timeout``: seconds each step on the workers may take (setup, deploy, start, each
    check; default 600); following the recipe's logs has no limit.
    Returns 0 when the recipe finished on every worker; otherwise BabysitError says why.
    """

    from tpufab import babysit as babysitting

    argv = split_args(args)
    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                   jump=jump, timeout=timeout)
    options = {} if poll is None else {"poll": poll}
    result = babysitting.babysit(settings, recipe, args=argv, max_restarts=max_restarts,
                                 restart_on_failure=restart_on_failure, env=list(env or ()),
                                 setup_script=setup_script, no_deploy=no_deploy,
                                 direct=direct, **options)
    return result.exit_code
