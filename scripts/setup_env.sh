#!/usr/bin/env bash
# Creates .venv (Python >= 3.10), installs torch and the tools, and builds ringreduce in place.
# Sourced by scripts/bench.sh and scripts/test.sh. Knobs: PYTHON, TORCH_SPEC, TORCH_CUDA_ARCH_LIST,
# MAX_JOBS, CUDA_HOME, NCCL_HOME, RINGREDUCE_FORCE_CPU=1, RINGREDUCE_REQUIRE_CUDA=1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.14.1}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "$TORCH_SPEC" numpy pytest hypothesis ninja cmake matplotlib psutil ruff

export MAX_JOBS="${MAX_JOBS:-2}"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
echo "[setup] building ringreduce (MAX_JOBS=$MAX_JOBS, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0 default})"
python -m pip install -q --no-build-isolation --no-deps -e .
python - <<'PY'
import os, ringreduce
info = ringreduce.build_info()
print("[setup] ringreduce.build_info():", info)
if os.environ.get("RINGREDUCE_REQUIRE_CUDA") == "1" and not info["cuda"]:
    raise SystemExit("[setup] RINGREDUCE_REQUIRE_CUDA=1 but the CUDA+NCCL part was not built")
PY
