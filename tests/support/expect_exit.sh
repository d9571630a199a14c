#!/bin/sh
# tests/support/expect_exit.sh CODE PATTERN CMD [ARGS...] — runs CMD and passes (exit 0) when it
# exits with status CODE and its output (stdout and stderr) matches the extended regex PATTERN:
# ctest's PASS_REGULAR_EXPRESSION alone ignores the exit status.
want=$1
pattern=$2
shift 2
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ "$rc" != "$want" ]; then
  echo "expect_exit: '$*' exited with status $rc, expected $want"
  exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq -- "$pattern"; then
  echo "expect_exit: the output of '$*' does not match '$pattern'"
  exit 1
fi
exit 0
