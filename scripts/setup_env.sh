#!/usr/bin/env bash
# Creates .venv (Python >= 3.10), installs torch and the tools, and builds ringreduce in place (an
# editable install). Sourced by scripts/bench.sh and scripts/test.sh. Knobs: PYTHON, TORCH_SPEC,
# TORCH_CUDA_ARCH_LIST, MAX_JOBS, CUDA_HOME, NCCL_HOME, RINGREDUCE_FORCE_CPU=1, RINGREDUCE_REQUIRE_CUDA=1,
# RR_SETUP_STOP=install (stop after the venv, before the build).
# Each step says what it does and about how long it takes; the whole output of pip and of the build
# goes to .venv/install.log and .venv/build.log (printed in part when a step fails).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.14.1}"
# pytorch-lightning and accelerate: docs/trainers.md's programs, which tests/test_trainers.py runs over the
# backend; torchft: docs/torchft.md, tests/test_torchft.py (pip installs them with torch pinned to TORCH_SPEC
# in the same command).
TOOLS=(numpy pytest hypothesis ninja cmake matplotlib psutil ruff "pytorch-lightning==2.6.6" "accelerate==1.15.*"
       "torchft==0.2.0")
export PYTHONUNBUFFERED=1

# Runs "$@" with its whole output in the log file $1 and the lines the awk program $2 selects on the
# terminal, as they come; on failure prints the log's last 40 lines and stops.
_rr_logged() {
  local log="$1" filter="$2" status
  shift 2
  set +e
  "$@" 2>&1 | tee "$log" | awk "$filter"
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$log"
    echo "[setup] failed: $* (exit $status); the whole output is in $log" >&2
    exit "$status"
  fi
}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PYTHON" --version 2>&1) (a few seconds)"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

# pip only when something is missing: a second run starts the benchmark or the tests at once.
if ! python - "$TORCH_SPEC" "${TOOLS[@]}" <<'PY' 2>/dev/null
import re
import sys
from importlib.metadata import version

spec, *tools = sys.argv[1:]
name, _, want = spec.partition("==")
have = version(name).split("+")[0]
if not want or have != want:
    sys.exit(1)
for tool in tools:  # a name, or a name with a version: "accelerate==1.15.*"
    tool_name, _, tool_want = tool.partition("==")
    if not re.fullmatch(tool_want.replace(".", r"\.").replace("*", ".*") or ".*", version(tool_name)):
        sys.exit(1)
PY
then
  SECONDS=0
  echo "[setup] installing $TORCH_SPEC and ${TOOLS[*]} into .venv: torch's Linux wheels bring CUDA" \
       "libraries, about 3 GB of wheels and 5.7 GB installed (about a minute from a nearby mirror, more over" \
       "a slow network); the large wheels are listed as they come"
  # Large wheels (torch, triton, the nvidia-* CUDA libraries), then how many packages are unpacked.
  # --no-compile: pip would byte-compile all ~7,500 modules on one core (42 s on the 2-vCPU VM); the step
  # after this one does it on every core.
  _rr_logged .venv/install.log '
    /^[[:space:]]*(Downloading|Processing) .*\.whl/ {
      big = $0 ~ /\(([0-9.]+ GB|[0-9][0-9][0-9.]* MB)\)/ || $0 ~ /(torch|triton|nvidia|cuda)[-_]/
      if (!big) next
      sub(/^[[:space:]]*/, ""); sub(/ \/[^ ]*\//, " "); sub(/ \(from .*$/, "")
      print "[setup]   " $0; fflush()
    }
    /^Installing collected packages:/ {
      print "[setup]   unpacking " split($0, names, ",") " packages"; fflush()
    }' \
    python -m pip install --progress-bar off --no-compile --upgrade pip "$TORCH_SPEC" "${TOOLS[@]}"
  echo "[setup] installed in ${SECONDS} s"
fi

# Byte-compiled modules, written once here: where PYTHONDONTWRITEBYTECODE=1 (as on the dev VM) Python never
# writes them itself, and every process then compiles torch's modules again as it imports them (import
# torch: 4.5 s instead of 2.3 s on the 2-vCPU VM). The test suite starts hundreds of rank processes.
SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -e "$SITE/torch/__pycache__/__init__.$(python -c 'import sys; print(sys.implementation.cache_tag)').pyc" ]; then
  SECONDS=0
  python -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true   # a module that does not compile stays as it is
  echo "[setup] byte-compiled .venv's modules in ${SECONDS} s (once)"
fi
# RR_SETUP_STOP=install: the venv only, no build (.ci/run then starts the sanitizer builds, which find
# NCCL's headers in the venv's nvidia-nccl wheel).
if [ "${RR_SETUP_STOP:-}" = install ]; then
  return 0 2>/dev/null || exit 0
fi

export MAX_JOBS="${MAX_JOBS:-2}"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
SECONDS=0
if compgen -G "ringreduce/_C*.so" >/dev/null; then
  echo "[setup] building ringreduce in place (incremental: only what changed; MAX_JOBS=$MAX_JOBS)"
else
  echo "[setup] building ringreduce in place, MAX_JOBS=$MAX_JOBS: on 2 idle cores about 1 minute without CUDA," \
       "2 with CUDA for one architecture, each further one about 30 s more; compile steps are listed as they finish"
fi
# setup.py says what it builds ("[ringreduce setup] ..." lines: CUDA or not, which architectures, why);
# ninja's "[k/n] command" lines are shortened to the file each step compiled.
_rr_logged .venv/build.log '
  /\[ringreduce setup\]/ { sub(/^[[:space:]]*/, ""); if (!seen[$0]++) print; fflush(); next }
  /^[[:space:]]*\[[0-9]+\/[0-9]+\] / {
    match($0, /\[[0-9]+\/[0-9]+\]/); step = substr($0, RSTART, RLENGTH); what = "linking ringreduce/_C"
    n = split($0, w, " ")
    for (i = 1; i < n; i++) if (w[i] == "-c" && w[i + 1] ~ /\.(cpp|cu)$/) what = w[i + 1]
    sub(/.*\/csrc\//, "csrc/", what)
    print "[setup]   " step " " what; fflush()
  }' \
  python -m pip install -v --no-build-isolation --no-deps -e .
echo "[setup] built in ${SECONDS} s"
python - <<'PY'
import os

import ringreduce

info = ringreduce.build_info()
cuda = f"CUDA archs {','.join(info['cuda_archs'])}, NCCL {info['nccl_version']}" if info["cuda"] else "CPU only"
print(f"[setup] ringreduce {info['version']} ({cuda}; shared memory: {info['shm']}) on torch {info['torch']}")
if os.environ.get("RINGREDUCE_REQUIRE_CUDA") == "1" and not info["cuda"]:
    raise SystemExit("[setup] RINGREDUCE_REQUIRE_CUDA=1 but the CUDA+NCCL part was not built")
PY
