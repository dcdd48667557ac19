// ringreduce GPU: the reduce kernel template and its typed launcher, for the .cu files only.
// The instantiations are split over two TUs that compile in parallel (reduce_kernels_half.cu:
// float16/bfloat16); each declares the other's `extern`, so every kernel is compiled once.
#pragma once

#include <cuda_runtime.h>

#include "../core/functors.h"
#include "cuda_check.h"
#include "../core/reduce_body.h"
#include "reduce_kernels.cuh"

namespace rr {

template <typename TA, typename TB, typename TD, RedOp op>
__global__ void __launch_bounds__(kReduceThreads)
    reduceKernel(const TA* a, const TB* b, TD* dst, int64_t count, Scaling scaling) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  ReduceBody<TA, TB, TD, op>::run(a, b, dst, count, scaling, thread, nthreads);
}

// Note [First hop] (plan.h): the convert, converting on load/store in the same vectorized loop.
template <typename TS, typename TD>
__global__ void __launch_bounds__(kReduceThreads)
    convertKernel(const TS* a, TD* dst, int64_t count, double predivide) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  ConvertBody<TS, TD>::run(a, dst, count, predivide, thread, nthreads);
}

// Multiprocessors of the current device (cached per device).
int reduceSmCount();

// One thread per vector, at most 8 blocks per SM: the grid-stride loop covers the rest.
inline unsigned reduceBlocks(int64_t count, int V) {
  const int64_t work = ceilDiv(count, V);
  const int64_t wanted = ceilDiv(work, kReduceThreads);
  return static_cast<unsigned>(maxI64(1, minI64(wanted, static_cast<int64_t>(reduceSmCount()) * 8)));
}

template <typename TA, typename TB, typename TD, RedOp op>
void launchTyped(const void* a, const void* b, void* dst, int64_t count, Scaling scaling, cudaStream_t stream) {
  constexpr int V = ReduceBody<TA, TB, TD, op>::V;
  reduceKernel<TA, TB, TD, op><<<reduceBlocks(count, V), kReduceThreads, 0, stream>>>(
      static_cast<const TA*>(a), static_cast<const TB*>(b), static_cast<TD*>(dst), count, scaling);
  RR_CUDA_CHECK(cudaGetLastError());
}

template <typename TS, typename TD>
void launchConvertTyped(const void* a, void* dst, int64_t count, double predivide, cudaStream_t stream) {
  constexpr int V = ConvertBody<TS, TD>::V;
  convertKernel<TS, TD><<<reduceBlocks(count, V), kReduceThreads, 0, stream>>>(
      static_cast<const TS*>(a), static_cast<TD*>(dst), count, predivide);
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace rr

// RR_INST_PREFIX is `template` (instantiate here) or `extern template` (instantiated elsewhere).
#define RR_INST(TA, TB, TD, OP) \
  RR_INST_PREFIX void launchTyped<TA, TB, TD, RedOp::OP>(const void*, const void*, void*, int64_t, Scaling, cudaStream_t);
#define RR_INST_CONVERT(TS, TD) \
  RR_INST_PREFIX void launchConvertTyped<TS, TD>(const void*, void*, int64_t, double, cudaStream_t);
#define RR_INST_ALL_OPS(TA, TB, TD) \
  RR_INST(TA, TB, TD, kSum)         \
  RR_INST(TA, TB, TD, kAvg)         \
  RR_INST(TA, TB, TD, kMax)         \
  RR_INST(TA, TB, TD, kMin)         \
  RR_INST(TA, TB, TD, kProduct)
#define RR_INST_NO_AVG(T) \
  RR_INST(T, T, T, kSum)  \
  RR_INST(T, T, T, kMax)  \
  RR_INST(T, T, T, kMin)  \
  RR_INST(T, T, T, kProduct)
// float16/bfloat16: all operands narrow, and the three float32-partial patterns of the plan; and
// float32 tensors with 16-bit partials of that type (a 16-bit wire: SUM and AVG), with the converts
// of the first hop (reduce_dispatch.h).
#define RR_INST_WIRE(P)          \
  RR_INST(float, P, P, kSum)     \
  RR_INST(float, P, P, kAvg)     \
  RR_INST(float, P, float, kSum) \
  RR_INST(float, P, float, kAvg) \
  RR_INST_CONVERT(float, P)      \
  RR_INST_CONVERT(P, P)
#define RR_INST_HALF(T)            \
  RR_INST_ALL_OPS(T, T, T)         \
  RR_INST_WIRE(T)                  \
  RR_INST_ALL_OPS(T, T, float)     \
  RR_INST_ALL_OPS(T, float, float) \
  RR_INST_ALL_OPS(T, float, T)
#define RR_INST_HALF_TYPES \
  RR_INST_HALF(Half)       \
  RR_INST_HALF(BFloat16)
#define RR_INST_OTHER_TYPES                                        \
  RR_INST_ALL_OPS(float, float, float)                             \
  RR_INST_ALL_OPS(double, double, double)                          \
  RR_INST_CONVERT(float, float)                                    \
  RR_INST_CONVERT(double, double)                                  \
  RR_INST_CONVERT(Complex<float>, Complex<float>)                  \
  RR_INST_CONVERT(Complex<double>, Complex<double>)                \
  RR_INST_NO_AVG(int8_t)                                           \
  RR_INST_NO_AVG(int16_t)                                          \
  RR_INST_NO_AVG(int32_t)                                          \
  RR_INST_NO_AVG(int64_t)                                          \
  RR_INST_NO_AVG(uint8_t)                                          \
  RR_INST_NO_AVG(Bool8)                                            \
  RR_INST(Complex<float>, Complex<float>, Complex<float>, kSum)    \
  RR_INST(Complex<float>, Complex<float>, Complex<float>, kAvg)    \
  RR_INST(Complex<double>, Complex<double>, Complex<double>, kSum) \
  RR_INST(Complex<double>, Complex<double>, Complex<double>, kAvg)
