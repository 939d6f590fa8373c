# tpufab one-shot: one command line on a plain SSH exec channel, without starting the agent.
# POSIX sh. Run as `sh -c "<this file>" tpufab-oneshot`; stdin brings the command line (a
# line with its number of lines, then those lines), and then nothing until the client stops.
#
# The command line runs once, by the user's login shell, as `ssh host CMD` would, with stdin
# from /dev/null and TPUFAB_TASK set (so its setsid/nohup descendants can be found). Unlike
# plain ssh, nothing is left behind: when the channel's stdin ends (the client sends EOF on
# Ctrl-C or at its timeout, or the connection drops), the command's process group and every
# process carrying its marker get SIGTERM, then SIGKILL 2 s later, with whatever is left in
# its session (what it ran under sudo too). The exit status is the command's (128+N when a
# signal ended it).

mark="oneshot.$$"

IFS= read -r count || exit 97
line=
command=
while [ "$count" -gt 0 ]; do
    IFS= read -r line
    command="$command$line
"
    count=$((count - 1))
done

marked() {  # one grep over every environment; prints pids
    for file in $(grep -lsxz "TPUFAB_TASK=$mark" /proc/[0-9]*/environ 2>/dev/null); do
        file=${file#/proc/}
        echo "${file%/environ}"
    done
}

stop() {  # strays first: once the group is gone the wrapper exits and reports
    for pid in $(marked); do
        kill "-$1" "$pid" 2>/dev/null
    done
    kill "-$1" "-$cmd" 2>/dev/null
}

# At the SIGKILL, what is left in the command's session goes too. What it ran under sudo runs
# as root, where this user's signals do not reach: sudo relays no SIGKILL, and drops a SIGTERM
# that comes while it is still starting its command. sudo's pkill ends those, matched by
# session where they run (never by a pid read here).
stop_session() {
    [ -n "$session" ] || return 0
    pkill -KILL -s "$session" 2>/dev/null
    [ "$(id -u)" = 0 ] && return 0
    pgrep -s "$session" >/dev/null 2>&1 && sudo -n pkill -KILL -s "$session" >/dev/null 2>&1
}

session=
if command -v setsid >/dev/null 2>&1; then
    TPUFAB_TASK=$mark setsid "${SHELL:-/bin/sh}" -c "$command" </dev/null &
else
    TPUFAB_TASK=$mark "${SHELL:-/bin/sh}" -c "$command" </dev/null &
fi
cmd=$!
command -v setsid >/dev/null 2>&1 && session=$cmd

# The watcher: stdin ends only when the client stops the command or is gone. (A background
# list's stdin is /dev/null before its own redirections, so the channel's goes through fd 3.)
# Once stopping, it ignores the TERM the wrapper sends it when the command is gone, so the
# command's stray descendants still get theirs.
exec 3<&0
{
    while read -r line; do :; done
    trap '' TERM
    stop TERM
    sleep 2
    stop KILL
    stop_session
} <&3 >/dev/null 2>&1 &
watch=$!
exec 3<&-

wait "$cmd"
status=$?
kill "$watch" 2>/dev/null
exit "$status"
