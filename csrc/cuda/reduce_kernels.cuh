// ringreduce GPU: host-callable launcher of the reduce kernels (reduce_kernels.cu).
//
// Declared here with CUDA types only: csrc/cuda/*.cpp and the torch glue call it; the kernels
// themselves live in the .cu, which includes nothing but CUDA headers and csrc/core.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../core/dtype.h"
#include "../core/functors.h"

namespace rr {

// Enqueues dst[i] = reduce(a[i], b[i]) for i < count on `stream`, with the semantics of
// hostReduce() (csrc/cpu/host_reduce.h) and the same ReduceStep functors: a of the tensor's type,
// b and dst of theirs (the tensor's, or partials: float32 for half types, 16 bits for float32;
// reduce_dispatch.h lists the triples), `scaling` the predivide and final scaling (functors.h).
// b null: a convert instead, dst[i] = ConvertStep(a[i], scaling.predivide) (hostConvert()).
// Pointers may have any alignment; dst may alias a. Throws rr::Error(kType) for unsupported
// dtype/op pairs, rr::Error(kRuntime) for impossible type patterns, rr::Error(kBackend) when the
// launch fails. Does nothing when count <= 0.
void launchReduce(RedOp op, const void* a, DType a_type, const void* b, DType b_type, void* dst, DType dst_type,
                  int64_t count, const Scaling& scaling, cudaStream_t stream);

// Threads per block of the reduce kernels (also their __launch_bounds__).
constexpr int kReduceThreads = 256;

}  // namespace rr
