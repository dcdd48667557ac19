#!/usr/bin/env bash
# scripts/gpu_check.sh: the checks of ringreduce that need a GPU, in parts that each fit one device
# command of at most 10 minutes (issue 30), the most valuable first:
#
#   scripts/gpu_check.sh speed   build for the visible GPU(s) with every core; the reduce kernels
#                                against torch, and float32 / bfloat16 / float16 SUM and AVG against a
#                                device-to-device copy; python -m ringreduce.bench --backend nccl at 2
#                                ranks from 8 B to 256 MiB with the NCCL default, NCCL_ALGO=RING and
#                                loopback columns; then float32, bfloat16 and float16 from 64 KiB to
#                                64 MiB with algorithm="ring" and "direct" columns     budget 330 s
#   scripts/gpu_check.sh suite   the multi-rank GPU suite (pytest -m gpu tests: the behavioural tests'
#                                cases at the place "cuda" and tests/gpu, error paths included) at 2
#                                ranks, using the build speed left                      budget 300 s
#   scripts/gpu_check.sh more    the loopback suite (ranks as threads on one GPU, n = 2..8), the suite
#                                and the benchmark at 3 ranks                           budget 540 s
#   scripts/gpu_check.sh         speed, then suite                                     budget 570 s
#   scripts/gpu_check.sh cpu     no GPU needed: the CPU sweeps that need a core per rank, which the
#                                2-vCPU development VM cannot give (issue 45's 4-rank half-type target):
#                                python -m ringreduce.bench at 4 ranks pinned to a core each, float32 /
#                                bfloat16 / float16, AVG then SUM, 64 KiB-64 MiB; with fewer than 4
#                                cores a rehearsal at tiny sizes                       budget 360 s
#
# --dry-run (or GPU_CHECK_DRY_RUN=1) prints the plan, each step with its time limit, and runs nothing.
# With fewer GPUs than ranks the ranks share them over NCCL's socket transport on lo, and the output
# says so (Note [Ranks sharing a GPU], ringreduce/bench/gpu_map.py). The build (only when the checkout
# has no usable one) refuses an extension linked with its own static libstdc++ (docs/design.md section
# 3): a probe library shows such a compiler in seconds, and then it builds with /usr/bin/g++.
#
# Without a GPU each part runs its simulated-device rehearsal instead: speed the kernel body and ring
# driver on simulated streams (pytest) and the benchmark's JSON-to-summary path on 2 CPU ranks; suite
# the communicator registry and the GPU tests' harness on CPU ranks; more the C++ checks (ring driver
# on simulated streams, CudaRing/NcclComm on a fake CUDA runtime). The last line then says that no CUDA
# GPU was found, and the exit code is 0 when the rehearsal passed.
#
# Time: every step has a limit and the part a budget (GPU_CHECK_BUDGET overrides it); a step the budget
# cannot hold any more is "not run". The GPU suite's jobs end 30 s before their step's limit
# (RINGREDUCE_GPU_DEADLINE, tests/ranks.py), printing where every rank waits.
# Output: one results folder (RESULTS, default benchmarks/results/gpu_check-<part>-<UTC time>; without
# a GPU a temporary folder): the log, summary.txt written line by line as each step ends (a command
# cut short still says what it found), then the whole summary again at the end. Where OUT is set (the
# device tool's folder whose files come back), gpu_check.log and summary.txt are also written line by
# line into $OUT/gpu_check-<part>/, with the results folder packed there as results.tar.gz after every
# step (the tool returns at most 8 files). Exit code: 0 when every check passed, 1 otherwise.
# Environment: PYTHON (default: the first of .venv/bin/python, python, python3 that has torch),
# RESULTS, OUT, MAX_JOBS, CXX (the build's compiler), TORCH_CUDA_ARCH_LIST (default: the visible GPUs'),
# GPU_CHECK_BUDGET, BENCH_ARGS (extra arguments for ringreduce.bench); SIM_TESTS (the pytest files of a
# part's rehearsal), GPU_CHECK_CPP=0 (skip the C++ checks) and GPU_CHECK_CORES (the cores cpu assumes
# there are; default nproc's).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PART=all
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
for arg in "$@"; do
  case "$arg" in
    speed|suite|more|cpu) PART="$arg" ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$arg' (speed, suite, more, cpu, --dry-run; none: speed then suite)" >&2
       exit 2 ;;
  esac
