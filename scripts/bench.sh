#!/usr/bin/env bash
# Quickstart command 1: set up (venv, torch, build) and run the benchmark: ringreduce vs the stock
# backend (gloo on CPU, NCCL on >= 2 GPUs), nccl-tests columns.
#
# The table (table.txt), every row with the machine and the command (allreduce.json) and the plot
# (allreduce.png) go to one folder, benchmarks/results/local/<date>-<time>-<host>/ (gitignored;
# BENCH_OUT=DIR picks another), whose path is the last line printed. Extra arguments go to
# `python -m ringreduce.bench` (`bash scripts/bench.sh --help` lists them); a --json or --plot of
# your own replaces the folder's file; --mode train runs the training-step benchmark (train.json).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# With no GPU visible the benchmark is CPU-only, so a first build here skips the CUDA part (one line
# says so; setup.py, Note [First-build time]); TORCH_CUDA_ARCH_LIST set, or a CUDA build already in
# build-ext (scripts/test.sh makes one), keeps CUDA.
export RINGREDUCE_CPU_WITHOUT_GPU=1
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"

mode=allreduce
# The sweep covers float32 and bfloat16 (Note [Several element types in one sweep],
# ringreduce/bench/sweep.py) unless the arguments name the types (-d) or ask for what runs one type
# (--wire-dtype: float32 tensors; --vs: one type per run).
types=(-d float,bfloat16)
for arg in "$@"; do
  case "$arg" in
    -h|--help) exec python -m ringreduce.bench "$@" ;;
    train|--mode=train) mode=train ;;
    -d|-d*|--dtype|--dtype=*|--wire-dtype|--wire-dtype=*|--vs|--vs=*) types=() ;;
  esac
done

OUT="${BENCH_OUT:-benchmarks/results/local/$(date +%Y%m%d-%H%M%S)-$(hostname -s 2>/dev/null || echo host)}"
mkdir -p "$OUT"
# The sweep times 2 s per size, type and implementation (the bench's own default is 6), as README's
# results table; a --seconds of your own comes later on the command line and wins.
if [ "$mode" = train ]; then
  files=(--json "$OUT/train.json")
else
  files=(--seconds 2 ${types[@]+"${types[@]}"} --json "$OUT/allreduce.json" --plot "$OUT/allreduce.png")
fi

# Other processes on the cores make small-size figures move between runs (README, Results).
read -r load _ < /proc/loadavg
cores="$(nproc)"
if awk -v l="$load" 'BEGIN { exit !(l > 0.5) }'; then
  echo "# note: load average $load on $cores cores before the run: other processes compete for the cores," \
       "so figures below 1 MiB may move by several times between runs" | tee "$OUT/table.txt"
else
  : > "$OUT/table.txt"
fi

echo "[bench] running python -m ringreduce.bench ${files[*]} $* (a few minutes on 2 cores)"
status=0
python -m ringreduce.bench "${files[@]}" "$@" | tee -a "$OUT/table.txt" || status=$?
echo "[bench] results: $OUT/ ($(cd "$OUT" && ls | tr '\n' ' '| sed 's/ $//'))"
exit "$status"
