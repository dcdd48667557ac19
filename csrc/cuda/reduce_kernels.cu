// ringreduce GPU: the reduce kernels (only CUDA headers and csrc/core here). reduceKernel
// (reduce_launch.cuh) runs ReduceBody (Note [Vectorized reduce with scalar head and tail]);
// launchReduce() dispatches once through reduce_dispatch.h (shared with the host tests). This TU
// instantiates everything but the half types (reduce_kernels_half.cu).
#include <cuda_runtime.h>

#include <atomic>

#include "../core/error.h"
#include "../core/reduce_dispatch.h"
#include "reduce_launch.cuh"

namespace rr {

namespace {
constexpr int kMaxDevices = 64;
std::atomic<int> g_sm_count[kMaxDevices];
}  // namespace

int reduceSmCount() {
  int device = 0;
  RR_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 0 && device < kMaxDevices) {
    const int cached = g_sm_count[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int sms = 0;
  RR_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (sms <= 0) sms = 1;
  if (device >= 0 && device < kMaxDevices) g_sm_count[device].store(sms, std::memory_order_relaxed);
  return sms;
}

#define RR_INST_PREFIX template
RR_INST_OTHER_TYPES
#undef RR_INST_PREFIX
#define RR_INST_PREFIX extern template
RR_INST_HALF_TYPES
#undef RR_INST_PREFIX

namespace {

struct KernelLauncher {
  const void* a;
  const void* b;
  void* dst;
  int64_t count;
  Scaling scaling;
  cudaStream_t stream;
  template <typename TA, typename TB, typename TD, RedOp op>
  void run() {
    launchTyped<TA, TB, TD, op>(a, b, dst, count, scaling, stream);
  }
  template <typename TS, typename TD>
  void convert() {
    launchConvertTyped<TS, TD>(a, dst, count, scaling.predivide, stream);
  }
};

}  // namespace

void launchReduce(const ReduceLaunch& r, cudaStream_t stream) {
  if (r.count <= 0) {
    checkSupported(r.a_type, r.op);
    return;
  }
  KernelLauncher l{r.a, r.b, r.dst, r.count, r.scaling, stream};
  if (r.b == nullptr) return dispatchConvert(r.a_type, r.dst_type, l);
  dispatchReduce(r.op, r.a_type, r.b_type, r.dst_type, l);
}

}  // namespace rr
