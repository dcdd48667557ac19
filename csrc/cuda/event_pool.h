// ringreduce CUDA: a pool of one device's cudaEventDisableTiming events, shared by a ring (CudaRing)
// and the works it hands out (CudaWork), which return their events to it.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

#include "cuda_check.h"
#include "nccl_comm.h"

namespace rr {

class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}

  ~EventPool() {
    // Destroying an event whose record is pending is allowed (resources are freed on completion).
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
  }

  cudaEvent_t acquire() {  // throws kBackend
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    DeviceGuard guard(device_);
    cudaEvent_t e = nullptr;
    RR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  void release(cudaEvent_t event) {  // never throws
    if (event == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(event);
  }

 private:
  int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

}  // namespace rr
