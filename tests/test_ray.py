"""Ray on the pod, the parts that need no Ray: the job's entrypoint (its output masked before
Ray's job log sees it), the Job API client's token, and the worker side's private files
(issue 37, High 1 and 2). Real Ray on the simulated pod: tests/test_ray_sim.py."""

from __future__ import annotations

import http.server
import json
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from helpers import shipped

from tpufab.ssh.remote_files import RemoteFile
from tpufab.steps.start import raycluster

SECRET = "hf_Ray-secret-never-in-logs-4417"
RECIPE = """import os, sys
print("token is " + os.environ["HF_TOKEN"], flush=True)
sys.stderr.write("again " + os.environ["HF_TOKEN"] + "\\n")
sys.exit(int(sys.argv[1]))
"""


def place(home: Path, f: RemoteFile) -> None:
    target = home / f.path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(f.data)
    target.chmod(f.mode)


@pytest.mark.parametrize("code", [0, 3])
def test_a_ray_jobs_output_is_masked_before_ray_logs_it(tmp_path, code):
    """The entrypoint `ray submit` gives Ray: what Ray's job supervisor writes to the job's
    log (the entrypoint's stdout and stderr) never holds a secret, and the job exits with the
    recipe's status. Before, the recipe's own output went to Ray's log as printed."""
    home = tmp_path / "home"
    recipe = RemoteFile("job.py", RECIPE.encode(), 0o755)
    masktee = RemoteFile.bundled("masktee.py")
    for f in (recipe, masktee):
        place(home, f)
    (home / ".cache/tpufab/ray").mkdir(parents=True)
    secrets_file = ".cache/tpufab/ray/j.env"
    (home / secrets_file).write_text(f"HF_TOKEN={SECRET}\n")
    command = raycluster.entrypoint(recipe.path, is_python=True, args=[str(code)], cwd=None,
                                    secrets_file=secrets_file, secret_names=["HF_TOKEN"],
                                    masktee=masktee.path, masktee_sha256=masktee.sha256)
    env = {"HOME": str(home), "PATH": os.environ["PATH"],
           "TPUFAB_PYTHON": str(Path(os.sys.executable))}
    done = subprocess.run(command, shell=True, env=env, capture_output=True, text=True,
                          timeout=60)
    logged = done.stdout + done.stderr            # what Ray's log file would hold
    assert SECRET not in logged and SECRET not in command
    assert "token is ***" in logged and "again ***" in logged
    assert done.returncode == code
    assert not (home / secrets_file).exists()     # read, then removed
    assert not list((home / ".cache/tpufab/ray").glob("rc.*"))


def test_a_changed_masking_script_on_the_head_is_never_run(tmp_path):
    home = tmp_path / "home"
    recipe = RemoteFile("job.py", RECIPE.encode(), 0o755)
    masktee = RemoteFile.bundled("masktee.py")
    for f in (recipe, masktee):
        place(home, f)
    (home / ".cache/tpufab/ray").mkdir(parents=True)
    (home / masktee.path).write_text("import sys; sys.stdout.write(sys.stdin.read())\n")
    (home / ".cache/tpufab/ray/j.env").write_text(f"HF_TOKEN={SECRET}\n")
    command = raycluster.entrypoint(recipe.path, is_python=True, args=["0"], cwd=None,
                                    secrets_file=".cache/tpufab/ray/j.env",
                                    secret_names=["HF_TOKEN"], masktee=masktee.path,
                                    masktee_sha256=masktee.sha256)
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60,
                          env={"HOME": str(home), "PATH": os.environ["PATH"]})
    assert done.returncode == 97 and SECRET not in done.stdout + done.stderr
    assert "the masking script on the head was changed" in done.stderr


def test_the_job_api_client_sends_the_clusters_token(tmp_path):
    """Ray's token authentication: the dashboard answers 401 without the token; tpufab's Job
    API client sends it as a bearer token."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            ok = self.headers.get("Authorization") == "Bearer tok-1"
            body = json.dumps({"status": "RUNNING"} if ok else {}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert raycluster.JobApi(url, "tok-1").info("j") == {"status": "RUNNING"}
        with pytest.raises(raycluster.RayError, match="answered 401"):
            raycluster.JobApi(url).info("j")
    finally:
        server.shutdown()
    assert seen == ["Bearer tok-1", None]


def test_ray_nodes_token_and_started_files_are_private(tmp_path):
    """ray_worker.py keeps the cluster's token where Ray looks for it (~/.ray/auth_token), 0600
    in a 0700 directory, replacing a file that was there (never writing through a link)."""
    script = shipped("ray_worker.py")
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray").chmod(0o755)
    outside = tmp_path / "outside"
    outside.write_text("keep\n")
    (home / ".ray" / "auth_token").symlink_to(outside)
    probe = (f"import runpy, sys; g = runpy.run_path({str(script)!r}, run_name='ray_node'); "
             "g['private_file'](g['TOKEN_PATH'], 'tok'); "
             "print(g['read'](__import__('os').path.expanduser(g['TOKEN_PATH'])))")
    done = subprocess.run([os.sys.executable, "-c", probe], env={"HOME": str(home)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tok" and outside.read_text() == "keep\n"
    token = home / ".ray" / "auth_token"
    assert not token.is_symlink()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE((home / ".ray").stat().st_mode) == 0o700


def test_hosts_on_loopback_addresses_get_a_dashboard_agent_port_each():
    """Ray's agent binds its port on the node's address and on 127.0.0.1: hosts on loopback
    addresses (the simulated pod) share that one, so each gets its own port; a TPU VM's
    address, or a port the user passes, keeps Ray's."""
    from tpufab.remote.ray_worker import agent_port

    ports = {agent_port(f"127.16.{n}.{w}", []) for n in range(1, 4) for w in range(1, 9)}
    assert len(ports) == 24 and all(1024 < p < 65536 for p in ports)
    assert agent_port("10.128.0.7", []) is None
    assert agent_port("127.16.2.1", ["--dashboard-agent-listen-port=6000"]) is None
    assert agent_port("127.16.2.1", ["--dashboard-agent-listen-port", "6000"]) is None
