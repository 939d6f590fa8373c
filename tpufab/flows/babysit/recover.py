"""What babysit brings back after a preemption: the node's shape (``NodeSpec``), what the
workers had (``Restore``: the setup script, the commit, the mounts; read before the first
attempt), and ``Recovery``, the part of the babysitter that deletes the lost node, creates it
again in that shape and restores it. ``restore_setup``, ``restore_commit`` and
``restore_mount`` bring any pod to a Restore (launch uses them on a new or reused pod)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tpufab.errors import ApiError, ConfigError
from tpufab.flows.babysit.policy import BabysitError, backoff_delay
from tpufab.steps.host.sshconfig import keep_current

if TYPE_CHECKING:
    from tpufab.cloud.nodes import Node, QueuedResourceInfo
    from tpufab.config import Settings
    from tpufab.steps.health.status import StatusRow
    from tpufab.steps.host.environment import EnvReport, EnvSpec


@dataclass(frozen=True)
class NodeSpec:
    """The shape of the pod to recreate after a preemption."""

    name: str
    accelerator_type: str
    runtime_version: str
    tier: str                      # spot | preemptible | reserved | on-demand
    queued: bool = False
    num_slices: int = 1
    labels: Mapping[str, str] = field(default_factory=dict)
    # read from the node (None: not known, the settings decide): a node created with
    # --internal-ips comes back without external IPs, an OS Login node with enable-oslogin
    external_ips: bool | None = None
    metadata: Mapping[str, str] | None = None
    network: str = ""
    subnetwork: str = ""
    flex_start: int = 0            # Compute Engine flex-start: its maximum run duration (s)

    @classmethod
    def from_api(cls, name: str, nodes: Sequence[Node], qr: QueuedResourceInfo | None
                 ) -> NodeSpec:
        if not nodes:
            if qr is None:
                raise ConfigError(f"Nothing to babysit: there is no TPU node or queued resource "
                                  f"named {name!r}; create it first (`tpufab create`).")
            tier = "spot" if qr.tier == "spot" else ("reserved" if qr.tier == "reserved"
                                                     else "on-demand")
            return cls(name, qr.accelerator_type, qr.runtime_version, tier, True,
                       qr.node_count or 1)
        from tpufab.cloud.nodes import AUTOSTOP_KEY

        node = nodes[0]
        queued = qr is not None or node.queued_resource is not None
        slices = (qr.node_count if qr is not None else len(nodes)) or 1
        # autostop's marker goes: the recreated node has no watchdog until armed again
        metadata = {k: v for k, v in node.metadata.items() if k != AUTOSTOP_KEY}
        flex = node.max_run_duration if node.provisioning_model == "FLEX_START" else 0
        return cls(name, node.accelerator_type, node.runtime_version,
                   "flex-start" if flex else node.tier, queued, slices,
                   dict(node.labels), external_ips=node.external_ips, metadata=metadata,
                   network=node.network, subnetwork=node.subnetwork, flex_start=flex)

    def settings(self, base: Settings) -> Settings:
        """``base`` with this spec's type, runtime, tier, labels, metadata and network (a
        copy; what ``base`` sets itself wins for labels, metadata and network)."""
        return replace(base, name=self.name, type=self.accelerator_type,
                       runtime_version=self.runtime_version or None,
                       spot=self.tier == "spot", preemptible=self.tier == "preemptible",
                       reserved=self.tier == "reserved",
                       labels={**self.labels, **base.labels},
                       metadata={**(self.metadata or {}), **base.metadata},
                       internal_ip=base.internal_ip if self.external_ips is None
                       else not self.external_ips,
                       network=base.network or self.network or None,
                       subnetwork=base.subnetwork or self.subnetwork or None,
                       flex_start=bool(self.flex_start),
                       max_run_duration=f"{self.flex_start}s" if self.flex_start
                       else base.max_run_duration)

    def describe(self) -> str:
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        queued = ", queued" if self.queued else ""
        internal = ", no external IPs" if self.external_ips is False else ""
        return (f"{self.accelerator_type}{slices} ({self.tier}{queued}{internal}, "
                f"{self.runtime_version})")


@dataclass(frozen=True)
class MountPoint:
    url: str
    at: str
    driver: str
    options: tuple[str, ...] = ()


@dataclass
class Restore:
    """What a recreated node needs before the recipe starts again."""

    setup_hash: str | None = None          # the script the workers last ran with `setup`
    setup_script: bytes | None = None
    setup_name: str | None = None
    commit: str | None = None
    deploy_dir: str | None = None
    mounts: list[MountPoint] = field(default_factory=list)
    environment: EnvSpec | None = None     # the configured environment, read at the start

    @classmethod
    def from_facts(cls, facts: Mapping[int, StatusRow]) -> Restore:
        """What worker 0 (or the first that answered) has: setup, commit, mounts."""
        answered = [facts[w] for w in sorted(facts) if facts[w].reachable]
        if not answered:
            return cls()
        first = answered[0]
        done = [s for s in first.setup if s.done]
        mounts = []
        for m in first.mounts:
            if m.driver in ("gcsfuse", "rclone") and m.url:
                mounts.append(MountPoint(m.url, m.at, m.driver))
        return cls(setup_hash=done[-1].hash if done else None, commit=first.commit,
                   deploy_dir=first.deploy_dir, mounts=mounts)

    def describe(self) -> str:
        parts = []
        if self.environment is not None:
            parts.append(f"the environment at {self.environment.path} "
                         f"({self.environment.spec})")
        if self.setup_script is not None:
            parts.append(f"setup {self.setup_name or self.setup_hash}")
        if self.commit:
            parts.append(f"commit {self.commit[:12]} in {self.deploy_dir}")
        parts += [f"{m.url} at {m.at} ({m.driver})" for m in self.mounts]
        return ", ".join(parts) or "nothing"


def setup_hash(content: bytes) -> str:
    """The name `tpufab setup` gives a script on the workers (tpufab.steps.host.setup)."""
    return hashlib.sha256(content).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Bringing a pod to a Restore (babysit after a preemption, launch on a new or reused pod)


def restore_environment(pod, r: Restore, *, timeout: float | None = None) -> EnvReport:
    """``r.environment`` on every worker, as `tpufab setup` puts it there (built once and
    copied, skipped where its hash is: tpufab.steps.host.environment); its report."""
    from tpufab.steps.host.environment import put_environment

    assert r.environment is not None
    return put_environment(pod, r.environment, timeout=timeout)


def restore_setup(pod, r: Restore, *, sink=None, env: Mapping[str, str] | None = None,
                  secrets: Mapping[str, str] | None = None,
                  timeout: float | None = None, force: bool = False) -> dict:
    """Run ``r.setup_script`` on every worker (once per content unless ``force``; ``env`` and
    ``secrets``, the latter on stdin only, do not count as content; inside the environment,
    VIRTUAL_ENV set, where one is configured); {worker: SetupRow}."""
    from tpufab.steps.host.setup import run_setup

    if r.environment is not None:     # as `tpufab setup`: the script sees the environment
        env = {**(env or {}), "VIRTUAL_ENV": r.environment.path}

    result, outcomes = run_setup(pod.fanout, r.setup_script, sink=sink, env=env,
                                 secrets=secrets, timeout=timeout, force=force,
                                 name=_setup_words(r.setup_name))
    result.close()
    return outcomes


def _setup_words(name: str | None) -> str:
    """How a failure names the setup: ``the task.yaml setup``, ``the setup.sh``."""
    if not name:
        return "setup"
    return name if name.startswith("the ") else f"the {name}"


def restore_commit(pod, r: Restore, *, root: Path, direct: bool = False, lease: bool = True,
                   timeout: float | None = None,
                   progress: Callable[[str], None] | None = None):
    """Deploy ``r.commit`` of the repository at ``root`` into ``r.deploy_dir`` (the one deploy
    path: ``deploy_checkout``; ``lease``: False when the caller holds the code lease); the
    report."""
    from tpufab.steps.code import deploy

    return deploy.deploy_checkout(pod, cwd=root, ref=r.commit or "HEAD", dir=r.deploy_dir,
                                  direct=direct, lease=lease, timeout=timeout,
                                  progress=progress)


def restore_mount(pod, m: MountPoint, *, endpoint: str | None = None,
                  for_task: bool = False):
    """Mount ``m`` on every worker (a verified no-op where it is mounted); the report.
    ``for_task``: a task file's mount (the advice of an error names the task's fields)."""
    from tpufab.steps.host import mount

    return mount.mount(pod.fanout, m.url, at=m.at, driver=m.driver, options=m.options,
                       endpoint=endpoint, for_task=for_task)


class Recovery:
    """The babysitter's recovery (a part of ``loop.Babysitter``, whose state it uses:
    ``settings``, ``control``, ``console``, ``spec``, ``restore``, ``root``): read what to
    restore, delete and recreate the lost node, restore it."""

    def _capture(self) -> None:
        """Read what the workers have now (setup, commit, mounts) to restore it later."""
        from tpufab.steps.health import status

        pod = self._pod()
        dirs = status.default_deploy_dirs(self.settings)
        checkout = getattr(self, "checkout", None)
        if checkout is not None:    # a caller's checkout (the supervisor's clone), not cwd's
            from tpufab.steps.code import deploy, gitops

            dirs.append(deploy.default_dir(gitops.repo_root(checkout)))
        facts = status.gather_facts(pod.fanout, deploy_dirs=list(dict.fromkeys(dirs)),
                                    timeout=self.timeout)
        silent = {w: f.error or "no answer" for w, f in facts.items() if not f.reachable}
        if silent:  # as `run`: a recipe needs every worker (asking again would wait again)
            from tpufab.steps.runs.running import unreachable_error

            raise unreachable_error(silent, f"babysit {self.recipe.name}")
        found = Restore.from_facts(facts)
        if self.restore.setup_script is None and found.setup_hash:
            first = min(w for w, f in facts.items() if f.reachable)
            got = pod.fanout.run(["cat", f".cache/tpufab/remote/{found.setup_hash}/setup.sh"],
                                 workers=[first], timeout=self.timeout)
            try:
                content = got[first].stdout_bytes if got[first].ok else None
            finally:
                got.close()
            if content is not None and setup_hash(content) == found.setup_hash:
                self.restore.setup_script = content
                self.restore.setup_hash = found.setup_hash
                self.restore.setup_name = f"the setup script the workers ran ({found.setup_hash})"
        self.restore.commit = found.commit
        self.restore.deploy_dir = found.deploy_dir
        self.restore.mounts = found.mounts

    def _recreate(self, reason: str) -> None:
        """Delete the node and create it again in the shape it had (``self.spec``)."""
        from tpufab.cloud import lifecycle

        assert self.spec is not None
        self._forget_pod()
        self.note(f"babysit: {reason}: deleting {self.name} (a preempted node still counts "
                  "against quota) ...", "yellow")
        lifecycle.delete(self.settings, yes=True, console=self.console, control=self.control,
                         deletable=self._still_lost)
        wanted = self.spec.settings(self.settings)
        for attempt in range(1, self.create_attempts + 1):
            self.go_on(f"creating {self.name}")
            try:
                lifecycle.create(wanted, queued=self.spec.queued,
                                 num_slices=self.spec.num_slices, console=self.console,
                                 control=self.control)
                keep_current(wanted, self.console)  # new IPs and host keys in ~/.ssh/config
                break
            except ApiError as err:
                if attempt == self.create_attempts:
                    raise BabysitError(f"Could not recreate {self.name} after {attempt} tries: "
                                       f"{err}") from None
                delay = backoff_delay(attempt, *self.backoff)
                self.note(f"babysit: creating {self.name} failed ({err}); trying again in "
                          f"{delay:g} s.", "yellow")
                if "Queued resource" in str(err) or "vanished" in str(err):
                    lifecycle.delete(self.settings, yes=True, console=self.console,
                                     control=self.control)
                self.sleep(delay)

    def _still_lost(self, now) -> str | None:
        """Re-read just before babysit deletes: nodes that are not the ones it watched (another
        id: recreated by someone else meanwhile) are used, not deleted."""
        strangers = [s for s in now.slices if self._watched_ids and s.id
                     and s.id not in self._watched_ids]
        if strangers:
            from tpufab.cloud.lifecycle import slices_text

            return (f"{slices_text(strangers)} is not the node babysit watched (it was "
                    "recreated meanwhile); using it as it is.")
        return None

    def _restore(self) -> None:
        from tpufab import nodeset

        pod = self._pod()
        r = self.restore
        if r.environment is not None:
            self.note(f"babysit: the environment at {r.environment.path} on "
                      f"{nodeset.fold(pod.workers)} ...")
            built = restore_environment(pod, r, timeout=self.timeout)
            self.note(f"babysit: {built.summary}")
        if r.setup_script is not None:
            self.note(f"babysit: setup ({r.setup_name}) on {nodeset.fold(pod.workers)} ...")
            restore_setup(pod, r, timeout=self.timeout)
        if r.commit and self.root is not None:
            report = restore_commit(pod, r, root=self.root, direct=self.direct,
                                    timeout=self.timeout,
                                    progress=lambda msg: self.note(f"deploy: {msg}", "dim"))
            self.note(f"babysit: deployed {report.commit[:12]} to {report.dir} again.")
        elif r.commit:
            self.note(f"babysit: commit {r.commit[:12]} was deployed, but this directory is "
                      "not its repository: not deploying it again.", "yellow")
        for m in r.mounts:
            restore_mount(pod, m, endpoint=self.settings.storage_endpoint)
            self.note(f"babysit: mounted {m.url} at {m.at} again.")
