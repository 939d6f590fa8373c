"""The Pod: the Python API every verb is built on (api)."""
