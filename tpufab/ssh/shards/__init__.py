"""Fan-out work in other client processes: a large pod's connections spread over children
(parent.py: the Shard a Fanout holds; child.py: ``python -m tpufab.ssh.shards.child``), the
same protocol the pod's connection keeper serves (tpufab.ssh.keeper)."""
