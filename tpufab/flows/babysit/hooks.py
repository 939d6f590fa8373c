"""What a caller plugs into the babysitter to run it as someone else's loop (the supervisor,
tpufab/flows/supervisor/service.py); the defaults change nothing, so `tpufab babysit` is
babysit as before.

- ``planned(number, run_id, reason, ended)``: attempt ``number`` (0 for the first) will be
  run ``run_id``, started because of ``reason`` (``first``, or the restart's kind); called
  BEFORE anything of it is started on the pod, and before the node is recovered for it.
  ``ended`` is the attempt before it as it ended (None for the first), so that the caller
  can record "attempt k ended, attempt k+1 planned" as one write.
- ``started(number, run_id, workers, attached)``: the run is going on the pod (``attached``:
  it was already going, and the babysitter followed it instead of starting it).
- ``ended(attempt, final)``: the babysit ends after ``attempt`` (``final``: finished).
- ``output(number, run_id, workers)``: the sink of the attempt's output (``lines``,
  ``done``, ``close``), or None for the babysitter's own view.
- ``go_on()``: None to go on, else why to stop (``cancel``: stop the run and end;
  ``lost``: stop acting at once, touching nothing). Asked before every step that acts on the
  pod (recover: delete, create; deploy; start; stop) and at every poll of an attempt.

``Resume(run_id, history)``: the babysitter continues a babysit someone else began:
``history`` the attempts so far (their restart kinds count against the budgets as if this
babysitter had made them), ``run_id`` the attempt planned or running: followed where it is
going on the pod, started where it never started (the worker side refuses a second start of
one run id: ``run_worker.py start`` makes the run's folder with ``mkdir``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpufab.flows.babysit.policy import BabysitError

if TYPE_CHECKING:
    from tpufab.flows.babysit.records import Attempt


class Hooks:
    """The no-op hooks: babysit as `tpufab babysit` runs it."""

    def planned(self, number: int, run_id: str, reason: str, ended: Attempt | None) -> None:
        pass

    def started(self, number: int, run_id: str, workers: Sequence[int],
                attached: bool) -> None:
        pass

    def ended(self, attempt: Attempt, final: str) -> None:
        pass

    def output(self, number: int, run_id: str, workers: Sequence[int]) -> Any:
        return None

    def go_on(self) -> str | None:
        return None


@dataclass(frozen=True)
class Resume:
    run_id: str
    history: Sequence[Attempt] = field(default_factory=tuple)


class Stopped(BabysitError):
    """The caller's ``go_on`` said stop (``why``: cancel or lost)."""

    def __init__(self, why: str, step: str):
        self.why = why
        self.step = step
        super().__init__(f"babysit stopped before {step}: {why}")
