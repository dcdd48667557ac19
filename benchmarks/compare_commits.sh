#!/usr/bin/env bash
# Does this tree's CPU path regress against an older commit? Builds BASE (CPU-only, in a temporary git
# worktree) next to this checkout's build, runs the same all-reduce sweep with each build in turn,
# alternating, RUNS times at 2 and at 4 ranks, then the training step RUNS times each, and prints the
# medians (benchmarks/compare.py). Run it on an otherwise idle machine: about 15 minutes for RUNS=3
# on 2 vCPUs, plus BASE's build (2 minutes there).
# Usage: bash benchmarks/compare_commits.sh BASE [OUT]
#   BASE: a commit; OUT: the results folder (default benchmarks/results/local/compare-<BASE>-<time>)
# Environment: RUNS (default 3), SWEEP (default "-b 1K -e 64M -f 4 --seconds 2"), PARTS (default
# "sweep train": the all-reduce sweeps and the training step; name one to run only it), PYTHON
# (default .venv/bin/python, else python).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
BASE="${1:?usage: bash benchmarks/compare_commits.sh BASE [OUT]}"
base_sha="$(git rev-parse --short "$BASE^{commit}")"
OUT="${2:-benchmarks/results/local/compare-$base_sha-$(date -u +%Y%m%dT%H%M%SZ)}"
RUNS="${RUNS:-3}"
PARTS="${PARTS:-sweep train}"
read -r -a SWEEP <<< "${SWEEP:--b 1K -e 64M -f 4 --seconds 2}"
PYTHON="${PYTHON:-$([[ -x .venv/bin/python ]] && echo "$ROOT/.venv/bin/python" || echo python)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

WT="$(mktemp -d "${TMPDIR:-/tmp}/ringreduce-base-XXXXXX")"
cleanup() { git -C "$ROOT" worktree remove --force "$WT" >/dev/null 2>&1 || rm -rf "$WT"; }
trap cleanup EXIT
git worktree add --detach "$WT" "$base_sha" >/dev/null
echo "compare: building $base_sha (CPU only) in $WT"
(cd "$WT" && RINGREDUCE_FORCE_CPU=1 MAX_JOBS="${MAX_JOBS:-2}" "$PYTHON" setup.py build_ext --inplace \
  --build-temp build-ext > "$OUT/base-build.log" 2>&1) || { echo "compare: the build of $base_sha failed ($OUT/base-build.log)"; exit 1; }
head_sha="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- csrc ringreduce || echo '+changes')"
{ echo "base (old): $base_sha, CPU-only build"; echo "head (new): $head_sha, $(PYTHONPATH=$ROOT "$PYTHON" -c \
  'import ringreduce; print(ringreduce.build_info())')"; echo "sweep: ${SWEEP[*]}; runs: $RUNS"; } > "$OUT/builds.txt"

one() {  # one LABEL DIR MODULE ARGS...: one benchmark run with the build in DIR
  local label="$1" dir="$2" module="$3"
  shift 3
  echo "compare: $label ($(cut -d' ' -f1 /proc/loadavg) load) $module $*"
  (cd "$dir" && PYTHONPATH="$dir" "$PYTHON" -m "$module" "$@" --json "$OUT/$label.json") 2>&1 |
    grep -v "^ringreduce.bench: .* elapsed" > "$OUT/$label.txt"
}
for i in $(seq 1 "$RUNS"); do  # alternate the order so neither build always runs first
  for n in 2 4; do
    [[ " $PARTS " == *" sweep "* ]] || continue
    if (( i % 2 )); then order=(old new); else order=(new old); fi
    for who in "${order[@]}"; do
      dir="$ROOT"; [[ "$who" == old ]] && dir="$WT"
      one "$who-${n}r-$i" "$dir" ringreduce.bench "${SWEEP[@]}" --nproc "$n"
    done
  done
  if (( i % 2 )); then order=(old new); else order=(new old); fi
  [[ " $PARTS " == *" train "* ]] || continue
  for who in "${order[@]}"; do
    dir="$ROOT"; [[ "$who" == old ]] && dir="$WT"
    one "train-$who-$i" "$dir" ringreduce.bench.train_step
  done
done
PYTHONPATH="$ROOT" "$PYTHON" benchmarks/compare.py "$OUT" | tee "$OUT/summary.md"
echo "$OUT"
