// ringreduce core: element types and reduction functors shared by the CPU loops and CUDA kernels.
//
// Note [Reduction contract]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// * Storage types are plain structs (Half, BFloat16, Bool8, Complex<T>), so this header needs
//   neither torch nor cuda_fp16.h. Each has an accumulation type Acc: float for float32 and the half
//   types (float32 inside a hop), double for float64, integers themselves (computed in the unsigned
//   type of the same width, so overflow wraps like torch's, never UB), bool a 0/1 byte (SUM/MAX =
//   or, MIN/PRODUCT = and, as torch's NCCL backend maps them), complex (re, im) pairs.
// * One step computes dst = store(combine(load(a), load(b))) in dst's accumulation type: a is the
//   local operand (the tensor's element), b the partial from the previous rank. Which rank's value
//   enters at which hop depends on (world size, numel) alone: same bits for every segment size.
// * Partials travel in the plan's partial type (plan.h): the tensor's own by default (half types
//   round at every hop, as NCCL does); float32 with accum_dtype=float32 (only the final store
//   rounds); or 16 bits for a float32 tensor with wire_dtype, each hop adding in float32 and
//   rounding once as it stores. ConvertStep makes the first hop's partial. With a 16-bit all-gather
//   (Note [16-bit all-gather] in plan.h) the final reduce rounds its scaled float32 result once
//   through the wire type (Scaling::wire_round, roundThroughWire): the owner keeps the bits it sends.
// * Scaling: with a predivide factor f the local operand enters every step as a / f, rounded to a's
//   type (what t.div_(f) before the call gives), as does the first hop's convert. The final reduce
//   scales the finished sum once: AVG divides by n (`sum / n`, correctly rounded, as `t.div_(n)`),
//   or by n / f with a predivide factor; SUM with a predivide factor multiplies by f. An extra
//   divisor d (accumulation steps) makes it n d (or n d / f) for AVG, d (or d / f) for SUM. In
//   float32 for half types and float32, float64 for float64 and complex128 (per component). With
//   `round_sum` the sum is first rounded to dst's type, so AVG == all_reduce(SUM) then div_(n) bit
//   for bit. Never a pre-multiplication by 1/n (NCCL's bf16 AVG is biased by it).
// * MAX/MIN propagate NaN (like torch.maximum/minimum). Predivide factors, extra divisors and
//   16-bit partials apply to SUM and AVG only (the bindings refuse the rest before any data moves).
#pragma once

#include <type_traits>

#include "common.h"
#include "dtype.h"

