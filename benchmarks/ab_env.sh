#!/usr/bin/env bash
# Alternating A/B runs of `python -m ringreduce.bench` under two values of one environment variable
# (e.g. RINGREDUCE_LEAD=0 vs its default), each run interleaving ringreduce with gloo, so that each
# line's ratio is measured side by side and the two settings alternate through the VM's slow and
# fast phases. Prints one line per run: size: ringreduce/gloo us = ratio.
#   bash benchmarks/ab_env.sh RINGREDUCE_LEAD 0 2 ROUNDS [bench args...]
set -euo pipefail
cd "$(dirname "$0")/.."
var=$1 a=$2 b=$3 rounds=$4
shift 4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$rounds"); do
  for v in "$a" "$b"; do
    env "$var=$v" python -m ringreduce.bench "$@" --json "$tmp/run.json" -q >/dev/null
    python benchmarks/ab_line.py "$tmp/run.json" "$var=$v" "$r"
  done
done
