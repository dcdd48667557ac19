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

template <typename T, typename P, RedOp op>
__global__ void __launch_bounds__(kOneShotThreads) oneShotKernel(const OneShotArgs args) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  OneShotBody<T, P, op>::run(args, thread, nthreads);
}

struct OneShotLauncher {
  const OneShotArgs& args;
  cudaStream_t stream;
  template <typename TA, typename TB, typename TD, RedOp op>
  void run() {
    if constexpr (!std::is_same<TB, TD>::value) {
      RR_THROW(kRuntime, "ringreduce internal error: the one-shot reduce dispatches (tensor, partial, partial)");
    } else {
      int device = 0;
      RR_CUDA_CHECK(cudaGetDevice(&device));
      int sms = 0;
      RR_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      const int64_t wanted = ceilDiv(args.count, kOneShotThreads);
      const int64_t blocks = maxI64(1, minI64(wanted, static_cast<int64_t>(sms > 0 ? sms : 1) * 4));
      oneShotKernel<TA, TB, op><<<static_cast<unsigned>(blocks), kOneShotThreads, 0, stream>>>(args);
      RR_CUDA_CHECK(cudaGetLastError());
    }
  }
};

}  // namespace

void launchOneShotReduce(DType dtype, DType partial, RedOp op, const OneShotArgs& args, cudaStream_t stream) {
  checkSupported(dtype, op);
  RR_CHECK(args.n >= 1 && args.n <= kOneShotMaxRanks, kValue, "ringreduce: a one-shot all-reduce of ", args.n,
           " ranks (1..", kOneShotMaxRanks, ")");
  if (args.count <= 0) return;
  OneShotLauncher l{args, stream};
  dispatchReduce(op, dtype, partial, partial, l);
}

}  // namespace rr
