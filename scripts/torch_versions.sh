#!/usr/bin/env bash
# Builds ringreduce against one torch version and runs the torch.distributed backend's tests on it
# (tests/test_backend.py, tests/test_backend_train.py): the check that the backend "ringreduce" works
# on that torch (docs/design.md section 1.7, "Which torch").
#
#   bash scripts/torch_versions.sh VERSION [pytest args...]     e.g.  bash scripts/torch_versions.sh 2.11.0
#
# VERSION is pip's full version (2.11.0, not 2.11).
#
# It works in $RR_TORCH_WORK (default /tmp/ringreduce-torch-VERSION): a venv with torch==VERSION, numpy,
# pytest, ninja and setuptools (pip as configured; add options with RR_PIP_ARGS, e.g. a CPU-only index),
# and a copy of this checkout (tracked and untracked files, not the ignored ones), so the checkout's own
# build stays as it is. The build is CPU-only (RINGREDUCE_FORCE_CPU=1, MAX_JOBS default 2). A second run
# reuses the venv and the copy's objects. The last line is the summary:
#   torch_versions: torch 2.11.0+cu130: build ok; backend tests: 31 passed in 250.12s (0:04:10) (pytest rc 0)
# Exit status: the build's when it failed, else pytest's. Remove $RR_TORCH_WORK afterwards (a CUDA
# torch wheel and its libraries take several GB).
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: bash scripts/torch_versions.sh VERSION [pytest args...]   (e.g. 2.11.0)" >&2
    exit 2
fi
VERSION="$1"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${RR_TORCH_WORK:-/tmp/ringreduce-torch-$VERSION}"
VENV="$WORK/venv"
SRC="$WORK/src"
PY="$VENV/bin/python"
LOG="$WORK/build.log"
summary() { echo "torch_versions: torch $1: $2"; }

mkdir -p "$WORK"
if [[ ! -x "$PY" ]] || ! "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
    echo "[torch_versions] venv $VENV with torch==$VERSION"
    python3 -m venv "$VENV"
    # shellcheck disable=SC2086 - RR_PIP_ARGS is a list of options
    "$VENV/bin/pip" install -q ${RR_PIP_ARGS:-} "torch==$VERSION" numpy pytest ninja setuptools
fi
TORCH="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"

echo "[torch_versions] copying $ROOT to $SRC"
mkdir -p "$SRC"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$SRC"

echo "[torch_versions] building CPU-only against torch $TORCH (log: $LOG)"
if ! (cd "$SRC" && RINGREDUCE_FORCE_CPU=1 MAX_JOBS="${MAX_JOBS:-2}" "$PY" setup.py build_ext --inplace >"$LOG" 2>&1); then
    tail -n 30 "$LOG"
    summary "$TORCH" "build FAILED (see $LOG)"
    exit 1
fi

echo "[torch_versions] backend tests"
set +e
(cd "$SRC" && PYTHONPATH="$SRC" "$PY" -m pytest -q -p no:cacheprovider tests/test_backend.py tests/test_backend_train.py "$@") \
    2>&1 | tee "$WORK/pytest.log"
rc=${PIPESTATUS[0]}
set -e
# pytest's last line: "31 passed in 250.12s (0:04:10)", "2 failed, 29 passed in ...", "no tests ran in ..."
result="$(grep -E ' in [0-9.]+s' "$WORK/pytest.log" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')"
summary "$TORCH" "build ok; backend tests: ${result:-no pytest summary} (pytest rc $rc)"
exit "$rc"
