"""tpufab: make a Cloud TPU pod feel like one machine.

    from tpufab import Pod
    pod = Pod.current()            # this project's pod; Pod("name") for another
    pod.run("nvidia-smi || hostname")

See tpufab.pod.api. Importing tpufab loads neither fabric nor google-cloud-tpu, and nothing
at all until a name is used: the ``tpufab`` command's entry (tpufab.entry) is inside it.
"""

__version__ = "0.1.0"
__all__ = ["Pod", "PodError", "PodResult", "Run", "create", "delete", "gc"]


def __getattr__(name: str):
    """The API's names load on first use (tpufab.pod.api; PodError and PodResult with the
    fan-out)."""
    if name in __all__:
        from tpufab.pod import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
