# shellcheck shell=bash
# The session shell's start-up script (lua/moonbox/_shell.lua sends it through
# fd 62, which bash sources: a file is read in blocks, a pipe one byte per
# read). The protocol it speaks is specified in docs/sessions.md.
#
# The runtime replaces the @NAME@ slots with the paths of the shell's five fd
# slots and its env file (/proc/<runtime>/fd/<n>, or entries of the shell's
# run directory under namespaces) and drops the lines that are only comments
# (and blank ones) before sending it: the bytes bash gets are exactly the
# script, as before it lived here.
#
# Checked by CTest (prelude_bash: bash -n and shellcheck).
# Why shellcheck's rules are turned off here:
#   SC2016: trap actions and command shapes are single-quoted on purpose, to
#           expand when they run, not now.
#   SC1090/SC1091: the sourced files are the runtime's slots.
#   SC2034: __mb_c1..__mb_c6, __mb_pN are read by the control line (eval "$__mb_cN").
#   SC2317: trap actions and functions are called indirectly.
#   SC2218, SC2064 (where marked): `builtin trap` is bash's, not the trap
#           function defined below, and that function passes its words on.
# shellcheck shell=bash disable=SC2016,SC1090,SC1091,SC2034,SC2317
shopt -s expand_aliases
# the builtins (src/bash/): __mb_run for shapes 5 and 6 (below),
# __mb_rep, the report in one write, the env file only when it changed, and
# `@`, the short control line (`@ N` runs shape N, as `eval "$__mb_cN"`)
if builtin enable -f /proc/self/fd/63 __mb_run __mb_rep _ 2>/dev/null; then __mb_b=1; else __mb_b=; fi; exec 63<&-
# the shell's own stdout is the status pipe (a command's is redirected)
# (export -p also if __mb_rep fails: one disabled by `enable -d` must not
# cost the session its reports; the shell's stderr, where bash would
# complain, is /dev/null)
__mb_report_p() { builtin export -p >|@ENV@; builtin printf '\n%s %s %s\0%s\0' "$1" "$2" "$3" "$PWD"; }
# with the builtin every record carries the runtime's nonce (see
# report_builtin.c); the hello tells the runtime the first one, before any
# command runs. Without it records are not authenticated.
# (status 1 or 127: __mb_rep was disabled or deleted, `builtin enable -d`;
# the same report is also __mb_run -r. A refused report is status 3. Not
# `builtin __mb_rep`: a function named builtin would take the report's
# place, and the report is what removes such a function, see
# report_builtin.c keep_protocol_names.)
if [ -n "$__mb_b" ]; then
  __mb_report() { __mb_in=; __mb_rep "$1" "$2" "$3" @ENV@ || case $? in 1|127) builtin __mb_run -r "$1" "$2" "$3" @ENV@ ;; esac; }
  builtin __mb_rep -h
else
  __mb_report() { __mb_in=; __mb_report_p "$@"; }
  __mb_report_p 0 0 hello
