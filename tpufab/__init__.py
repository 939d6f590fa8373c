"""tpufab: make a Cloud TPU pod feel like one machine.

    from tpufab import Pod
    pod = Pod.current()            # this project's pod; Pod("name") for another
    pod.run("nvidia-smi || hostname")

See tpufab.pod.api. Importing tpufab loads neither fabric nor google-cloud-tpu.
"""

from tpufab.pod.api import Pod, Run, create, delete, gc

__version__ = "0.1.0"
__all__ = ["Pod", "PodError", "PodResult", "Run", "create", "delete", "gc"]


def __getattr__(name: str):
    """``PodError`` and ``PodResult`` load with the fan-out, on first use (tpufab.pod.api)."""
    if name in ("PodError", "PodResult"):
        from tpufab.pod import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
