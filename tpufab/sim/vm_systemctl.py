#!/usr/bin/python3 -IS
"""systemctl and journalctl on a simulated general-purpose VM (stdlib only).

The VM's PID 1 (worker_init.py's Units) plays systemd's part: this script, put over the
image's /usr/bin/systemctl and /usr/bin/journalctl, asks it to start, stop and restart units
(a request file in /run/tpufab-init/requests, then SIGUSR2 to PID 1, then its answer), and
reads what it says of each unit (/run/tpufab-init/units/NAME.json). enable and disable make
and remove the links in /etc/systemd/system/multi-user.target.wants, as systemctl does.
journalctl -u NAME prints the unit's output (/var/log/units/NAME.log). What is honoured:
docs/simulated-pod.md ("General-purpose VMs").
"""

import json
import os
import signal
import sys
import time

INIT_DIR = "/run/tpufab-init"
UNITS_DIR = "/etc/systemd/system"
WANTS = f"{UNITS_DIR}/multi-user.target.wants"
UNIT_LOGS = "/var/log/units"
ASKED = ("start", "stop", "restart", "try-restart", "reload-or-restart")


def unit_name(name):
    return name if "." in name else f"{name}.service"


def status(name):
    try:
        with open(f"{INIT_DIR}/units/{name}.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"ActiveState": "inactive", "SubState": "dead", "MainPID": 0}


def ask(verb, units):
    if os.geteuid() != 0:
        sys.stderr.write("Failed to " + verb + " " + " ".join(units) + ": Access denied\n")
        return 4
    ident = f"{os.getpid()}-{time.monotonic_ns()}.json"
    tmp = f"{INIT_DIR}/requests/.{ident}"
    with open(tmp, "w") as f:
        json.dump({"verb": verb, "units": units}, f)
    os.rename(tmp, f"{INIT_DIR}/requests/{ident}")
    os.kill(1, signal.SIGUSR2)
    answer = f"{INIT_DIR}/answers/{ident}"
    deadline = time.monotonic() + 120
    while not os.path.exists(answer):
        if time.monotonic() > deadline:
            sys.stderr.write(f"Job for {' '.join(units)} timed out.\n")
            return 1
        time.sleep(0.05)
    with open(answer) as f:
        result = json.load(f)
    os.unlink(answer)
    sys.stderr.write(result.get("err", ""))
    return int(result.get("code", 1))


def enable(units, on):
    os.makedirs(WANTS, exist_ok=True)
    for name in units:
        link = f"{WANTS}/{name}"
        if on and not os.path.exists(f"{UNITS_DIR}/{name}"):
            sys.stderr.write(f"Failed to enable unit: Unit file {name} does not exist.\n")
            return 1
        if on and not os.path.lexists(link):
            os.symlink(f"{UNITS_DIR}/{name}", link)
            sys.stderr.write(f"Created symlink {link} -> {UNITS_DIR}/{name}.\n")
        elif not on and os.path.lexists(link):
            os.unlink(link)
            sys.stderr.write(f"Removed \"{link}\".\n")
    return 0


def systemctl(args):
    flags = {a for a in args if a.startswith("-")}
    words = [a for a in args if not a.startswith("-")]
    if not words:
        sys.stderr.write("usage: systemctl VERB [UNIT...]\n")
        return 2
    verb, units = words[0], [unit_name(u) for u in words[1:]]
    if verb == "daemon-reload":
        return 0  # each start reads its unit file afresh
    if verb in ASKED:
        return ask(verb, units)
    if verb in ("enable", "disable"):
        code = enable(units, verb == "enable")
        if code or "--now" not in flags:
            return code
        return ask("start" if verb == "enable" else "stop", units)
    if verb == "is-active":
        states = [status(u)["ActiveState"] for u in units]
        if "--quiet" not in flags and "-q" not in flags:
            print("\n".join(states))
        return 0 if all(s == "active" for s in states) else 3
    if verb == "is-enabled":
        found = [os.path.lexists(f"{WANTS}/{u}") for u in units]
        print("\n".join("enabled" if f else "disabled" for f in found))
        return 0 if all(found) else 1
    if verb == "show":
        for name in units:
            for key, value in sorted(status(name).items()):
                print(f"{key}={value}")
        return 0
    if verb == "status":
        code = 0
        for name in units:
            state = status(name)
            since = state.get("ActiveEnterTimestamp")
            when = time.strftime(" since %a %Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) \
                if since and state["ActiveState"] == "active" else ""
            print(f"* {name}\n     Active: {state['ActiveState']} ({state['SubState']}){when}")
            if state.get("MainPID"):
                print(f"   Main PID: {state['MainPID']}")
            code = code or (0 if state["ActiveState"] == "active" else 3)
        return code
    sys.stderr.write(f"systemctl on this simulated VM does not know {verb!r}.\n")
    return 1


def journalctl(args):
    units, lines, follow = [], None, False
    it = iter(args)
    for arg in it:
        if arg in ("-u", "--unit"):
            units.append(unit_name(next(it, "")))
        elif arg.startswith("--unit="):
            units.append(unit_name(arg.split("=", 1)[1]))
        elif arg in ("-n", "--lines"):
            lines = int(next(it, "10"))
        elif arg in ("-f", "--follow"):
            follow = True
    for name in units:
        try:
            with open(f"{UNIT_LOGS}/{name}.log", errors="replace") as f:
                text = f.read().splitlines()
                for line in text[-lines:] if lines else text:
                    print(line)
                while follow:
                    chunk = f.read()
                    if chunk:
                        sys.stdout.write(chunk)
                        sys.stdout.flush()
                    else:
                        time.sleep(0.2)
        except OSError:
            print("-- No entries --")
    return 0


if __name__ == "__main__":
    tool = os.path.basename(sys.argv[0])
    sys.exit(journalctl(sys.argv[1:]) if tool == "journalctl" else systemctl(sys.argv[1:]))
