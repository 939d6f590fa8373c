"""Run a worker's ``startup-script`` metadata once, as root, like Google's guest agent
(google_metadata_script_runner) does at boot. Stdlib only; the sim daemon runs it inside the
worker (``python3 -I -S -`` on stdin, through nsenter).

It fetches the script from the worker's metadata server, runs it (its own ``#!`` line, else
``/bin/bash``) with a root login's environment, appends every output line to
/var/log/google-startup-scripts.log in syslog form, and prints one JSON line:
``{"ran": true, "exitCode": N}`` or ``{"ran": false}`` (no script).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/startup-script"
LOG = "/var/log/google-startup-scripts.log"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def fetch():
    request = urllib.request.Request(URL, headers={"Metadata-Flavor": "Google"})
    for attempt in range(20):  # the metadata server opens with the worker; allow a moment
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.read().decode()
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return None
            error = err
        except OSError as err:
            error = err
        time.sleep(0.1 * (attempt + 1))
    raise SystemExit(f"startup_runner: cannot read startup-script metadata: {error}")


def main():
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    host = socket.gethostname()
    tag = f"google_metadata_script_runner[{os.getpid()}]"
    with open(LOG, "a", buffering=1) as log:
        def say(message):
            log.write(f"{time.strftime('%b %d %H:%M:%S')} {host} {tag}: {message}\n")

        say("Starting startup scripts.")
        script = fetch()
        if script is None:
            say("No startup scripts to run.")
            print(json.dumps({"ran": False}))
            return 0
        say("Found startup-script in metadata.")
        with tempfile.TemporaryDirectory(prefix="metadata-scripts") as folder:
            path = os.path.join(folder, "startup-script")
            with open(path, "w") as f:
                f.write(script)
            os.chmod(path, 0o700)
            argv = [path] if script.startswith("#!") else ["/bin/bash", path]
            env = {"PATH": PATH, "HOME": "/root", "USER": "root", "LOGNAME": "root",
                   "SHELL": "/bin/bash", "LANG": "C.UTF-8"}
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, cwd="/", env=env)
            for line in proc.stdout:
                say("startup-script: " + line.decode(errors="replace").rstrip("\n"))
            code = proc.wait()
        say(f"startup-script exit status {code}")
        say("Finished running startup scripts.")
    print(json.dumps({"ran": True, "exitCode": code}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
