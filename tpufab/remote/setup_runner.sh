#!/bin/sh
# Run a setup script once per content hash; log under ~/.tpufab/setup/.
# usage: setup_runner.sh HASH SCRIPT_PATH [--force]
# Prints the script's output, then one JSON line: {"status": "ran"|"skipped", "exit_code": N, "log": PATH}
set -u
hash=$1
script=$2
force=${3:-}
dir="$HOME/.tpufab/setup"
mkdir -p "$dir"
done_file="$dir/$hash.done"
log="$dir/$hash.log"
if [ -f "$done_file" ] && [ "$force" != "--force" ]; then
    printf '{"status": "skipped", "exit_code": 0, "log": "%s"}\n' "$log"
    exit 0
fi
rm -f "$done_file"
rc_file="$dir/$hash.rc"
chmod 700 "$script"
if head -c 2 "$script" | grep -q '^#!'; then
    runner=""
else
    runner="/bin/sh"
fi
{ $runner "$script" 2>&1; echo $? > "$rc_file"; } | tee "$log"
rc=$(cat "$rc_file" 2>/dev/null || echo 1)
if [ "$rc" -eq 0 ]; then
    date -u +%Y-%m-%dT%H:%M:%SZ > "$done_file"
fi
printf '{"status": "ran", "exit_code": %s, "log": "%s"}\n' "$rc" "$log"
exit "$rc"
