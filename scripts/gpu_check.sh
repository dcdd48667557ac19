#!/usr/bin/env bash
# scripts/gpu_check.sh: every check of ringreduce that needs a GPU, on whatever GPUs this machine has.
#
# One command for the first GPU machine, from a fresh clone or the set-up venv:
#   scripts/gpu_check.sh
# It builds ringreduce if needed (in place, with CUDA), prints the GPUs and their topology, then
#   * 1+ GPU:  the loopback suite (the GPU ring driver with ranks as threads on one GPU, n = 2..8,
#              flat, halves, mapped sub-rings, hierarchical), the reduce kernel against torch for
#              every dtype/op, and the kernel's bandwidth next to a device-to-device copy's;
#   * 2+ GPUs: also the whole GPU suite (pytest -m gpu) and python -m ringreduce.bench against NCCL
#              (default and NCCL_ALGO=RING) from 1 MiB to 1 GiB, JSON and PNG;
#   * no GPU:  the simulated-device checks (ring driver on simulated streams, CudaRing/NcclComm on a
#              fake CUDA runtime, the communicator registry); the last line says no GPU was found.
# Everything goes to one results folder (RESULTS, default benchmarks/results/gpu_check-<UTC time>;
# without a GPU a temporary folder),
# with a one-screen summary at the end (also summary.txt). Exit code: 0 when every check passed
# (and on a machine without a GPU when the simulated checks passed), 1 otherwise.
# Environment: PYTHON (default: the first of .venv/bin/python, python, python3 that has torch),
# RESULTS, MAX_JOBS, BENCH_ARGS (extra arguments for ringreduce.bench); without a GPU also
# SIM_TESTS (the pytest files to run) and GPU_CHECK_CPP=0 (skip the C++ checks).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -z "${PYTHON:-}" ]]; then  # the first interpreter that has torch
  for cand in "$ROOT/.venv/bin/python" python python3; do
    if "$cand" -c "import torch" >/dev/null 2>&1; then PYTHON="$cand"; break; fi
  done
fi
if [[ -z "${PYTHON:-}" ]]; then
  echo "gpu_check: no Python with torch found (set PYTHON, or run scripts/setup_env.sh first)" >&2
  exit 1
fi
NGPU="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
if [[ "$NGPU" == "0" ]]; then  # nothing worth keeping in the repository
  RESULTS="${RESULTS:-${TMPDIR:-/tmp}/ringreduce-gpu_check-$STAMP}"
else
  RESULTS="${RESULTS:-$ROOT/benchmarks/results/gpu_check-$STAMP}"
fi
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=()
FAILED=0

say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
step() {  # step NAME CMD...: runs CMD with its output in the log, records PASS/FAIL
  local name="$1"
  shift
  say "---- $name: $*"
  local t0=$SECONDS
  if "$@" 2>&1 | tee -a "$LOG"; then
    SUMMARY+=("PASS  $name ($((SECONDS - t0)) s)")
  else
    SUMMARY+=("FAIL  $name ($((SECONDS - t0)) s)")
    FAILED=1
  fi
}
finish() {  # finish LAST_LINE
  {
    echo
    echo "================ ringreduce gpu_check summary ================"
    echo "machine: $(hostname) | $(date -u +%Y-%m-%dT%H:%M:%SZ) | commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "results: $RESULTS"
    for line in "${SUMMARY[@]}"; do echo "$line"; done
    [[ -f "$RESULTS/kernels.txt" ]] && cat "$RESULTS/kernels.txt"
    [[ -f "$RESULTS/bench_summary.txt" ]] && cat "$RESULTS/bench_summary.txt"
    echo "$1"
  } | tee "$RESULTS/summary.txt" | tee -a "$LOG"
  exit "$FAILED"
}

# ---- GPUs ------------------------------------------------------------------------------------
say "python: $PYTHON ($("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1))"
say "CUDA GPUs visible to torch: $NGPU"

