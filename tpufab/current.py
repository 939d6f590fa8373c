"""This project's current pod: the node verbs use when no --name, TPUFAB_NAME or `name:` says.

`tpufab create` (and `tpufab use NAME`) remember it in ``<project>/.tpufab/current-pod.json``
(name, zone, project, who set it and when), where ``<project>`` is the nearest folder up from
the working directory with a tpufab.yaml, invoke.yaml, tasks.py or .git. tpufab.yaml and the
environment still win over it; `tpufab status` and `tpufab use` say which pod is current and why.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

MARKERS = ("tpufab.yaml", "tpufab.yml", "invoke.yaml", "invoke.yml", "tasks.py", ".git")
FILE = Path(".tpufab") / "current-pod.json"


def project_root(cwd: Path | None = None) -> Path:
    """The nearest folder (from cwd up) that looks like a project; else cwd itself."""
    cwd = Path.cwd() if cwd is None else cwd
    for folder in (cwd, *cwd.parents):
        if any((folder / marker).exists() for marker in MARKERS):
            return folder
    return cwd


@dataclass(frozen=True)
class CurrentPod:
    name: str
    zone: str | None
    project: str | None
    set_by: str            # "create" or "use"
    at: float
    path: Path

    def layer(self) -> dict:
        """Settings this pod implies (the zone and project it lives in)."""
        return {k: v for k, v in (("name", self.name), ("zone", self.zone),
                                  ("project", self.project)) if v}

    def reason(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at))
        return f"this project's current pod, set by `tpufab {self.set_by}` at {when} ({self.path})"


def read(cwd: Path | None = None) -> CurrentPod | None:
    path = project_root(cwd) / FILE
    try:
        data = json.loads(path.read_text())
        return CurrentPod(name=str(data["name"]), zone=data.get("zone"),
                          project=data.get("project"), set_by=str(data.get("set_by", "use")),
                          at=float(data.get("at", 0)), path=path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: as if none (the next create/use rewrites it)


def remember(name: str, *, zone: str | None, project: str | None, set_by: str,
             cwd: Path | None = None) -> Path:
    path = project_root(cwd) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    ignore = path.parent / ".gitignore"   # as jobs.local_log_dir: never dirties a checkout
    if not ignore.exists():
        ignore.write_text("*\n")
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"name": name, "zone": zone, "project": project,
                               "set_by": set_by, "at": time.time()}, indent=2) + "\n")
    tmp.replace(path)
    return path


def forget(name: str, cwd: Path | None = None) -> bool:
    """Forget the current pod if it is ``name`` (after it was deleted)."""
    current = read(cwd)
    if current is None or current.name != name:
        return False
    current.path.unlink(missing_ok=True)
    return True


def became(name: str, before: CurrentPod | None, path: Path) -> str:
    """What to say once ``name`` is remembered: a move away from another pod is said."""
    if before is not None and before.name != name:
        return f"The current pod is now {name} (was {before.name}; {path})."
    return f"{name} is this project's current pod ({path})."
