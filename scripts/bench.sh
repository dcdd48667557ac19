#!/usr/bin/env bash
# Quickstart command 1: set up (venv, torch, build) and run the benchmark: ringreduce vs the stock
# backend (gloo on CPU, NCCL on >= 2 GPUs), nccl-tests columns. Extra arguments go to the benchmark.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python -m ringreduce.bench "$@"
