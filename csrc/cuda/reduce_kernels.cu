// ringreduce GPU: the reduce kernels. Only CUDA headers and csrc/core here (compile time).
//
// One kernel template, reduceKernel<TA, TB, TD, op>, runs ReduceBody (reduce_body.h, Note
// [Vectorized reduce with scalar head and tail]) over a grid-stride loop. Dispatch from the
// runtime (DType, RedOp, widths) happens once, in launchReduce(), with an explicit list and a
// loud default; the launchers are instantiated explicitly below, the float32-partial variants only
// for the half types.
#include <cuda_runtime.h>

#include <atomic>

#include "../core/error.h"
#include "../core/functors.h"
#include "cuda_check.h"
#include "reduce_body.h"
#include "reduce_dispatch.h"
#include "reduce_kernels.cuh"

namespace rr {

template <typename TA, typename TB, typename TD, RedOp op>
__global__ void __launch_bounds__(kReduceThreads)
    reduceKernel(const TA* a, const TB* b, TD* dst, int64_t count, int divisor, bool round_sum) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  ReduceBody<TA, TB, TD, op>::run(a, b, dst, count, divisor, round_sum, thread, nthreads);
}

namespace {

constexpr int kMaxDevices = 64;
std::atomic<int> g_sm_count[kMaxDevices];

int smCount() {
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

}  // namespace

template <typename TA, typename TB, typename TD, RedOp op>
void launchTyped(const void* a, const void* b, void* dst, int64_t count, int divisor, bool round_sum,
                 cudaStream_t stream) {
  constexpr int V = ReduceBody<TA, TB, TD, op>::V;
  // One thread per vector (plus head/tail), at most 8 resident blocks per SM: the grid-stride
  // loop covers the rest. Segments are <= a few MiB, so this is a few thousand blocks at most.
  const int64_t work = ceilDiv(count, V);
  const int64_t wanted = ceilDiv(work, kReduceThreads);
  const int64_t blocks = maxI64(1, minI64(wanted, static_cast<int64_t>(smCount()) * 8));
  reduceKernel<TA, TB, TD, op><<<static_cast<unsigned>(blocks), kReduceThreads, 0, stream>>>(
      static_cast<const TA*>(a), static_cast<const TB*>(b), static_cast<TD*>(dst), count, divisor,
      round_sum);
  RR_CUDA_CHECK(cudaGetLastError());
}

// ---- explicit instantiation --------------------------------------------------------------------
#define RR_INST(TA, TB, TD, OP)                                                                   \
  template void launchTyped<TA, TB, TD, RedOp::OP>(const void*, const void*, void*, int64_t, int, \
                                                   bool, cudaStream_t);
#define RR_INST_ALL_OPS(TA, TB, TD) \
  RR_INST(TA, TB, TD, kSum)         \
  RR_INST(TA, TB, TD, kAvg)         \
  RR_INST(TA, TB, TD, kMax)         \
  RR_INST(TA, TB, TD, kMin)         \
  RR_INST(TA, TB, TD, kProduct)
#define RR_INST_NO_AVG(T)  \
  RR_INST(T, T, T, kSum)   \
  RR_INST(T, T, T, kMax)   \
  RR_INST(T, T, T, kMin)   \
  RR_INST(T, T, T, kProduct)
#define RR_INST_HALF(T)                 \
  RR_INST_ALL_OPS(T, T, T)              \
  RR_INST_ALL_OPS(T, T, float)          \
  RR_INST_ALL_OPS(T, float, float)      \
  RR_INST_ALL_OPS(T, float, T)

RR_INST_ALL_OPS(float, float, float)
RR_INST_ALL_OPS(double, double, double)
RR_INST_HALF(Half)
RR_INST_HALF(BFloat16)
RR_INST_NO_AVG(int8_t)
RR_INST_NO_AVG(int16_t)
RR_INST_NO_AVG(int32_t)
RR_INST_NO_AVG(int64_t)
RR_INST_NO_AVG(uint8_t)
RR_INST_NO_AVG(Bool8)
RR_INST(Complex<float>, Complex<float>, Complex<float>, kSum)
RR_INST(Complex<float>, Complex<float>, Complex<float>, kAvg)
RR_INST(Complex<double>, Complex<double>, Complex<double>, kSum)
RR_INST(Complex<double>, Complex<double>, Complex<double>, kAvg)
#undef RR_INST_HALF
#undef RR_INST_NO_AVG
#undef RR_INST_ALL_OPS
#undef RR_INST

// ---- dispatch (reduce_dispatch.h) --------------------------------------------------------------
namespace {

struct KernelLauncher {
  const void* a;
  const void* b;
  void* dst;
  int64_t count;
  int divisor;
  bool round_sum;
  cudaStream_t stream;
  template <typename TA, typename TB, typename TD, RedOp op>
  void run() {
    launchTyped<TA, TB, TD, op>(a, b, dst, count, divisor, round_sum, stream);
  }
};

}  // namespace

void launchReduce(DType dtype, RedOp op, const void* a, bool a_wide, const void* b, bool b_wide,
                  void* dst, bool dst_wide, int64_t count, int divisor, bool round_sum,
                  cudaStream_t stream) {
  if (count <= 0) {
    checkSupported(dtype, op);
    return;
  }
  KernelLauncher l{a, b, dst, count, divisor, round_sum, stream};
  dispatchReduce(dtype, op, a_wide, b_wide, dst_wide, l);
}

}  // namespace rr
