// ringreduce core: the one runtime -> template dispatch of the reduce, shared by the CUDA launcher
// (csrc/cuda/reduce_kernels.cu), the CPU loops (csrc/cpu/host_reduce.cpp) and the host tests, so all
// instantiate exactly the same (TA, TB, TD, op).
//
// dispatchReduce(dtype, op, a_wide, b_wide, dst_wide, launcher) calls
// launcher.template run<TA, TB, TD, op>() for the storage types of the call; an explicit list
// with a loud default (STYLE rule 4). float32 partials (the wide variants) exist only for the half
// types; AVG only for floating and complex types; complex only for SUM and AVG.
#pragma once

#include "dtype.h"
#include "error.h"
#include "functors.h"
#include "reduce_body.h"

namespace rr {
namespace dispatch_detail {

template <typename T, RedOp op, typename L>
void byWidths(int widths, L& l) {
  switch (static_cast<Widths>(widths)) {
    case Widths::kNarrow: return l.template run<T, T, T, op>();
    case Widths::kToWide: return l.template run<T, T, float, op>();
    case Widths::kWideToWide: return l.template run<T, float, float, op>();
    case Widths::kWideToNarrow: return l.template run<T, float, T, op>();
  }
  RR_THROW(kRuntime, "ringreduce internal error: unexpected operand widths ", widths);
}

template <typename T, typename L>
void halfType(RedOp op, int widths, L& l) {
  switch (op) {
    case RedOp::kSum: return byWidths<T, RedOp::kSum>(widths, l);
    case RedOp::kAvg: return byWidths<T, RedOp::kAvg>(widths, l);
    case RedOp::kMax: return byWidths<T, RedOp::kMax>(widths, l);
    case RedOp::kMin: return byWidths<T, RedOp::kMin>(widths, l);
    case RedOp::kProduct: return byWidths<T, RedOp::kProduct>(widths, l);
  }
  RR_THROW(kType, "ringreduce: unknown op code ", static_cast<int>(op));
}

template <typename T, typename L>
void floating(RedOp op, L& l) {
  switch (op) {
    case RedOp::kSum: return l.template run<T, T, T, RedOp::kSum>();
    case RedOp::kAvg: return l.template run<T, T, T, RedOp::kAvg>();
    case RedOp::kMax: return l.template run<T, T, T, RedOp::kMax>();
    case RedOp::kMin: return l.template run<T, T, T, RedOp::kMin>();
    case RedOp::kProduct: return l.template run<T, T, T, RedOp::kProduct>();
  }
  RR_THROW(kType, "ringreduce: unknown op code ", static_cast<int>(op));
}

template <typename T, typename L>
void integral(RedOp op, L& l) {  // bool included; AVG is refused by checkSupported() first
  switch (op) {
    case RedOp::kSum: return l.template run<T, T, T, RedOp::kSum>();
    case RedOp::kMax: return l.template run<T, T, T, RedOp::kMax>();
    case RedOp::kMin: return l.template run<T, T, T, RedOp::kMin>();
    case RedOp::kProduct: return l.template run<T, T, T, RedOp::kProduct>();
    case RedOp::kAvg: break;
  }
  RR_THROW(kType, "ringreduce: op ", redOpName(op), " is not supported for integer and bool tensors");
}

template <typename T, typename L>
void complexType(RedOp op, L& l) {
  switch (op) {
    case RedOp::kSum: return l.template run<T, T, T, RedOp::kSum>();
    case RedOp::kAvg: return l.template run<T, T, T, RedOp::kAvg>();
    default: break;
  }
  RR_THROW(kType, "ringreduce: op ", redOpName(op), " is not supported for complex tensors");
}

}  // namespace dispatch_detail

template <typename L>
void dispatchReduce(DType dtype, RedOp op, bool a_wide, bool b_wide, bool dst_wide, L& l) {
  using namespace dispatch_detail;
  checkSupported(dtype, op);
  const int widths = widthsOf(a_wide, b_wide, dst_wide);
  RR_CHECK(widths == static_cast<int>(Widths::kNarrow) || (widths > 0 && isHalfType(dtype)), kRuntime,
           "ringreduce internal error: float32 partials requested for ", dtypeName(dtype), " (a=", a_wide,
           " b=", b_wide, " dst=", dst_wide, ")");
  switch (dtype) {
    case DType::kFloat32: return floating<float>(op, l);
    case DType::kFloat64: return floating<double>(op, l);
    case DType::kFloat16: return halfType<Half>(op, widths, l);
    case DType::kBFloat16: return halfType<BFloat16>(op, widths, l);
    case DType::kInt8: return integral<int8_t>(op, l);
    case DType::kInt16: return integral<int16_t>(op, l);
    case DType::kInt32: return integral<int32_t>(op, l);
    case DType::kInt64: return integral<int64_t>(op, l);
    case DType::kUInt8: return integral<uint8_t>(op, l);
    case DType::kBool: return integral<Bool8>(op, l);
    case DType::kComplex64: return complexType<Complex<float>>(op, l);
    case DType::kComplex128: return complexType<Complex<double>>(op, l);
  }
  RR_THROW(kType, "ringreduce: unknown dtype code ", static_cast<int>(dtype));
}

}  // namespace rr
