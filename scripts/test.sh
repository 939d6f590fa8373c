#!/usr/bin/env bash
# Install what the tests need, then run the whole test suite. Exits non-zero on any failure.
#
#   ./scripts/test.sh              the whole suite, in four pytest processes at once
#   ./scripts/test.sh ARGS...      pytest ARGS (one process), e.g. tests/test_fields.py -x
#
# Most of the suite waits on real sshd workers, JAX processes and timeouts, not on the CPU,
# so four processes over disjoint groups of the test files (balanced on the seconds each file
# took, tests/file-seconds.txt; each process with its own simulated pod on its own port and
# state dir) finish in a fraction of one process's time on a 2-core machine (three groups took
# 38 minutes on CI's, so there are four). Each group's output is printed when it ends; any
# failure fails the whole run. (Background commands of a shell without job control start with SIGINT
# ignored; tests/conftest.py puts it back, so the suite's Ctrl-C tests work under this script.)
set -euo pipefail
cd "$(dirname "$0")/.."
# A clean environment, whatever the calling shell holds: no TPUFAB_* settings (the simulated
# pod's lines the README has a user export) but the suite's own TPUFAB_TEST_*, and no other
# virtualenv active (its python3 first on PATH, its Python for `run --local`).
while read -r name; do
    case $name in TPUFAB_TEST_*) ;; TPUFAB_*) unset "$name" ;; esac
done < <(compgen -e)
if [ -n "${VIRTUAL_ENV:-}" ]; then
    PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "${VIRTUAL_ENV%/}/bin" | paste -sd: -)
    unset VIRTUAL_ENV
fi
unset PYTHONHOME CONDA_PREFIX PIP_REQUIRE_VIRTUALENV
export PATH
./scripts/bootstrap.sh
echo "==> ruff (lint; indentation and whitespace: pyproject.toml)"
.venv/bin/ruff check tpufab tests tasks.py bench
if [ $# -gt 0 ]; then
    echo "==> pytest $*"
    exec .venv/bin/python -m pytest -q -ra --durations=25 "$@"
fi
GROUPS_N=4
mapfile -t files < <(LC_ALL=C ls -1 tests/test_*.py)
# Files go to groups by the seconds each took in a whole run (tests/file-seconds.txt, as this
# script prints them at the end; a file not listed counts as the median), longest first to the
# group with the least so far: the same split on every machine, groups of about equal length.
mapfile -t plan < <(.venv/bin/python - "$GROUPS_N" tests/file-seconds.txt "${files[@]}" <<'PY'
import sys
n, table, files = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
seconds = {}
for line in open(table):
    if line.strip() and not line.startswith("#"):
        took, path = line.split()
        seconds[path] = float(took)
known = sorted(seconds.values())
default = known[len(known) // 2] if known else 1.0
load, groups = [0.0] * n, [[] for _ in range(n)]
for path in sorted(files, key=lambda p: (-seconds.get(p, default), p)):
    g = min(range(n), key=lambda i: (load[i], i))
    load[g] += seconds.get(path, default)
    groups[g].append(path)
for paths in groups:
    print(" ".join(sorted(paths)))
PY
)
if [ "${#plan[@]}" -ne "$GROUPS_N" ]; then echo "could not split the test files" >&2; exit 1; fi
logs=()
pids=()
times=$(mktemp -d /tmp/tpufab-test-times.XXXXXX)
for ((g = 0; g < GROUPS_N; g++)); do
    read -r -a group <<<"${plan[$g]}"
    if [ "${#group[@]}" -eq 0 ]; then continue; fi   # (pytest without files runs them all)
    log=$(mktemp /tmp/tpufab-test-group.XXXXXX)
    logs+=("$log")
    echo "==> pytest group $((g + 1)) of $GROUPS_N: ${#group[@]} files"
    .venv/bin/python -m pytest -q -ra --durations=15 --junitxml="$times/group$((g + 1)).xml" \
        "${group[@]}" >"$log" 2>&1 &
    pids+=($!)
done
status=0
for ((g = 0; g < GROUPS_N; g++)); do
    if wait "${pids[$g]}"; then result=passed; else result=FAILED; status=1; fi
    echo "==> pytest group $((g + 1)) of $GROUPS_N: $result"
    cat "${logs[$g]}"
    rm -f "${logs[$g]}"
done
# Where the time went, per file (setup, call and teardown of its tests), for balancing groups.
echo "==> seconds per test file"
.venv/bin/python - "$times" <<'PY' || true
import collections, pathlib, sys, xml.etree.ElementTree as ET
total, group_of = collections.Counter(), {}
for xml in sorted(pathlib.Path(sys.argv[1]).glob("group*.xml")):
    for case in ET.parse(xml).iter("testcase"):
        parts = case.get("classname", "").split(".")
        name = "tests/" + next((p for p in parts if p.startswith("test_")), "?") + ".py"
        total[name] += float(case.get("time") or 0)
        group_of[name] = xml.stem
for name, seconds in total.most_common():
    print(f"{seconds:8.1f}s  {name}  ({group_of[name]})")
PY
rm -rf "$times"
exit $status
