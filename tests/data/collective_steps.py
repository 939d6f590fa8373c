"""A synchronous job on the simulated TPU: every host holds its chips and, each step, runs
one program of SECONDS chip-seconds on them, then meets the others at a barrier (one byte
to worker 0 and one back, over TCP between the workers' addresses) and prints `step N`.

    collective_steps.py STEPS SECONDS

The simulated chip is busy while the holder's main thread is on a CPU or waiting for one
(tpufab/sim/tpumetrics.py), so a program of SECONDS computes until its own run + runqueue
time (/proc/self/task/PID/schedstat) grew by SECONDS: it takes that long however busy the
machine's CPUs are, as a program of a fixed size on a chip does, and longer only where the
worker is slowed (`tpufab sim slow` stops its processes: that time is neither). The step
lines of all hosts appear together (the barrier), so only each host's time outside
collectives says which one is slow. Each step ends with a short wait on every host (the next
batch read), so each step is one program on every host's chips.
"""
import glob
import os
import socket
import sys
import time

STEPS, SECONDS = int(sys.argv[1]), float(sys.argv[2])
PORT = 8479
held = [open(p, "rb") for p in sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))]
me = int(os.environ["TPU_WORKER_ID"])
hosts = os.environ["TPU_WORKER_HOSTNAMES"].split(",")
SCHEDSTAT = f"/proc/self/task/{os.getpid()}/schedstat"


def chip_seconds() -> float:
    with open(SCHEDSTAT, "rb") as f:
        run, wait = f.read().split()[:2]
    return (int(run) + int(wait)) / 1e9


def program(seconds: float) -> None:
    start, x = chip_seconds(), 0
    while chip_seconds() - start < seconds:
        for _ in range(2000):
            x = (x * 31 + 7) % 1000003


def exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        got = conn.recv(size - len(data))
        if not got:
            sys.exit(f"w{me}: a peer left the barrier")
        data += got
    return data


if me == 0:
    server = socket.create_server((hosts[0], PORT))
    peers = [server.accept()[0] for _ in hosts[1:]]
else:
    deadline = time.monotonic() + 60
    while True:
        try:
            peers = [socket.create_connection((hosts[0], PORT), timeout=5)]
            peers[0].settimeout(None)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
print(f"holding {len(held)} chips, {len(hosts)} hosts", flush=True)
for step in range(1, STEPS + 1):
    program(SECONDS)
    if me == 0:
        for peer in peers:
            exactly(peer, 1)
        for peer in peers:
            peer.sendall(b".")
    else:
        peers[0].sendall(b".")
        exactly(peers[0], 1)
    print(f"step {step}", flush=True)
    # the next batch is read: a wait of its own on every host (the simulated chip ends a
    # program at a wait; worker 0, last at the barrier, may not have waited there)
    time.sleep(0.002)
