#!/usr/bin/env bash
# Times both Quickstart commands from a fresh clone of this repository's HEAD (issue 35): the seconds
# of `bash scripts/bench.sh` to its first table row and to its end, then of `bash scripts/test.sh`,
# with the machine they ran on (CPU, cores, GPUs, load average before each); with RR_QUICKSTART_ALL=1
# then `bash scripts/test.sh --all` (every test) too. Their whole output goes to DIR/bench.log,
# DIR/test.log and DIR/test-all.log. The clone is left in DIR/ringreduce (about 6 GB with .venv).
#   bash scripts/time_quickstart.sh [DIR]      # DIR: an empty folder (default: a new one under /tmp)
set -euo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$(mktemp -d "${TMPDIR:-/tmp}/rr_quickstart.XXXXXX")}"
mkdir -p "$DIR"
git clone -q "$SRC" "$DIR/ringreduce"
cd "$DIR/ringreduce"

cpu="$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)"
gpus="$(nvidia-smi -L 2>/dev/null | wc -l || true)"
echo "[quickstart] machine: ${cpu:-unknown CPU}, $(nproc) cores, ${gpus:-0} GPUs visible; clone of" \
     "$(git rev-parse --short HEAD) in $DIR/ringreduce"

# Runs "$@" with its output in $log; prints the seconds to the first nccl-tests table row and to the end.
timed() {
  local log="$1" start first=""
  shift
  echo "[quickstart] $* (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  start=$EPOCHREALTIME
  while IFS= read -r line; do
    printf '%s\n' "$line" >> "$log"
    if [ -z "$first" ] && [[ "$line" =~ ^\ +[0-9]+\ +[0-9]+\ +[a-z0-9]+\ +[a-z]+\ +[0-9.]+ ]]; then
      first=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
      echo "[quickstart]   first table row after $first s"
    fi
  done < <("$@" 2>&1; echo "[quickstart-exit] $?")
  echo "[quickstart]   done after $(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }') s;" \
       "$(tail -n 1 "$log" | sed 's/^\[quickstart-exit\] /exit status /')"
}

timed "$DIR/bench.log" bash scripts/bench.sh
timed "$DIR/test.log" bash scripts/test.sh
if [ "${RR_QUICKSTART_ALL:-0}" = 1 ]; then
  timed "$DIR/test-all.log" bash scripts/test.sh --all
fi
