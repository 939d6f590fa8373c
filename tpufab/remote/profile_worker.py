"""tpufab profile capture: ask a running JAX program's profiler server for a trace.

    PYTHON profile_worker.py --port P --duration-ms D --logdir DIR [--host H]

Runs with the job's Python (the one with JAX), since the trace client comes from xprof
(``xprof.convert._pywrap_profiler_plugin.trace``, what ``python -m jax.collect_profile``
calls). Writes ``DIR/plugins/profile/<stamp>/<host>.xplane.pb`` and answers (workerlib.answer)
``{"logdir": ..., "files": [[path, size], ...]}`` or ``{"error": ...}``.
"""

import argparse
import os
import sys

from tpufab.remote.workerlib import answer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--duration-ms", type=int, required=True)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    logdir = os.path.abspath(os.path.expanduser(args.logdir))
    try:
        from xprof.convert import _pywrap_profiler_plugin as plugin
    except ImportError as err:
        answer("answer", {"error": f"xprof is not installed for {sys.executable} ({err}): `pip install xprof` "
                          "in the job's environment (tpufab setup --script scripts/setup.sh "
                          "does)"})
        return 0
    os.makedirs(logdir, exist_ok=True)
    options = {"host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 1}
    try:
        plugin.trace(f"{args.host}:{args.port}", logdir, "", True, args.duration_ms,
                     3, options)
    except Exception as err:  # the plugin raises plain exceptions with the gRPC status
        text = str(err).strip().splitlines()
        answer("answer", {"error": f"no trace from the profiler server on port {args.port}: {text[0] if text else type(err).__name__} (is a "
                          "JAX program running jax.profiler.start_server there?)"})
        return 0
    files = []
    for folder, _dirs, names in os.walk(logdir):
        for name in sorted(names):
            path = os.path.join(folder, name)
            files.append([os.path.relpath(path, logdir), os.path.getsize(path)])
    answer("answer", {"logdir": logdir, "files": files})
    return 0


if __name__ == "__main__":
    sys.exit(main())
