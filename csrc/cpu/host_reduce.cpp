#include "host_reduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../core/error.h"
#include "../core/functors.h"
#include "../core/reduce_dispatch.h"
#include "half_vector.h"
#include "host_isa.h"

namespace rr {

namespace {

// Note [Host loops]
// ~~~~~~~~~~~~~~~~~
// dst[i] = ReduceStep(a[i], b[i], scaling) and dst[i] = ConvertStep(a[i], predivide) (functors.h,
// Note [Reduction contract]), bit for bit, at memory speed:
// * What a call's Scaling asks for is decided once per call (LoopKind: predivide or not; the final
//   scaling: none, a division, a multiplication; round_sum; the 16-bit all-gather's wire rounding)
//   and each kind has a loop of its own: no loop tests anything per element. The factors are computed
//   once, in the accumulation type, as ReduceStep computes them (AVG's divisor is divisor /
//   postscale, and it divides: never a multiplication by 1 / n), with one exception that changes
//   no bit: a divisor that is a power of two whose reciprocal is a normal number becomes a
//   multiplication by that reciprocal (exactReciprocal). s / 2^k and s * 2^-k are the same real
//   number rounded once, for every s (subnormal results, infinities, NaNs and signed zeros
//   included), and a multiplication costs a fraction of a division: AVG over 2, 4 or 8 ranks.
// * A type that is its own accumulation type (float32, float64, complex, integers; bool) runs one
//   loop over its elements per kind (fusedLoop), which the compiler vectorizes.
// * Where a 16-bit type takes part (and for float32 rounded through a wire type), one loop per kind
//   runs ReduceStep's operations on lanes of float32 (loop16, half_vector.h): widening loads,
//   combine, the scaling, narrowing stores, fused in registers. Where every operand is bfloat16 the
//   vector lanes take 2 x kWidth elements at a time, widened in place (Note [Paired bfloat16 lanes]
//   in half_vector.h), and so does hostReduceInOrder's fused chain over bfloat16 inputs (Note
//   [Fused in-order reduce]).
// * Each loop exists for the portable instruction set and, on x86, for AVX2 + F16C and for AVX-512
//   (host_loops.inc, compiled three times); hostIsa() picks one per call (Note [Host loop
//   instruction sets], host_isa.h).
// * MAX, MIN and PRODUCT are never scaled (the bindings refuse a predivide factor or a wire for
//   them, and finalScaling gives them no divisor): their loops are the unscaled ones, and a Scaling
//   that asks for more anyway, or a wire rounding for anything but a float32 tensor's float32
//   result, runs ReduceStep element by element (stepByStep): the same bits, no loop of its own.
// dst may be a or b (an in-place reduce): every element is read before it is written at its index.
// tests/cpp/test_host_loops.cpp compares every loop with the functors, under both instruction sets.

enum class Final { kNone, kDivide, kMultiply };
enum class Wire { kNone, kBFloat16, kFloat16 };

struct LoopKind {
  bool pre = false;             // the local operand divided by the predivide factor first
  Final final = Final::kNone;   // scaleFinal: divide by the divisor (over postscale), or multiply by postscale
  bool round_sum = false;       // the sum rounded to dst's type before the final scaling
  Wire wire = Wire::kNone;      // a float32 result rounded through the wire type (Note [16-bit all-gather])
};

LoopKind loopKind(const Scaling& sc) {
  LoopKind k;
  k.pre = sc.predivide > 0;
  k.final = sc.divisor > 0 ? Final::kDivide : sc.postscale > 0 ? Final::kMultiply : Final::kNone;
  k.round_sum = sc.round_sum && k.final != Final::kNone;  // scaleFinal returns an unscaled sum as it is
  k.wire = sc.wire_round == static_cast<int32_t>(DType::kBFloat16)  ? Wire::kBFloat16
           : sc.wire_round == static_cast<int32_t>(DType::kFloat16) ? Wire::kFloat16
                                                                    : Wire::kNone;
  return k;
}

// ReduceStep's factors in the accumulation type's real type, computed as it computes them.
template <typename Real>
struct Factors {
  Real pre{};    // the predivide factor
  Real final{};  // the divisor (over postscale), or the multiplier
};

template <typename Real>
Factors<Real> factors(const Scaling& sc) {
  Factors<Real> f;
  f.pre = static_cast<Real>(sc.predivide);
  if (sc.divisor > 0)
    f.final = sc.postscale > 0 ? static_cast<Real>(sc.divisor) / static_cast<Real>(sc.postscale)
                               : static_cast<Real>(sc.divisor);
  else
    f.final = static_cast<Real>(sc.postscale);
  return f;
}

// A final division by a power of two turned into a multiplication by its reciprocal, where that
// reciprocal is a normal number: the same bits for every input (Note [Host loops]).
template <typename Real>
void exactReciprocal(LoopKind& k, Factors<Real>& f) {
  if (k.final != Final::kDivide || !(f.final > Real(0))) return;
  int e = 0;
  if (std::frexp(f.final, &e) != Real(0.5)) return;  // not a power of two
  const Real r = Real(1) / f.final;
  if (!std::isnormal(r) || r * f.final != Real(1)) return;
  k.final = Final::kMultiply;
  f.final = r;
}

template <Final kFinal, typename Acc, typename Real>
RR_CPU_INLINE Acc finish(Acc s, Real f) {
  if constexpr (kFinal == Final::kDivide) return divideBy(s, f);
  else if constexpr (kFinal == Final::kMultiply) return multiplyBy(s, f);
  else return s;
}

// Accumulation types that scaling changes (floating and complex); integers pass unchanged.
template <typename T>
struct IsScaled : std::integral_constant<bool, std::is_floating_point<T>::value> {};
template <typename R>
struct IsScaled<Complex<R>> : std::true_type {};

namespace portable {
using Lane = PortableLane;
#include "host_loops.inc"
}  // namespace portable

#if RR_HOST_AVX2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif
namespace avx2 {
using Lane = Avx2Lane;
#include "host_loops.inc"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,f16c")
#endif
namespace avx512 {
using Lane = Avx512Lane;
#include "host_loops.inc"
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

// dispatchReduce's launcher: the loop of the operand types, for the instruction set of the call.
struct HostLoop {
  const void* a;
  const void* b;
  void* dst;
  int64_t count;
  const Scaling& sc;
  LoopKind kind;
  HostIsa isa;

