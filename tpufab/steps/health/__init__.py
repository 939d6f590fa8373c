"""Is the pod well: status (every worker's facts), check, stacks (py-spy), top."""
