#!/usr/bin/env bash
# Quickstart command 2: set up (venv, torch, build) and run the tests: C++ unit tests (ctest) and the
# Python suite (pytest). By default the default set: every test not marked `full`, which covers every
# behaviour at least once (every public function, both CPU places, every error path, the backend, the
# hooks; tests/README.md, "The default run", and tests/tools/test_default_run.py proves it) in a few
# minutes; `--all` runs every test (CI: .ci/run). The GPU tests (marked `gpu`) run where a CUDA GPU
# exists; ranks share a GPU over NCCL's socket transport when there are fewer GPUs than ranks.
#   bash scripts/test.sh [--all] [pytest arguments]      RR_CTEST=0 skips ctest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SET=default
if [ "${1:-}" = --all ]; then
  SET=all
  shift
fi
# The default set, written once: the marker expression below (tests/README.md explains the marker).
DEFAULT_SET=(-m "not full")
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"

if [ "${RR_CTEST:-1}" = 0 ]; then
  # .ci/run sets it: tools/sanitize.sh runs every C++ test right after, under ASan+UBSan.
  echo "[test] C++ unit tests: skipped here (RR_CTEST=0)"
else
  echo "[test] C++ unit tests (csrc/core, csrc/cpu) via CMake + ctest"
  # The CUDA kernels are compiled (and checked) by the Python build above; ctest needs only host code.
  cmake -S . -B build-ctest -G Ninja -DCMAKE_BUILD_TYPE=Release -DRR_CUDA=OFF >/dev/null
  cmake --build build-ctest -j "${MAX_JOBS:-2}"
  ctest --test-dir build-ctest --output-on-failure -j "${MAX_JOBS:-2}"
fi

SECONDS=0
status=0
if [ "$SET" = all ]; then
  echo "[test] Python suite: every test (--all; load average $(cut -d' ' -f1-3 /proc/loadavg))"
  RINGREDUCE_TEST_SET=all python -m pytest -q "$@" || status=$?
else
  echo "[test] Python suite: the default set, ${DEFAULT_SET[*]} (bash scripts/test.sh --all: every test;" \
       "load average $(cut -d' ' -f1-3 /proc/loadavg))"
  RINGREDUCE_TEST_SET=default python -m pytest -q "${DEFAULT_SET[@]}" "$@" || status=$?
fi
echo "[test] pytest took ${SECONDS} s ($SET set; load average now $(cut -d' ' -f1-3 /proc/loadavg))"
exit "$status"
