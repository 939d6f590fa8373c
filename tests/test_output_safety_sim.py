"""Output safety on a simulated v4-16 (2 real sshd workers), through the verbs as a user runs
them: secrets masked in every view and on every disk, hostile worker output that cannot drive
the terminal (also through a real pty), a full disk mid-run named as such, local log copies
pruned. The pure and worker-side parts are in tests/test_output_safety.py.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time
from urllib.parse import quote

import pytest
from harness import sim_node
from helpers import LOGIN, TPUFAB, in_worker, quiet_console, tpufab

HOME = f"/home/{LOGIN}"  # the login user's home on the workers (not root: TPU VMs)

pytestmark = pytest.mark.sim

HF = "hf_Sim9/x+y=z&w-must-not-leak"
WANDB = "wandb-51d3-must-not-leak"

SET_X = r"""#!/bin/bash
set -x
echo "HF_TOKEN=$HF_TOKEN WANDB_API_KEY=$WANDB_API_KEY on $TPUFAB_WORKER_ID"
url="https://user:${HF_TOKEN}@hub.example/x?key=${WANDB_API_KEY}"
echo "$url"
python3 -c 'import os, urllib.parse as u; print("encoded", u.quote(os.environ["HF_TOKEN"], safe=""))'
set +x
printf '%s' "${HF_TOKEN:0:7}"; sleep 0.2; printf '%s\n' "${HF_TOKEN:7}"
echo done
"""

HOSTILE = r"""#!/bin/sh
printf 'title \033]0;pwned\007 clip \033]52;c;cHduZWQ=\007 clear \033[2J\033[H bell \007\n'
printf 'real\rw9 \342\224\202 forged\n'
printf 'back\b\b\b\bw9 \342\224\202 forged2\n'
printf '\033[31mred\033[0m end\n'
"""

HOSTILE_COMMAND = HOSTILE.split("\n", 1)[1]      # the same, for exec
VIEWS = [(), ("--raw",), ("--follow",), ("--follow", "--raw")]     # every view of `logs`


@pytest.fixture(scope="module")
def pod(sim, tmp_path_factory):
    """A READY v4-16, its user's environment (with HF_TOKEN and WANDB_API_KEY) and home."""
    from tpufab.hosts import connect as pods

    with sim_node(sim, tmp_path_factory, "safe", "v4-16") as node:
        pods.connect(node.settings, console=quiet_console()).close()  # as an earlier command
        for script, body in (("setx.sh", SET_X), ("hostile.sh", HOSTILE)):
            (node.home / script).write_text(body)
            (node.home / script).chmod(0o755)
        node.secret_env = {**node.env, "HF_TOKEN": HF, "WANDB_API_KEY": WANDB}
        yield node


def text(proc) -> str:
    return (proc.stdout + proc.stderr).decode("utf-8", "replace")


def assert_no_secret(where: str, data: bytes | str) -> None:
    data = data.encode() if isinstance(data, str) else data
    from urllib.parse import quote

    for secret in (HF, WANDB, quote(HF, safe="")):
        assert secret.encode() not in data, f"{secret} in {where}"


def run_id_of(proc) -> str:
    found = re.search(r"Run (\d{8}-\d{6}-[0-9a-f]{4})", text(proc))
    assert found, text(proc)
    return found.group(1)


