"""One supervisor at a time per job: a lease object with an expiry, in the job's folder.

    gs://BUCKET/tpufab/jobs/<job>/lease.json
    {"holder": "tpufab-supervisor", "token": "<random, per take>", "taken_at": ...,
     "renewed_at": ..., "expires_at": ..., "ttl": 60}

- **take**: written with ``ifGenerationMatch=0`` when there is no lease, or
  ``ifGenerationMatch=<the generation read>`` when the one there expired more than ``margin``
  seconds ago by the taker's clock: of any number of takers at once exactly one write lands.
- **renew**: the holder rewrites it (a later expiry) every ttl/3, over the generation it
  wrote last; a renewal that fails (412: someone took it; or the lease already within
  ``margin`` of its expiry by the holder's clock) loses it for good.
- **valid**: held, and more than ``margin`` seconds before its expiry by the holder's clock.
  A holder checks it before every step that acts (create, delete, start, kill) and stops
  acting for the job the moment it is false. With the holder stopping ``margin`` before the
  expiry and a taker waiting ``margin`` after it, clocks may disagree by up to 2 x margin.
- **fencing**: the taker writes its token into the state record (``state.Owner``); every
  state write is conditional on the generation read and fenced on that token
  (:meth:`Lease.fence`), so a holder that lost its lease without knowing can never write
  over the new holder's record.

The decisions (:func:`free`, :func:`renew_due`, :func:`granted`) are pure; ``Lease`` applies
them to the bucket.
"""

from __future__ import annotations

import secrets as _random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from tpufab.errors import TpufabError

if TYPE_CHECKING:
    from tpufab.cloud.storage import Storage
    from tpufab.flows.supervisor.state import JobState, Records

DEFAULT_TTL = 60.0          # seconds a lease lasts unless renewed
DEFAULT_MARGIN = 10.0       # seconds of clock skew allowed each way


class LeaseLost(TpufabError):
    """This supervisor no longer holds the job: it must not act for it."""


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    token: str
    taken_at: float
    renewed_at: float
    expires_at: float
    ttl: float

    def to_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> LeaseRecord:
        return cls(holder=str(data["holder"]), token=str(data["token"]),
                   taken_at=float(data["taken_at"]), renewed_at=float(data["renewed_at"]),
                   expires_at=float(data["expires_at"]), ttl=float(data["ttl"]))


# -- the decisions (pure) -----------------------------------------------------------------------


def free(record: LeaseRecord | None, now: float, margin: float = DEFAULT_MARGIN) -> bool:
    """May a supervisor take the job now? Only when nobody holds it, or the holder's lease
    ran out more than ``margin`` seconds ago."""
    return record is None or now > record.expires_at + margin


def holder_of(record: LeaseRecord | None, now: float,
              margin: float = DEFAULT_MARGIN) -> str | None:
    """Who holds the job as seen from here (None: nobody, or a lease that ran out)."""
    return None if record is None or free(record, now, margin) else record.holder


def renew_due(record: LeaseRecord, now: float) -> bool:
    return now >= record.renewed_at + record.ttl / 3


def granted(holder: str, token: str, now: float, ttl: float,
            taken_at: float | None = None) -> LeaseRecord:
    return LeaseRecord(holder=holder, token=token, taken_at=now if taken_at is None else taken_at,
                       renewed_at=now, expires_at=now + ttl, ttl=ttl)


# -- the lease in the bucket ------------------------------------------------------------------


