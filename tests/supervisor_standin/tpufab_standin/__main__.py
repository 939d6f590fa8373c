"""`python -m tpufab_standin serve --bucket B --name N`: what the supervisor VM's tests need of
a service, through tpufab's own VM-side calls: a heartbeat a second in the bucket (its pid,
start, user and which tpufab it imports), and the idle end (tpufab.flows.supervisor.vm's
IdleWatch and delete_self: the VM deletes itself after supervisor_idle with no live job)."""

import argparse
import getpass
import os
import sys
import time

import tpufab
from tpufab.cloud.storage import Storage
from tpufab.config import load_settings
from tpufab.flows.supervisor import vm
from tpufab.flows.supervisor.state import heartbeat_name, idle_seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    settings = load_settings({"supervisor_bucket": args.bucket, "supervisor_name": args.name})
    store = Storage.from_settings(settings)
    watch = vm.IdleWatch(idle_seconds(settings))
    started, beats, deleting = time.time(), 0, None
    def beat(live: int) -> None:
        store.put_json(args.bucket, heartbeat_name(args.name), {
            "pid": os.getpid(), "started_at": started, "beats": beats, "at": time.time(),
            "version": tpufab.__version__, "tpufab_file": tpufab.__file__,
            "user": getpass.getuser(), "uid": os.getuid(), "live": live,
            "deleting": deleting})

    while True:
        live = len(vm.live_jobs(settings))
        beats += 1
        beat(live)
        if watch.update(live) and deleting is None:
            deleting = time.time()
            beat(live)   # said before the VM (and this process) goes
            vm.delete_self(settings)
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
