#!/usr/bin/env bash
# Alternating runs of one of this tree's benchmark scripts with an earlier commit's build of
# ringreduce (A) and this tree's (B): the script is always this tree's, only `import ringreduce`
# changes, so both builds are measured the same way and go through the VM's slow and fast phases.
# Each run prints its own lines, prefixed with the build.
#   bash benchmarks/ab_script.sh COMMIT ROUNDS SCRIPT [script args...]
#   e.g. bash benchmarks/ab_script.sh 14a95a7 3 benchmarks/cpu_split.py --nproc 4 --size 1M
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
commit=$(git rev-parse --short "$1") rounds=$2 script=$3
shift 3
old=$(bash benchmarks/ab_build.sh "$commit")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"  # so that `import ringreduce` follows PYTHONPATH, not the current directory
for r in $(seq 1 "$rounds"); do
  for tree in "$old" "$here"; do
    label=$([ "$tree" = "$here" ] && echo "this tree" || echo "$commit")
    PYTHONPATH="$tree" python "$here/$script" "$@" | sed "s/^/$label round $r: /"
  done
done
