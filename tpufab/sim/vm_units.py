"""A systemd unit file as a general-purpose VM's init reads it (stdlib only, pure).

tpufab.sim.worker_init (the VM's PID 1, whose ``Units`` play systemd) loads this module from
its path; what it honours of a unit is listed in docs/simulated-pod.md.
"""

import shlex


def parse_seconds(text, default):  # systemd's time spans: 5, 5s, 100ms, 2min
    text = (text or "").strip()
    for suffix, factor in (("ms", 0.001), ("min", 60.0), ("s", 1.0), ("", 1.0)):
        if text.endswith(suffix):
            try:
                return float(text[:len(text) - len(suffix)] or "x") * factor
            except ValueError:
                return default
    return default


def parse_unit(text):
    """A unit file's [Service] settings this init honours (docs/simulated-pod.md)."""
    section, found = "", {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif "=" in line and section == "Service":
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    env = {}
    for path in found.get("EnvironmentFile", []):
        optional = path.startswith("-")
        try:
            with open(path.lstrip("-")) as f:
                for entry in f.read().splitlines():
                    if "=" in entry and not entry.lstrip().startswith("#"):
                        key, _, value = entry.partition("=")
                        env[key.strip()] = value.strip().strip('"')
        except OSError:
            if not optional:
                raise
    for value in found.get("Environment", []):
        for pair in shlex.split(value):
            key, _, rest = pair.partition("=")
            env[key] = rest
    exec_start = (found.get("ExecStart") or [""])[-1].lstrip("-@+!")
    return {"argv": shlex.split(exec_start), "user": (found.get("User") or [""])[-1],
            "group": (found.get("Group") or [""])[-1], "env": env,
            "cwd": (found.get("WorkingDirectory") or [""])[-1].lstrip("-"),
            "restart": (found.get("Restart") or ["no"])[-1],
            "restart_sec": parse_seconds((found.get("RestartSec") or [""])[-1], 0.1)}
