#!/bin/sh
# Run a setup script once per content hash; log under ~/.tpufab/setup/ (0700; the log 0600,
# secrets masked as it is written, by masktee.py).
# usage: setup_runner.sh HASH SCRIPT_PATH MASKTEE_PATH --force|- [SECRET_NAME ...]
# Prints the script's output, then its answer (the answer codec, tpufab/remote/workerlib.py):
#   @tpufab-answer answer {"status": "ran"|"skipped"|"incomplete", "exit_code": N, "log": PATH,
#   "failed": TEXT|null}
# A script without a shebang runs under `/bin/sh -e` (errexit: the first failing command stops
# it). The setup is recorded as done (HASH.done) only when it exited 0 and no command recorded
# a failure in $TPUFAB_SETUP_FAILED (the ERR trap launch writes into a task's setup appends
# "LINE<TAB>STATUS<TAB>COMMAND" there for every failure `set -e` would have stopped at); such a
# run is "incomplete": it ran to the end (as SkyPilot runs a setup) but runs again next time.
set -u
hash=$1
script=$2
masktee=$3
force=$4
shift 4
dir="$HOME/.tpufab/setup"
mkdir -p "$dir"
chmod 700 "$dir"
done_file="$dir/$hash.done"
log="$dir/$hash.log"
failed="$dir/$hash.failed"
if [ -f "$done_file" ] && [ "$force" != "--force" ]; then
    printf '@tpufab-answer answer {"status": "skipped", "exit_code": 0, "log": "%s", "failed": null}\n' "$log"
    exit 0
fi
rm -f "$done_file" "$failed"
rc_file="$dir/$hash.rc"
chmod 700 "$script"
if head -c 2 "$script" | grep -q '^#!'; then
    runner=""
else
    runner="/bin/sh -e"
fi
TPUFAB_SETUP_FAILED=$failed
TPUFAB_SETUP_LOG=$log
export TPUFAB_SETUP_FAILED TPUFAB_SETUP_LOG
# the environment tpufab built (VIRTUAL_ENV, as jobs get it: docs/environment.md), bin first
if [ -n "${VIRTUAL_ENV:-}" ]; then
    case $VIRTUAL_ENV in "~/"*) VIRTUAL_ENV=$HOME/${VIRTUAL_ENV#"~/"} ;; esac
    PATH=$VIRTUAL_ENV/bin:$PATH
    export VIRTUAL_ENV PATH
fi
{ $runner "$script" 2>&1; echo $? > "$rc_file"; } | python3 -I -S "$masktee" "$log" "$@"
rc=$(cat "$rc_file" 2>/dev/null || echo 1)
status=ran
if [ "$rc" -eq 0 ]; then
    if [ -s "$failed" ]; then
        status=incomplete
    else
        date -u +%Y-%m-%dT%H:%M:%SZ > "$done_file"
    fi
fi
python3 -I -S -c '
import json, sys
status, rc, log, failed = sys.argv[1:5]
first = None
try:
    with open(failed, encoding="utf-8", errors="replace") as fh:
        line = fh.readline().rstrip("\n")
    if line:
        where, code, command = (line.split("\t", 2) + ["", ""])[:3]
        first = {"line": int(where) if where.isdigit() else None,
                 "exit_code": int(code) if code.isdigit() else None, "command": command}
except OSError:
    pass
# the answer codec of tpufab/remote/workerlib.py (answer()), written out: a shell script
# cannot import it; tests/test_spine.py holds this tag to ANSWER_TAG
answer = {"status": status, "exit_code": int(rc), "log": log, "failed": first}
print("@tpufab-answer answer " + json.dumps(answer, sort_keys=True), flush=True)
' "$status" "$rc" "$log" "$failed"
exit "$rc"