  template <typename TA, typename TB, typename TD, RedOp op>
  void run() const {
    constexpr RedOp kOp = op == RedOp::kAvg ? RedOp::kSum : op;  // AVG combines as SUM (functors.h)
#if RR_HOST_AVX2
    if (isa == HostIsa::kAvx512) return avx512::reduce<TA, TB, TD, kOp>(a, b, dst, count, kind, sc);
    if (isa == HostIsa::kAvx2) return avx2::reduce<TA, TB, TD, kOp>(a, b, dst, count, kind, sc);
#endif
    portable::reduce<TA, TB, TD, kOp>(a, b, dst, count, kind, sc);
  }
};

struct HostConvert {
  const void* a;
  void* dst;
  int64_t count;
  double predivide;
  HostIsa isa;

  template <typename TS, typename TD>
  void convert() const {
#if RR_HOST_AVX2
    if (isa == HostIsa::kAvx512) return avx512::convert<TS, TD>(a, dst, count, predivide);
    if (isa == HostIsa::kAvx2) return avx2::convert<TS, TD>(a, dst, count, predivide);
#endif
    portable::convert<TS, TD>(a, dst, count, predivide);
  }
};

// Note [Fused in-order reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// hostReduceInOrder of SUM or AVG over n >= 2 inputs of float32, bfloat16 or float16, with float32
// partials and no wire (shared memory's reduce of every rank's copy, the direct exchange's of its
// shard's pieces) runs its chain of ReduceSteps in one pass (reduceChain, host_loops.inc): for each
// lane of elements, input 0 widened (and predivided), then input k combined with the partial as the
// first operand, in rank order, the partial kept in a register, the last step's scaling and
// rounding, one store. Those are the operations of the step-by-step chain (a hostReduce per input
// through float32 partials in scratch), in its order, so the same bits
// (tests/cpp/test_host_loops.cpp compares the two); what goes is the partials' stores and loads:
// 2 (n - 2) float32 accesses per element. Everything else (MIN, MAX, PRODUCT; 16-bit partials; a
// wire; inputs rounded to a wire type first; other types) keeps the chain, one block of
// kReduceInOrderBlock elements at a time.
struct HostChain {
  const void* const* in;
  size_t n;
  void* dst;
  int64_t count;
  const Scaling& sc;
  HostIsa isa;

