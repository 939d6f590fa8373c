"""tpufab: make a Cloud TPU pod feel like one machine.

    from tpufab import Pod
    pod = Pod.current()            # this project's pod; Pod("name") for another
    pod.run("nvidia-smi || hostname")

See tpufab.pod.api. Importing tpufab loads neither paramiko nor google-cloud-tpu, and nothing
at all until a name is used: the ``tpufab`` command's entry (tpufab.entry) is inside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public API (docs/api.md): each name, and the module it lives in. They load on first use.
API = {"Pod": "tpufab.pod.api", "Run": "tpufab.pod.run", "Launched": "tpufab.pod.launched",
       "launch": "tpufab.pod.launched", "create": "tpufab.pod.pods",
       "create_node": "tpufab.pod.pods", "delete": "tpufab.pod.pods", "gc": "tpufab.pod.pods",
       "list_pods": "tpufab.pod.pods", "describe": "tpufab.pod.pods",
       "forget_host_keys": "tpufab.pod.pods",
       # one result type and one exception carrying every worker's result: the fan-out's
       # (Fabric's GroupResult and GroupException)
       "PodResult": "tpufab.ssh.results:GroupResult", "PodError": "tpufab.ssh.results:FanoutError"}
__all__ = ["Pod", "Run", "Launched", "launch", "create", "create_node", "delete", "gc",
           "list_pods", "describe", "forget_host_keys", "PodResult", "PodError"]   # = API

if TYPE_CHECKING:
    from tpufab.pod.api import Pod
    from tpufab.pod.launched import Launched, launch
    from tpufab.pod.pods import (
        create,
        create_node,
        delete,
        describe,
        forget_host_keys,
        gc,
        list_pods,
    )
    from tpufab.pod.run import Run
    from tpufab.ssh.results import FanoutError as PodError
    from tpufab.ssh.results import GroupResult as PodResult


def __getattr__(name: str) -> object:
    """A name of the public API, loaded from its module on first use."""
    if name not in API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, _, attr = API[name].partition(":")
    return getattr(importlib.import_module(module), attr or name)