done

# Step limits (s). speed: the build is ~60-75 s with 16 cores (the 963a10d H100 run), the kernels ~10 s,
# the 2-rank sweep of 26 sizes x 3 implementations 58 s at --seconds 0.5 (the 185e23a H200 run), the
# half types' 6 sizes x 3 types x 4 implementations (with the CPU-side accuracy of ring and direct)
# about as long; suite: the 2-rank suite with its error-path twins; more: the loopback suite took 138 s
# on one H100.
LIMIT_BUILD=110 LIMIT_KERNELS=40 LIMIT_BENCH=100 LIMIT_HALF=80 LIMIT_SUITE=280
LIMIT_LOOPBACK=150 LIMIT_SUITE3=220 LIMIT_BENCH3=60 LIMIT_CPU=120
case "$PART" in
  speed) DEFAULT_BUDGET=330 ;;
  suite) DEFAULT_BUDGET=300 ;;
  more) DEFAULT_BUDGET=540 ;;
  cpu) DEFAULT_BUDGET=360 ;;
  all) DEFAULT_BUDGET=570 LIMIT_SUITE=240 ;;  # speed's 330 s, then the suite in the 240 s left
esac
BUDGET="${GPU_CHECK_BUDGET:-$DEFAULT_BUDGET}"
BENCH_SWEEP=(-b 8 -e 256M -f 2 --rounds 3 --warmup 2 --seconds 0.5 --min-iters 2)
# The half types (issue 48, item 3): each type's time over float32's at the same bytes, and
# algorithm="direct" against the ring on real NCCL, with the elements each leaves off the correctly
# rounded sum where the float32 sum is exact (0: rounded once).
HALF_SWEEP=(-d float,bfloat16,float16 --algorithms ring,direct -b 64K -e 64M -f 4 --rounds 3 --warmup 2
            --seconds 0.3 --min-iters 2 --no-loopback --no-nccl-ring)
# cpu: each half type's time over float32's at the same bytes, 4 ranks with a core each (the target:
# <= 1.1x, 64 KiB-64 MiB, AVG and SUM), next to gloo; gloo's half types take up to ~1 s a call at 64 MiB.
CPU_RANKS=4
CPU_SWEEP=(--backend gloo --nproc "$CPU_RANKS" --pin -d float,bfloat16,float16 -b 64K -e 64M -f 4 --rounds 6
           --warmup 2 --seconds 0.5 --min-iters 2)

plan() {  # the steps of PART on a GPU, with their limits (what --dry-run prints)
  local total=0 line name limit
  local steps=("build ringreduce for the visible GPU(s) with every core (where none is usable)|$LIMIT_BUILD")
  if [[ "$PART" == speed || "$PART" == all ]]; then
    steps+=("speed: kernels vs torch; f32/bf16/fp16 SUM, AVG vs device-to-device copy|$LIMIT_KERNELS"
            "speed: bench --backend nccl, 2 ranks, 8 B-256 MiB: nccl, nccl-ring, loopback|$LIMIT_BENCH"
            "speed: bench --backend nccl, 2 ranks, f32/bf16/fp16 64K-64M: ring, direct|$LIMIT_HALF")
  fi
  if [[ "$PART" == suite || "$PART" == all ]]; then
    steps+=("suite: pytest -m gpu tests at 2 ranks (every place-\"cuda\" case, error paths included)|$LIMIT_SUITE")
  fi
  if [[ "$PART" == cpu ]]; then
    steps=("build ringreduce with every core (where none is usable; no GPU needed)|$LIMIT_BUILD"
           "cpu: bench, $CPU_RANKS CPU ranks pinned, f32/bf16/fp16 64K-64M, AVG|$LIMIT_CPU"
           "cpu: bench, $CPU_RANKS CPU ranks pinned, f32/bf16/fp16 64K-64M, SUM|$LIMIT_CPU")
  fi
  if [[ "$PART" == more ]]; then
    steps+=("more: loopback suite on one GPU (n = 2..8, halves, sub-rings, hierarchical)|$LIMIT_LOOPBACK"
            "more: pytest -m gpu tests at 3 ranks|$LIMIT_SUITE3"
            "more: bench --backend nccl, 3 ranks, 1 MiB-256 MiB|$LIMIT_BENCH3")
  fi
  echo "[gpu_check] plan of '$PART' on a GPU machine: budget $BUDGET s (device tool: run with timeout_s $((BUDGET + 30)))"
  for line in "${steps[@]}"; do
    name="${line%|*}" limit="${line##*|}"
    total=$((total + limit))
    printf '  %-78s limit %3d s, by %3d s\n' "$name" "$limit" "$(( total < BUDGET ? total : BUDGET ))"
  done
  echo "  each limit is cut to what is left of the $BUDGET s budget; a step it cannot hold is 'not run'"
  if [[ "$PART" == cpu ]]; then
    echo "  with fewer than $CPU_RANKS cores: the same sweeps at tiny sizes, unpinned (a rehearsal); the last line says so"
  else
    echo "  without a GPU: the part's simulated-device rehearsal; the last line says no CUDA GPU was found"
  fi
}
if [[ "$DRY_RUN" == 1 ]]; then
  plan
  exit 0
