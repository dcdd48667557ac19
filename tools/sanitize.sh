#!/usr/bin/env bash
# Builds the torch-free core and its C++ tests under AddressSanitizer with UndefinedBehaviorSanitizer
# (one build, build-asan-ubsan) and under ThreadSanitizer (build-tsan: the multi-threaded tests only,
# tsan_tests below) in the repo root, and runs ctest in each. ASan and UBSan alone are still available
# (build-asan, build-ubsan).
# Prints the time of each stage; exits non-zero if any configure, build or test failed. nvcc is not
# used (RR_CUDA=OFF): the host-side GPU driver test still runs under each sanitizer.
#
#   tools/sanitize.sh                 # address+undefined, then thread (what CI runs)
#   tools/sanitize.sh thread          # only some: address+undefined | address | undefined | thread
#   JOBS=2 tools/sanitize.sh
#   SANITIZE_BUILD_ONLY=1 tools/sanitize.sh   # configure and build, run no test (.ci/run builds this way
#                                            # in the background during the Python suite; the run after it
#                                            # finds the builds up to date and only tests)
set -u -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${JOBS:-2}"
if [ "$#" -gt 0 ]; then sanitizers=("$@"); else sanitizers=(address+undefined thread); fi
# ThreadSanitizer only finds races where threads share memory: it builds and runs the tests whose code
# runs several threads (the in-process transport's ranks, the shared-memory ring, the fake CUDA/NCCL
# runtimes' streams). The single-threaded ones (schedule, functors, the plan checker's sweeps, error,
# simulated device, GPU pipeline) run under ASan+UBSan only: under TSan they cost most of the build
# and run time and cannot race.
tsan_tests=(test_inproc_transport test_agreement test_executor test_halves test_recv_only test_shm_ring
            test_cuda_ring_fake test_nccl_compat_fake)

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"

status=0
summary=()
for san in "${sanitizers[@]}"; do
  case "$san" in
    address+undefined) dir="$root/build-asan-ubsan" ;;
    address) dir="$root/build-asan" ;;
    undefined) dir="$root/build-ubsan" ;;
    thread) dir="$root/build-tsan" ;;
    *) echo "unknown sanitizer '$san' (address+undefined, address, undefined, thread)" >&2; exit 2 ;;
  esac
  echo "=== $san: $dir"
  start=$(date +%s)
  result=ok
  # -O1, as the sanitizers' documentation advises: the build is about a third shorter than at -O2 and
  # the instrumented tests run no slower. -g1: line tables, all a report's stack needs (file:line of each
  # frame); full debug information made host_reduce.cpp's compile 82 s instead of 65 s.
  if ! cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DRR_SANITIZE="$san" -DRR_CUDA=OFF >/dev/null; then
    result="configure failed"
  fi
  targets=() select=()
  if [ "$san" = thread ] && [ "$result" = ok ]; then
    for t in "${tsan_tests[@]}"; do
      if ninja -C "$dir" -t query "$t" >/dev/null 2>&1; then targets+=("$t"); fi
    done
    select=(-R "^($(IFS='|'; echo "${targets[*]}"))(\.[0-9]+)?\$")
  fi
  if [ "$result" = ok ] && ! ninja -C "$dir" -j"$jobs" "${targets[@]}"; then
    result="build failed"
  fi
  built=$(date +%s)
  if [ "${SANITIZE_BUILD_ONLY:-0}" = 1 ]; then
    [ "$result" = ok ] && result=built
  elif [ "$result" = ok ] && ! ctest --test-dir "$dir" -j"$jobs" --output-on-failure "${select[@]}"; then
    result="tests failed"
  fi
  end=$(date +%s)
  line="$san: $result (build $((built - start)) s, tests $((end - built)) s, total $((end - start)) s)"
  echo "=== $line"
  summary+=("$line")
  case "$result" in ok|built) ;; *) status=1 ;; esac
done

echo
echo "sanitizer summary:"
for line in "${summary[@]}"; do echo "  $line"; done
exit $status
