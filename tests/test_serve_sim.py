"""Serving and profiling on a simulated v4-32 (real sshd workers, JAX on CPU), end to end:
`run recipes/serve_jax.sh --wait-port`, `forward`, the benchmark client, `profile`, and
`--wait-port` on a server that never comes up.

The verbs run as a user runs them, through the real `tpufab` command; the benchmark client
runs here against the forwarded port.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from harness import connected_pod
from helpers import build_shared_site, free_port, tpufab, wait_for

REPO = Path(__file__).resolve().parents[1]
TPUFAB = str(Path(sys.executable).parent / "tpufab")

pytestmark = pytest.mark.sim


def share_xprof(state: Path) -> None:
    """xprof's trace client next to the shared JAX (scripts/sim-wheels.sh builds both)."""
    cache = Path(os.environ.get("TPUFAB_TEST_SIM_CACHE",
                                Path.home() / ".cache" / "tpufab" / "test-sim"))
    source, target = cache / "share" / "xprof", state / "share" / "xprof"
    if source.is_dir() and not target.exists():
        shutil.copytree(source, target, symlinks=True)


@pytest.fixture(scope="module")
def serve_env(sim, tmp_path_factory):
    state = Path(sim.state_dir)
    build_shared_site([state / "share"])
    share_xprof(state)                                  # beside the JAX that build_shared_site made
    with connected_pod(sim, tmp_path_factory, "srv", ssh_user="root", setup=True) as pod:
        project = pod.base / "proj"
        (project / "recipes").mkdir(parents=True)
        for name in ("serve_jax.sh", "bench_serve.py"):
            shutil.copy(REPO / "recipes" / name, project / "recipes" / name)
        yield pod.env, pod.pod, project