def test_secrets_are_masked_in_every_view_and_on_every_disk(pod):
    runs_dir = pod.home / ".tpufab" / "runs"
    old = [f"20200101-00000{n}-abcd" for n in range(3)]     # local copies of older runs
    for name in old:
        (runs_dir / name).mkdir(parents=True, exist_ok=True)
        (runs_dir / name / "w0.log").write_text("old\n")
    ran = tpufab("run", "setx.sh", "--no-deploy", "--raw", "-e", "HF_TOKEN", "-e",
                 "WANDB_API_KEY", env={**pod.secret_env, "TPUFAB_KEEP_RUNS": "2"},
                 cwd=pod.home, text=False)
    assert ran.returncode == 0, text(ran)
    run_id = run_id_of(ran)
    assert "HF_TOKEN=*** WANDB_API_KEY=***" in text(ran)       # the run's environment line
    assert "w1 │ + echo 'HF_TOKEN=*** WANDB_API_KEY=*** on 1'" in text(ran)
    assert "w0 │ https://user:***@hub.example/x?key=***" in text(ran)
    assert "w1 │ encoded ***" in text(ran) and "w0 │ ***\n" in text(ran)
    assert_no_secret("run", ran.stdout + ran.stderr)
    # the local copy is masked; older copies beyond TPUFAB_KEEP_RUNS=2 are pruned
    assert sorted(p.name for p in runs_dir.iterdir()) == sorted([old[-1], run_id])
    copy = (runs_dir / run_id / "w1.log").read_text()
    assert "+ echo 'HF_TOKEN=*** WANDB_API_KEY=*** on 1'" in copy

    # every view of `logs`, from a shell that does not even have the secrets: the workers'
    # logs were masked as they were written
    for flags in VIEWS:
        view = " ".join(flags) or "plain"
        shown = tpufab("logs", "--run", run_id, *flags, env=pod.env, cwd=pod.home, text=False)
        assert shown.returncode == 0, (view, text(shown))
        out = text(shown)
        assert_no_secret(f"logs {view}", out)
        assert "https://user:***@hub.example/x?key=***" in out, (view, out)
        # w1's line, as it printed it (raw), or folded with w0's (the worker id in braces)
        assert "+ echo 'HF_TOKEN=*** WANDB_API_KEY=*** on " + \
            ("1'" if "--raw" in flags else "{0,1}'") in out, (view, out)
    listed = tpufab("runs", env=pod.env, cwd=pod.home, text=False)
    assert listed.returncode == 0 and run_id in text(listed)
    assert_no_secret("runs", listed.stdout + listed.stderr)

    # exec --env: forwarded like run's, masked in live and gathered output
    for gather in (False, True):
        done = tpufab("exec",
                      'set -x; echo "$HF_TOKEN" "$WANDB_API_KEY" >&2; '
                      'echo "t=$HF_TOKEN"',
                      "-e", "HF_TOKEN", "-e", "WANDB_API_KEY", *(["--gather"] if gather else []),
                      env=pod.secret_env, cwd=pod.home, text=False)
        assert done.returncode == 0, text(done)
        assert "t=***" in text(done) and "*** ***" in text(done)
        assert_no_secret(f"exec gather={gather}", done.stdout + done.stderr)

    # babysit: its live view, attempt copies and babysit.json (checked with every file below)
    sat = tpufab("babysit", "setx.sh", "--no-deploy", "-e", "HF_TOKEN", "-e", "WANDB_API_KEY",
                 env=pod.secret_env, cwd=pod.home, text=False)
    assert sat.returncode == 0, text(sat)
    assert "HF_TOKEN=*** WANDB_API_KEY=*** on 1" in text(sat)
    assert_no_secret("babysit", sat.stdout + sat.stderr)
    assert list(runs_dir.glob("*/babysit.json")) and list(runs_dir.glob("*/attempt-0/w1.log"))
    # every local copy tpufab wrote is its user's alone (issue 23, finding 11)
    written = [p for p in runs_dir.rglob("*") if p.relative_to(runs_dir).parts[0] not in old]
    assert written and {oct(p.stat().st_mode & 0o777) for p in written if p.is_dir()} == {"0o700"}
    assert {oct(p.stat().st_mode & 0o777) for p in written if p.is_file()} == {"0o600"}

    # nothing on the workers' disks (state, caches, /tmp) or here holds either secret
    for w in (0, 1):
        hits = in_worker(pod.sim, pod.node, w,
                         f"grep -rlF -e '{HF}' -e '{WANDB}' /home /root /tmp 2>/dev/null || true")
        assert hits.strip() == "", f"w{w}: {hits}"
        env_files = in_worker(pod.sim, pod.node, w, f"ls -a {HOME}/.tpufab/runs")
        assert ".env.json" not in env_files          # the env file is gone once read
        modes = in_worker(pod.sim, pod.node, w,
                          f"stat -c '%a %n' {HOME}/.tpufab/runs/{run_id} "
                          f"{HOME}/.tpufab/runs/{run_id}/log")
        assert [line.split()[0] for line in modes.splitlines()] == ["700", "600"]
    for path in pod.home.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert_no_secret(str(path), path.read_bytes())


