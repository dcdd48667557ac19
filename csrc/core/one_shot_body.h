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
// csrc/cpu/group_runtime.h is the CPU's twin, hostReduceInOrder its loop): element i lies in chunk
// c of the ring's schedule (Note [Chunk ownership], schedule.h: bounds from (n, numel) only), whose
// reduction starts at ring index c and goes on in ring order, so
//     partial = First(in[c][i]);  for k = 1 .. n-1:  partial = ReduceStep(in[(c + k) % n][i], partial)
// with the ring's types, rounding and scaling (Note [Reduction contract], functors.h):
//   * partials between steps are of the plan's partial type P (partialDType, plan.h), rounded to it
//     at every step: the tensor's type; float32 for half types with accum_dtype=float32 on more than
//     two ranks; the 16-bit wire type of a float32 tensor with wire_dtype;
//   * the first partial is what the ring's first hop sends (Note [First hop], plan.h): the element
//     itself, or its ConvertStep - rounded to a 16-bit wire and/or divided by the predivide factor -
//     when the ring converts (half types with float32 partials still send their own type first);
//   * every later contribution enters as the local operand of a ReduceStep, divided by the predivide
//     factor on load; the last step stores the tensor's type with the final reduce's Scaling (AVG's
//     division by n, n / f with a predivide factor, the extra divisor; SUM's post factor), the same
//     Scaling the ring's final reduce uses (Plan::finalScaling).
// So the one-shot gives the ring's bits on every rank, with a 16-bit wire and with any scaling, and
// whether a tensor takes the one-shot never changes a result (tests/test_cuda_logic.py compares both
// on random data). With a 16-bit wire the one-shot still moves the float32 tensors: it reproduces
// the wire's rounding, not its bytes (below the threshold latency, not bandwidth, is the cost).
#pragma once

#include <type_traits>

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
  // The ring's final reduce's Scaling (Plan::finalScaling); its predivide also divides every other
  // contribution on load (the ring's hops, Plan::scaling).
  Scaling scaling;
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

// T: the tensor's storage type; P: the plan's partial type (T, float for half types with float32
// partials, Half/BFloat16 for a float32 tensor with a 16-bit wire).
template <typename T, typename P, RedOp op>
struct OneShotBody {
  // Float32 partials of a half type start narrow: the ring's first hop sends the tensor's elements
  // and the first reduce widens; a 16-bit wire's first hop sends the converted partial.
  static constexpr bool kWidening = IsHalfStorage<T>::value && std::is_same<P, float>::value;
  using First = typename std::conditional<kWidening, T, P>::type;

  // The finished value of element i.
  RR_HD_INLINE static T element(const OneShotArgs& a, int64_t i) {
    const int n = a.n;
    int c = a.chunk > 0 ? static_cast<int>(i / a.chunk) : 0;
    if (c >= n) c = n - 1;
    const T x0 = static_cast<const T*>(a.in[c])[i];
    if (n == 1) return x0;
    // Note [First hop]: the ring converts when the partial type differs or a predivide factor is set.
    First first;
    if constexpr (std::is_same<First, T>::value) {
      first = a.scaling.predivide > 0 ? ConvertStep<T, T>::apply(x0, a.scaling.predivide) : x0;
    } else {
      first = ConvertStep<T, First>::apply(x0, a.scaling.predivide);
    }
    const T x1 = static_cast<const T*>(a.in[(c + 1) % n])[i];
    if (n == 2) return ReduceStep<T, First, T, op>::apply(x1, first, a.scaling);
    Scaling hop;  // the hops between: only the predivide of the local operand
    hop.predivide = a.scaling.predivide;
    P partial = ReduceStep<T, First, P, op>::apply(x1, first, hop);
    for (int k = 2; k < n - 1; ++k) {
      const T xk = static_cast<const T*>(a.in[(c + k) % n])[i];
      partial = ReduceStep<T, P, P, op>::apply(xk, partial, hop);
    }
    const T xl = static_cast<const T*>(a.in[(c + n - 1) % n])[i];
    return ReduceStep<T, P, T, op>::apply(xl, partial, a.scaling);
  }

  // The elements of [0, count) that belong to `thread` of `nthreads` (grid-stride).
  RR_HD_INLINE static void run(const OneShotArgs& a, int64_t thread, int64_t nthreads) {
    T* dst = static_cast<T*>(a.dst);
    for (int64_t i = thread; i < a.count; i += nthreads) dst[i] = element(a, i);
  }
};

}  // namespace rr
