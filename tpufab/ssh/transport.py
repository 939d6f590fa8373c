"""What every SSH connection tpufab opens shares (the fan-out's and the jump host's): the
errors a connection can end in, and paramiko's logging kept quiet."""

from __future__ import annotations

from tpufab.errors import TpufabError


class ConnectError(TpufabError):
    """A worker could not be reached or logged into."""


class WorkerSilent(ConnectError):
    """The worker accepted the connection but did not answer within the connect timeout."""


def quiet_paramiko() -> None:
    """paramiko logs its transport thread's failures with tracebacks through the logging
    module's last-resort handler (stderr); each worker's failure is reported as one sentence
    instead. --debug (a configured root logger) still sees them."""
    import logging

    logger = logging.getLogger("paramiko")
    if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
        logger.addHandler(logging.NullHandler())
