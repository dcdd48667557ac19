// ringreduce core: the one runtime -> template dispatch of the reduce and the convert, shared by the
// CUDA launcher, the CPU loops and the host tests, so all instantiate the same types.
// dispatchReduce calls launcher.template run<TA, TB, TD, op>() for the operand triples a plan
// produces: all of the tensor's type; half types with float32 b and/or dst (accum_dtype=float32);
// float32 with 16-bit b and 16-bit or float32 dst (wire_dtype; SUM and AVG). dispatchConvert calls
// launcher.template convert<TS, TD>(): a floating or complex type to itself (in-place predivide),
// float32 to and from float16/bfloat16 (a 16-bit wire's first hop, a 16-bit all-gather's widening).
#pragma once

#include <type_traits>

#include "dtype.h"
#include "error.h"
#include "functors.h"
#include "reduce_body.h"

namespace rr {
namespace dispatch_detail {

// Calls f(std::integral_constant<RedOp, op>) when the runtime `op` is one of Ops; false when not.
template <RedOp... Ops, typename F>
bool withOp(RedOp op, F&& f) {
  return ((op == Ops && (f(std::integral_constant<RedOp, Ops>{}), true)) || ...);
}

// Throws for an op outside a dtype's table: `what` names the tensors, nullptr an unknown op code.
[[noreturn]] inline void refuseOp(RedOp op, const char* what) {
  if (what == nullptr) RR_THROW(kType, "ringreduce: unknown op code ", static_cast<int>(op));
  RR_THROW(kType, "ringreduce: op ", redOpName(op), " is not supported ", what);
}

// Every op with operands (T, T, T); `what` as refuseOp's.
template <typename T, RedOp... Ops, typename L>
void sameType(RedOp op, L& l, const char* what) {
  if (!withOp<Ops...>(op, [&](auto o) { l.template run<T, T, T, decltype(o)::value>(); })) refuseOp(op, what);
}

template <typename T, typename L>
void floating(RedOp op, L& l) {
  sameType<T, RedOp::kSum, RedOp::kAvg, RedOp::kMax, RedOp::kMin, RedOp::kProduct>(op, l, nullptr);
}

template <typename T, typename L>
void integral(RedOp op, L& l) {  // bool included; AVG is refused by checkSupported() first
  sameType<T, RedOp::kSum, RedOp::kMax, RedOp::kMin, RedOp::kProduct>(op, l, "for integer and bool tensors");
}

template <typename T, typename L>
void complexType(RedOp op, L& l) {
  sameType<T, RedOp::kSum, RedOp::kAvg>(op, l, "for complex tensors");
}

// Half types with float32 partials: b and/or dst float32 (a is the tensor).
template <typename T, typename L>
void halfType(RedOp op, bool b_wide, bool dst_wide, L& l) {
  const bool known = withOp<RedOp::kSum, RedOp::kAvg, RedOp::kMax, RedOp::kMin, RedOp::kProduct>(op, [&](auto o) {
    constexpr RedOp kOp = decltype(o)::value;
    if (!b_wide && !dst_wide) return l.template run<T, T, T, kOp>();
    if (!b_wide) return l.template run<T, T, float, kOp>();
    if (dst_wide) return l.template run<T, float, float, kOp>();
    return l.template run<T, float, T, kOp>();
  });
  if (!known) refuseOp(op, nullptr);
}

// float32 tensors with 16-bit partials P: b is P, dst P (a hop) or float32 (the final reduce).
template <typename P, typename L>
void sixteenBitWire(RedOp op, bool dst_partial, L& l) {
  const bool known = withOp<RedOp::kSum, RedOp::kAvg>(op, [&](auto o) {
    constexpr RedOp kOp = decltype(o)::value;
    return dst_partial ? l.template run<float, P, P, kOp>() : l.template run<float, P, float, kOp>();
  });
  if (!known) refuseOp(op, "with a 16-bit wire (SUM and AVG are)");
}

}  // namespace dispatch_detail

template <typename L>
void dispatchReduce(RedOp op, DType a_type, DType b_type, DType dst_type, L& l) {
  using namespace dispatch_detail;
  checkSupported(a_type, op);
  const DType t = a_type;  // the local operand is always the tensor itself
  if (b_type == t && dst_type == t) {
    switch (t) {
      case DType::kFloat32: return floating<float>(op, l);
      case DType::kFloat64: return floating<double>(op, l);
      case DType::kFloat16: return halfType<Half>(op, false, false, l);
      case DType::kBFloat16: return halfType<BFloat16>(op, false, false, l);
      case DType::kInt8: return integral<int8_t>(op, l);
      case DType::kInt16: return integral<int16_t>(op, l);
      case DType::kInt32: return integral<int32_t>(op, l);
      case DType::kInt64: return integral<int64_t>(op, l);
      case DType::kUInt8: return integral<uint8_t>(op, l);
      case DType::kBool: return integral<Bool8>(op, l);
      case DType::kComplex64: return complexType<Complex<float>>(op, l);
      case DType::kComplex128: return complexType<Complex<double>>(op, l);
    }
    RR_THROW(kType, "ringreduce: unknown dtype code ", static_cast<int>(t));
  }
  const bool b_ok = b_type == t || b_type == DType::kFloat32;
  const bool dst_ok = dst_type == t || dst_type == DType::kFloat32;
  if (isHalfType(t) && b_ok && dst_ok) {
    const bool b_wide = b_type == DType::kFloat32;
    const bool dst_wide = dst_type == DType::kFloat32;
    if (t == DType::kFloat16) return halfType<Half>(op, b_wide, dst_wide, l);
    return halfType<BFloat16>(op, b_wide, dst_wide, l);
  }
  if (t == DType::kFloat32 && isHalfType(b_type) && (dst_type == b_type || dst_type == t)) {
    if (b_type == DType::kFloat16) return sixteenBitWire<Half>(op, dst_type == b_type, l);
    return sixteenBitWire<BFloat16>(op, dst_type == b_type, l);
  }
  RR_THROW(kRuntime, "ringreduce internal error: no reduce for operand types (", dtypeName(a_type), ", ",
           dtypeName(b_type), ") -> ", dtypeName(dst_type));
}

template <typename L>
void dispatchConvert(DType from, DType to, L& l) {
  if (from == to) {
    switch (from) {
      case DType::kFloat32: return l.template convert<float, float>();
      case DType::kFloat64: return l.template convert<double, double>();
      case DType::kFloat16: return l.template convert<Half, Half>();
      case DType::kBFloat16: return l.template convert<BFloat16, BFloat16>();
      case DType::kComplex64: return l.template convert<Complex<float>, Complex<float>>();
      case DType::kComplex128: return l.template convert<Complex<double>, Complex<double>>();
      default: break;
    }
  } else if (from == DType::kFloat32 && to == DType::kFloat16) {
    return l.template convert<float, Half>();
  } else if (from == DType::kFloat32 && to == DType::kBFloat16) {
    return l.template convert<float, BFloat16>();
  } else if (from == DType::kFloat16 && to == DType::kFloat32) {  // Note [16-bit all-gather]: widening
    return l.template convert<Half, float>();
  } else if (from == DType::kBFloat16 && to == DType::kFloat32) {
    return l.template convert<BFloat16, float>();
  }
  RR_THROW(kRuntime, "ringreduce internal error: no convert from ", dtypeName(from), " to ", dtypeName(to));
}

}  // namespace rr