# -- one masking rule (issue 23, finding 11) ----------------------------------------------------

DB_PASS = "db-pass-3381-must-not-leak"     # a secret by its name's last word, not by a pattern
RULE_RECIPE = r"""#!/bin/sh
echo "step $MAX_NEW_TOKENS loss 2.$MAX_NEW_TOKENS auth=$USE_AUTH_TOKEN db=$DB_PASS"
python3 -c '
import glob, os
value = os.environ["DB_PASS"].encode()
leak = [p for p in glob.glob("/proc/[0-9]*/cmdline") if value in open(p, "rb").read()]
print("argv", "LEAK" if leak else "clean")'
"""


def test_one_masking_rule_for_run_exec_and_the_api(pod):
    """DB_PASS is a secret (its last word), MAX_NEW_TOKENS=128 and USE_AUTH_TOKEN=1 are not:
    the short values never garble output or tpufab's own end-of-run record, DB_PASS's value
    reaches no output, local copy or argv, and exec -e and Pod.run(env=...) mask alike."""
    from tpufab import Pod

    (pod.home / "rule.sh").write_text(RULE_RECIPE)
    (pod.home / "rule.sh").chmod(0o755)
    environ = {**pod.env, "DB_PASS": DB_PASS}
    ran = tpufab("run", "rule.sh", "--no-deploy", "--raw", "-e", "DB_PASS",
                 "-e", "MAX_NEW_TOKENS=128", "-e", "USE_AUTH_TOKEN=1", env=environ,
                 cwd=pod.home, text=False)
    out = text(ran)
    assert ran.returncode == 0, out
    assert DB_PASS not in out
    assert "DB_PASS=***" in out and "MAX_NEW_TOKENS=128" in out     # the Environment: line
    assert "step 128 loss 2.128 auth=1 db=***" in out               # not "step *** loss 2.***"
    assert "argv clean" in out and "argv LEAK" not in out           # no worker argv has it
    assert '{"state"' not in out and "finished on w[0-1]: exit 0" in out  # the record parsed
    run_id = run_id_of(ran)
    root = pod.home / ".tpufab"
    copies = sorted((root / "runs" / run_id).glob("w*.log"))
    assert copies and all(DB_PASS not in c.read_text() for c in copies)
    assert "step 128 loss 2.128 auth=1 db=***" in copies[0].read_text()
    assert {oct(p.stat().st_mode & 0o777) for p in (root, root / "runs", root / "runs" / run_id)
            } == {"0o700"}
    assert {oct(c.stat().st_mode & 0o777) for c in copies} == {"0o600"}

    line = 'echo "db=$DB_PASS n=$MAX_NEW_TOKENS"'
    done = tpufab("exec", line, "-w", "0", "-e", "DB_PASS", "-e", "MAX_NEW_TOKENS=128",
                  env=environ, cwd=pod.home, text=False)
    assert done.returncode == 0, text(done)
    assert "db=*** n=128" in text(done) and DB_PASS not in text(done)
    with Pod.from_settings(pod.settings) as api:
        result = api.run(line, workers=[0], env={"DB_PASS": DB_PASS, "MAX_NEW_TOKENS": "128"})
    assert result[0].stdout == "db=*** n=128\n"


SETUP = r"""#!/bin/sh
echo "installing with db=$DB_PASS n=$MAX_NEW_TOKENS"
python3 -c 'import os, sys, time; v = os.environ["DB_PASS"]; sys.stdout.write(v[:7])
sys.stdout.flush(); time.sleep(0.2); print(v[7:], "split")'
python3 -c 'import os, urllib.parse as u; print("encoded", u.quote(os.environ["DB_PASS"], safe=""))'
"""


