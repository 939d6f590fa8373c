"""The SSH engine: one connection per worker (fan-out, shards, jump hosts), pinned host keys,
tpufab's key, the worker-side script seam, file transfer and port forwards."""
