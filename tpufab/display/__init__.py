"""The terminal: consoles (stdout/stderr), text made safe to show, live progress."""
