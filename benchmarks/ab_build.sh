#!/usr/bin/env bash
# Builds an earlier commit of ringreduce (CPU only, for speed) in a worktree under /tmp, once, and
# prints its path: put it first on PYTHONPATH to import that build (benchmarks/ab_commits.sh,
# benchmarks/ab_script.sh).
#   bash benchmarks/ab_build.sh COMMIT
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse --short "$1")
old="/tmp/ringreduce-ab-$commit"
if [ ! -f "$old/.built" ]; then
  rm -rf "$old"
  git worktree add -f --detach "$old" "$commit" >/dev/null 2>&1
  (cd "$old" && RINGREDUCE_FORCE_CPU=1 MAX_JOBS="${MAX_JOBS:-2}" python setup.py build_ext --inplace >/dev/null 2>&1) \
    && touch "$old/.built"
fi
echo "$old"