namespace rr {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
struct Bool8 {
  uint8_t bits;
};
template <typename T>
struct Complex {
  T re;
  T im;
};

// Half-type conversions (round to nearest even; NaN stays NaN; overflow goes to infinity).
RR_HD_INLINE float halfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bitCast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bitCast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

RR_HD_INLINE uint16_t floatToHalfBits(float value) {
  uint32_t bits = bitCast<uint32_t>(value);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint16_t out;
  if (bits >= 0x47800000u) {  // >= 65536 (or inf/nan): inf, or a quiet NaN
    out = bits > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (bits < 0x38800000u) {  // below 2^-14: the result is subnormal or zero
    // Adding 0.5 shifts the value so that float's own round-to-nearest-even rounds at 2^-24.
    const float shifted = bitCast<float>(bits) + 0.5f;
    out = static_cast<uint16_t>(bitCast<uint32_t>(shifted) - 0x3f000000u);
  } else {
    const uint32_t odd = (bits >> 13) & 1u;
    bits += 0xc8000fffu;  // rebias the exponent (-112 << 23) and add half an ulp minus one
    bits += odd;          // ties to even
    out = static_cast<uint16_t>(bits >> 13);
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

RR_HD_INLINE float bf16BitsToFloat(uint16_t b) { return bitCast<float>(static_cast<uint32_t>(b) << 16); }

RR_HD_INLINE uint16_t floatToBf16Bits(float value) {
  uint32_t bits = bitCast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // canonical quiet NaN, as torch
  bits += 0x7fffu + ((bits >> 16) & 1u);                   // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

// Accumulation type of each storage type, and the conversions in and out of it.
template <typename T>
struct AccOf {
  using type = std::conditional_t<std::is_same<T, Half>::value || std::is_same<T, BFloat16>::value, float,
                                  std::conditional_t<std::is_same<T, Bool8>::value, uint8_t, T>>;
};

template <typename Acc, typename T>
struct Convert {
  RR_HD_INLINE static Acc load(const T& v) { return static_cast<Acc>(v); }
  RR_HD_INLINE static T store(const Acc& v) { return static_cast<T>(v); }
};
template <>
struct Convert<float, Half> {
  RR_HD_INLINE static float load(const Half& v) { return halfBitsToFloat(v.bits); }
  RR_HD_INLINE static Half store(const float& v) { return Half{floatToHalfBits(v)}; }
};
template <>
struct Convert<float, BFloat16> {
  RR_HD_INLINE static float load(const BFloat16& v) { return bf16BitsToFloat(v.bits); }
  RR_HD_INLINE static BFloat16 store(const float& v) { return BFloat16{floatToBf16Bits(v)}; }
};
template <>
struct Convert<uint8_t, Bool8> {
  RR_HD_INLINE static uint8_t load(const Bool8& v) { return v.bits != 0; }
  RR_HD_INLINE static Bool8 store(const uint8_t& v) { return Bool8{static_cast<uint8_t>(v != 0)}; }
};
template <typename R>
struct Convert<Complex<R>, Complex<R>> {
  RR_HD_INLINE static Complex<R> load(const Complex<R>& v) { return v; }
  RR_HD_INLINE static Complex<R> store(const Complex<R>& v) { return v; }
};

// Unsigned arithmetic for wrapping integer SUM/PRODUCT (signed overflow is undefined in C++).
// 8/16-bit values are widened to uint32_t first: uint16_t*uint16_t would promote to signed int.
template <typename T>
struct WrapOf {
  using type = std::conditional_t<std::is_same<T, int64_t>::value, uint64_t, uint32_t>;
};

template <typename T>
RR_HD_INLINE T wrapAdd(T a, T b) {
  using U = typename WrapOf<T>::type;
  return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
}
template <typename T>
RR_HD_INLINE T wrapMul(T a, T b) {
  using U = typename WrapOf<T>::type;
  return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
}

// combine(a, b) for each accumulation type and op.
template <RedOp op>
struct Combine;

template <>
struct Combine<RedOp::kSum> {
  RR_HD_INLINE static float apply(float a, float b) { return a + b; }
  RR_HD_INLINE static double apply(double a, double b) { return a + b; }
  template <typename T>  // integers
  RR_HD_INLINE static T apply(T a, T b) {
    return wrapAdd(a, b);
  }
  template <typename R>
  RR_HD_INLINE static Complex<R> apply(Complex<R> a, Complex<R> b) {
    return Complex<R>{a.re + b.re, a.im + b.im};
  }
};
// AVG combines like SUM; the division happens once, in the final reduce (scaleFinal).
template <>
struct Combine<RedOp::kAvg> : Combine<RedOp::kSum> {};

template <>
struct Combine<RedOp::kMax> {
  template <typename T>
  RR_HD_INLINE static T apply(T a, T b) {
    return (a != a || a > b) ? a : b;  // NaN in a wins; NaN in b: a > b is false, so b wins
  }
};
template <>
struct Combine<RedOp::kMin> {
  template <typename T>
  RR_HD_INLINE static T apply(T a, T b) {
    return (a != a || a < b) ? a : b;
  }
};
template <>
struct Combine<RedOp::kProduct> {
  RR_HD_INLINE static float apply(float a, float b) { return a * b; }
  RR_HD_INLINE static double apply(double a, double b) { return a * b; }
  template <typename T>  // integers
  RR_HD_INLINE static T apply(T a, T b) {
    return wrapMul(a, b);
  }
};

// bool: SUM/MAX/AVG-never (AVG is refused for bool) = or; MIN/PRODUCT = and.
template <RedOp op>
RR_HD_INLINE uint8_t combineBool(uint8_t a, uint8_t b) {
  return (op == RedOp::kMin || op == RedOp::kProduct) ? static_cast<uint8_t>(a & b)
                                                      : static_cast<uint8_t>(a | b);
}

// Scaling by a real factor in the accumulation precision. Integers are never scaled: AVG, predivide
// factors and extra divisors are refused for them before any data moves.
template <typename T>
struct RealOf {
  using type = T;
};
template <typename R>
struct RealOf<Complex<R>> {
  using type = R;
};

// s / d and s * m, per component for complex; integral types pass unchanged.
template <typename T, typename R>
RR_HD_INLINE T divideBy(T s, R d) {
  if constexpr (std::is_floating_point<T>::value) return s / d;
  else if constexpr (std::is_same<T, Complex<R>>::value) return T{s.re / d, s.im / d};
  else return s;
}
template <typename T, typename R>
RR_HD_INLINE T multiplyBy(T s, R m) {
  if constexpr (std::is_floating_point<T>::value) return s * m;
  else if constexpr (std::is_same<T, Complex<R>>::value) return T{s.re * m, s.im * m};
  else return s;
}

// What one reduction step does besides combining its operands (Note [Reduction contract]). A plain
// struct, passed by value to kernels.
struct Scaling {
  double predivide = 0;    // > 0: the local operand enters as a / predivide, rounded to a's type
  int32_t divisor = 0;     // > 0 (final reduce): the sum is divided by divisor, or divisor / postscale
  double postscale = 0;    // > 0 (final reduce): see divisor; without a divisor the sum is multiplied by it
  bool round_sum = false;  // final reduce: round the sum to dst's type before scaling it
  // Final reduce of a float32 element: -1, or the 16-bit DType its scaled result is rounded through
  // (Note [16-bit all-gather]); applied by the CPU host loop outside ReduceStep, so the other loops
  // keep no per-element branch.
  int32_t wire_round = -1;
};

// The Scaling of an element's final reduce: AVG divides by `ring_divisor` (the ring's size, or the
// group's for the hierarchical all-reduce) times `extra_divisor`, SUM by `extra_divisor` when above
// 1; `postscale`: the predivide factor (0: none). Other ops: none.
RR_HD_INLINE Scaling finalScaling(RedOp op, int32_t ring_divisor, int32_t extra_divisor, double postscale,
                                  double predivide, bool round_sum) {
  Scaling s;
  s.predivide = predivide;
  s.round_sum = round_sum;
  if (op == RedOp::kAvg) {
    s.divisor = ring_divisor * (extra_divisor > 1 ? extra_divisor : 1);
    s.postscale = postscale;
  } else if (op == RedOp::kSum) {
    s.divisor = extra_divisor > 1 ? extra_divisor : 0;
    s.postscale = postscale;
  }
  return s;
}

// Rounds an accumulation-type value to T's precision (and back).
template <typename Acc, typename T>
RR_HD_INLINE Acc roundTo(const Acc& v) {
  return Convert<Acc, T>::load(Convert<Acc, T>::store(v));
}

// The final scaling of a finished sum s (Acc), stored as TD.
template <typename TD, typename Acc>
RR_HD_INLINE Acc scaleFinal(Acc s, const Scaling& sc) {
  using Real = typename RealOf<Acc>::type;
  // Integers are never scaled (divideBy and multiplyBy pass them unchanged): no factor is computed
  // in an integer type, where a postscale below 1 would make a division by zero.
  if constexpr (!std::is_floating_point<Real>::value) return s;
  if (sc.divisor <= 0 && sc.postscale <= 0) return s;
  if (sc.round_sum) s = roundTo<Acc, TD>(s);
  if (sc.divisor > 0) {
    const Real d = sc.postscale > 0 ? static_cast<Real>(sc.divisor) / static_cast<Real>(sc.postscale)
                                    : static_cast<Real>(sc.divisor);
    return divideBy(s, d);
  }
  return multiplyBy(s, static_cast<Real>(sc.postscale));
}

// A finished float32 value rounded once to the 16-bit wire type `wire` (a DType code; -1: none) and
// widened back (Note [16-bit all-gather] in plan.h); values of other types pass unchanged.
template <typename Acc>
RR_HD_INLINE Acc roundThroughWire(Acc v, int32_t wire) {
  if constexpr (std::is_same<Acc, float>::value) {
    if (wire == static_cast<int32_t>(DType::kBFloat16)) return roundTo<float, BFloat16>(v);
    if (wire == static_cast<int32_t>(DType::kFloat16)) return roundTo<float, Half>(v);
  }
  return v;
}

// One reduction step on one element. TA: local operand (the tensor's type), TB: received partial,
// TD: destination. Mixed types occur only with a partial type other than the tensor's (TB/TD the
// partial type: float32 for half tensors, float16/bfloat16 for float32 tensors).
template <typename TA, typename TB, typename TD, RedOp op>
struct ReduceStep {
  using Acc = typename AccOf<TD>::type;
  using Real = typename RealOf<Acc>::type;

  RR_HD_INLINE static TD apply(const TA& a, const TB& b, const Scaling& sc) {
    Acc x = Convert<Acc, TA>::load(a);
    if (sc.predivide > 0) x = roundTo<Acc, TA>(divideBy(x, static_cast<Real>(sc.predivide)));
    const Acc y = Convert<Acc, TB>::load(b);
    return Convert<Acc, TD>::store(scaleFinal<TD>(Combine<op>::apply(x, y), sc));
  }
};

template <RedOp op>
struct ReduceStep<Bool8, Bool8, Bool8, op> {
  RR_HD_INLINE static Bool8 apply(const Bool8& a, const Bool8& b, const Scaling&) {
    return Bool8{combineBool<op>(a.bits != 0, b.bits != 0)};
  }
};

// The first hop's partial made from the local value: dst = store(a), divided by the predivide
// factor first (rounded to TS, as in ReduceStep), in TS's accumulation type. TS is the tensor's
// type; TD the partial type (the same type for an in-place predivide).
template <typename TS, typename TD>
struct ConvertStep {
  using Acc = typename AccOf<TS>::type;
  using Real = typename RealOf<Acc>::type;

  RR_HD_INLINE static TD apply(const TS& a, double predivide) {
    Acc x = Convert<Acc, TS>::load(a);
    if (predivide > 0) x = roundTo<Acc, TS>(divideBy(x, static_cast<Real>(predivide)));
    return Convert<Acc, TD>::store(x);
  }
};

}  // namespace rr
