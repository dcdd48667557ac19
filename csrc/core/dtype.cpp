#include "dtype.h"

#include "error.h"

namespace rr {

const char* dtypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
    case DType::kComplex64: return "complex64";
    case DType::kComplex128: return "complex128";
  }
  return "unknown-dtype";
}

const char* redOpName(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "SUM";
    case RedOp::kAvg: return "AVG";
    case RedOp::kMax: return "MAX";
    case RedOp::kMin: return "MIN";
    case RedOp::kProduct: return "PRODUCT";
  }
  return "unknown-op";
}

const char* unsupportedReason(DType t, RedOp op) {
  if (static_cast<int>(t) < 0 || static_cast<int>(t) >= kNumDTypes) return "unknown dtype";
  if (static_cast<int>(op) < 0 || static_cast<int>(op) >= kNumRedOps) return "unknown op";
  if (op == RedOp::kAvg && isIntegralType(t)) {
    return "AVG needs a floating-point or complex tensor (an integer average would truncate); "
           "use SUM and divide yourself, or convert the tensor to a floating type";
  }
  if (isComplexType(t) && (op == RedOp::kMax || op == RedOp::kMin || op == RedOp::kProduct)) {
    return "complex tensors support only SUM and AVG";
  }
  return nullptr;
}

void checkSupported(DType t, RedOp op) {
  const char* why = unsupportedReason(t, op);
  RR_CHECK(why == nullptr, kType, "ringreduce: op ", redOpName(op), " is not supported for dtype ",
           dtypeName(t), ": ", why);
}

}  // namespace rr
