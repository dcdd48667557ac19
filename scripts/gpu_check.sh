#!/usr/bin/env bash
# scripts/gpu_check.sh: every check of ringreduce that needs a GPU, on whatever GPUs this machine has.
#
# One command for a GPU machine, from a fresh clone or the set-up venv:
#   scripts/gpu_check.sh
# It builds ringreduce in place when the checkout has no usable build (the build refuses an extension
# linked with its own static libstdc++, docs/design.md section 3: a probe library linked first
# shows such a compiler in seconds, and then it builds with the system's /usr/bin/g++; it says which
# compiler it used), prints the GPUs, then
#   * 1+ GPU:  the loopback suite (the GPU ring driver with ranks as threads on one GPU, n = 2..8,
#              flat, halves, mapped sub-rings, hierarchical); the reduce kernel against torch for
#              every dtype/op and its bandwidth next to a device-to-device copy's; the multi-rank GPU
#              suite (pytest -m gpu tests/gpu) at 2 and at 3 ranks (and at one rank per GPU beyond
#              3 GPUs); python -m ringreduce.bench against NCCL (1 MiB - 256 MiB; JSON, and a PNG
#              where matplotlib is installed). With fewer GPUs than ranks the ranks share them over
#              NCCL's socket transport on lo, and the output says so (Note [Ranks sharing a GPU],
#              ringreduce/bench/gpu_map.py);
#   * no GPU:  the simulated-device checks (ring driver on simulated streams, CudaRing/NcclComm on a
#              fake CUDA runtime, the communicator registry); the last line says no GPU was found.
# Time: every step has a limit and the whole run a budget (GPU_CHECK_BUDGET, default 900 s = 15
# minutes on one H100, build included); a step the budget cannot hold any more fails as "not run".
# The multi-rank suite's jobs end 30 s before their step's limit (RINGREDUCE_GPU_DEADLINE,
# tests/gpu/gpu_ranks.py), printing where every rank waits; the tests left then skip.
# Everything goes to one results folder (RESULTS, default benchmarks/results/gpu_check-<UTC time>;
# without a GPU a temporary folder), with a one-screen summary last (also summary.txt). Exit code:
# 0 when every check passed (and on a machine without a GPU when the simulated checks passed), 1
# otherwise.
# Environment: PYTHON (default: the first of .venv/bin/python, python, python3 that has torch),
# RESULTS, MAX_JOBS, CXX (the build's compiler), TORCH_CUDA_ARCH_LIST (default with a GPU: the visible
# GPUs' architectures), GPU_CHECK_BUDGET, BENCH_ARGS (extra arguments for
# ringreduce.bench); without a GPU also SIM_TESTS (the pytest files to run) and GPU_CHECK_CPP=0
# (skip the C++ checks).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUDGET="${GPU_CHECK_BUDGET:-900}"
SYSTEM_CXX=/usr/bin/g++
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
step() {  # step NAME LIMIT_S CMD...: runs CMD (at most LIMIT_S s, within the budget), output in the log
  local name="$1" limit="$2"
  shift 2
  local left=$((BUDGET - SECONDS))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then
    SUMMARY+=("FAIL  $name (not run: the $BUDGET s budget of GPU_CHECK_BUDGET is spent)")
    FAILED=1
    return 1
  fi
  say "---- $name (limit $limit s): $*"
  local t0=$SECONDS rc
  # The GPU tests' harness ends its jobs 30 s before the limit (tests/gpu/gpu_ranks.py): a hang is
  # reported with every rank's stacks, and pytest's summary still prints, before timeout kills it.
  RINGREDUCE_GPU_DEADLINE="$(($(date +%s) + (limit > 60 ? limit - 30 : limit / 2)))" timeout --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if (( rc == 0 )); then
    SUMMARY+=("PASS  $name ($((SECONDS - t0)) s)")
  elif (( rc == 124 || rc == 137 )); then
    SUMMARY+=("FAIL  $name (stopped at its $limit s limit)")
    FAILED=1
  else
    SUMMARY+=("FAIL  $name ($((SECONDS - t0)) s, exit code $rc)")
    FAILED=1
  fi
  return "$rc"
}
finish() {  # finish LAST_LINE
  {
    echo
    echo "================ ringreduce gpu_check summary ================"
    echo "machine: $(hostname) | $(date -u +%Y-%m-%dT%H:%M:%SZ) | commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') | $SECONDS s"
    echo "results: $RESULTS"
    for line in "${SUMMARY[@]}"; do echo "$line"; done
    [[ -f "$RESULTS/kernels.txt" ]] && cat "$RESULTS/kernels.txt"
    [[ -f "$RESULTS/bench_summary.txt" ]] && cat "$RESULTS/bench_summary.txt"
    echo "$1"
  } | tee "$RESULTS/summary.txt" | tee -a "$LOG"
  exit "$FAILED"
}

