"""Runs: ids and the job environment (env), starting, following, listing and stopping a run's
processes (running), what the workers know of their runs (history)."""
