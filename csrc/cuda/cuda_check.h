// ringreduce GPU: the CUDA and NCCL members of the error-macro family (csrc/core/error.h).
//
// Every CUDA runtime and NCCL return code in ringreduce goes through one of these. A failure
// throws rr::Error(kBackend) - DistBackendError in Python - whose message names the call, the
// library's own error string, and file:line.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "../core/error.h"

#define RR_CUDA_CHECK(expr)                                                                    \
  do {                                                                                         \
    const cudaError_t rr_cuda_status_ = (expr);                                                \
    if (rr_cuda_status_ != cudaSuccess) {                                                      \
      /* clear a non-sticky error so that it is not reported again by the next call */         \
      (void)cudaGetLastError();                                                                \
      RR_THROW(kBackend, "ringreduce: CUDA call `", #expr, "` failed: ",                      \
               cudaGetErrorName(rr_cuda_status_), ": ", cudaGetErrorString(rr_cuda_status_)); \
    }                                                                                          \
  } while (0)

// ncclInProgress is not a failure for a non-blocking communicator; callers that may see it use
// NcclComm's polling helpers instead of this macro.
#define RR_NCCL_CHECK(expr)                                                                    \
  do {                                                                                         \
    const ncclResult_t rr_nccl_status_ = (expr);                                               \
    if (rr_nccl_status_ != ncclSuccess) {                                                      \
      RR_THROW(kBackend, "ringreduce: NCCL call `", #expr, "` failed: ",                      \
               ncclGetErrorString(rr_nccl_status_), " (", ncclGetLastError(nullptr), ")");    \
    }                                                                                          \
  } while (0)
