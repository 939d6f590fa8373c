"""The frames between a fan-out and its other processes (a shard child, the pod's keeper): a
4-byte length and a pickle of plain data, over a private pipe or a private unix socket."""

from __future__ import annotations

import pickle
import struct
import threading
from typing import Any

LENGTH = struct.Struct(">I")


def write_frame(stream, lock: threading.Lock, message: tuple) -> None:
    """One message to ``stream`` (whole, under ``lock``), flushed."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        stream.write(LENGTH.pack(len(data)) + data)
        stream.flush()


def read_frame(stream) -> Any:
    """The next message on ``stream``; None at its end (or a torn last frame)."""
    head = stream.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    size = LENGTH.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)  # noqa: S301 - our own child process over a private pipe
