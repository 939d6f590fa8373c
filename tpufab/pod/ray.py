"""The Pod's Ray methods (docs/ray.md): `tpufab ray up | status | submit | down`. A base of
``tpufab.Pod`` (the Pod class stays under the house's 600 lines); the work is
``tpufab.steps.start.raycluster``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpufab.steps.start.raycluster import RayDown, RayStatusReport, RayUp, Submitted

Progress = Callable[..., None]          # progress(text, style=None): a step's notes


class PodRay:
    """Mixed into ``tpufab.Pod``: it has ``settings`` and ``_timeout``."""

    def ray_up(self, *, options: Sequence[str] | None = None, timeout: float | None = None,
               progress: Progress | None = None, join_batch: int = 0) -> RayUp:
        """`tpufab ray up`: Ray's head on worker 0 of slice 0, every other host joined, each
        with the TPU environment Ray labels its node from; a quick no-op when Ray is up
        everywhere. ``options``: more ``ray start`` options for every host; ``join_batch``:
        hosts joined at a time (0: all at once); ``timeout``: TIMEOUTS["ray up"]. Returns a
        RayUp (``.address``, ``.already``, ``.started``); raises RayError saying where and why
        it could not."""
        from tpufab.steps.start import raycluster

        return raycluster.up(self, extra=list(options or ()),
                             timeout=self._timeout("ray up", timeout),
                             progress=progress or raycluster.silent,
                             join_batch=join_batch)

    def ray_status(self, *, timeout: float | None = None) -> RayStatusReport:
        """`tpufab ray status`: whether Ray is up, the nodes the head sees (TPU resources,
        the head resource, slice labels), the hosts not joined and the jobs: a RayStatusReport, a
        Report whose rows are the hosts (``.up``, ``.healthy``, ``.missing``; printed by
        ``tpufab.views.report.show``)."""
        from tpufab.steps.start import raycluster

        return raycluster.status(self, timeout=self._timeout("ray status", timeout))

    def ray_submit(self, recipe: str | Path, extra: Sequence[str] = (), *,
                   env: Sequence[str] | None = None, secret: Sequence[str] | None = None,
                   no_deploy: bool = False, direct: bool = False,
                   timeout: float | None = None, out: Callable[[str], None] | None = None,
                   progress: Progress | None = None) -> Submitted:
        """`tpufab ray submit`: deploy the commit (as `run` does), submit ``recipe`` with
        ``extra`` as its arguments through Ray's Job API (over a port forwarded to the head's
        127.0.0.1), follow its logs (``out(line)``, secrets masked) until it ends. Returns a
        Submitted (``.job``, ``.status``, ``.exit_code``); raises RayError when Ray is not
        up."""
        from tpufab.steps.start import raycluster

        return raycluster.submit(self, self.settings, recipe, list(extra), env=env,
                                 secret=secret, no_deploy=no_deploy, direct=direct,
                                 timeout=self._timeout("ray submit", timeout),
                                 out=out, progress=progress or raycluster.silent)

    def ray_down(self, *, grace: float = 10.0, timeout: float | None = None) -> RayDown:
        """`tpufab ray down`: `ray stop` on every host (then forced) until no Ray process is
        left: a RayDown (``.answers``); RayError names hosts where Ray processes are left."""
        from tpufab.steps.start import raycluster

        return raycluster.down(self, grace=grace,
                               timeout=self._timeout("ray down", timeout))
