"""Starting a run on every worker (the one start path), `run --local`, Ray on the pod, and the
stall watchdog of a followed run."""
