#!/usr/bin/env bash
# Quickstart command 2: set up (venv, torch, build) and run every test: C++ unit tests (ctest)
# and the Python suite (pytest; the GPU tests, marked `gpu`, run where a CUDA GPU exists; ranks share
# a GPU over NCCL's socket transport when there are fewer GPUs than ranks). RR_CTEST=0 skips ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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

echo "[test] Python suite"
python -m pytest -q "$@"
