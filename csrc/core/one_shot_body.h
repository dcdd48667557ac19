// ringreduce core: the element of a one-shot all-reduce, written once for the GPU kernel
// (csrc/cuda/one_shot_kernels.cu) and the host tests.
//
// Note [GPU one-shot all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Below a threshold (gpuOneShotBytes, csrc/cuda/gpu_pipeline.h) a flat GPU all-reduce is one NCCL
// group - every rank sends its whole tensor to every other rank and receives theirs into the
// staging - followed by one kernel that reduces the n tensors. One exchange instead of the ring's
// 2(n-1): what costs on NCCL's socket transport (milliseconds per dependent launch) and on NVLink
// (microseconds per launch) alike for small tensors, at (n - 1) x the bytes per rank.
//
// The kernel combines the n tensors exactly as the ring would (Note [One-shot all-reduce] in
// csrc/cpu/group_runtime.h is the CPU's twin): element i lies in chunk c of the ring's schedule
// (Note [Chunk ownership], schedule.h: bounds from (n, numel) only), whose reduction starts at
// ring index c and goes on in ring order, so
//     partial = in[c][i];  for k = 1 .. n-1:  partial = ReduceStep(in[(c + k) % n][i], partial)
// with the ring's widths and rounding: the partial is rounded to the tensor's type at every step,
// unless the ring would carry float32 partials (half types, accum_dtype=float32 and n > 2; on two
// ranks the ring has a single step, which already accumulates in float32); AVG divides once, at
// the last step, after rounding the sum to the tensor's type unless the partials were float32 (the
// ring's round_sum). So the one-shot gives the ring's bits on every rank, and whether a tensor takes
// the one-shot never changes a result (tests/test_cuda_logic.py compares both on random data).
#pragma once

#include "common.h"
#include "functors.h"

namespace rr {

constexpr int kOneShotMaxRanks = 64;  // rings beyond take the ring path

// What the one-shot kernel needs (passed by value as the kernel's parameter).
struct OneShotArgs {
  const void* in[kOneShotMaxRanks];  // in[c]: ring index c's tensor (this rank's own among them)
  void* dst;                         // may be this rank's own input (elementwise in place)
  int32_t n;
  int64_t count;
  int64_t chunk;    // elements per chunk (RingSchedule::chunk)
  int32_t divisor;  // > 0: AVG's division at the last step
  bool wide;        // float32 partials (half types only)
};

template <typename T>
struct IsHalfStorage {
  static constexpr bool value = false;
};
template <>
struct IsHalfStorage<Half> {
  static constexpr bool value = true;
};
template <>
struct IsHalfStorage<BFloat16> {
  static constexpr bool value = true;
};

template <typename T, RedOp op>
struct OneShotBody {
  // The finished value of element i.
  RR_HD_INLINE static T element(const OneShotArgs& a, int64_t i) {
    const int n = a.n;
    int c = a.chunk > 0 ? static_cast<int>(i / a.chunk) : 0;
    if (c >= n) c = n - 1;
    const T* x0 = static_cast<const T*>(a.in[c]);
    T partial = x0[i];
    if (n == 1) return partial;
    if constexpr (IsHalfStorage<T>::value) {
      if (a.wide && n > 2) {
        // Step 1 widens, the middle steps stay float32, the last one rounds (and divides).
        const T* x1 = static_cast<const T*>(a.in[(c + 1) % n]);
        const Scaling hop;
        Scaling last;
        last.divisor = a.divisor;
        float w = ReduceStep<T, T, float, op>::apply(x1[i], partial, hop);
        for (int k = 2; k < n - 1; ++k) {
          const T* xk = static_cast<const T*>(a.in[(c + k) % n]);
          w = ReduceStep<T, float, float, op>::apply(xk[i], w, hop);
        }
        const T* xl = static_cast<const T*>(a.in[(c + n - 1) % n]);
        return ReduceStep<T, float, T, op>::apply(xl[i], w, last);
      }
    }
    Scaling last;
    last.divisor = a.divisor;
    last.round_sum = true;
    for (int k = 1; k < n; ++k) {
      const T* xk = static_cast<const T*>(a.in[(c + k) % n]);
      partial = ReduceStep<T, T, T, op>::apply(xk[i], partial, k == n - 1 ? last : Scaling());
    }
    return partial;
  }

  // The elements of [0, count) that belong to `thread` of `nthreads` (grid-stride).
  RR_HD_INLINE static void run(const OneShotArgs& a, int64_t thread, int64_t nthreads) {
    T* dst = static_cast<T*>(a.dst);
    for (int64_t i = thread; i < a.count; i += nthreads) dst[i] = element(a, i);
  }
};

}  // namespace rr