  template <typename T>
  void run() const {
#if RR_HOST_AVX2
    if (isa == HostIsa::kAvx512) return avx512::reduceChain<T>(in, n, dst, count, sc);
    if (isa == HostIsa::kAvx2) return avx2::reduceChain<T>(in, n, dst, count, sc);
#endif
    portable::reduceChain<T>(in, n, dst, count, sc);
  }
};

// Whether hostReduceInOrder of r has a fused loop (Note [Fused in-order reduce]).
bool fusedChain(const InOrderReduce& r, size_t n) {
  const bool sum = r.op == RedOp::kSum || r.op == RedOp::kAvg;
  const bool floating = r.dtype == DType::kFloat32 || r.dtype == DType::kBFloat16 || r.dtype == DType::kFloat16;
  return n >= 2 && sum && floating && r.partial == DType::kFloat32 && r.round_to == r.dtype && r.dst == r.dtype &&
         r.scaling.wire_round < 0;
}

}  // namespace

void hostReduce(RedOp op, const void* a, DType a_type, const void* b, DType b_type, void* dst, DType dst_type,
                int64_t count, const Scaling& scaling) {
  checkSupported(a_type, op);
  if (count <= 0) return;
  HostLoop loop{a, b, dst, count, scaling, loopKind(scaling), hostIsa()};
  dispatchReduce(op, a_type, b_type, dst_type, loop);
}

void hostConvert(const void* a, DType a_type, void* dst, DType dst_type, int64_t count, double predivide) {
  if (count <= 0) return;
  HostConvert c{a, dst, count, predivide, hostIsa()};
  dispatchConvert(a_type, dst_type, c);
}

void hostReduceInOrder(DType dtype, DType partial, RedOp op, const std::vector<const void*>& inputs, void* dst,
                       int64_t count, const Scaling& scaling, void* scratch) {
  InOrderReduce r;
  r.dtype = r.round_to = r.dst = dtype;
  r.partial = partial;
  r.op = op;
  r.scaling = scaling;
  hostReduceInOrder(r, inputs, dst, count, scratch);
}

void hostReduceInOrder(const InOrderReduce& r, const std::vector<const void*>& inputs, void* dst, int64_t count,
                       void* scratch) {
  const size_t n = inputs.size();
  RR_CHECK(n >= 1, kRuntime, "ringreduce internal error: a reduction of no inputs");
  if (fusedChain(r, n)) {
    if (count <= 0) return;
    HostChain chain{inputs.data(), n, dst, count, r.scaling, hostIsa()};
    switch (r.dtype) {
      case DType::kFloat32: return chain.run<float>();
      case DType::kBFloat16: return chain.run<BFloat16>();
      default: return chain.run<Half>();
    }
  }
  // Inputs rounded to a 16-bit wire first (Note [Direct all-reduce]): the steps read the rounded
  // values, which carry the predivide already.
  const bool rounds = r.round_to != r.dtype;
  const DType in_type = r.round_to;
  const size_t elem = dtypeSize(r.dtype);
  const size_t dst_elem = dtypeSize(r.dst);
  const size_t celem = dtypeSize(in_type);
  const size_t pelem = std::max(celem, dtypeSize(r.partial));
  Scaling last = r.scaling;
  if (rounds) last.predivide = 0;
  // Float32 partials of a half type start narrow (the ring's first hop sends the tensor's elements);
  // a 16-bit wire or a predivide converts the first input (Note [First hop] in plan.h).
  const bool wide = isHalfType(in_type) && r.partial == DType::kFloat32;
  const bool convert_first = rounds || (r.partial != in_type && !wide) || last.predivide > 0;
  Scaling hop;
  hop.predivide = last.predivide;
  char* s[2] = {static_cast<char*>(scratch), static_cast<char*>(scratch) + kReduceInOrderBlock * pelem};
  char* rounded = static_cast<char*>(scratch) + 2 * kReduceInOrderBlock * pelem;  // an input rounded to in_type
  RR_CHECK(!rounds || (2 * pelem + celem) * kReduceInOrderBlock <= kReduceInOrderScratchBytes, kRuntime,
           "ringreduce internal error: in-order scratch too small");
  std::vector<const char*> in(n);
  for (int64_t at = 0; at < count; at += kReduceInOrderBlock) {
    const int64_t m = count - at < kReduceInOrderBlock ? count - at : kReduceInOrderBlock;
    for (size_t k = 0; k < n; ++k) in[k] = static_cast<const char*>(inputs[k]) + static_cast<size_t>(at) * elem;
    char* out_last = static_cast<char*>(dst) + static_cast<size_t>(at) * dst_elem;
    if (n == 1) {
      RR_CHECK(r.scaling.predivide == 0 && r.scaling.divisor <= 1 && r.scaling.postscale == 0 && !rounds &&
                   r.dst == r.dtype,
               kRuntime, "ringreduce internal error: a one-input reduction that scales or converts");
      if (out_last != in[0]) std::memcpy(out_last, in[0], static_cast<size_t>(m) * elem);
      continue;
    }
    // The partial (second operand) must never be what the last step writes: a first input that is
    // dst starts as a copy.
    const void* acc = in[0];
    DType acc_type = in_type;
    if (convert_first) {
      const DType first = rounds || wide ? in_type : r.partial;
      hostConvert(in[0], r.dtype, s[0], first, m, r.scaling.predivide);
      acc = s[0];
      acc_type = first;
    } else if (acc == out_last) {
      std::memcpy(s[0], in[0], static_cast<size_t>(m) * elem);
      acc = s[0];
    }
    for (size_t k = 1; k < n; ++k) {
      const bool is_last = k + 1 == n;
      const void* a = in[k];
      if (rounds) {
        hostConvert(in[k], r.dtype, rounded, in_type, m, r.scaling.predivide);
        a = rounded;
      }
      void* out = is_last ? static_cast<void*>(out_last) : s[k % 2];
      const DType out_type = is_last ? r.dst : r.partial;
      hostReduce(r.op, a, in_type, acc, acc_type, out, out_type, m, is_last ? last : hop);
      acc = out;
      acc_type = out_type;
    }
  }
}

}  // namespace rr
