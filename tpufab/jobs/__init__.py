"""Jobs on the pod: run ids and the job environment (runs), starting and following runs
(running), `run --local` (localrun), task files and launch, babysit."""
