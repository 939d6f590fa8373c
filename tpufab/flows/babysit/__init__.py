"""`tpufab babysit`: a recipe kept running through preemptions (``loop``), its decisions
(``policy``), records (``records``), recovery (``recover``) and attempts (``attempt``)."""
