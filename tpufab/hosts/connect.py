"""A node's workers as one group: find the node(s), make sure we can log in, open a Fanout.

Every worker verb (exec, setup, deploy, mount, run, kill, status) starts here. A node name
may also name a multislice queued resource: its slices' workers form one pod, numbered
slice by slice (slice 0's workers first).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, TpufabError

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.nodes import Node
    from tpufab.cloud.oslogin import Login
    from tpufab.cloud.planes.base import ControlPlane
    from tpufab.ssh.fanout import Fanout

SSH_PORT = 22  # networkEndpoints[].port is the TPU runtime's port (8470), never SSH's


@dataclass
class Hosts:
    """A pod as connected hosts: its node(s), the fan-out over every worker's SSH connection, and
    the global worker ids of each slice. What every step runs on (the Python API's tpufab.Pod
    holds one)."""

    settings: Settings
    nodes: list[Node]
    fanout: Fanout
    slices: list[list[int]] = field(default_factory=list)  # global worker ids per slice

    @property
    def node(self) -> Node:
        return self.nodes[0]

    @property
    def name(self) -> str:
        return self.settings.name or self.node.name

    @property
    def workers(self) -> list[int]:
        return self.fanout.workers

    def internal_ips(self) -> list[str]:
        return [w.internal_ip for n in self.nodes for w in n.workers]

    def device_globs(self) -> tuple[str, ...]:
        from tpufab.topology import DEVICE_GLOBS

        return DEVICE_GLOBS

    @property
    def jump(self):
        """The bastion the workers are reached through (a tpufab.config.Jump), or None."""
        return next((t.jump for t in self.fanout.targets.values() if t.jump is not None), None)

    def view(self, settings: Settings) -> Hosts:
        """This open pod as the caller of ``settings`` sees it: the same nodes and warm
        connections, with its own settings and its own timeouts (a FanoutView passes them on
        every call). Nothing here changes what another caller sees."""
        return replace(self, settings=settings, fanout=self.fanout.bound(
            connect_timeout=settings.connect_timeout, command_timeout=settings.command_timeout))

    def close(self) -> None:
        self.fanout.close()
        if self.jump is not None:
            from tpufab.ssh import jump

            jump.release(self.jump)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_nodes(control: ControlPlane, name: str) -> list[Node]:
    """The node called ``name``, or the slices of the queued resource called ``name``."""
    node = control.find_node(name)   # a name on two planes: one sentence
    qr = control.find_queued_resource(name) if node is None else None
    if (node is not None or qr is not None) and control.has_multislice(name):
        from tpufab.cloud.lifecycle import two_things

        raise ConfigError(two_things(name, node, qr, control.multislice(name)))
    if node is not None:
        return [node]
    if qr is not None:
        nodes = [n for n in control.list_nodes() if n.queued_resource == name]
        if nodes:
            return sorted(nodes, key=lambda n: (n.slice_index or 0, n.name))
        raise ApiError(f"Queued resource {name!r} has no nodes yet (state {qr.state}); wait for "
                       f"it with `tpufab describe --name {name}`.")
    slices = control.multislice(name)   # a multislice a plane groups itself
    if slices:
        return slices
    raise ApiError(f"No TPU node or queued resource named {name!r} in "
                   f"{control.settings.zone} (project {control.settings.project}); create it "
                   f"with `tpufab create --name {name} --type ...` or check `tpufab list`.")


def _check_ready(nodes: list[Node]) -> None:
    for node in nodes:
        if node.legacy:
            raise ApiError(f"TPU node {node.name} is a legacy TPU Node (API v1): it has no "
                           "workers to SSH into, so tpufab can only list, describe and delete "
                           "it; create a TPU VM instead (`tpufab create`).")
        if node.condition and not node.ready:   # Compute Engine: a short MIG, a flex-start end
            raise ApiError(node.condition)
        if node.preempted:
            raise ApiError(f"TPU node {node.name} was preempted ({node.state}); its workers are "
                           f"gone. Recover with `tpufab delete --name {node.name} --yes` and "
                           "create it again (or let `tpufab babysit` do it).")
        if not node.ready:
            raise ApiError(f"TPU node {node.name} is {node.state}, not READY; wait for it "
                           f"(`tpufab describe --name {node.name}`) or start it.")


def pin_host_keys(control: ControlPlane, nodes: list[Node], known_hosts) -> None:
    """Pin each worker's host key from the API's guest attributes (once per node id).

    Workers whose keys the API does not offer are trusted on first use instead.
    """
    for node in nodes:
        if all(known_hosts.lookup(worker_alias(node, w)) for w in node.workers):
            continue
        try:
            offered = control.host_keys(node.name)
        except ApiError:
            continue  # older runtimes do not publish host keys: first use pins them
        by_index = {w.index: w for w in node.workers}
        keys = {worker_alias(node, by_index[i]): k["ssh-ed25519"] for i, k in offered.items()
                if k.get("ssh-ed25519") and i in by_index}
        if keys:
            known_hosts.pin_aliases(keys)


def worker_alias(node: Node, worker) -> str:
    """The known_hosts alias of one worker: by node id and worker index, or for a Compute
    Engine VM by its own instance id (a VM a MIG recreates is a new VM, with a new host key,
    under the same group: it is pinned afresh, and the old VM's key is never offered for it)."""
    from tpufab.ssh.hostkeys import alias

    return alias(node.id, worker.index, getattr(worker, "host_id", ""))


def check_reachable(nodes: list[Node], settings: Settings) -> None:
    """Workers without external IPs need a way in: a jump host, or tpufab inside their VPC
    (``internal_ip``). Said before anything tries to connect."""
    if settings.jump or settings.internal_ip:
        return
    closed = [n.name for n in nodes if any(not w.external_ip for w in n.workers)]
    if closed:
        raise ConfigError(
            f"TPU node {closed[0]} has no external IPs, so its workers can only be reached from "
            "inside its VPC: pass --jump BASTION (or put `jump: BASTION` in "
            "tpufab.yaml), or run tpufab on a VM in that VPC with `internal_ip: true`; tpufab "
            "does not tunnel through IAP (no --iap yet: docs/access.md says why).")


def open_jump(settings: Settings, known_hosts, console: Console, name: str, count: int, *,
              login_user: str | None = None, os_login: Login | None = None):
    """The bastion of ``--jump``, connected now so that a bastion that is down is one
    sentence (naming it) rather than one failure per worker; None without --jump.

    A jump that names no user logs in as ``login_user`` (the user tpufab logs into the workers
    as: the OS Login POSIX user where OS Login is on, else ssh_user). With OS Login on
    (``os_login``), a refused login says what OS Login needs rather than authorized_keys."""
    if not settings.jump:
        return None
    from tpufab.config import parse_jump
    from tpufab.ssh import jump

    bastion = parse_jump(settings.jump, key_filename=str(settings.ssh_key_path))
    bastion = bastion.for_user(login_user or settings.ssh_user)
    refused = None
    if os_login is not None and os_login.user:
        if bastion.user != os_login.user:
            refused = (f"OS Login is on, so a bastion in the project takes only the keys "
                       f"registered for {os_login.account or 'your account'}, as its POSIX "
                       f"user {os_login.user}: name no user in --jump (or "
                       f"{os_login.user}@{bastion.host}), or put your public key "
                       f"({bastion.key_filename}.pub) in {bastion.user}'s authorized_keys if "
                       "the bastion does not use OS Login.")
        else:
            refused = (f"OS Login is on and tpufab's key is registered for "
                       f"{os_login.account or 'your account'} as {os_login.user}: check that "
                       "the account holds roles/compute.osLogin or roles/compute.osAdminLogin "
                       "in the bastion's project, or, if the bastion does not use OS Login "
                       "(its own metadata says enable-oslogin=FALSE), name its user in --jump "
                       "and put your public key in that user's authorized_keys there.")
    first_use = not known_hosts.lookup(bastion.key_alias)
    jump.client(bastion, known_hosts, settings.connect_timeout, refused=refused)
    jump.hold(bastion)
    if first_use:
        for note in jump.pinned_notes(bastion, known_hosts):
            console.print(note, markup=False, highlight=False)
    say_path(console, name, count, bastion)
    return bastion


def say_path(console: Console, name: str, count: int, bastion) -> None:
    """The line every verb through a bastion says once, connected or kept."""
    console.print(f"[dim]Reaching {name}'s {count} worker{'s' if count != 1 else ''} at their "
                  f"internal IPs via bastion {bastion}.[/dim]", highlight=False)


def connect(settings: Settings, *, control: ControlPlane | None = None,
            console: Console | None = None, nodes: list[Node] | None = None) -> Hosts:
    """Open the pod named by ``settings.name``: checks, SSH key, pinned host keys, Fanout
    (the pod's keeper's, without asking the cloud API, when it holds every connection)."""
    if control is None and nodes is None and settings.name and settings.project:
        pod = warm(settings)  # a keeper exists only under a name that was checked
        if pod is not None:
            if pod.jump is not None:
                from tpufab.term.console import stderr

                say_path(console or stderr(), settings.name,
                         sum(len(n.workers) for n in pod.nodes), pod.jump)
            return pod
    pending = None
    if settings.keep_alive_seconds > 0 and settings.name:
        from tpufab.ssh.keeper import client as keeper

        pending = keeper.prestart()   # its start overlaps the API lookup below
    from tpufab.cloud import oslogin, planes
    from tpufab.cloud.create import ensure_key
    from tpufab.cloud.names import validate_name

    name = validate_name(settings.name)
    settings.project = settings.require("project")
    from tpufab.ssh import keys as sshkeys
    from tpufab.ssh.connections import Target
    from tpufab.ssh.fanout import Fanout
    from tpufab.ssh.hostkeys import KnownHosts
    from tpufab.term.console import stderr

    control = planes.control_plane(settings, control)
    nodes = nodes if nodes is not None else resolve_nodes(control, name)
    _check_ready(nodes)
    check_reachable(nodes, settings)
    console = console or stderr()
    for node in nodes:   # a slice whose workers are numbered by IP only: say so
        if node.order_note:
            from rich.markup import escape

            console.print(f"[yellow]{escape(node.order_note)}[/yellow]")
    logins = oslogin.logins(settings, nodes, console)  # {node: Login} where OS Login is on
    entry = sshkeys.metadata_entry(settings.ssh_user, sshkeys.ensure_key(settings.ssh_key_path))
    for node in nodes:
        if node.name in logins and logins[node.name].user:
            continue  # its workers ignore ssh-keys metadata
        if ensure_key(control, node, entry, settings, console):
            console.print(f"[dim]Added your SSH key ({settings.ssh_key_path}.pub) to "
                          f"{node.name}'s metadata.[/dim]")
    known_hosts = KnownHosts(settings.known_hosts_path)
    pin_host_keys(control, nodes, known_hosts)
    os_login = next((login for login in logins.values() if login.user), None)
    bastion = open_jump(settings, known_hosts, console, name, sum(len(n.workers) for n in nodes),
                        login_user=os_login.user if os_login else None, os_login=os_login)

    targets, slices = [], []
    for node in nodes:
        ids = []
        login = logins.get(node.name)
        for w in node.workers:
            worker = len(targets)
            ids.append(worker)
            # Through a bastion in their VPC, workers are dialled at their internal IPs.
            targets.append(Target(worker=worker,
                                  host=w.address(settings.internal_ip or bastion is not None),
                                  user=login.user if login and login.user else settings.ssh_user,
                                  key_filename=str(settings.ssh_key_path),
                                  port=SSH_PORT, host_key_alias=worker_alias(node, w),
                                  jump=bastion, auth_hint=login.hint if login else None))
        slices.append(ids)
    if not targets:
        raise TpufabError(f"TPU node {name} reports no workers (networkEndpoints is empty).")
    fanout = Fanout(targets, known_hosts=known_hosts, concurrency=settings.concurrency,
                    processes=settings.fanout_processes or None,
                    ssh_transport=settings.ssh_transport,
                    connect_timeout=settings.connect_timeout,
                    command_timeout=settings.command_timeout)
    from tpufab.ssh.keeper import client as keeper

    # later runs go to the pod's kept connections, if on; the keeper keeps what the API said
    keeper.attach(fanout, settings, {"nodes": nodes, "slices": slices,
                                     "settings": fingerprint(settings)}, pending)
    return Hosts(settings=settings, nodes=nodes, fanout=fanout, slices=slices)


def fingerprint(settings: Settings) -> tuple:
    """The settings a pod's connections were made with (beyond what their targets say)."""
    return (settings.ssh_user, str(settings.ssh_key_path), bool(settings.internal_ip),
            settings.jump, settings.os_login, str(settings.known_hosts_path))


def warm(settings: Settings) -> Hosts | None:
    """The pod as its keeper holds it (tpufab.ssh.keeper.lookup): no cloud API call, no
    cloud client import, no connection to a jump host (the keeper's own carries its
    connections; this process connects to the bastion only if it opens one of its own, for
    SFTP or a forward). None when keep_alive is off, or no keeper of the pod holds every
    worker's connection made with these settings and the host keys pinned now (then
    ``connect`` asks the API)."""
    found = _warm(settings)
    return found[0] if found else None


class KeptControl:
    """A control plane whose reads (tpufab.ssh.keeper.API_READS) the pod's keeper asks the
    cloud API for, fresh, with the client it has loaded already; whatever else, and any read
    the keeper does not answer, this command does itself (loading the client then)."""

    def __init__(self, settings: Settings, path):
        self.settings, self.path = settings, path
        self._local = None

    def local(self):
        if self._local is None:
            from tpufab.cloud import planes

            self._local = planes.control_plane(self.settings)
        return self._local

    def __getattr__(self, attr: str):
        from tpufab.ssh.keeper import client as keeper

        if attr.startswith("_") or attr not in keeper.API_READS:
            return getattr(self.local(), attr)

        def read(*args, **kwargs):
            from tpufab.term.console import stderr

            if self.path is not None:
                try:
                    return keeper.ask_api(self.path, self.settings, attr, args, kwargs,
                                          on_note=lambda text: stderr().print(text))
                except keeper.KeeperGone:
                    self.path = None   # not again in this command
            return getattr(self.local(), attr)(*args, **kwargs)

        return read


def kept_api(settings: Settings) -> tuple[Hosts, KeptControl] | None:
    """The pod as its keeper holds it, and a control plane asking the API through that
    keeper (`tpufab status`: fresh API state without loading the API's client here). None
    as for ``warm``. The pod is the one ``shared`` gives this process from now on; a caller
    that finds the nodes changed (``same_nodes``) calls ``forget`` and connects anew."""
    found = _warm(settings)
    if found is None:
        return None
    pod, path = found
    _OPEN.setdefault(_key(settings), pod)
    return pod, KeptControl(settings, path)


def same_nodes(a: list[Node], b: list[Node]) -> bool:
    """The same nodes (names, ids) with the same workers (addresses): connections made to
    one reach the other."""
    def shape(nodes):
        return [(n.name, n.id, [(w.internal_ip, w.external_ip, w.port, w.host_id) for w in n.workers]) for n in nodes]

    return shape(a) == shape(b)


def _warm(settings: Settings):
    if settings.keep_alive_seconds <= 0:
        return None
    from tpufab.ssh.keeper import client as keeper

    found = keeper.lookup(settings.project, settings.zone, settings.name, fingerprint(settings))
    if found is None:
        return None
    path, record, init = found
    from tpufab.ssh.fanout import Fanout
    from tpufab.ssh.hostkeys import KnownHosts

    fanout = Fanout(init["targets"], known_hosts=KnownHosts(settings.known_hosts_path),
                    concurrency=settings.concurrency,
                    processes=settings.fanout_processes or None,
                    ssh_transport=settings.ssh_transport,
                    connect_timeout=settings.connect_timeout,
                    command_timeout=settings.command_timeout)
    if not keeper.matches(path, fanout):  # pins or keys changed since: ask the API
        fanout.close()
        return None
    keeper.attach(fanout, settings, record)
    return Hosts(settings=settings, nodes=record["nodes"], fanout=fanout,
               slices=record["slices"]), path


# One open pod per (project, zone, name) for the life of the process: `invoke deploy run`
# runs both steps over the same warm connections.
_OPEN: dict[tuple, Hosts] = {}


def _key(settings: Settings) -> tuple:
    return (settings.project, settings.zone, settings.name, settings.ssh_user,
            str(settings.ssh_key_path), settings.internal_ip, settings.jump, settings.os_login)


def shared(settings: Settings, **kwargs) -> Hosts:
    """``connect`` once per node for this process; later verbs reuse the open connections.
    Each caller gets its own view (``Hosts.view``): its settings and timeouts, never the ones
    of the caller before it, and never changing the cached pod's."""
    import atexit

    key = _key(settings)
    pod = _OPEN.get(key)
    if pod is None:
        pod = _OPEN[key] = connect(settings, **kwargs)
        if len(_OPEN) == 1:
            atexit.register(close_all)
    return pod.view(settings)


def forget(settings: Settings) -> None:
    """Drop (and close) the cached pod of ``settings.name``, e.g. after a delete."""
    for key in [k for k in _OPEN if k[2] == settings.name]:
        _OPEN.pop(key).close()


def stop_keepers(settings: Settings, why: str | None = None) -> int:
    """Stop the background processes keeping the pod's connections (tpufab.ssh.keeper): how
    many there were. ``why``: what the commands under way over them are told."""
    from tpufab.ssh.keeper import client as keeper

    return keeper.stop(settings.project, settings.zone, settings.name, why)


def disconnect(settings: Settings) -> int:
    """Stop the pod's keepers (`tpufab disconnect`): how many; NotFound in one sentence when
    none ran because the pod does not exist (the API unreachable: nothing was kept either way)."""
    from tpufab.cloud import lifecycle
    from tpufab.errors import NotFound

    stopped = stop_keepers(settings, "`tpufab disconnect` closed the pod's connections")
    if not stopped:   # nothing was kept: say so only of a pod that exists
        try:
            lifecycle.describe(settings)
        except NotFound as err:
            raise NotFound(f"{str(err).rstrip('.').split(';')[0]}; there are no "
                           "connections to it to close (`tpufab list` shows the pods).",
                           exit_code=err.exit_code) from None
        except TpufabError:
            pass
    return stopped


def kept(settings: Settings) -> str | None:
    """One line: whether the pod's connections are kept between commands (None: keep_alive
    is 0)."""
    from tpufab.ssh.keeper import client as keeper

    return keeper.describe(settings.project, settings.zone, settings.name,
                           settings.keep_alive_seconds)


def close_all() -> None:
    while _OPEN:
        _OPEN.popitem()[1].close()


def forget_host_keys(settings: Settings, node: str) -> int:
    """Forget the pinned host keys of ``node`` (a node name, or the node id an error named):
    how many keys were removed from ``settings.known_hosts_path``."""
    from tpufab.ssh.hostkeys import KnownHosts

    node_id = node
    if not node.isdigit():
        from tpufab.cloud import planes
        from tpufab.cloud.names import validate_name

        node_id = planes.control_plane(settings).get_node(validate_name(node)).id
    return KnownHosts(settings.known_hosts_path).forget(node_id)

def ssh_session(hosts: Hosts, worker: int, *, command=None, forwards=(), replace: bool = False,
                before_exec=None) -> int:
    """The system ssh to ``worker`` (`tpufab ssh`, ``Pod.ssh``): its exit status, or with
    ``replace`` this process becomes it (``before_exec()`` first: close what is open)."""
    import os
    import subprocess
    import sys

    binary, argv = system_ssh(hosts, worker, command=command, forwards=forwards,
                              tty=sys.stdin.isatty())
    sys.stdout.flush()
    if replace:
        if before_exec is not None:
            before_exec()
        os.execv(binary, argv)
    return subprocess.call(argv, executable=binary)


def system_ssh(pod: Hosts, worker: int, *, command=None, forwards=(), tty: bool = False,
               ) -> tuple[str, list[str]]:
    """(the system ssh binary, its argv) for a session on ``worker`` (`tpufab ssh`): tpufab's
    key, the host key pinned for that worker, the jump host as a ProxyCommand, ``-L``
    ``forwards`` (tpufab.ssh.forward.PortForward) and ``command`` (an argv) or, on a
    terminal (``tty``), an interactive shell."""
    import shutil

    from tpufab.ssh.hostkeys import KnownHosts

    settings = pod.settings
    if worker not in pod.fanout.targets:
        raise ConfigError(f"Worker {worker} does not exist; {pod.name} has workers "
                          f"0-{len(pod.workers) - 1}.")
    target = pod.fanout.targets[worker]
    ssh_bin = shutil.which("ssh")
    if ssh_bin is None:
        raise ConfigError("The system ssh client is missing; install openssh-client.")
    known_hosts = KnownHosts(settings.known_hosts_path)
    argv = ["ssh", "-i", str(settings.ssh_key_path), "-o", "IdentitiesOnly=yes",
            *known_hosts.ssh_options(target.host_key_alias), "-p", str(target.port)]
    if target.jump is not None:  # -J would not pass our key and known_hosts on to the jump
        from tpufab.ssh.jump import proxy_command

        argv += ["-o", "ProxyCommand=" + proxy_command(
            target.jump, known_hosts.ssh_options(target.jump.key_alias), str(settings.ssh_key_path))]
    for f in forwards:
        argv += ["-L", f.ssh_option()]
    if forwards:
        argv += ["-o", "ExitOnForwardFailure=yes"]
    argv.append(f"{target.user}@{target.host}")
    if command:
        argv += ["--", *command]
    elif tty:
        argv.insert(1, "-t")
    return ssh_bin, argv