fi

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
# What the script asks torch, in one interpreter start (each start imports torch: seconds, on a lent
# GPU's clock too): the GPUs, their architectures, torch's and CUDA's versions.
TORCH_PROBE=()
mapfile -t TORCH_PROBE < <("$PYTHON" -c 'import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n)
print(";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(n)})))
print(torch.__version__)
print(torch.version.cuda)' 2>/dev/null)
NGPU="${TORCH_PROBE[0]:-0}" GPU_ARCHS="${TORCH_PROBE[1]:-}" TORCH_VERSION="${TORCH_PROBE[2]:-?}" TORCH_CUDA="${TORCH_PROBE[3]:-?}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
CORES="${GPU_CHECK_CORES:-$(nproc)}"
KEEP=1  # whether this run's results are figures worth keeping in the repository
if [[ "$PART" == cpu ]]; then
  (( CORES >= CPU_RANKS )) || KEEP=0
elif [[ "$NGPU" == "0" ]]; then
  KEEP=0
fi
if [[ "$KEEP" == 0 ]]; then  # a rehearsal: nothing worth keeping in the repository
  RESULTS="${RESULTS:-${TMPDIR:-/tmp}/ringreduce-gpu_check-$PART-$STAMP}"
else
  RESULTS="${RESULTS:-$ROOT/benchmarks/results/gpu_check-$PART-$STAMP}"
fi
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
LOGS=("$LOG")
PUB=""  # $OUT/gpu_check-<part>: what the device tool brings back
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  PUB="$OUT/gpu_check-$PART"
  mkdir -p "$PUB"
  LOGS+=("$PUB/gpu_check.log")
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=()
FAILED=0

say() { echo "[gpu_check] $*" | tee -a "${LOGS[@]}"; }
note() {  # note LINE: a summary line, written at once (a command cut short still says what it found)
  SUMMARY+=("$1")
  echo "$1" >> "$RESULTS/summary.txt"
  [[ -n "$PUB" ]] && echo "$1" >> "$PUB/summary.txt"
  return 0
}
publish() {  # the results folder, packed into $OUT (at most 8 files come back from there)
  [[ -n "$PUB" ]] || return 0
  tar czf "$PUB/results.tar.gz.part" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" 2>/dev/null &&
    mv "$PUB/results.tar.gz.part" "$PUB/results.tar.gz"
  return 0
}
step() {  # step NAME LIMIT_S CMD...: runs CMD (at most LIMIT_S s, within the budget), output in the log
  local name="$1" limit="$2"
  shift 2
  local left=$((BUDGET - SECONDS))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then
    note "FAIL  $name (not run: the $BUDGET s budget is spent)"
    FAILED=1
    return 1
  fi
  say "---- $name (limit $limit s): $*"
  local t0=$SECONDS rc
  # The GPU tests' harness ends its jobs 30 s before the limit (tests/ranks.py): a hang is
  # reported with every rank's stacks, and pytest's summary still prints, before timeout kills it.
  RINGREDUCE_GPU_DEADLINE="$(($(date +%s) + (limit > 60 ? limit - 30 : limit / 2)))" timeout --kill-after=20 "$limit" "$@" 2>&1 | tee -a "${LOGS[@]}"
  rc=${PIPESTATUS[0]}
  if (( rc == 0 )); then
    note "PASS  $name ($((SECONDS - t0)) s)"
  elif (( rc == 124 || rc == 137 )); then
    note "FAIL  $name (stopped at its $limit s limit)"
    FAILED=1
  else
    note "FAIL  $name ($((SECONDS - t0)) s, exit code $rc)"
    FAILED=1
  fi
  publish
  return "$rc"
}
finish() {  # finish LAST_LINE
  {
    echo
    echo "================ ringreduce gpu_check $PART: summary ================"
    echo "machine: $(hostname) | $(date -u +%Y-%m-%dT%H:%M:%SZ) | commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') | $SECONDS s of $BUDGET"
    echo "results: $RESULTS${PUB:+ (packed into $PUB/results.tar.gz)}"
    for line in "${SUMMARY[@]}"; do echo "$line"; done
    echo "$1"
  } > "$RESULTS/summary.txt.new"
  mv "$RESULTS/summary.txt.new" "$RESULTS/summary.txt"
  tee -a "${LOGS[@]}" < "$RESULTS/summary.txt"
  [[ -n "$PUB" ]] && cp "$RESULTS/summary.txt" "$PUB/summary.txt"
  publish
  exit "$FAILED"
}
{
  echo "# gpu_check $PART: $(hostname) | started $(date -u +%Y-%m-%dT%H:%M:%SZ) | commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') | budget $BUDGET s"
} > "$RESULTS/summary.txt"
[[ -n "$PUB" ]] && cp "$RESULTS/summary.txt" "$PUB/summary.txt"

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
  local cxx="$1" need="$2" env_=(MAX_JOBS="${MAX_JOBS:-$(nproc)}") limit=$LIMIT_BUILD left=$((BUDGET - SECONDS)) cc
  [[ "$need" == 1 ]] && env_+=(RINGREDUCE_REQUIRE_CUDA=1)
  if [[ -n "$cxx" ]]; then  # torch's build hands CC to nvcc as -ccbin (the .cu files' host compiler)
    env_+=(CXX="$cxx")
    cc="$(cc_for "$cxx")" && env_+=(CC="$cc")
  fi
  (( left < limit )) && limit=$left
  (( limit >= 20 )) || return 1
  say "---- build ringreduce in place with $(compiler "$cxx") (limit $limit s): setup.py build_ext --inplace"
  timeout --kill-after=20 "$limit" env "${env_[@]}" "$PYTHON" setup.py build_ext --inplace 2>&1 |
    tee "$RESULTS/build.log" | tee -a "${LOGS[@]}" >/dev/null
  tail -n 5 "$RESULTS/build.log"
  build_ok "$need"
}
build() {  # build NEED_CUDA: in place unless a usable build exists; with the system g++ if refused
  local need="$1" t0=$SECONDS
  if build_ok "$need"; then
    say "using the existing build ($(ext_file)); it loads the shared libstdc++"
    note "INFO  build: the checkout's existing one, checked: it loads the shared libstdc++"
    return 0
  fi
  local probe=0
  probe_libstdcxx "${CXX:-}" || probe=$?
  if (( probe == 1 )) && [[ -x "$SYSTEM_CXX" ]] && [[ "${CXX:-}" != "$SYSTEM_CXX" ]]; then
    # the build would be refused after its whole compile: straight to the system compiler
    note "INFO  $(compiler "${CXX:-}") links libstdc++ statically (a probe library), which the build refuses"
    say "the default compiler links libstdc++ statically (probe); building with $SYSTEM_CXX instead"
  elif build_with "${CXX:-}" "$need"; then
    note "PASS  build ($((SECONDS - t0)) s) with $(compiler "${CXX:-}")"
    return 0
  elif grep -q "refusing the extension just linked" "$RESULTS/build.log" && [[ -x "$SYSTEM_CXX" ]] &&
       [[ "${CXX:-}" != "$SYSTEM_CXX" ]]; then
    note "INFO  build with $(compiler "${CXX:-}") refused: the extension carried its own static libstdc++"
    say "the build with the default compiler was refused (static libstdc++); building with $SYSTEM_CXX instead"
  else
    note "FAIL  build ($((SECONDS - t0)) s; see $RESULTS/build.log)"
    FAILED=1
    return 1
  fi
  t0=$SECONDS
  if build_with "$SYSTEM_CXX" "$need"; then
    note "PASS  build ($((SECONDS - t0)) s) with $(compiler "$SYSTEM_CXX")"
    return 0
  fi
  note "FAIL  build ($((SECONDS - t0)) s; see $RESULTS/build.log)"
  FAILED=1
  return 1
}

say "python: $PYTHON (torch $TORCH_VERSION cuda $TORCH_CUDA)"
say "CUDA GPUs visible to torch: $NGPU; part: $PART (budget $BUDGET s)"

# ---- no GPU: each part's simulated-device rehearsal -------------------------------------------
sim_pytest() {  # sim_pytest NAME FILES...: the part's pytest files (SIM_TESTS replaces them)
  local name="$1"
  shift
  # shellcheck disable=SC2086
  step "$name (pytest)" 600 "$PYTHON" -m pytest -q -p no:cacheprovider ${SIM_TESTS:-"$@"}
}
cpu_bench() {  # cpu_bench LABEL NAME LIMIT ARGS...: ringreduce.bench on CPU ranks into NAME.json, then
  # its summary lines (scripts/gpu_bench_summary.py, as on a GPU)
  local label="$1" name="$2" limit="$3"
  shift 3
  step "$label: $*" "$limit" "$PYTHON" -m ringreduce.bench "$@" -q --json "$RESULTS/$name.json" ${BENCH_ARGS:-} &&
    "$PYTHON" scripts/gpu_bench_summary.py "$RESULTS/$name.json" > "$RESULTS/${name}_summary.txt" 2>&1 ||
    { note "FAIL  benchmark summary of $name (scripts/gpu_bench_summary.py)"; FAILED=1; }
  [[ -f "$RESULTS/${name}_summary.txt" ]] && while IFS= read -r line; do note "      $line"; done < "$RESULTS/${name}_summary.txt"
  return 0
}
sim_bench() {  # sim_bench NAME SWEEP...: the benchmark's JSON -> summary path, as speed runs it, on 2
  # CPU ranks at tiny sizes
  local name="$1"
  shift
  cpu_bench "benchmark plumbing on 2 CPU ranks (JSON, summary lines)" "$name" 180 --backend gloo --nproc 2 "$@" \
    --rounds 1 -w 1 -n 2
}
sim_cpp() {  # the C++ simulated-device checks
  if [[ "${GPU_CHECK_CPP:-1}" == "0" ]]; then
    note "SKIP  C++ simulated-device checks (GPU_CHECK_CPP=0)"
    return 0
  elif ! command -v cmake >/dev/null 2>&1; then
    note "SKIP  C++ simulated-device checks (cmake not found)"
    return 0
  fi
  local build="$ROOT/build-gpucheck" gen=() targets=(test_cuda_driver_sim)
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  step "configure the C++ checks (cmake, RR_CUDA=OFF)" 300 \
    cmake -S "$ROOT" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DRR_CUDA=OFF \
    -DPython3_EXECUTABLE="$("$PYTHON" -c 'import sys; print(sys.executable)')"
  if grep -q test_cuda_ring_fake "$build/CTestTestfile.cmake" 2>/dev/null; then
    targets+=(test_cuda_ring_fake test_nccl_compat_fake)
  else
    note "SKIP  test_cuda_ring_fake, test_nccl_compat_fake (cuda_runtime_api.h or nccl.h not found by cmake)"
  fi
  step "build ${targets[*]}" 900 cmake --build "$build" -j "${MAX_JOBS:-2}" --target "${targets[@]}"
  step "simulated streams + fake CUDA runtime (ctest)" 300 \
    ctest --test-dir "$build" --output-on-failure -R "$(IFS='|'; echo "${targets[*]}")"
}
# ---- cpu: no GPU needed --------------------------------------------------------------------------
if [[ "$PART" == cpu ]]; then
  {
    lscpu 2>&1 | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3|Flags)" || true
    echo "torch: $TORCH_VERSION"
  } > "$RESULTS/machine.txt"
  if [[ "$KEEP" == 0 ]]; then  # fewer cores than ranks (CI): a rehearsal; the build takes minutes, the sweeps tiny
    BUDGET=$(( BUDGET > 1800 ? BUDGET : 1800 )) LIMIT_BUILD=900 LIMIT_CPU=300
    CPU_SWEEP=(--backend gloo --nproc "$CPU_RANKS" -d float,bfloat16,float16 -b 1K -e 4K -f 4 --rounds 1 -w 1 -n 2)
  fi
  build 0 || finish "gpu_check cpu: could not build ringreduce (see $LOG)"
  [[ "$KEEP" == 0 ]] && note "INFO  $CORES cores, fewer than the $CPU_RANKS ranks: the sweeps at tiny sizes, unpinned (a rehearsal)"
  for op in avg sum; do
    cpu_bench "ringreduce.bench on CPU ranks" "cpu_${CPU_RANKS}r_$op" "$LIMIT_CPU" "${CPU_SWEEP[@]}" -o "$op"
  done
  if [[ "$KEEP" == 0 ]]; then
    finish "gpu_check cpu: $CORES cores, fewer than $CPU_RANKS: ran the rehearsal only ($([[ $FAILED == 0 ]] && echo passed || echo FAILED)); no figure"
  fi
  finish "gpu_check cpu: $CPU_RANKS CPU ranks pinned on $CORES cores; $([[ $FAILED == 0 ]] && echo 'every sweep ran, 0 wrong elements' || echo 'SOME SWEEPS FAILED') (results in $RESULTS)"