# ---- no GPU: the simulated-device checks -----------------------------------------------------
if [[ "$NGPU" == "0" ]]; then
  # shellcheck disable=SC2086
  step "simulated device: kernel body + ring driver + registry (pytest)" \
    "$PYTHON" -m pytest -q -p no:cacheprovider ${SIM_TESTS:-tests/test_cuda_logic.py tests/test_cuda_registry.py \
    tests/test_setup_archs.py}
  if [[ "${GPU_CHECK_CPP:-1}" == "0" ]]; then
    SUMMARY+=("SKIP  C++ simulated-device checks (GPU_CHECK_CPP=0)")
  elif command -v cmake >/dev/null 2>&1; then
    BUILD="$ROOT/build-gpucheck"
    GEN=()
    command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
    step "configure the C++ checks (cmake, RR_CUDA=OFF)" \
      cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DRR_CUDA=OFF \
      -DPython3_EXECUTABLE="$("$PYTHON" -c 'import sys; print(sys.executable)')"
    TARGETS=(test_cuda_driver_sim)
    if grep -q test_cuda_ring_fake "$BUILD/CTestTestfile.cmake" 2>/dev/null; then
      TARGETS+=(test_cuda_ring_fake)
    else
      SUMMARY+=("SKIP  test_cuda_ring_fake (cuda_runtime_api.h or nccl.h not found by cmake)")
    fi
    step "build ${TARGETS[*]}" cmake --build "$BUILD" -j "${MAX_JOBS:-2}" --target "${TARGETS[@]}"
    step "simulated streams + fake CUDA runtime (ctest)" \
      ctest --test-dir "$BUILD" --output-on-failure -R "$(IFS='|'; echo "${TARGETS[*]}")"
  else
    SUMMARY+=("SKIP  C++ simulated-device checks (cmake not found)")
  fi
  finish "gpu_check: no CUDA GPU was found; ran the simulated-device checks only ($([[ $FAILED == 0 ]] && echo passed || echo FAILED)); nothing ran on a GPU"
fi

# ---- build if needed -------------------------------------------------------------------------
built_with_cuda() { "$PYTHON" -c 'import ringreduce, sys; sys.exit(0 if ringreduce.build_info()["cuda"] else 1)' >/dev/null 2>&1; }
if ! built_with_cuda; then
  say "ringreduce is not built with CUDA here: building it in place (setup.py build_ext --inplace)"
  step "build ringreduce with CUDA" env RINGREDUCE_REQUIRE_CUDA=1 MAX_JOBS="${MAX_JOBS:-8}" \
    "$PYTHON" setup.py build_ext --inplace
  built_with_cuda || finish "gpu_check: could not build ringreduce with CUDA (see $LOG)"
fi
"$PYTHON" -c 'import json, ringreduce; print(json.dumps(ringreduce.build_info()))' > "$RESULTS/build_info.json" 2>&1
say "build_info: $(cat "$RESULTS/build_info.json")"

# ---- the machine -----------------------------------------------------------------------------
{
  nvidia-smi -L 2>&1 || true
  nvidia-smi topo -m 2>&1 || true
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,pcie.link.gen.current,clocks.max.sm \
    --format=csv 2>&1 || true
} > "$RESULTS/machine.txt"
tee -a "$LOG" < "$RESULTS/machine.txt"

# ---- one GPU and more ------------------------------------------------------------------------
step "loopback suite on one GPU (n = 2..8, halves, sub-rings, hierarchical)" \
  "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_loopback.py \
  --junitxml="$RESULTS/loopback.xml"
step "reduce kernel vs torch, kernel vs D2D copy bandwidth" \
  bash -c "set -o pipefail; '$PYTHON' scripts/gpu_kernels.py --json '$RESULTS/kernels.json' | tee '$RESULTS/kernels.txt'"

if (( NGPU >= 2 )); then
  step "GPU suite (pytest -m gpu)" \
    "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml="$RESULTS/gpu_suite.xml"
  # ringreduce vs NCCL (default) and NCCL_ALGO=RING, 1 MiB - 1 GiB, every GPU as a rank.
  # shellcheck disable=SC2086
  step "ringreduce.bench vs NCCL, 1 MiB - 1 GiB" \
    "$PYTHON" -m ringreduce.bench --backend nccl -b 1M -e 1G -f 2 --json "$RESULTS/bench.json" \
    --plot "$RESULTS/bench.png" ${BENCH_ARGS:-}
  if [[ -f "$RESULTS/bench.json" ]]; then
    "$PYTHON" - "$RESULTS/bench.json" > "$RESULTS/bench_summary.txt" 2>&1 <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
rows = data.get("rows", data if isinstance(data, list) else [])
print("bench (busbw GB/s; target: ringreduce >= 0.85 x NCCL_ALGO=RING at >= 64 MiB):")
for r in rows:
    if isinstance(r, dict) and r.get("bytes", r.get("size", 0)) >= 64 << 20:
        print("  " + " ".join(f"{k}={v}" for k, v in r.items() if k in ("bytes", "size", "impl", "busbw", "ratio")))
EOF
  fi
else
  SUMMARY+=("SKIP  GPU suite and bench vs NCCL (need >= 2 GPUs; found $NGPU)")
fi

finish "gpu_check: $NGPU CUDA GPU(s); $([[ $FAILED == 0 ]] && echo 'every check passed' || echo 'SOME CHECKS FAILED') (results in $RESULTS)"
