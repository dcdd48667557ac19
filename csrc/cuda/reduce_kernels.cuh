// ringreduce GPU: host-callable launcher of the reduce kernels (reduce_kernels.cu).
//
// Declared here with CUDA types only: csrc/cuda/*.cpp and the torch glue call it; the kernels
// themselves live in the .cu, which includes nothing but CUDA headers and csrc/core.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../core/dtype.h"

namespace rr {

// Enqueues dst[i] = reduce(a[i], b[i]) for i < count on `stream`, with the semantics of
// hostReduce() (csrc/cpu/host_reduce.h) and the same ReduceStep functors. a_wide/b_wide/dst_wide:
// the operand holds float32 partials (float16/bfloat16 only; a is never wide). divisor > 0: AVG's
// final division by the world size; round_sum: round the sum to the destination type first.
// Pointers may have any alignment; dst may alias a. Throws rr::Error(kType) for unsupported
// dtype/op pairs, rr::Error(kRuntime) for impossible width patterns, rr::Error(kBackend) when the
// launch fails. Does nothing when count <= 0.
void launchReduce(DType dtype, RedOp op, const void* a, bool a_wide, const void* b, bool b_wide,
                  void* dst, bool dst_wide, int64_t count, int divisor, bool round_sum,
                  cudaStream_t stream);

// Threads per block of the reduce kernels (also their __launch_bounds__).
constexpr int kReduceThreads = 256;

}  // namespace rr