fi

if [[ "$NGPU" == "0" ]]; then
  # The rehearsal runs on small CPU machines (CI): a CPU build there takes minutes, not the GPU's limits.
  BUDGET=$(( BUDGET > 1800 ? BUDGET : 1800 )) LIMIT_BUILD=900
  build 0 || finish "gpu_check: no CUDA GPU was found; could not build ringreduce (see $LOG); nothing ran on a GPU"
  if [[ "$PART" == speed || "$PART" == all ]]; then
    sim_pytest "simulated device: kernel body + ring driver" tests/test_cuda_logic.py tests/tools/test_setup_archs.py
    sim_bench bench -b 8 -e 1K -f 8
    sim_bench bench_half -d float,bfloat16,float16 --algorithms ring,direct -b 1K -e 4K -f 4
  fi
  if [[ "$PART" == suite || "$PART" == all ]]; then
    sim_pytest "simulated device: communicator registry + GPU harness on CPU ranks" tests/test_cuda_registry.py \
      tests/tools/test_gpu_harness.py
  fi
  [[ "$PART" == more ]] && sim_cpp
  finish "gpu_check: no CUDA GPU was found; ran the simulated-device rehearsal of '$PART' only ($([[ $FAILED == 0 ]] && echo passed || echo FAILED)); nothing ran on a GPU"
