"""The verbs, one module per family as the user sees them (nodes, workers, data, jobs,
status, sim). Each verb turns flags into Settings, calls the library and prints; heavy
modules are imported inside the verbs so `tpufab --help` and `invoke --list` stay instant.
No library module imports these."""
