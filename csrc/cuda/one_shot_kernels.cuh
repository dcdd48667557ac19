// ringreduce GPU: host-callable launcher of the one-shot all-reduce's reduce kernel
// (one_shot_kernels.cu; Note [GPU one-shot all-reduce] in csrc/core/one_shot_body.h).
#pragma once

#include <cuda_runtime_api.h>

#include "../core/dtype.h"
#include "../core/one_shot_body.h"
#include "ring_executor.h"

namespace rr {

// Enqueues l.args.dst[i] = the reduction of l.args.in[0..n-1][i] in the ring's order (chunk 0: in
// rank order), inputs of l.dtype, partials of l.partial (partialDType, plan.h; directPartial), the
// result of l.dst, scaled by l.args.scaling. Throws rr::Error (kType: dtype/op, kValue: n,
// kBackend: launch).
void launchOneShotReduce(const OneShotLaunch& l, cudaStream_t stream);

}  // namespace rr
