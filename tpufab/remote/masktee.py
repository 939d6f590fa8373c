#!/usr/bin/env python3
"""Copy stdin to stdout and into a log file, secrets masked in both (stdlib only; shipped once
per content hash). The setup runner's output goes through it, so a setup log on a worker never
holds a secret (issue 23, finding 6).

    masktee.py LOG [NAME ...]      (LOG "-": no log, stdout only: a Ray job's output)

NAME: environment variables whose values are secrets (the names travel in argv, the values
only in this process's environment, sent on the fan-out agent's stdin). LOG is created 0600
(replaced if it exists); a log that cannot be written (a full disk) stops being written, while
the output still reaches stdout.
"""

import os
import sys

from tpufab.remote.workerlib import Masker, secret_forms

CHUNK = 1 << 16


def main(argv):
    if len(argv) < 2:
        sys.stderr.write("usage: masktee.py LOG [NAME ...]\n")
        return 2
    values = [os.environ.get(name, "") for name in argv[2:]]
    masker = Masker([form.encode() for form in secret_forms(values)])
    log = None
    try:
        if argv[1] != "-":
            fd = os.open(argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)
            log = os.fdopen(fd, "wb")
    except OSError as err:
        sys.stderr.write(f"tpufab: cannot write the setup log {argv[1]}: {err.strerror}\n")
    out = sys.stdout.buffer
    while True:
        data = os.read(0, CHUNK)
        masked = masker.feed(data) if data else masker.flush()
        if masked:
            out.write(masked)
            out.flush()
            if log is not None:
                try:
                    log.write(masked)
                    log.flush()
                except OSError:
                    log = None
        if not data:
            break
    if log is not None:
        try:
            log.close()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