fi
readonly -f __mb_report_p
readonly -f __mb_report
# a subshell hit by a signal right after fork may still run this trap:
# only the shell itself reports its exit, untraced under a user's `set -x`
# (the shell is ending). A user's own EXIT trap (kept by
# the trap function below) runs first, its output the command's (where the
# outputs are pipes received by __mb_run: the fds 1 and 2 the command left,
# as in any bash; a pipe cannot be opened again by path inside a sandbox).
__mb_user_exit=
__mb_status() { return "$1"; }
# shellcheck disable=SC2218
builtin trap '{ __mb_s=$?; builtin set +x; } 2>/dev/null; if [ "$BASHPID" = "$$" ]; then if [ -z "$__mb_user_exit" ]; then :; elif [ -n "${__mb_in-}" ] && [ -n "$__mb_fdo" ]; then { __mb_status $__mb_s; eval "$__mb_user_exit"; }; else __mb_o=/dev/null __mb_e=/dev/null; [ -n "${__mb_in-}" ] && __mb_o=@STDOUT@ __mb_e=@STDERR@; { __mb_status $__mb_s; eval "$__mb_user_exit"; } >|"$__mb_o" 2>|"$__mb_e"; fi; __mb_report "${__mb_id:-0}" "$__mb_s" exit; fi' EXIT
__mb_id=0
# a timed-out body stops where it is (Shell:interrupt): `return` ends a
# sourced script. Inside a function (or a nested source) it ends only that,
# so a DEBUG trap returns again before each further command of the callers,
# up to the body's end; the report clears it. (Never from __mb_report: a
# signal that comes as the body ends must not cost the record.)
# (this script is sourced at a body's depth: its BASH_SOURCE is as long)
__mb_top=${#BASH_SOURCE[@]}; readonly __mb_top
# shellcheck disable=SC2218
# (SIGRTMIN+3, not a signal a script traps or sends: a user's USR1 trap or
# `kill -USR1 $$` is the user's business, as in any bash). It runs
# untraced under a user's `set -x` (a timeout adds nothing to stderr);
# __mb_run turns xtrace back on after the body from __mb_xt, and takes the
# DEBUG trap away (__mb_dbg) where no `__mb_report` command came to (the
# report made in C): it stayed, and refused every later body.
builtin trap '{ __mb_xt=$-; builtin set +x; } 2>/dev/null; if [ -n "${__mb_in-}" ] && [ "${FUNCNAME[0]-}" != __mb_report ]; then [ "${#BASH_SOURCE[@]}" -le "$__mb_top" ] || { __mb_dbg=1; builtin trap '\''if [ -z "${__mb_dbg-}" ] || [ "${BASH_COMMAND%% *}" = __mb_report ]; then builtin trap - DEBUG; else return 124; fi'\'' DEBUG; }; return 124; fi' RTMIN+3
# the session's own two traps as `trap -p` prints them: left out of a
# user's listing (the trap function below)
# (and the KILL the builtin ignores, src/bash/spawn_builtin.c); read at
# the first listing, not here: each is a subshell, a fork, and three of
# them were most of a new shell's first command (issue #32)
__mb_trap_texts() { [ -n "${__mb_trap_read-}" ] && return
  __mb_trap_exit=$(builtin trap -p EXIT) __mb_trap_int=$(builtin trap -p RTMIN+3) __mb_trap_kill=$(builtin trap -p KILL)
  __mb_trap_read=1; }
# `trap` and `trap -p [SIG...]` list the user's traps: the kept EXIT action
# in the place bash prints it, the session's own two left out. The
# interrupt's signal is refused, as `enable` refuses the builtins.
__mb_is_exit() { case "$1" in [Ee][Xx][Ii][Tt]|[Ss][Ii][Gg][Ee][Xx][Ii][Tt]|0) return 0 ;; esac; return 1; }
__mb_trap_list() { local __mb_l __mb_s __mb_x=0
  [ "$#" -eq 0 ] && __mb_x=1
  for __mb_s in "$@"; do __mb_is_exit "$__mb_s" && __mb_x=1; done
  __mb_trap_texts
  __mb_l="$(builtin trap -p "$@")"$'\n'
  __mb_l=${__mb_l/"$__mb_trap_exit"$'\n'/}
  __mb_l=${__mb_l/"$__mb_trap_int"$'\n'/}
  [ -z "$__mb_trap_kill" ] || __mb_l=${__mb_l/"$__mb_trap_kill"$'\n'/}
  [ "$__mb_x" = 1 ] && [ -n "$__mb_user_exit" ] &&
    builtin printf "trap -- '%s' EXIT\n" "${__mb_user_exit//\'/\'\\\'\'}"
  [ "$__mb_l" = $'\n' ] || builtin printf '%s' "$__mb_l"; }
