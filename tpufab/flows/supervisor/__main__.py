"""`python -m tpufab.flows.supervisor serve --bucket BUCKET --name NAME`: the supervisor's
service (service.py), as the supervisor VM's systemd unit runs it. Its log lines go to stderr
(the journal); SIGTERM stops it (every job's lease released, the runs left going on their
pods for the next supervisor to re-attach to)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path


def _log(text: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {text}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    from tpufab.config import load_settings
    from tpufab.errors import TpufabError
    from tpufab.flows.supervisor.lease import DEFAULT_MARGIN, DEFAULT_TTL
    from tpufab.flows.supervisor.service import FLUSH, POLL, SECRETS_DIR, Options, Service

    parser = argparse.ArgumentParser(prog="python -m tpufab.flows.supervisor")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="keep the bucket's jobs going")
    serve.add_argument("--bucket", required=True)
    serve.add_argument("--name", required=True, help="this supervisor's name (its heartbeat)")
    serve.add_argument("--workdir", default="~/.tpufab-supervisor",
                       help="where the jobs' clones and log copies go")
    serve.add_argument("--poll", type=float, default=POLL)
    serve.add_argument("--lease-ttl", type=float, default=DEFAULT_TTL)
    serve.add_argument("--lease-margin", type=float, default=DEFAULT_MARGIN)
    serve.add_argument("--babysit-poll", type=float, default=None)
    serve.add_argument("--flush", type=float, default=FLUSH)
    serve.add_argument("--backoff", type=float, default=None,
                       help="seconds between a lost attempt and the next (babysit's backoff)")
    serve.add_argument("--secrets-dir", default=SECRETS_DIR)
    serve.add_argument("--on-vm", action="store_true",
                       help="the supervisor VM's one service (its unit): take this VM's "
                            "earlier leases at once; delete the VM after supervisor_idle")
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        workdir = Path(args.workdir).expanduser()
        workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        service = Service(settings, args.bucket.removeprefix("gs://"), args.name,
                          workdir=workdir, log=_log,
                          options=Options(poll=args.poll, ttl=args.lease_ttl,
                                          margin=args.lease_margin,
                                          babysit_poll=args.babysit_poll, flush=args.flush,
                                          backoff=None if args.backoff is None else
                                          (args.backoff, args.backoff),
                                          secrets_dir=Path(args.secrets_dir),
                                          on_vm=args.on_vm))
    except (TpufabError, ValueError, OSError) as err:
        _log(f"error: {err}")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: service.shutdown.set())
    try:
        service.serve()
    except KeyboardInterrupt:
        service.shutdown.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