# ---- the build -------------------------------------------------------------------------------
# A usable build: this checkout's ringreduce._C (not one an editable install of another checkout
# maps in), which loads the shared libstdc++ (tools/libstdcxx_check.py); with a GPU it has CUDA too.
ext_file() { "$PYTHON" -c 'import ringreduce._native as n; print(n.C.__file__)' 2>/dev/null; }
build_ok() {  # build_ok NEED_CUDA
  local f
  f="$(ext_file)" && [[ -n "$f" && "$(dirname "$(realpath "$f")")" == "$(realpath "$ROOT/ringreduce")" ]] || return 1
  "$PYTHON" "$ROOT/tools/libstdcxx_check.py" "$f" >>"$LOG" 2>&1 || return 1
  [[ "$1" == 0 ]] || "$PYTHON" -c 'import ringreduce, sys; sys.exit(0 if ringreduce.build_info()["cuda"] else 1)' \
    >/dev/null 2>&1
}
compiler() {  # the compiler a build with CXX=$1 (empty: unset) uses, with its version
  local cxx="${1:-}" link
  if [[ -n "$cxx" ]]; then
    echo "$(command -v "$cxx" || echo "$cxx") ($("$cxx" --version 2>/dev/null | head -1))"
  else  # torch compiles with c++ and setuptools links with Python's configured CXX
    link="$("$PYTHON" -c 'import sysconfig; print((sysconfig.get_config_var("CXX") or "c++").split()[0])')"
    echo "c++ = $(command -v c++ || echo '?') ($(c++ --version 2>/dev/null | head -1)), linked by $link = $(command -v "$link" || echo '?')"
  fi
}
cc_for() {  # cc_for CXX: the C compiler beside CXX (g++-12 -> gcc-12, clang++ -> clang), if it exists
  local path dir base cc
  path="$(command -v "$1" 2>/dev/null || echo "$1")"
  dir="$(dirname "$path")"
  base="$(basename "$path")"
  case "$base" in
    *clang++*) cc="${base/clang++/clang}" ;;
    *g++*) cc="${base/g++/gcc}" ;;
    *c++*) cc="${base/c++/cc}" ;;
    *) return 1 ;;
  esac
  [[ -x "$dir/$cc" ]] || return 1
  echo "$dir/$cc"
}
probe_libstdcxx() {  # probe_libstdcxx CXX (empty: Python's link command): does a library it links
  # load the shared libstdc++? 0 yes, 1 no (a static copy: the build would be refused), 2 could not
  # tell. Seconds, where a refused build costs its whole compile (tools/libstdcxx_check.py).
  local cxx="${1:-}" dir rc link=()
  if [[ -n "$cxx" ]]; then
    link=("$cxx" -shared)
  else  # setuptools links the extension with Python's LDCXXSHARED
    read -r -a link <<< "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("LDCXXSHARED") or "c++ -shared")')"
  fi
  dir="$(mktemp -d)"
  printf '#include <sstream>\nint rr_probe(int x) { std::ostringstream s; s << x; return int(s.str().size()); }\n' \
    > "$dir/probe.cpp"
  if ! "${link[@]}" -fPIC -O1 -o "$dir/probe.so" "$dir/probe.cpp" >/dev/null 2>&1; then
    rc=2
  elif "$PYTHON" "$ROOT/tools/libstdcxx_check.py" "$dir/probe.so" >/dev/null 2>&1; then
    rc=0
  else
    rc=1
  fi
  rm -rf "$dir"
  return "$rc"
}
build_with() {  # build_with CXX NEED_CUDA: one in-place build (CXX empty: the default compilers)
  local cxx="$1" need="$2" env_=(MAX_JOBS="${MAX_JOBS:-$(nproc)}") limit=600 left=$((BUDGET - SECONDS)) cc
  [[ "$need" == 1 ]] && env_+=(RINGREDUCE_REQUIRE_CUDA=1)
  if [[ -n "$cxx" ]]; then  # torch's build hands CC to nvcc as -ccbin (the .cu files' host compiler)
    env_+=(CXX="$cxx")
    cc="$(cc_for "$cxx")" && env_+=(CC="$cc")
  fi
  (( left < limit )) && limit=$left
  (( limit >= 20 )) || return 1
  say "---- build ringreduce in place with $(compiler "$cxx") (limit $limit s): setup.py build_ext --inplace"
  timeout --kill-after=20 "$limit" env "${env_[@]}" "$PYTHON" setup.py build_ext --inplace 2>&1 |
    tee "$RESULTS/build.log" >>"$LOG"
  tail -n 5 "$RESULTS/build.log"
  build_ok "$need"
}
build() {  # build NEED_CUDA: in place unless a usable build exists; with the system g++ if refused
  local need="$1" t0=$SECONDS
  if build_ok "$need"; then
    say "using the existing build ($(ext_file)); it loads the shared libstdc++"
    SUMMARY+=("INFO  build: the checkout's existing one, checked: it loads the shared libstdc++")
    return 0
  fi
  local probe=0
  probe_libstdcxx "${CXX:-}" || probe=$?
  if (( probe == 1 )) && [[ -x "$SYSTEM_CXX" ]] && [[ "${CXX:-}" != "$SYSTEM_CXX" ]]; then
    # the build would be refused after its whole compile: straight to the system compiler
    SUMMARY+=("INFO  $(compiler "${CXX:-}") links libstdc++ statically (a probe library), which the build refuses")
    say "the default compiler links libstdc++ statically (probe); building with $SYSTEM_CXX instead"
  elif build_with "${CXX:-}" "$need"; then
    SUMMARY+=("PASS  build ($((SECONDS - t0)) s) with $(compiler "${CXX:-}")")
    return 0
  elif grep -q "refusing the extension just linked" "$RESULTS/build.log" && [[ -x "$SYSTEM_CXX" ]] &&
       [[ "${CXX:-}" != "$SYSTEM_CXX" ]]; then
    SUMMARY+=("INFO  build with $(compiler "${CXX:-}") refused: the extension carried its own static libstdc++")
    say "the build with the default compiler was refused (static libstdc++); building with $SYSTEM_CXX instead"
  else
    SUMMARY+=("FAIL  build ($((SECONDS - t0)) s; see $RESULTS/build.log)")
    FAILED=1
    return 1
  fi
  t0=$SECONDS
  if build_with "$SYSTEM_CXX" "$need"; then
    SUMMARY+=("PASS  build ($((SECONDS - t0)) s) with $(compiler "$SYSTEM_CXX")")
    return 0
  fi
  SUMMARY+=("FAIL  build ($((SECONDS - t0)) s; see $RESULTS/build.log)")
  FAILED=1
  return 1
}