def test_setup_logs_on_the_workers_are_masked_and_private(pod):
    """launch's setup (fanout.run_setup with the run's secrets, as babysit.run_setup calls it):
    the log each worker keeps is masked as it is written, 0600 in a 0700 directory, and the
    output shown is masked too (issue 23, finding 6)."""
    from tpufab.hosts import connect as pods
    from tpufab.quoting import Secret
    from tpufab.steps.host.setup import run_setup

    secret = DB_PASS + "/x+y=z"          # with characters URL-encoding changes
    with pods.connect(pod.settings, console=quiet_console()) as connected:
        result, outcomes = run_setup(connected.fanout, SETUP.encode(), force=True,
                                     env={"MAX_NEW_TOKENS": "128"},
                                     secrets={"DB_PASS": Secret(secret)})
        shown = {w: r.stdout for w, r in result.items()}
        result.close()
    for w, outcome in outcomes.items():
        assert outcome.status == "ran", outcome
        assert "installing with db=*** n=128" in shown[w] and "encoded ***" in shown[w]
        assert secret not in shown[w]
        log = in_worker(pod.sim, pod.node, w, f"cat {outcome.log}")
        assert log.splitlines()[:1] == ["installing with db=*** n=128"], log
        assert "*** split" in log and "encoded ***" in log and secret not in log and quote(secret, safe="") not in log
        modes = in_worker(pod.sim, pod.node, w,
                          f"stat -c '%a' {HOME}/.tpufab/setup {outcome.log}").split()
        assert modes == ["700", "600"], (w, modes)


ESCAPES = re.compile(rb"\x1b\]|\x1b\[2J|\x1b\[H|\x07|\x08|\r(?!\n)")


def assert_harmless(where: str, data: bytes, *, prefixed: bool = True) -> None:
    """No worker-sent control sequence reached the terminal, and (in the prefixed views)
    every line that says "forged" carries the real worker's prefix. The folded view shows a
    line that every worker printed as it is: there, a worker's text is only ever text."""
    assert not ESCAPES.search(data), (where, data)
    assert b"\x1b[31mred" not in data, (where, data)            # colours only with --color
    plain = re.sub(rb"\x1b\[(?:\d+)?m", b"", data)             # our own prefix colours
    for line in plain.replace(b"\r\n", b"\n").split(b"\n"):
        if b"forged" in line and prefixed:
            assert re.match(rb"^w[01] +\xe2\x94\x82 ", line), (where, line)


def test_hostile_output_cannot_drive_the_terminal(pod):
    ran = tpufab("run", "hostile.sh", "--no-deploy", "--raw", env=pod.env, cwd=pod.home, text=False)
    assert ran.returncode == 0, text(ran)
    assert_harmless("run", ran.stdout)
    assert b"w0 \xe2\x94\x82 title ^[]0;pwned^G clip ^[]52;c;cHduZWQ=^G clear ^[[2J^[[H bell ^G" \
        in ran.stdout
    assert b"w1 \xe2\x94\x82 w9 \xe2\x94\x82 forged\n" in ran.stdout
    run_id = run_id_of(ran)
    for flags in VIEWS:
        shown = tpufab("logs", "--run", run_id, *flags, env=pod.env, cwd=pod.home, text=False)
        assert shown.returncode == 0, text(shown)
        assert_harmless(f"logs {flags}", shown.stdout, prefixed="--raw" in flags)
        assert b"^[]0;pwned^G" in shown.stdout
    colored = tpufab("logs", "--run", run_id, "--raw", "--color", env=pod.env, cwd=pod.home,
                     text=False)
    assert b"\x1b[31mred\x1b[0m end\x1b[0m" in colored.stdout
    assert_harmless("logs --color", colored.stdout.replace(b"\x1b[31mred", b"red"))
    gathered = tpufab("exec", HOSTILE_COMMAND, "--gather", env=pod.env, cwd=pod.home, text=False)
    assert gathered.returncode == 0, text(gathered)
    assert_harmless("exec --gather", gathered.stdout, prefixed=False)


def read_pty(argv, env, cwd, timeout=120.0) -> bytes:
    """Everything a program writes to a real terminal (stdout and stderr on one pty)."""
    main, secondary = pty.openpty()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=secondary, stdout=secondary,
                            stderr=secondary, close_fds=True)
    os.close(secondary)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:      # EIO: every writer is gone
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    return data