# (trap, enable and ulimit start with `local -` and set +x, in
# a group whose trace goes nowhere: under a user's `set -x` only the call
# is traced, `+ trap ... EXIT`, as bash's own builtin's would be; the
# options come back as they were when the function returns)
# `trap ... EXIT` from a command would replace the trap above, and with it
# the report of the shell's exit (cwd, exports, the command's exit status):
# EXIT (0, SIGEXIT) actions are kept aside for it to run instead
# shellcheck disable=SC2064
trap() { { local -; builtin set +x; } 2>/dev/null; local __mb_a=("$@") __mb_rest=() __mb_sigs __mb_sig __mb_set=0
  [ "${__mb_a[0]-}" = -- ] && __mb_a=("${__mb_a[@]:1}")
  if [ "$#" -eq 0 ]; then __mb_trap_list; return; fi
  if [ "${__mb_a[0]-}" = -p ]; then __mb_trap_list "${__mb_a[@]:1}"; return; fi
  case "${__mb_a[0]-}" in -?*) builtin trap "$@"; return ;; esac
  # (the signals: all but the action; all when there is one word, or the
  # first is a number, which bash then takes for a signal to reset)
  __mb_sigs=("${__mb_a[@]:1}")
  case "${__mb_a[0]-}" in *[!0-9]*|'') [ "${#__mb_a[@]}" -lt 2 ] && __mb_sigs=("${__mb_a[@]}") ;; *) __mb_sigs=("${__mb_a[@]}") ;; esac
  for __mb_sig in "${__mb_sigs[@]}"; do case "$__mb_sig" in [Ss][Ii][Gg][Rr][Tt][Mm][Ii][Nn]+3|[Rr][Tt][Mm][Ii][Nn]+3|37)
    builtin echo "trap: $__mb_sig: used by the session shell itself (timeouts)" >&2; return 1 ;; esac; done
  if [ "${#__mb_a[@]}" -lt 2 ]; then
    if __mb_is_exit "${__mb_a[0]-}"; then __mb_user_exit=; return 0; fi
    builtin trap "$@"; return
  fi
  for __mb_sig in "${__mb_a[@]:1}"; do
    if __mb_is_exit "$__mb_sig"; then __mb_set=1; else __mb_rest+=("$__mb_sig"); fi
  done
  if [ "$__mb_set" = 1 ]; then [ "${__mb_a[0]}" = - ] && __mb_user_exit= || __mb_user_exit=${__mb_a[0]}; fi
  [ "${#__mb_rest[@]}" -eq 0 ] || builtin trap -- "${__mb_a[0]}" "${__mb_rest[@]}"
}
# every command goes through `@` and __mb_run, the report through __mb_rep:
# `enable` leaves them alone (`builtin enable` does not; the report enables
# a disabled `@` again)
enable() { { local -; builtin set +x; } 2>/dev/null; local __mb_w; for __mb_w in "$@"; do case "$__mb_w" in @|__mb_run|__mb_rep)
  builtin echo "enable: $__mb_w: used by the session shell itself" >&2; return 1 ;; esac; done
  builtin enable "$@"; }
# every command's redirections need descriptors above 9 (bash keeps its
# copies of 0-2 there): in the session shell itself (not a subshell)
# `ulimit` refuses to leave fewer than 16 open files, which would fail every
# later command with exit 1 and no output (the change is tried in a
# subshell first, whatever its syntax; with no redirection around it, which
# bash could not undo under the new limit: the limits it then printed went
# nowhere, and the change passed)
ulimit() { { local -; builtin set +x; } 2>/dev/null; if [ "$BASHPID" = "$$" ]; then case "$*" in *n*) local __mb_l __mb_w
  __mb_l=$(builtin exec 2>/dev/null; builtin ulimit "$@" && { builtin ulimit -Sn; builtin ulimit -Hn; }; :)
  for __mb_w in $__mb_l; do case "$__mb_w" in *[!0-9]*|'') ;; *) if [ "$__mb_w" -lt 16 ]; then
    builtin echo "ulimit: $__mb_w open files would leave the session shell unable to run commands (it needs 16); use a subshell: ( ulimit ...; command )" >&2
    return 1; fi ;; esac; done ;; esac; fi
  builtin ulimit "$@"; }
