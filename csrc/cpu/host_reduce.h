// ringreduce CPU: host loops over the shared functors (csrc/core/functors.h).
#pragma once

#include <cstdint>

#include "../core/dtype.h"

namespace rr {

// dst[i] = reduce(a[i], b[i]) for i < count, with the semantics of ReduceStep (functors.h).
// a_wide/b_wide/dst_wide: the operand holds float32 partials (only for float16/bfloat16).
// divisor > 0: AVG's final division by the world size; round_sum: round the sum to the
// destination type before dividing. Throws rr::Error(kType) for unsupported pairs.
void hostReduce(DType dtype, RedOp op, const void* a, bool a_wide, const void* b, bool b_wide,
                void* dst, bool dst_wide, int64_t count, int divisor, bool round_sum);

}  // namespace rr
