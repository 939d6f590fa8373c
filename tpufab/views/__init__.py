"""Views: everything that draws a step's outcome on a terminal (the one report renderer, the
layouts of status, check, top, stacks and Ray, live progress, a run's logs). The band above
the flows: it may import every band below it; nothing below imports it."""
