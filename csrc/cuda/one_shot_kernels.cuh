// ringreduce GPU: host-callable launcher of the one-shot all-reduce's reduce kernel
// (one_shot_kernels.cu; Note [GPU one-shot all-reduce] in csrc/core/one_shot_body.h).
#pragma once

#include <cuda_runtime_api.h>

#include "../core/dtype.h"
#include "../core/one_shot_body.h"

namespace rr {

// Enqueues args.dst[i] = the ring-ordered reduction of args.in[0..n-1][i] on `stream`, with
// partials of `partial` (the ring's: partialDType, plan.h) and the ring's scaling (args.scaling).
// Throws rr::Error(kType) for unsupported dtype/op pairs, kValue for n outside 1..kOneShotMaxRanks,
// kBackend when the launch fails. Does nothing when args.count <= 0.
void launchOneShotReduce(DType dtype, DType partial, RedOp op, const OneShotArgs& args, cudaStream_t stream);

}  // namespace rr
