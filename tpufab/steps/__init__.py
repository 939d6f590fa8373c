"""Steps: what a pod does on its workers, in sub-bands that import only downwards:
start (starting a run, Ray, the stall watchdog) -> health (status, check, stacks, top) ->
host (setup, mount, kill, autostop, profile) -> code (git, the code lease, deploy) -> runs
(run ids, the job environment, following and stopping a run)."""