class Lease:
    """``holder``'s lease on ``job``. ``clock`` (epoch seconds) is the supervisor's own."""

    def __init__(self, store: Storage, bucket: str, job: str, holder: str, *,
                 ttl: float = DEFAULT_TTL, margin: float = DEFAULT_MARGIN,
                 clock: Callable[[], float] = time.time, token: str | None = None):
        from tpufab.flows.supervisor.state import lease_name

        if not ttl > 2 * margin:
            raise ValueError("a lease's ttl must be longer than twice its margin")
        self.store = store
        self.bucket = bucket
        self.job = job
        self.name = lease_name(job)
        self.holder = holder
        self.ttl = ttl
        self.margin = margin
        self.clock = clock
        self.token = token or _random.token_hex(12)
        self.record: LeaseRecord | None = None
        self.generation: int | None = None
        self.lost = False

    def read(self) -> tuple[LeaseRecord, int] | None:
        found = self.store.read_json(self.bucket, self.name)
        return (LeaseRecord.from_record(found[0]), found[1].generation) if found else None

    def take(self, dead: Callable[[LeaseRecord], bool] | None = None) -> bool:
        """Take the job if it is free (True), else leave it (False). ``dead``: says of a
        lease that has not run out that its holder is certainly gone (a supervisor's own
        earlier process on its VM), so it is taken at once, over its generation."""
        from tpufab.cloud.storage import PreconditionFailed

        now = self.clock()
        found = self.read()
        if found is not None and found[0].token == self.token:
            self.record, self.generation = found
            return self.valid()
        if found is not None and not free(found[0], now, self.margin) and \
                not (dead is not None and dead(found[0])):
            return False
        record = granted(self.holder, self.token, now, self.ttl)
        try:
            blob = self.store.put_json(self.bucket, self.name, record.to_record(),
                                       if_generation_match=found[1] if found else 0)
        except PreconditionFailed:
            return self._landed(record)
        self.record, self.generation, self.lost = record, blob.generation, False
        return True

    def renew(self) -> bool:
        """Push the expiry out; False (and lost for good) when the lease is no longer ours."""
        from tpufab.cloud.storage import PreconditionFailed, StorageError

        if self.lost or self.record is None:
            return False
        now = self.clock()
        if now >= self.record.expires_at - self.margin:
            self.lost = True             # too late: a taker may be about to take it
            return False
        record = replace(self.record, renewed_at=now, expires_at=now + self.ttl)
        try:
            blob = self.store.put_json(self.bucket, self.name, record.to_record(),
                                       if_generation_match=self.generation)
        except PreconditionFailed:
            if self._landed(record):
                return True
            self.lost = True
            return False
        except StorageError:
            return self.valid()          # an outage: still ours until the expiry says not
        self.record, self.generation = record, blob.generation
        return True

    def _landed(self, record: LeaseRecord) -> bool:
        """After a 412: did our own write land (its answer lost, the call retried)?"""
        found = self.read()
        if found is not None and found[0] == record:
            self.record, self.generation, self.lost = record, found[1], False
            return True
        return False

    def valid(self) -> bool:
        """Ours, and not within ``margin`` of its expiry by our clock: safe to act."""
        return not self.lost and self.record is not None and \
            self.clock() < self.record.expires_at - self.margin

    def check(self) -> None:
        """Raise LeaseLost unless :meth:`valid` (before every step that acts)."""
        if not self.valid():
            raise LeaseLost(f"This supervisor ({self.holder}) no longer holds job {self.job}; "
                            "it stops acting for it.")

    def fence(self, state: JobState) -> None:
        """For ``Records.update``: the lease still valid, and the state still names this
        lease as its owner (a newer holder's token there: lost)."""
        self.check()
        if state.owner is None or state.owner.token != self.token:
            self.lost = True
            raise LeaseLost(f"Job {self.job} is held by "
                            f"{state.owner.holder if state.owner else 'nobody'} now, not by "
                            f"this supervisor ({self.holder}); it stops acting for it.")

    def release(self) -> None:
        """Give the job up at once (deleted only if it is still our lease)."""
        from tpufab.cloud.storage import PreconditionFailed

        self.lost = True
        if self.generation is None:
            return
        try:
            self.store.delete(self.bucket, self.name, if_generation_match=self.generation)
        except PreconditionFailed:
            pass                         # someone else's lease by now: theirs to keep

    def kept(self, on_lost: Callable[[], None] | None = None) -> Keeper:
        """A thread renewing the lease every ttl/3 until released (``with lease.kept():``);
        ``on_lost`` is called once if it is lost."""
        return Keeper(self, on_lost)


def take_job(records: Records, lease: Lease,
             dead: Callable[[LeaseRecord], bool] | None = None) -> JobState | None:
    """Take ``lease``'s job if it is free (or its holder ``dead``, Lease.take), then write the lease's token into the job's state
    as its owner (fenced on the lease being valid): from then on no state write of an older
    holder lands. The state as taken, or None when another supervisor holds the job."""
    from tpufab.flows.supervisor.state import Owner, take_ownership

    if not lease.take(dead):
        return None
    owner = Owner(lease.holder, lease.token)
    try:
        return records.update(lease.job, lambda s: take_ownership(s, owner, records.now()),
                              fence=lambda s: lease.check())
    except BaseException:
        lease.release()                  # not half-taken: free for the next one at once
        raise


class Keeper:
    def __init__(self, lease: Lease, on_lost: Callable[[], None] | None):
        self.lease = lease
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tpufab-lease-{lease.job}")

    def _run(self) -> None:
        while not self._stop.wait(self.lease.ttl / 3):
            if not self.lease.renew() and not self.lease.valid():
                if self.on_lost is not None:
                    self.on_lost()
                return

    def __enter__(self) -> Keeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=self.lease.ttl)
        self.lease.release()
