// ringreduce core: the element types and reduction operators, as plain enums (the torch layer
// converts at the boundary). The values are part of the agreement frame: append, never renumber.
#pragma once

#include "common.h"

namespace rr {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kInt16 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kUInt8 = 8,
  kBool = 9,
  kComplex64 = 10,
  kComplex128 = 11,
};
constexpr int kNumDTypes = 12;

enum class RedOp : int32_t {
  kSum = 0,
  kAvg = 1,
  kMax = 2,
  kMin = 3,
  kProduct = 4,
};
constexpr int kNumRedOps = 5;

RR_HD_INLINE size_t dtypeSize(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt8: return 1;
    case DType::kInt16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kBool: return 1;
    case DType::kComplex64: return 8;
    case DType::kComplex128: return 16;
  }
  return 0;
}

RR_HD_INLINE bool isHalfType(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }
RR_HD_INLINE bool isComplexType(DType t) {
  return t == DType::kComplex64 || t == DType::kComplex128;
}
RR_HD_INLINE bool isFloatingType(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || isHalfType(t);
}
RR_HD_INLINE bool isIntegralType(DType t) {  // bool included
  return !isFloatingType(t) && !isComplexType(t);
}

const char* dtypeName(DType t);   // "float32", "bfloat16", ...
const char* redOpName(RedOp op);  // "SUM", "AVG", ...

// nullptr when `op` is defined on `t`, else why not (AVG needs a floating or complex type; complex
// has no MAX, MIN or PRODUCT).
const char* unsupportedReason(DType t, RedOp op);

// Throws rr::Error(kType) naming both when the pair is unsupported.
void checkSupported(DType t, RedOp op);

}  // namespace rr
