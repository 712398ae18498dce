#!/usr/bin/env bash
# Run pytest (arguments passed on) in two phases, with the interpreter $ELASTIC_TRAINER_PYTHON
# (default .venv/bin/python):
#   1. every test not marked `timing`, spread over the CPU cores by pytest-xdist, one worker per
#      core (ELASTIC_TRAINER_TEST_JOBS sets the number), a test module's tests on one worker;
#   2. the `timing` tests (a tight wall-clock bound), one at a time with nothing beside them.
# ELASTIC_TRAINER_TEST_MARK adds a mark expression to both (the compat job: "not soak").
# Exit status: 0 when both phases pass (a phase with no test selected counts as passed).
set -uo pipefail
PY="${ELASTIC_TRAINER_PYTHON:-.venv/bin/python}"
JOBS="${ELASTIC_TRAINER_TEST_JOBS:-auto}"
EXTRA="${ELASTIC_TRAINER_TEST_MARK:-}"
mark() { if [ -n "$EXTRA" ]; then echo "($1) and ($EXTRA)"; else echo "$1"; fi; }
phase() {
  "$PY" -m pytest -p no:cacheprovider -ra "$@"
  local rc=$?
  [ "$rc" = 5 ] && rc=0  # no test selected in this phase
  return "$rc"
}
phase -n "$JOBS" --dist loadfile -m "$(mark "not timing")" "$@"
first=$?
phase -m "$(mark timing)" "$@"
second=$?
[ "$first" = 0 ] && exit "$second"
exit "$first"
