"""tpufab's own checkout uses tpufab's invoke collection like any project: `invoke --list`."""

from tpufab.tasks import ns  # noqa: F401
