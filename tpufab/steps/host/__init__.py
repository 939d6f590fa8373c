"""What a host is set up with, and cleared of: setup scripts, bucket mounts, kill, the
autostop watchdog, profiles."""