say "python: $PYTHON ($("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1))"
say "CUDA GPUs visible to torch: $NGPU"

# ---- no GPU: the simulated-device checks -----------------------------------------------------
if [[ "$NGPU" == "0" ]]; then
  build 0 || finish "gpu_check: no CUDA GPU was found; could not build ringreduce (see $LOG); nothing ran on a GPU"
  # shellcheck disable=SC2086
  step "simulated device: kernel body + ring driver + registry (pytest)" 900 \
    "$PYTHON" -m pytest -q -p no:cacheprovider ${SIM_TESTS:-tests/test_cuda_logic.py tests/test_cuda_registry.py \
    tests/test_setup_archs.py}
  if [[ "${GPU_CHECK_CPP:-1}" == "0" ]]; then
    SUMMARY+=("SKIP  C++ simulated-device checks (GPU_CHECK_CPP=0)")
  elif command -v cmake >/dev/null 2>&1; then
    BUILD="$ROOT/build-gpucheck"
    GEN=()
    command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
    step "configure the C++ checks (cmake, RR_CUDA=OFF)" 300 \
      cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DRR_CUDA=OFF \
      -DPython3_EXECUTABLE="$("$PYTHON" -c 'import sys; print(sys.executable)')"
    TARGETS=(test_cuda_driver_sim)
    if grep -q test_cuda_ring_fake "$BUILD/CTestTestfile.cmake" 2>/dev/null; then
      TARGETS+=(test_cuda_ring_fake)
    else
      SUMMARY+=("SKIP  test_cuda_ring_fake (cuda_runtime_api.h or nccl.h not found by cmake)")
    fi
    step "build ${TARGETS[*]}" 900 cmake --build "$BUILD" -j "${MAX_JOBS:-2}" --target "${TARGETS[@]}"
    step "simulated streams + fake CUDA runtime (ctest)" 300 \
      ctest --test-dir "$BUILD" --output-on-failure -R "$(IFS='|'; echo "${TARGETS[*]}")"
  else
    SUMMARY+=("SKIP  C++ simulated-device checks (cmake not found)")
  fi
  finish "gpu_check: no CUDA GPU was found; ran the simulated-device checks only ($([[ $FAILED == 0 ]] && echo passed || echo FAILED)); nothing ran on a GPU"
