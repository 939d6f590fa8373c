"""tpufab port probe: does anything answer on a TCP port of this worker? Stdlib only.

    python3 -I -S ports.py wait PORT SECONDS [HOST]

Tries to connect every 0.1 s for up to SECONDS; answers (workerlib.answer) ``{"open": true,
"after": 1.23}`` or ``{"open": false, "error": "connection refused"}``, and exits 0 either way.
"""

import os
import socket
import sys
import time

from tpufab.remote.workerlib import answer


def wait(port, seconds, host="127.0.0.1"):
    began = time.monotonic()
    error = "not tried"
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return {"open": True, "after": round(time.monotonic() - began, 3)}
        except OSError as err:
            error = os.strerror(err.errno).lower() if err.errno else str(err)
        if time.monotonic() - began >= seconds:
            return {"open": False, "error": error}
        time.sleep(0.1)  # the probe's own polling interval, bounded by SECONDS


def main():
    if len(sys.argv) < 4 or sys.argv[1] != "wait":
        sys.stderr.write("usage: ports.py wait PORT SECONDS [HOST]\n")
        return 2
    host = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
    answer("answer", wait(int(sys.argv[2]), float(sys.argv[3]), host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
