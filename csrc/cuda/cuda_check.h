// ringreduce GPU: the CUDA and NCCL members of the error-macro family (csrc/core/error.h): a
// failure throws rr::Error(kBackend) (DistBackendError) naming the call and the library's error.
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

namespace rr {

// Note [Polling events from any thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every event poll (watchdog, Work.is_completed(), host waits) goes through eventFired(), which
//   * queries in cudaStreamCaptureModeRelaxed: in the global mode, a query while another thread
//     captures a CUDA graph invalidates that capture (torch's NCCL watchdog relaxes for the same
//     reason), and counts capture refusals as "not ready yet";
//   * clears the last error after cudaErrorNotReady, so that a later launch check does not report a
//     stale not-ready (as torch's CUDAEvent::query does).
// True once the event's latest record fired; throws kBackend on any other error.
inline bool eventFired(cudaEvent_t event) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool exchanged = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  const cudaError_t q = cudaEventQuery(event);
  if (exchanged) (void)cudaThreadExchangeStreamCaptureMode(&mode);
  if (q == cudaSuccess) return true;
  (void)cudaGetLastError();  // not-ready (and capture refusals) must not linger as the last error
  if (q == cudaErrorNotReady || q == cudaErrorStreamCaptureUnsupported || q == cudaErrorStreamCaptureInvalidated ||
      q == cudaErrorStreamCaptureImplicit || q == cudaErrorStreamCaptureWrongThread) {
    return false;
  }
  RR_THROW(kBackend, "ringreduce: CUDA call `cudaEventQuery` failed: ", cudaGetErrorName(q), ": ",
           cudaGetErrorString(q));
}

}  // namespace rr

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
