"""Requests per second a simulated worker's metadata server answers, asked from inside the worker.

    sudo .venv/bin/python bench/sim_metadata.py [--requests 200] [--rounds 3]

Starts a simulated pod in a temporary state dir, creates a v4-8, and runs a stdlib loop on the
worker (over ssh) that GETs instance/attributes/agent-worker-number with the required header,
as JAX's pod discovery does; prints one line per round. Everything runs on this machine.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import tempfile
from pathlib import Path

LOOP = """import sys, time, urllib.request as u
r = u.Request('http://metadata.google.internal/computeMetadata/v1/instance/attributes/'
              'agent-worker-number', headers={'Metadata-Flavor': 'Google'})
t = time.perf_counter()
n = int(sys.argv[1])
for _ in range(n): u.urlopen(r).read()
d = time.perf_counter() - t
print(f'{n / d:.0f} requests/s, {d / n * 1000:.2f} ms each')
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import tpu_v2

    from tpufab.sim.daemon import down, up

    base = Path(tempfile.mkdtemp(prefix="bench-metadata-"))
    key = base / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    info = up(base / "state", port=0)
    try:
        client = tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
                                  client_options=ClientOptions(api_endpoint=info.endpoint))
        node = client.create_node(
            parent=f"projects/{info.project}/locations/{info.zone}", node_id="bench",
            node=tpu_v2.Node(accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base",
                             metadata={"ssh-keys": f"alice:{key.with_suffix('.pub').read_text()}"})
        ).result(timeout=120)
        ip = node.network_endpoints[0].ip_address
        for _ in range(args.rounds):
            done = subprocess.run(
                ["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                 "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"alice@{ip}",
                 shlex.join(["python3", "-c", LOOP, str(args.requests)])],
                capture_output=True, text=True, timeout=300)
            print(done.stdout.strip() or done.stderr.strip())
    finally:
        down(base / "state")


if __name__ == "__main__":
    main()
