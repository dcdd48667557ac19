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

// ---- dispatch ------------------------------------------------------------------------------------
namespace {

struct Args {
  const void* a;
  const void* b;
  void* dst;
  int64_t count;
  int divisor;
  bool round_sum;
  cudaStream_t stream;
};

template <typename T, RedOp op>
void byWidths(int widths, const Args& x) {
  switch (static_cast<Widths>(widths)) {
    case Widths::kNarrow:
      return launchTyped<T, T, T, op>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case Widths::kToWide:
      return launchTyped<T, T, float, op>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case Widths::kWideToWide:
      return launchTyped<T, float, float, op>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case Widths::kWideToNarrow:
      return launchTyped<T, float, T, op>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
  }
  RR_THROW(kRuntime, "ringreduce internal error: unexpected operand widths ", widths);
}

template <typename T>
void halfType(RedOp op, int widths, const Args& x) {
  switch (op) {
    case RedOp::kSum: return byWidths<T, RedOp::kSum>(widths, x);
    case RedOp::kAvg: return byWidths<T, RedOp::kAvg>(widths, x);
    case RedOp::kMax: return byWidths<T, RedOp::kMax>(widths, x);
    case RedOp::kMin: return byWidths<T, RedOp::kMin>(widths, x);
    case RedOp::kProduct: return byWidths<T, RedOp::kProduct>(widths, x);
  }
  RR_THROW(kType, "ringreduce: unknown op code ", static_cast<int>(op));
}

template <typename T>
void narrow(RedOp op, const Args& x) {
  switch (op) {
    case RedOp::kSum: return launchTyped<T, T, T, RedOp::kSum>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kAvg: return launchTyped<T, T, T, RedOp::kAvg>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kMax: return launchTyped<T, T, T, RedOp::kMax>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kMin: return launchTyped<T, T, T, RedOp::kMin>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kProduct:
      return launchTyped<T, T, T, RedOp::kProduct>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
  }
  RR_THROW(kType, "ringreduce: unknown op code ", static_cast<int>(op));
}

template <typename T>
void integral(RedOp op, const Args& x) {  // AVG refused by checkSupported() before we get here
  switch (op) {
    case RedOp::kSum: return launchTyped<T, T, T, RedOp::kSum>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kMax: return launchTyped<T, T, T, RedOp::kMax>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kMin: return launchTyped<T, T, T, RedOp::kMin>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kProduct:
      return launchTyped<T, T, T, RedOp::kProduct>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kAvg: break;
  }
  RR_THROW(kType, "ringreduce: op ", redOpName(op), " is not supported for integer tensors");
}

template <typename T>
void complexType(RedOp op, const Args& x) {
  switch (op) {
    case RedOp::kSum: return launchTyped<T, T, T, RedOp::kSum>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    case RedOp::kAvg: return launchTyped<T, T, T, RedOp::kAvg>(x.a, x.b, x.dst, x.count, x.divisor, x.round_sum, x.stream);
    default: break;
  }
  RR_THROW(kType, "ringreduce: op ", redOpName(op), " is not supported for complex tensors");
}

}  // namespace

void launchReduce(DType dtype, RedOp op, const void* a, bool a_wide, const void* b, bool b_wide,
                  void* dst, bool dst_wide, int64_t count, int divisor, bool round_sum,
                  cudaStream_t stream) {
  checkSupported(dtype, op);
  const int widths = widthsOf(a_wide, b_wide, dst_wide);
  RR_CHECK(widths == static_cast<int>(Widths::kNarrow) || (widths > 0 && isHalfType(dtype)), kRuntime,
           "ringreduce internal error: float32 partials requested for ", dtypeName(dtype), " (a=", a_wide,
           " b=", b_wide, " dst=", dst_wide, ")");
  if (count <= 0) return;
  const Args x{a, b, dst, count, divisor, round_sum, stream};
  switch (dtype) {
    case DType::kFloat32: return narrow<float>(op, x);
    case DType::kFloat64: return narrow<double>(op, x);
    case DType::kFloat16: return halfType<Half>(op, widths, x);
    case DType::kBFloat16: return halfType<BFloat16>(op, widths, x);
    case DType::kInt8: return integral<int8_t>(op, x);
    case DType::kInt16: return integral<int16_t>(op, x);
    case DType::kInt32: return integral<int32_t>(op, x);
    case DType::kInt64: return integral<int64_t>(op, x);
    case DType::kUInt8: return integral<uint8_t>(op, x);
    case DType::kBool: return integral<Bool8>(op, x);
    case DType::kComplex64: return complexType<Complex<float>>(op, x);
    case DType::kComplex128: return complexType<Complex<double>>(op, x);
  }
  RR_THROW(kType, "ringreduce: unknown dtype code ", static_cast<int>(dtype));
}

}  // namespace rr
