"""tpufab: make a Cloud TPU pod feel like one machine.

    from tpufab import Pod
    pod = Pod.current()            # this project's pod; Pod("name") for another
    pod.run("nvidia-smi || hostname")

See tpufab.api. Importing tpufab loads neither fabric nor google-cloud-tpu.
"""

from tpufab.api import Pod, PodError, PodResult, Run, create, delete, gc

__version__ = "0.1.0"
__all__ = ["Pod", "PodError", "PodResult", "Run", "create", "delete", "gc"]
