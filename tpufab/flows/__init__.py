"""Flows: orchestrations over a pod that take many steps and may outlive one command: launch
(a task file to a finished run) and babysit (a job kept alive through preemptions). They call
the Pod's steps and never print: the verbs hand them the views."""