class Background:
    """`tpufab ...` running in the background, its output collected as it arrives."""

    def __init__(self, env, cwd: Path, *args: str):
        self.proc = subprocess.Popen([TPUFAB, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, i=into: [i.append(x.rstrip("\n"))
                                                              for x in s], daemon=True).start()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(30)


def _health(port: int) -> dict | None:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return json.loads(answer.read())
    except OSError:
        return None


def run_id_of(stderr: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("Run ") and " started on " in line:
            return line.split()[1].rstrip(":")
    raise AssertionError(f"no run id in {stderr!r}")


@pytest.mark.timeout(720)
def test_serve_wait_port_forward_benchmark_and_profile(serve_env):
    # 22-95 s on CI; once the server did not answer within 5 minutes while the other groups
    # ran Ray and torch on the same 2 cores. The bounds leave room for that, and a run that
    # does not start is stopped here, not left for the next test.
    env, pod, project = serve_env
    port, local = free_port(), free_port()
    try:
        started = tpufab("run", "recipes/serve_jax.sh", "--no-deploy",
                         f"--args=--port {port} --threads 4", "--wait-port", str(port),
                         "--wait-timeout", "360", cwd=project, env=env, timeout=480)
    except subprocess.TimeoutExpired as err:
        tpufab("kill", cwd=project, env=env)
        pytest.fail(f"`tpufab run --wait-port` did not end: {err.stdout}{err.stderr}")
    if started.returncode != 0:
        tpufab("kill", cwd=project, env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"Port {port} answers on w0" in started.stderr
    run_id = run_id_of(started.stderr)
    forwarder = None
    try:
        logs = tpufab("logs", "--run", run_id, "--raw", cwd=project, env=env)
        assert f"w0 │ serve_jax: serving on port {port}" in logs.stdout, logs.stdout
        for w in (1, 2, 3):
            assert f"w{w} │ serve_jax: worker {w} idle: the model fits on one host" in logs.stdout

        forwarder = Background(env, project, "forward", f"{local}:{port}")
        wait_for(lambda: any(f"http://127.0.0.1:{local} -> w0" in line
                             for line in forwarder.out), 60, what="the forward to start")
        bench = subprocess.run([sys.executable, str(project / "recipes" / "bench_serve.py"),
                                "--url", f"http://127.0.0.1:{local}", "--requests", "24",
                                "--concurrency", "6", "--max-tokens", "8"],
                               capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stdout + bench.stderr
        lines = bench.stdout.splitlines()
        assert "Successful requests: 24" in lines
        for prefix in ("Benchmark duration: ", "Request throughput: ", "Median latency (P50): ",
                       "P99 latency: ", "Total generated tokens: 192"):
            assert any(line.startswith(prefix) for line in lines), (prefix, lines)

        # The same port through the system ssh: `tpufab ssh --forward L:R -- CMD`.
        plain = free_port()
        tunnel = Background(env, project, "ssh", "--forward", f"{plain}:{port}", "--",
                            "sleep", "60")
        try:
            health = wait_for(lambda: _health(plain), 60, 0.2, what="ssh -L to forward")
            assert health["status"] == "ok" and health["served"] >= 24
        finally:
            # The system ssh's own exit: it once missed the SIGTERM that came while it was
            # busy closing the forwarded request (1 of 3 runs alone, not seen in 17 more) and
            # waited for its next event, the end of `sleep 60`. Not what this step checks.
            tunnel.proc.terminate()
            try:
                tunnel.proc.wait(10)
            except subprocess.TimeoutExpired:
                tunnel.proc.kill()
                tunnel.proc.wait(10)

        profiled = tpufab("profile", "--worker", "0", "--duration", "2s", cwd=project, env=env)
        assert profiled.returncode == 0, profiled.stdout + profiled.stderr
        assert "profile: w0  1 trace file" in profiled.stdout
        traces = list((project / ".tpufab" / "runs" / run_id / "profiles").rglob("*.xplane.pb"))
        assert len(traces) == 1 and traces[0].stat().st_size > 1000, traces
        # every host at once: only w0 serves requests, so the others' JAX had nothing to
        # trace: w0's trace is counted and named, the others say why
        everyone = tpufab("profile", "--worker", "all", "--duration", "2s", cwd=project,
                          env=env)
        assert everyone.returncode == 0, everyone.stdout + everyone.stderr
        assert "profile: w0  1 trace file" in everyone.stdout, everyone.stdout
        assert everyone.stdout.count("no trace from the profiler server on port") == 3
    finally:
        if forwarder is not None:
            assert forwarder.stop() == 0
            assert any("Stopped forwarding" in line for line in forwarder.err), forwarder.err
        killed = tpufab("kill", "--run", run_id, cwd=project, env=env)
        assert killed.returncode == 0, killed.stdout + killed.stderr


def test_wait_port_on_a_server_that_never_listens_shows_the_logs(serve_env):
    env, _pod, project = serve_env
    recipe = project / "recipes" / "no_server.sh"
    recipe.write_text("#!/bin/sh\necho \"loading weights on $TPUFAB_WORKER_ID\"\n"
                      "echo 'out of memory' >&2\nexit 3\n")
    recipe.chmod(0o755)
    port = free_port()
    failed = tpufab("run", "recipes/no_server.sh", "--no-deploy", "--wait-port", str(port),
                    "--wait-timeout", "60", cwd=project, env=env)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "the run ended on w0 (exited, exit 3) before port" in failed.stderr, failed.stderr
    assert "out of memory" in failed.stdout and "loading weights on" in failed.stdout


BUSY_JAX = """import os, time
import jax, jax.numpy as jnp
jax.profiler.start_server(int(os.environ["TPUFAB_PROFILER_PORT"]))
print("profiler up on", os.environ["TPUFAB_PROFILER_PORT"], flush=True)
x, until = jnp.ones((128, 128)), time.monotonic() + 150
while time.monotonic() < until:          # every host computes: every host has a trace
    x = jnp.tanh(x @ x / 128.0)
    x.block_until_ready()
"""


def test_profile_of_every_host_is_one_logdir_with_a_trace_each(serve_env):
    """`profile --worker all` while every host's JAX computes: one capture per host at once,
    laid out as XProf reads a multi-host profile (<stamp>/plugins/profile/<stamp>/, one
    trace file per host)."""
    env, _pod, project = serve_env
    (project / "busy_jax.py").write_text(BUSY_JAX)
    job = Background(env, project, "run", "busy_jax.py", "--no-deploy")
    try:
        def every_host_up() -> bool:   # the fold says one line for all: on {9431..9434}
            said = {line for line in job.out if "profiler up on" in line}
            return len(said) >= 4 or any("{9431..9434}" in line for line in said)

        wait_for(every_host_up, 240, 0.2,
                 what=lambda: f"every host's profiler server: {job.out[-8:]} {job.err[-8:]}")
        run_id = run_id_of("\n".join(job.err))
        from tpufab.cloud.storage import Storage

        store = Storage(env["TPUFAB_STORAGE_ENDPOINT"])
        store.create_bucket("traces-b", project=env["TPUFAB_PROJECT"])
        refused = tpufab("profile", "--worker", "all", "--to", "s3://x/y", cwd=project, env=env)
        assert refused.returncode == 2 and "--to takes a Cloud Storage folder such as " \
            "gs://my-bucket/profiles, not 's3://x/y'." in refused.stderr, refused.stderr
        got = tpufab("profile", "--worker", "all", "--duration", "2s", "--to",
                     "gs://traces-b/team/profiles/", cwd=project, env=env)
        assert got.returncode == 0, got.stdout + got.stderr
        assert all(f"profile: w{w}  1 trace file (" in got.stdout for w in range(4)), got.stdout
        traces = list((project / ".tpufab" / "runs" / run_id / "profiles").rglob("*.xplane.pb"))
        assert len(traces) == 4 and len({t.parent for t in traces}) == 1, traces
        session = traces[0].parent
        stamp = session.parent.parent.parent
        assert (session.parent.name, session.parent.parent.name) == ("profile", "plugins")
        assert session.name == stamp.name and f"xprof --logdir {stamp}" in got.stderr
        assert all(t.stat().st_size > 1000 for t in traces), traces
        # --to: the same logdir in the bucket, file for file
        remote = f"gs://traces-b/team/profiles/{stamp.name}"
        assert "Copied 4 files (" in got.stderr and f"to {remote}: `xprof --logdir " \
            f"{remote}`." in got.stderr, got.stderr
        listed = store.list("traces-b", f"team/profiles/{stamp.name}/").blobs
        assert sorted(b.name for b in listed) == sorted(
            f"team/profiles/{stamp.name}/{t.relative_to(stamp).as_posix()}" for t in traces)
        assert {b.name: b.size for b in listed} == {
            f"team/profiles/{stamp.name}/{t.relative_to(stamp).as_posix()}": t.stat().st_size
            for t in traces}
    finally:
        tpufab("kill", "--run", run_id_of("\n".join(job.err)), cwd=project, env=env) \
            if any(" started on " in line for line in job.err) else None
        job.proc.kill()
        job.proc.wait(30)


def test_profile_without_a_running_job_says_so(serve_env):
    env, _pod, project = serve_env
    result = tpufab("profile", "--worker", "1", "--duration", "1s", cwd=project, env=env)
    assert result.returncode == 1
    assert "No run is running on w1" in result.stderr or "no trace from" in result.stderr, \
        result.stderr


def test_put_and_get_through_the_command(serve_env, tmp_path):
    env, pod, project = serve_env
    (project / "cfg").mkdir(exist_ok=True)
    (project / "cfg" / "model.yaml").write_text("layers: 4\n")
    put = tpufab("put", "cfg", "/root/", cwd=project, env=env)
    assert put.returncode == 0, put.stdout + put.stderr
    assert put.stdout.startswith("put: w[0-3]  1 file, 10 B, ")
    again = tpufab("put", "cfg", "/root/", cwd=project, env=env)
    assert again.stdout.startswith("put: w[0-3]  0 files, 1 already there, 0 B, ")
    pod.fanout.run("echo $(hostname) > /root/cfg/host.txt", check=True)
    got = tpufab("get", "/root/cfg", str(tmp_path / "back"), cwd=project, env=env)
    assert got.returncode == 0, got.stdout + got.stderr
    for w in range(4):
        assert (tmp_path / "back" / f"w{w}" / "cfg" / "model.yaml").read_text() == "layers: 4\n"
        assert (tmp_path / "back" / f"w{w}" / "cfg" / "host.txt").read_text().strip()\
            .endswith(f"-w-{w}")
    missing = tpufab("put", "nothing-here", cwd=project, env=env)
    assert missing.returncode != 0
    assert "nothing-here does not exist here" in missing.stderr
