// ringreduce GPU: the one-shot all-reduce's reduce kernel (Note [GPU one-shot all-reduce]): OneShotBody
// over a grid-stride loop, dispatched through the ring kernels' table (reduce_dispatch.h) with the
// partial type as received and stored operand, so it exists for exactly the triples the ring reduces.
// The tensors are small, so it reads element by element (microseconds next to the NCCL group).
#include <cuda_runtime.h>

#include <type_traits>

#include "../core/error.h"
#include "../core/one_shot_body.h"
#include "../core/reduce_dispatch.h"
#include "cuda_check.h"
#include "one_shot_kernels.cuh"

namespace rr {

namespace {

constexpr int kOneShotThreads = 256;

template <typename T, typename P, RedOp op, typename D>
__global__ void __launch_bounds__(kOneShotThreads) oneShotKernel(const OneShotArgs args) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  OneShotBody<T, P, op, D>::run(args, thread, nthreads);
}

struct OneShotLauncher {
  const OneShotArgs& args;
  bool dst_float;  // the result is float32 while the inputs are 16-bit (a direct wire's pieces)
  cudaStream_t stream;

  template <typename T, typename P, RedOp op, typename D>
  void launch() {
    int device = 0;
    RR_CUDA_CHECK(cudaGetDevice(&device));
    int sms = 0;
    RR_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int64_t wanted = ceilDiv(args.count, kOneShotThreads);
    const int64_t blocks = maxI64(1, minI64(wanted, static_cast<int64_t>(sms > 0 ? sms : 1) * 4));
    oneShotKernel<T, P, op, D><<<static_cast<unsigned>(blocks), kOneShotThreads, 0, stream>>>(args);
    RR_CUDA_CHECK(cudaGetLastError());
  }

  template <typename TA, typename TB, typename TD, RedOp op>
  void run() {
    if constexpr (!std::is_same<TB, TD>::value) {
      RR_THROW(kRuntime, "ringreduce internal error: the one-shot reduce dispatches (tensor, partial, partial)");
    } else if constexpr ((std::is_same<TA, Half>::value || std::is_same<TA, BFloat16>::value) &&
                         std::is_same<TB, float>::value) {
      if (dst_float) return launch<TA, TB, op, float>();
      launch<TA, TB, op, TA>();
    } else {
      RR_CHECK(!dst_float, kRuntime, "ringreduce internal error: a float32 result of a one-shot reduce of ",
               sizeof(TA), "-byte inputs");
      launch<TA, TB, op, TA>();
    }
  }
};

}  // namespace

void launchOneShotReduce(const OneShotLaunch& l, cudaStream_t stream) {
  checkSupported(l.dtype, l.op);
  RR_CHECK(l.args.n >= 1 && l.args.n <= kOneShotMaxRanks, kValue, "ringreduce: a one-shot all-reduce of ", l.args.n,
           " ranks (1..", kOneShotMaxRanks, ")");
  RR_CHECK(l.dst == l.dtype || (l.dst == DType::kFloat32 && isHalfType(l.dtype)), kRuntime,
           "ringreduce internal error: a one-shot reduce of ", dtypeName(l.dtype), " into ", dtypeName(l.dst));
  if (l.args.count <= 0) return;
  OneShotLauncher launcher{l.args, l.dst != l.dtype, stream};
  dispatchReduce(l.op, l.dtype, l.partial, l.partial, launcher);
}

}  // namespace rr