def test_hostile_output_through_a_real_terminal(pod):
    data = read_pty([TPUFAB, "exec", HOSTILE_COMMAND], pod.env, pod.home)
    assert b"forged" in data and b"title" in data, data
    assert_harmless("exec on a tty", data)
    assert re.search(rb"\x1b\[\d+mw0 \xe2\x94\x82 \x1b\[0m", data), data  # prefixes coloured


def test_a_disk_that_fills_up_mid_run_is_named(pod):
    body = ("#!/bin/sh\necho start\nif [ \"$TPUFAB_WORKER_ID\" = 1 ]; then\n"
            "  head -c 700000 /dev/zero | tr '\\0' x | fold -w 100\nfi\necho finished\n")
    (pod.home / "fill.sh").write_text(body)
    in_worker(pod.sim, pod.node, 1, "mkdir -p ~/.tpufab/runs", user=LOGIN)
    in_worker(pod.sim, pod.node, 1, f"mount -t tmpfs -o size=256k,uid=$(id -u {LOGIN}),"
              f"mode=0700 tmpfs {HOME}/.tpufab/runs")
    try:
        ran = tpufab("run", "fill.sh", "--no-deploy", env=pod.env, cwd=pod.home, text=False)
        out = text(ran)
        assert ran.returncode == 1, out
        assert re.search(r"failed on w1: w0 exited 0; w1 exited 0 \(disk full: the log stops "
                         r"at [\d.]+ KiB, [\d.]+ KiB of output lost \(no space left on device "
                         rf"in {HOME}/.tpufab/runs/\d{{8}}-\d{{6}}-[0-9a-f]{{4}}\)\)", out), out
        assert "lost" not in out.replace("of output lost", ""), out
        run_id = run_id_of(ran)
        listed = text(tpufab("runs", env=pod.env, cwd=pod.home, text=False))
        row = listed[listed.index(run_id):].split("\n20")[0]     # the run's row (wrapped)
        assert re.search(r"w0 exited 0; w1 exited 0 \(disk full", row), listed
        assert "no record" not in row, listed
    finally:
        in_worker(pod.sim, pod.node, 1, f"umount -l {HOME}/.tpufab/runs")


def test_status_shows_a_hostile_holders_name_as_text(pod):
    """A TPU holder whose command line sets the title, clears the screen and writes the
    clipboard (any user on a worker can name a process so): `status` shows it as text in the
    worker row and the "TPU holders" line, also on a real terminal."""
    from helpers import wait_for

    hold = "import signal; f = open('/dev/accel0'); signal.pause()"
    script = ("name=$(printf 'title \\033]0;pwned\\007 clear \\033[2J clip "
              "\\033]52;c;cHduZWQ=\\007'); setsid bash -c 'exec -a \"$0\" python3 -c \"$1\"' "
              f"\"$name\" \"{hold}\" </dev/null >/dev/null 2>&1 & echo $!")
    pid = int(in_worker(pod.sim, pod.node, 1, script, user=LOGIN).strip())
    try:
        def busy():
            shown = tpufab("status", env=pod.env, cwd=pod.home, text=False)
            return shown if b"TPU holders" in shown.stdout else None

        shown = wait_for(busy, 60, interval=0.5, what="w1's holder in `status`")
        assert_harmless("status", shown.stdout, prefixed=False)
        # the tables show a holder by what names it (its program: here the forged name's
        # first word), the whole name only in --json, and there as escaped text
        assert re.search(rb"w1 +up [^ ]+ +1/4 busy: python3:", shown.stdout), text(shown)
        assert b"pwned" not in shown.stdout, text(shown)
        on_tty = read_pty([TPUFAB, "status"], pod.env, pod.home)
        assert b"python3:" in on_tty, on_tty
        assert_harmless("status on a tty", on_tty, prefixed=False)
        whole = tpufab("status", "--json", env=pod.env, cwd=pod.home, text=False)
        assert b"\x1b" not in whole.stdout and b"\x07" not in whole.stdout, whole.stdout
        assert b"title \\u001b]0;pwned\\u0007 clear" in whole.stdout, whole.stdout
    finally:
        in_worker(pod.sim, pod.node, 1, f"kill {pid}", check=False)
