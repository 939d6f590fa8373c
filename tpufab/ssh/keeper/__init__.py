"""Kept connections: one background process per pod holds its SSH connections between commands.

Like OpenSSH's ControlPersist. The first command to a pod starts a *keeper*
(``python -m tpufab.ssh.keeper.server SOCKET``: double-forked, in its own session, so a terminal's
Ctrl-C or hang-up never reaches it) and hands it the pod's fan-out work; every later command,
``invoke`` task or Pod API call for that pod finds it on its unix socket and runs its commands
over the connections it already holds. The keeper is a long-lived fan-out shard: the client
side (client.py) is a :class:`tpufab.ssh.shards.parent.Shard` over the socket, the keeper
(server.py) runs ``tpufab.ssh.shards.child.serve`` for each client, so output, exit codes, masking, progress and
Ctrl-C (the keeper runs the same interrupt path) are those of a fan-out shard.

Keyed, private, bounded:

- The socket's name is a hash of everything the connections depend on: the pod (project,
  zone, name), every worker's address, login user, key and host-key alias (the node id), the
  host keys pinned for them, the jump host, tpufab's version and PROTOCOL. A recreated node
  (new node id or host key) therefore never reaches an old connection: it gets a new keeper,
  and the pod's other keepers are told to stop.
- The socket lives in a 0700 directory (``$XDG_RUNTIME_DIR/tpufab``, else
  ``~/.cache/tpufab/keepers``) and is 0600; the keeper checks the peer's uid (SO_PEERCRED) on
  every connection, the client checks the directory's and socket's owner and mode and the
  keeper's uid, and connects itself (with a one-sentence warning) when any is wrong.
- A command waits at most CONNECT_WAIT for a running keeper's answer (SPAWN_WAIT for one it
  starts) and otherwise connects itself; a keeper that does not answer in time, belongs to
  another tpufab version or refuses is stopped and replaced by the next command.
- The keeper exits after ``keep_alive`` seconds without a client (``TPUFAB_KEEP_ALIVE``,
  ``--keep-alive``; 0: no keeper), on ``tpufab disconnect``, when the pod is deleted, when
  its socket is removed or taken over, and when every connection it held is gone (a pod
  deleted, stopped or recreated behind tpufab's back, ``tpufab sim down``).

A warm command does not ask the cloud API: the keeper also holds the pod as the last command
that asked the API saw it (its nodes, slices and the settings its connections were made
with: :func:`lookup`). A command whose settings match and whose keeper holds every worker's
connection builds its fan-out from that, checks that the socket's name is the hash of that
fan-out (the same workers, keys, node id and host keys pinned in known_hosts now) and never
imports a cloud client. A keeper missing a connection (a worker that went away: a deleted,
stopped, preempted or recreated VM drops it) is not asked: the command asks the API as before,
and a recreated node's new id and host keys give it a new keeper.

A command that must ask the API (`tpufab status`: the node's state, health and maintenance
now) asks it through the keeper (``ask_api``: the reads in API_READS only), whose client is
loaded already; the answer is the API's, fresh, never the keeper's record. A keeper that does
not answer (CONNECT_WAIT to reach it, API_WAIT for the answer) is not asked again in that
command: it asks the API itself.

If the keeper dies during a command, the workers' commands die with its connections and each
worker's result says to run the command again (it is not rerun: it may have done part of
its work).
"""
