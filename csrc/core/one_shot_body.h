// ringreduce core: the element of a one-shot all-reduce, written once for the GPU kernel
// (csrc/cuda/one_shot_kernels.cu) and the host tests.
//
// Note [GPU one-shot all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Below gpuOneShotBytes (csrc/cuda/gpu_pipeline.h) a flat GPU all-reduce is one NCCL group (every
// rank sends its whole tensor to every other) and one kernel that reduces the n tensors: one
// exchange instead of the ring's 2(n-1) dependent launches, at (n - 1) x the bytes per rank.
// The kernel combines them exactly as the ring would (the CPU's twin: Note [One-shot all-reduce] in
// csrc/cpu/group_runtime.h): element i lies in chunk c of the ring's schedule (Note [Chunk
// ownership]), whose reduction starts at ring index c and goes on in ring order,
//     partial = First(in[c][i]);  for k = 1 .. n-1:  partial = ReduceStep(in[(c + k) % n][i], partial)
// with the ring's partial type P (partialDType) rounded at every step, the first hop's convert
// (Note [First hop]; half types with float32 partials send their own type first), the predivide
// on every later operand, and Plan::finalScaling at the last step. So it gives the ring's bits on
// every rank (tests/test_cuda_logic.py compares both). With a 16-bit wire it still moves float32:
// it reproduces the wire's rounding, not its bytes (latency, not bandwidth, is the cost here).
// With chunk 0 every element starts at ring index 0: the rank order of the direct all-reduce (Note
// [Direct all-reduce] in direct.h), whose rounds reduce their pieces with this body too, inputs of
// T (a wire's 16-bit pieces) and results of D (the float32 tensor).
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
  int64_t chunk;    // elements per chunk (RingSchedule::chunk); 0: every element in rank order
  Scaling scaling;  // Plan::finalScaling; its predivide also divides every other contribution
};

// T: the inputs' storage type (the tensor's, or a direct all-reduce's 16-bit wire); P: the partial
// type (T, float for half types with float32 partials, Half/BFloat16 for a float32 tensor with the
// ring's 16-bit wire); D: the result's type (T, or float for a direct wire's pieces).
template <typename T, typename P, RedOp op, typename D = T>
struct OneShotBody {
  // Float32 partials of a half type start narrow: the ring's first hop sends the tensor's elements
  // and the first reduce widens; a 16-bit wire's first hop sends the converted partial.
  static constexpr bool kWidening =
      (std::is_same<T, Half>::value || std::is_same<T, BFloat16>::value) && std::is_same<P, float>::value;
  using First = typename std::conditional<kWidening, T, P>::type;

  // The finished value of element i.
  RR_HD_INLINE static D element(const OneShotArgs& a, int64_t i) {
    const int n = a.n;
    int c = a.chunk > 0 ? static_cast<int>(i / a.chunk) : 0;
    if (c >= n) c = n - 1;
    const T x0 = static_cast<const T*>(a.in[c])[i];
    if (n == 1) return ConvertStep<T, D>::apply(x0, 0);
    // Note [First hop]: the ring converts when the partial type differs or a predivide factor is set.
    First first;
    if constexpr (std::is_same<First, T>::value) {
      first = a.scaling.predivide > 0 ? ConvertStep<T, T>::apply(x0, a.scaling.predivide) : x0;
    } else {
      first = ConvertStep<T, First>::apply(x0, a.scaling.predivide);
    }
    const T x1 = static_cast<const T*>(a.in[(c + 1) % n])[i];
    if (n == 2) return ReduceStep<T, First, D, op>::apply(x1, first, a.scaling);
    Scaling hop;  // the hops between: only the predivide of the local operand
    hop.predivide = a.scaling.predivide;
    P partial = ReduceStep<T, First, P, op>::apply(x1, first, hop);
    for (int k = 2; k < n - 1; ++k) {
      const T xk = static_cast<const T*>(a.in[(c + k) % n])[i];
      partial = ReduceStep<T, P, P, op>::apply(xk, partial, hop);
    }
    const T xl = static_cast<const T*>(a.in[(c + n - 1) % n])[i];
    return ReduceStep<T, P, D, op>::apply(xl, partial, a.scaling);
  }

  // The elements of [0, count) that belong to `thread` of `nthreads` (grid-stride).
  RR_HD_INLINE static void run(const OneShotArgs& a, int64_t thread, int64_t nthreads) {
    D* dst = static_cast<D*>(a.dst);
    for (int64_t i = thread; i < a.count; i += nthreads) dst[i] = element(a, i);
  }
};

}  // namespace rr
