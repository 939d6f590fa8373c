"""The `status` verb both front ends call (like verbs.py: flags in, library
call, printing out). Heavy modules are imported inside each verb."""

from __future__ import annotations

import json

from tpufab.verbs import settings_from_flags


def status(*, name: str | None = None, as_json: bool = False, zone: str | None = None,
           project: str | None = None) -> int:
    """The node's API state and every worker's facts, workers that agree folded into one row.

    Exit code 0 when the node is READY and every worker answered, 1 otherwise.
    """
    from tpufab import status as status_mod
    from tpufab.console import stdout

    settings = settings_from_flags(name=name, zone=zone, project=project)
    found = status_mod.collect(settings)
    if as_json:
        print(json.dumps(found.to_json(), indent=2))
    else:
        status_mod.render(found, stdout())
    return 0 if found.healthy else 1
