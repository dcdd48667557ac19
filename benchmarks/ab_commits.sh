#!/usr/bin/env bash
# Alternating A/B runs of `python -m ringreduce.bench` between an earlier commit (A) and this tree (B):
# A is checked out into a worktree under /tmp and built there (CPU only, for speed); the two trees
# alternate run by run, each run interleaving ringreduce with gloo, so every line's ratio is measured
# side by side and both builds go through the VM's slow and fast phases. One line per run:
# size: ringreduce/gloo us = ratio.
#   bash benchmarks/ab_commits.sh COMMIT ROUNDS [bench args...]
#   e.g. bash benchmarks/ab_commits.sh a4a734b 3 -b 1K -e 1M -f 32 --seconds 2
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
commit=$(git rev-parse --short "$1") rounds=$2
shift 2
old=$(bash benchmarks/ab_build.sh "$commit")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"  # so that `python -m` imports ringreduce from PYTHONPATH, not from the current directory
for r in $(seq 1 "$rounds"); do
  for tree in "$old" "$here"; do
    label=$([ "$tree" = "$here" ] && echo "this tree" || echo "$commit")
    PYTHONPATH="$tree" python -m ringreduce.bench "$@" --json "$tmp/run.json" -q >/dev/null
    python "$here/benchmarks/ab_line.py" "$tmp/run.json" "$label" "$r"
  done
done
