// ringreduce GPU: host-callable launcher of the reduce kernels (reduce_kernels.cu), CUDA types only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../core/dtype.h"
#include "../core/functors.h"
#include "reduce_args.h"

namespace rr {

// Enqueues dst[i] = reduce(a[i], b[i]) for i < count, as hostReduce() (the same ReduceStep
// functors; reduce_dispatch.h lists the type triples); b null: dst[i] = ConvertStep(a[i],
// scaling.predivide). Any alignment; dst may alias a. Throws rr::Error (kType: dtype/op, kRuntime:
// impossible types, kBackend: launch).
void launchReduce(const ReduceLaunch& l, cudaStream_t stream);

// Threads per block of the reduce kernels (also their __launch_bounds__).
constexpr int kReduceThreads = 256;

}  // namespace rr
