"""What a keeper's clients and the keeper itself agree on: the protocol's version, the
cloud API reads a keeper may answer, and the bounds a client waits (tpufab.ssh.keeper)."""

from __future__ import annotations

import sys

PROTOCOL = 4
CONNECT_WAIT = 2.0   # s: a running keeper's answer (connect + handshake)
LOOKUP_WAIT = 1.0    # s: a keeper's answer to "which pod do you hold" (else: the cloud API)
SPAWN_WAIT = 3.0     # s: a keeper this command starts (a Python interpreter starting)
API_WAIT = 60.0      # s: a cloud API read through a keeper (then the command asks itself)
API_BEAT = 1.0       # s: while it asks the API for a command, a keeper says it lives this often
API_SILENT = 5.0     # s: a keeper that says nothing this long is frozen: the command asks itself
# The control plane's reads a command may ask through the pod's keeper (tpufab status: its
# client is loaded there already); anything else a command does itself.
API_READS = frozenset({"get_node", "find_node", "holds", "list_nodes", "host_keys",
                       "upcoming_maintenance", "get_queued_resource", "find_queued_resource",
                       "list_queued_resources", "list_operations", "zones",
                       "accelerator_types", "multislice", "has_multislice"})
PRESTART_WAIT = 60.0  # s: how long a keeper started ahead waits to be told its socket


def version() -> str:
    """tpufab's ``__version__`` (the package is loaded: this module is inside it)."""
    return getattr(sys.modules.get("tpufab"), "__version__", "unknown")
