"""The Pod: the Python API every verb is built on (api), and the connected node it opens
(connection)."""