fi

# ---- a GPU: build, machine -------------------------------------------------------------------
# Kernels for the GPUs at hand only (setup.py's default is four architectures: minutes more on any
# machine), as torch's own extension builds do when TORCH_CUDA_ARCH_LIST is unset.
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST="$("$PYTHON" -c 'import torch; n = torch.cuda.device_count()
print(";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(n)})))' 2>/dev/null)"
  [[ -n "$TORCH_CUDA_ARCH_LIST" ]] && export TORCH_CUDA_ARCH_LIST &&
    say "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST (the visible GPUs; set it to build others)"
fi
build 1 || finish "gpu_check: could not build ringreduce with CUDA (see $LOG)"
"$PYTHON" -c 'import json, ringreduce; print(json.dumps(ringreduce.build_info()))' > "$RESULTS/build_info.json" 2>&1
say "build_info: $(cat "$RESULTS/build_info.json")"
{
  nvidia-smi -L 2>&1 || true
  nvidia-smi topo -m 2>&1 || true
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,pcie.link.gen.current,clocks.max.sm \
    --format=csv 2>&1 || true
} > "$RESULTS/machine.txt"
tee -a "$LOG" < "$RESULTS/machine.txt"

# ---- the checks (limits: the first run on one H100 took 138 s for the loopback suite, 10 s for
# the kernels; docs/performance.md has the plan). pytest -v names each test as it ends and
# --durations lists the slowest, so a run stopped at its limit still says where the time went. ------
step "loopback suite on one GPU (n = 2..8, halves, sub-rings, hierarchical)" 200 \
  "$PYTHON" -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_loopback.py --durations=5 \
  --junitxml="$RESULTS/loopback.xml"
step "reduce kernel vs torch, kernel vs D2D copy bandwidth" 60 \
  bash -c "set -o pipefail; '$PYTHON' scripts/gpu_kernels.py --json '$RESULTS/kernels.json' | tee '$RESULTS/kernels.txt'"

WORLDS=(2 3)
(( NGPU > 3 )) && WORLDS+=("$NGPU")
for n in "${WORLDS[@]}"; do
  if (( n <= NGPU )); then how="one GPU per rank"; else how="sharing $NGPU GPU(s) over NCCL's socket transport on lo"; fi
  step "multi-rank GPU suite, $n ranks ($how)" $(( n == 2 ? 240 : 300 )) \
    env RINGREDUCE_GPU_WORLD="$n" "$PYTHON" -m pytest -v -p no:cacheprovider -m gpu tests/gpu \
    --ignore=tests/gpu/test_gpu_loopback.py --durations=15 --junitxml="$RESULTS/gpu_suite_$n.xml"
done

# ringreduce vs NCCL (default) and NCCL_ALGO=RING, 1 MiB - 256 MiB; 2 ranks on one GPU, else one per GPU.
NPROC=$(( NGPU >= 2 ? NGPU : 2 ))
PLOT=(--plot "$RESULTS/bench.png")
if ! "$PYTHON" -c "import matplotlib" >/dev/null 2>&1; then  # the bench refuses --plot without it
  PLOT=()
  SUMMARY+=("INFO  bench without its PNG: $PYTHON has no matplotlib (the JSON has every figure)")
fi
# shellcheck disable=SC2086
step "ringreduce.bench vs NCCL, $NPROC ranks, 1 MiB - 256 MiB" 180 \
  "$PYTHON" -m ringreduce.bench --backend nccl --nproc "$NPROC" -b 1M -e 256M -f 2 --rounds 3 --warmup 2 \
  --seconds 2 --min-iters 2 --json "$RESULTS/bench.json" "${PLOT[@]}" ${BENCH_ARGS:-}
if [[ -f "$RESULTS/bench.json" ]]; then
  "$PYTHON" scripts/gpu_bench_summary.py "$RESULTS/bench.json" > "$RESULTS/bench_summary.txt" 2>&1 || FAILED=1
fi

finish "gpu_check: $NGPU CUDA GPU(s); $([[ $FAILED == 0 ]] && echo 'every check passed' || echo 'SOME CHECKS FAILED') (results in $RESULTS)"
