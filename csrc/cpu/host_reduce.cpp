#include "host_reduce.h"

#include "../core/error.h"
#include "../core/functors.h"

namespace rr {

namespace {

template <typename TA, typename TB, typename TD, RedOp op>
void loop(const void* a, const void* b, void* dst, int64_t count, int divisor, bool round_sum) {
  const TA* __restrict__ pa = static_cast<const TA*>(a);
  const TB* __restrict__ pb = static_cast<const TB*>(b);
  TD* pd = static_cast<TD*>(dst);  // may alias pa (in-place reduce)
  if (op == RedOp::kAvg && divisor > 0) {
    for (int64_t i = 0; i < count; ++i)
      pd[i] = ReduceStep<TA, TB, TD, op>::apply(pa[i], pb[i], divisor, round_sum);
  } else {
    for (int64_t i = 0; i < count; ++i) pd[i] = ReduceStep<TA, TB, TD, op>::apply(pa[i], pb[i], 0, false);
  }
}

template <typename T, RedOp op>
void dispatchWidth(const void* a, bool aw, const void* b, bool bw, void* d, bool dw, int64_t count,
                   int divisor, bool round_sum) {
  // Mixed widths exist only for half types; the caller has checked that.
  if (!aw && !bw && !dw) return loop<T, T, T, op>(a, b, d, count, divisor, round_sum);
  if (!aw && !bw && dw) return loop<T, T, float, op>(a, b, d, count, divisor, round_sum);
  if (!aw && bw && dw) return loop<T, float, float, op>(a, b, d, count, divisor, round_sum);
  if (!aw && bw && !dw) return loop<T, float, T, op>(a, b, d, count, divisor, round_sum);
  RR_THROW(kRuntime, "ringreduce internal error: unexpected operand widths a=", aw, " b=", bw, " dst=", dw);
}

template <typename T, RedOp op>
void dispatchNarrow(const void* a, const void* b, void* d, int64_t count, int divisor, bool round_sum) {
  loop<T, T, T, op>(a, b, d, count, divisor, round_sum);
}

template <typename T>
void byOpFloating(RedOp op, const void* a, bool aw, const void* b, bool bw, void* d, bool dw,
                  int64_t count, int divisor, bool round_sum) {
  switch (op) {
    case RedOp::kSum: return dispatchWidth<T, RedOp::kSum>(a, aw, b, bw, d, dw, count, divisor, round_sum);
    case RedOp::kAvg: return dispatchWidth<T, RedOp::kAvg>(a, aw, b, bw, d, dw, count, divisor, round_sum);
    case RedOp::kMax: return dispatchWidth<T, RedOp::kMax>(a, aw, b, bw, d, dw, count, divisor, round_sum);
    case RedOp::kMin: return dispatchWidth<T, RedOp::kMin>(a, aw, b, bw, d, dw, count, divisor, round_sum);
    case RedOp::kProduct:
      return dispatchWidth<T, RedOp::kProduct>(a, aw, b, bw, d, dw, count, divisor, round_sum);
  }
}

template <typename T>
void byOpNarrow(RedOp op, const void* a, const void* b, void* d, int64_t count, int divisor, bool round_sum) {
  switch (op) {
    case RedOp::kSum: return dispatchNarrow<T, RedOp::kSum>(a, b, d, count, divisor, round_sum);
    case RedOp::kAvg: return dispatchNarrow<T, RedOp::kAvg>(a, b, d, count, divisor, round_sum);
    case RedOp::kMax: return dispatchNarrow<T, RedOp::kMax>(a, b, d, count, divisor, round_sum);
    case RedOp::kMin: return dispatchNarrow<T, RedOp::kMin>(a, b, d, count, divisor, round_sum);
    case RedOp::kProduct: return dispatchNarrow<T, RedOp::kProduct>(a, b, d, count, divisor, round_sum);
  }
}

template <typename T>
void byOpComplex(RedOp op, const void* a, const void* b, void* d, int64_t count, int divisor, bool round_sum) {
  switch (op) {
    case RedOp::kSum: return dispatchNarrow<T, RedOp::kSum>(a, b, d, count, divisor, round_sum);
    case RedOp::kAvg: return dispatchNarrow<T, RedOp::kAvg>(a, b, d, count, divisor, round_sum);
    default: break;
  }
  RR_THROW(kRuntime, "ringreduce internal error: complex op reached the reduce loop");
}

}  // namespace

void hostReduce(DType dtype, RedOp op, const void* a, bool a_wide, const void* b, bool b_wide,
                void* dst, bool dst_wide, int64_t count, int divisor, bool round_sum) {
  checkSupported(dtype, op);
  RR_CHECK(!(a_wide || b_wide || dst_wide) || isHalfType(dtype), kRuntime,
           "ringreduce internal error: float32 partials requested for ", dtypeName(dtype));
  if (count <= 0) return;
  switch (dtype) {
    case DType::kFloat32: return byOpNarrow<float>(op, a, b, dst, count, divisor, round_sum);
    case DType::kFloat64: return byOpNarrow<double>(op, a, b, dst, count, divisor, round_sum);
    case DType::kFloat16:
      return byOpFloating<Half>(op, a, a_wide, b, b_wide, dst, dst_wide, count, divisor, round_sum);
    case DType::kBFloat16:
      return byOpFloating<BFloat16>(op, a, a_wide, b, b_wide, dst, dst_wide, count, divisor, round_sum);
    case DType::kInt8: return byOpNarrow<int8_t>(op, a, b, dst, count, divisor, round_sum);
    case DType::kInt16: return byOpNarrow<int16_t>(op, a, b, dst, count, divisor, round_sum);
    case DType::kInt32: return byOpNarrow<int32_t>(op, a, b, dst, count, divisor, round_sum);
    case DType::kInt64: return byOpNarrow<int64_t>(op, a, b, dst, count, divisor, round_sum);
    case DType::kUInt8: return byOpNarrow<uint8_t>(op, a, b, dst, count, divisor, round_sum);
    case DType::kBool: return byOpNarrow<Bool8>(op, a, b, dst, count, divisor, round_sum);
    case DType::kComplex64: return byOpComplex<Complex<float>>(op, a, b, dst, count, divisor, round_sum);
    case DType::kComplex128: return byOpComplex<Complex<double>>(op, a, b, dst, count, divisor, round_sum);
  }
  RR_THROW(kType, "ringreduce: unknown dtype code ", static_cast<int>(dtype));
}

}  // namespace rr