fi

# ---- a GPU: build, machine -------------------------------------------------------------------
# Kernels for the GPUs at hand only (setup.py's default too, said here for the log).
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST="$GPU_ARCHS"
  [[ -n "$TORCH_CUDA_ARCH_LIST" ]] && export TORCH_CUDA_ARCH_LIST &&
    say "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST (the visible GPUs; set it to build others)"
fi
build 1 || finish "gpu_check: could not build ringreduce with CUDA (see $LOG)"
{
  nvidia-smi -L 2>&1 || true
  nvidia-smi topo -m 2>&1 || true
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,pcie.link.gen.current,clocks.max.sm \
    --format=csv 2>&1 || true
  "$PYTHON" -c 'import json, torch, ringreduce
print("build_info:", json.dumps(ringreduce.build_info()))
print("torch:", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>&1
} > "$RESULTS/machine.txt"
tee -a "${LOGS[@]}" < "$RESULTS/machine.txt"
publish

bench() {  # bench NAME NPROC LIMIT SWEEP...: ringreduce vs NCCL (default, NCCL_ALGO=RING unless the
  # sweep says --no-nccl-ring) and the loopback (unless --no-loopback), into NAME.json, .png, _summary.txt
  local name="$1" nproc="$2" limit="$3" plot=(--plot "$RESULTS/$1.png")
  shift 3
  if ! "$PYTHON" -c "import matplotlib" >/dev/null 2>&1; then  # the bench refuses --plot without it
    plot=()
    note "INFO  bench without its PNG: $PYTHON has no matplotlib (the JSON has every figure)"
  fi
  # shellcheck disable=SC2086
  step "ringreduce.bench vs NCCL, $nproc ranks, $*" "$limit" \
    "$PYTHON" -m ringreduce.bench --backend nccl --nproc "$nproc" "$@" --json "$RESULTS/$name.json" \
    "${plot[@]}" ${BENCH_ARGS:-}
  if [[ -f "$RESULTS/$name.json" ]]; then
    "$PYTHON" scripts/gpu_bench_summary.py "$RESULTS/$name.json" > "$RESULTS/${name}_summary.txt" 2>&1 ||
      FAILED=1
    while IFS= read -r line; do note "      $line"; done < "$RESULTS/${name}_summary.txt"
  fi
}
suite() {  # suite N LIMIT: the multi-rank GPU suite at N ranks
  local n="$1" how
  if (( n <= NGPU )); then how="one GPU per rank"; else how="sharing $NGPU GPU(s) over NCCL's socket transport on lo"; fi
  step "multi-rank GPU suite, $n ranks ($how)" "$2" \
    env RINGREDUCE_GPU_WORLD="$n" "$PYTHON" -m pytest -v -p no:cacheprovider -m gpu tests \
    --ignore=tests/gpu/test_gpu_loopback.py --durations=15 --junitxml="$RESULTS/gpu_suite_$n.xml"
}

# ---- the parts (pytest -v names each test as it ends and --durations lists the slowest, so a step
# stopped at its limit still says where the time went) ---------------------------------------------
NPROC=$(( NGPU >= 2 ? NGPU : 2 ))
if [[ "$PART" == speed || "$PART" == all ]]; then
  step "reduce kernel vs torch; float32/bf16/fp16 kernels vs D2D copy bandwidth" "$LIMIT_KERNELS" \
    bash -c "set -o pipefail; '$PYTHON' scripts/gpu_kernels.py --json '$RESULTS/kernels.json' | tee '$RESULTS/kernels.txt'"
  [[ -f "$RESULTS/kernels.txt" ]] && while IFS= read -r line; do note "      $line"; done < "$RESULTS/kernels.txt"
  bench "bench_${NPROC}r" "$NPROC" "$LIMIT_BENCH" "${BENCH_SWEEP[@]}"
  bench "bench_half_${NPROC}r" "$NPROC" "$LIMIT_HALF" "${HALF_SWEEP[@]}"
fi
if [[ "$PART" == suite || "$PART" == all ]]; then
  suite 2 "$LIMIT_SUITE"
fi
if [[ "$PART" == more ]]; then
  step "loopback suite on one GPU (n = 2..8, halves, sub-rings, hierarchical)" "$LIMIT_LOOPBACK" \
    "$PYTHON" -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_loopback.py --durations=5 \
    --junitxml="$RESULTS/loopback.xml"
  suite 3 "$LIMIT_SUITE3"
  bench bench_3r 3 "$LIMIT_BENCH3" -b 1M -e 256M -f 4 --rounds 3 --warmup 2 --seconds 0.5 --min-iters 2
fi

finish "gpu_check $PART: $NGPU CUDA GPU(s); $([[ $FAILED == 0 ]] && echo 'every check passed' || echo 'SOME CHECKS FAILED') (results in $RESULTS)"
