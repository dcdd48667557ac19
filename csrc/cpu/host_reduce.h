// ringreduce CPU: host loops over the shared functors (csrc/core/functors.h).
#pragma once

#include <cstdint>
#include <vector>

#include "../core/direct.h"
#include "../core/dtype.h"
#include "../core/functors.h"

namespace rr {

// dst[i] = reduce(a[i], b[i]) for i < count, with the semantics of ReduceStep (functors.h): a of
// a_type (the tensor's), b and dst of their types (the tensor's, or the partial type). Throws
// rr::Error(kType) for unsupported dtype/op pairs.
void hostReduce(RedOp op, const void* a, DType a_type, const void* b, DType b_type, void* dst, DType dst_type,
                int64_t count, const Scaling& scaling);

// dst[i] = ConvertStep(a[i], predivide) for i < count (Note [First hop] in plan.h); dst may be a.
void hostConvert(const void* a, DType a_type, void* dst, DType dst_type, int64_t count, double predivide);

// dst = the reduction of inputs[0..n-1] (all of `dtype`) in the ring's order, step k computing
// inputs[k] (op) partial (Note [One-shot all-reduce] in group_runtime.h), with partials of `partial`
// (the first: inputs[0] converted, Note [First hop]); `scaling`'s predivide applies to every input,
// its divisor/postscale to the last step. Works in cache-sized blocks; `scratch` holds
// kReduceInOrderScratchBytes. dst may be one of the inputs.
constexpr int64_t kReduceInOrderBlock = 8192;
constexpr size_t kReduceInOrderScratchBytes = 2 * kReduceInOrderBlock * 16;  // widest element: complex128
void hostReduceInOrder(DType dtype, DType partial, RedOp op, const std::vector<const void*>& inputs, void* dst,
                       int64_t count, const Scaling& scaling, void* scratch);
// The same for any InOrderReduce (csrc/core/direct.h): inputs of r.dtype, each first rounded to
// r.round_to (after r.scaling's predivide, which the steps then leave out) where that differs, the
// result stored as r.dst.
void hostReduceInOrder(const InOrderReduce& r, const std::vector<const void*>& inputs, void* dst, int64_t count,
                       void* scratch);

}  // namespace rr