# bash reads this script through its own fd (it opened /dev/fd/60): the
# inherited fd 60 is closed once here, not redirected away per command
exec 60<&-
# The command shapes; the control line per command is `@ N` (the builtin
# evaluates $__mb_cN), or `eval "$__mb_cN"` in a shell without the builtins.
# 1, 2: the body sourced by the shell itself, stdin /dev/null or the stdin
#       slot (__mb_in marks it, see Shell:interrupt); the shell counts its
#       commands as the runtime does, the control line carries only the shape
# 3, 4: the same in a subshell, after the per-call prelude
# 5, 6: a plain external command: __mb_run reads the body's words and
#       posix_spawns it (src/bash/spawn_builtin.c)
# With the builtin, shapes 1 and 2 source the body through it, which ends a
# `set -n` with the body (else the shell would never report again); without
# it shapes 5 and 6 are 1 and 2. With it, shapes 1 and 5 take the shell's own
# stdin, /dev/null, which the report puts back if a body changed it
# (report_builtin.c, restore_null_stdin), instead of a `</dev/null` per command,
# and __mb_run opens the command's stdout and stderr on fds 1 and 2 itself
# (src/bash/outputs.c), instead of bash's `>|` with its save and restore.
# Where the status channel is a socket (@OUTS@ is `- -`, __mb_fdo is 1) the
# outputs are no files at all: the runtime sends the command's two pipes on
# it before the control line, and __mb_run receives them onto 1 and 2.
# __mb_p1, 2, 5, 6 are those shapes with the output files (FIFOs or fd
# slots): the runtime's first line to a shell, sent before its hello says
# whether the builtins loaded (`eval "$__mb_pN"`, which holds either way).
# There `@ 1` and `@ 5` do what shapes 1 and 5 say in C, from __mb_bp (the
# body) and __mb_ep (the env file), without bash parsing them per command.
# (with the builtin, 3 and 4 source the prelude and the body through it:
# under the user's `set -x` the body's lines alone are traced)
if [ -n "$__mb_b" ]; then __mb_src='builtin __mb_run -q @PRELUDE@ && builtin __mb_run -s @BODY@'; else __mb_src='builtin . @PRELUDE@ && builtin . @BODY@'; fi
readonly __mb_c3="__mb_id=\$((__mb_id+1)); ( $__mb_src ) </dev/null >|@STDOUT@ 2>|@STDERR@; __mb_report \$__mb_id \$? run"
readonly __mb_c4="__mb_id=\$((__mb_id+1)); ( $__mb_src ) <@STDIN@ >|@STDOUT@ 2>|@STDERR@; __mb_report \$__mb_id \$? run"
unset __mb_src
if [ -n "$__mb_b" ]; then readonly __mb_fdo=@FDO@ __mb_bp=@BODY@ __mb_ep=@ENV@ __mb_c1='__mb_id=$((__mb_id+1)); __mb_in=1; builtin __mb_run -s @BODY@ @OUTS@; __mb_report $__mb_id $? run' __mb_c2='__mb_id=$((__mb_id+1)); __mb_in=1; builtin __mb_run -s @BODY@ @OUTS@ <@STDIN@; __mb_report $__mb_id $? run' __mb_c5='__mb_id=$((__mb_id+1)); __mb_in=1; builtin __mb_run @BODY@ @OUTS@; __mb_report $__mb_id $? run' __mb_c6='__mb_id=$((__mb_id+1)); __mb_in=1; builtin __mb_run @BODY@ @OUTS@ <@STDIN@; __mb_report $__mb_id $? run' __mb_p1='__mb_id=$((__mb_id+1)); __mb_in=1; builtin __mb_run -s @BODY@ @STDOUT@ @STDERR@; __mb_report $__mb_id $? run' __mb_p2='__mb_id=$((__mb_id+1)); __mb_in=1; builtin __mb_run -s @BODY@ @STDOUT@ @STDERR@ <@STDIN@; __mb_report $__mb_id $? run'; readonly __mb_p5="$__mb_p1" __mb_p6="$__mb_p2"; else readonly __mb_fdo=; readonly __mb_c1='__mb_id=$((__mb_id+1)); __mb_in=1; builtin . @BODY@ </dev/null >|@STDOUT@ 2>|@STDERR@; __mb_report $__mb_id $? run' __mb_c2='__mb_id=$((__mb_id+1)); __mb_in=1; builtin . @BODY@ <@STDIN@ >|@STDOUT@ 2>|@STDERR@; __mb_report $__mb_id $? run'; readonly __mb_c5="$__mb_c1" __mb_c6="$__mb_c2" __mb_p1="$__mb_c1" __mb_p2="$__mb_c2" __mb_p5="$__mb_c1" __mb_p6="$__mb_c2"; fi; unset __mb_b
