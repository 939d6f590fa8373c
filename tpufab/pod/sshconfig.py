"""`tpufab config-ssh` as the Pod API offers it: a pod's (or every pod's) entries in
~/.ssh/config, so `ssh POD-w3`, scp, rsync, VS Code and Fabric reach the workers as tpufab
does (tpufab.steps.host.sshconfig does the work, tpufab.hosts.sshconfig owns the file)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpufab.config import Settings


def config_ssh(settings: Settings, *, name: str | None = None, remove: bool = False,
               confirm: Callable[[str], bool] | None = None, console: Any = None) -> Any:
    """Write pod ``name``'s entries (None: every READY pod in the zone; the entries of that
    zone's deleted pods go) into ~/.ssh/config, or with ``remove`` take them (None: all of
    tpufab's) out; ``confirm(question)`` is asked before tpufab's section is first added.
    Returns an SshConfigResult (``.path``, ``.written``, ``.removed``, ``.skipped``,
    ``.notes``, ``.declined``); ConfigError (one sentence) for a file tpufab cannot safely
    write into, ApiError for a pod that is not READY."""
    from tpufab.steps.host import sshconfig

    return sshconfig.configure(settings, name=name, remove=remove, confirm=confirm,
                               console=console)
