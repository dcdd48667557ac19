// ringreduce GPU: host-callable launcher of the one-shot all-reduce's reduce kernel
// (one_shot_kernels.cu; Note [GPU one-shot all-reduce] in csrc/core/one_shot_body.h).
#pragma once

#include <cuda_runtime_api.h>

#include "../core/dtype.h"
#include "../core/one_shot_body.h"

namespace rr {

// Enqueues args.dst[i] = the ring-ordered reduction of args.in[0..n-1][i], with partials of
// `partial` (partialDType, plan.h) and args.scaling. Throws rr::Error (kType: dtype/op, kValue: n,
// kBackend: launch).
void launchOneShotReduce(DType dtype, DType partial, RedOp op, const OneShotArgs& args, cudaStream_t stream);

}  // namespace rr
