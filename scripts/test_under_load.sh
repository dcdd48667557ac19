#!/usr/bin/env bash
# The default test set (--all: every test) RUNS times in a row with BUSY busy loops beside it (issue
# 49: tests that must pass on a loaded machine). Each run's pytest output goes to DIR/run-N.log; one
# line per run says its exit status, seconds, pytest's summary and the load average. Exits non-zero
# if any run failed.
#   bash scripts/test_under_load.sh [--all] [RUNS [BUSY [DIR]]]   # default: 3 runs, 2 busy loops, a new /tmp folder
# Run it in a built checkout (bash scripts/test.sh sets one up); extra pytest arguments: PYTEST_ARGS.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SET=default
SELECT=(-m "not full")   # scripts/test.sh's DEFAULT_SET
if [ "${1:-}" = --all ]; then
  SET=all
  SELECT=()
  shift
fi
RUNS="${1:-3}"
BUSY="${2:-2}"
DIR="${3:-$(mktemp -d "${TMPDIR:-/tmp}/rr_under_load.XXXXXX")}"
mkdir -p "$DIR"
cd "$ROOT"
# shellcheck disable=SC1091
. "$ROOT/.venv/bin/activate"
pids=()
for _ in $(seq "$BUSY"); do
  (while :; do :; done) &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
status=0
for i in $(seq "$RUNS"); do
  start=$(date +%s)
  echo "[under-load] run $i of $RUNS ($SET set), $BUSY busy loops, start $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"
  # shellcheck disable=SC2086
  RINGREDUCE_TEST_SET=$SET python -m pytest -q "${SELECT[@]}" -p no:cacheprovider ${PYTEST_ARGS:-} \
    > "$DIR/run-$i.log" 2>&1
  rc=$?
  [ "$rc" = 0 ] || status=1
  echo "[under-load] run $i: exit $rc after $(( $(date +%s) - start )) s: $(tail -1 "$DIR/run-$i.log")" \
       "(load $(cut -d' ' -f1-3 /proc/loadavg))"
done
echo "[under-load] logs in $DIR"
exit "$status"
