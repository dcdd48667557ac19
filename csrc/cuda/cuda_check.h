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

namespace rr {

// Note [Polling events from any thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every event poll of ringreduce (watchdog, Work.is_completed(), host waits) goes through
// eventFired(), which:
//   * runs the query in cudaStreamCaptureModeRelaxed: in the default global mode, a query on one
//     thread while another thread captures a CUDA graph in global mode invalidates that capture
//     (torch's ProcessGroupNCCL watchdog relaxes its mode for the same reason);
//   * counts capture refusals (cudaErrorStreamCapture*) as "not ready yet";
//   * clears the thread's last error after cudaErrorNotReady, so that a later
//     `cudaGetLastError()` check (the reduce kernel's launch check) does not report a stale
//     not-ready as a launch failure (torch's CUDAEvent::query clears it the same way).
// Returns true once the event's latest record fired; throws kBackend on any other error.
inline bool isCaptureRefusal(cudaError_t e) {
  return e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureInvalidated ||
         e == cudaErrorStreamCaptureImplicit || e == cudaErrorStreamCaptureWrongThread;
}

inline bool eventFired(cudaEvent_t event) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool exchanged = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  const cudaError_t q = cudaEventQuery(event);
  if (exchanged) (void)cudaThreadExchangeStreamCaptureMode(&mode);
  if (q == cudaSuccess) return true;
  (void)cudaGetLastError();  // not-ready (and capture refusals) must not linger as the last error
  if (q == cudaErrorNotReady || isCaptureRefusal(q)) return false;
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
