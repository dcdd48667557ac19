// ringreduce CPU: host loops over the shared functors (csrc/core/functors.h).
#pragma once

#include <cstdint>
#include <vector>

#include "../core/dtype.h"

namespace rr {

// dst[i] = reduce(a[i], b[i]) for i < count, with the semantics of ReduceStep (functors.h).
// a_wide/b_wide/dst_wide: the operand holds float32 partials (only for float16/bfloat16).
// divisor > 0: AVG's final division by the world size; round_sum: round the sum to the
// destination type before dividing. Throws rr::Error(kType) for unsupported pairs.
void hostReduce(DType dtype, RedOp op, const void* a, bool a_wide, const void* b, bool b_wide,
                void* dst, bool dst_wide, int64_t count, int divisor, bool round_sum);

// dst = the reduction of inputs[0..n-1], combined in that order, step k computing
// inputs[k] (op) partial (Note [One-shot all-reduce] in group_runtime.h), so every process that
// reduces the same inputs gets the same bits. AVG divides the complete sum once by `divisor`.
// Half types round the partial to their type at every step unless accum_float32 (then float32
// partials, rounded once). Works in blocks of kReduceInOrderBlock elements, so the partials stay in
// cache; `scratch` holds kReduceInOrderScratchBytes. dst may be one of the inputs.
constexpr int64_t kReduceInOrderBlock = 8192;
constexpr size_t kReduceInOrderScratchBytes = 2 * kReduceInOrderBlock * 16;  // widest element: complex128
void hostReduceInOrder(DType dtype, RedOp op, const std::vector<const void*>& inputs, void* dst, int64_t count,
                       int divisor, bool accum_float32, void* scratch);

}  // namespace rr
