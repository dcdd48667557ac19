// ringreduce GPU: one collective call, sequenced without torch.
//
// The torch layer (csrc/torch/cuda_bindings.cpp) only translates: it turns tensors into the raw
// buffers and callbacks below, calls runCudaCall() with the GIL released, and wraps the returned
// work. Everything that decides something lives here:
//   1. the CUDA graph capture check, before anything else (the agreement check would otherwise
//      run, fail under capture and abort the communicator);
//   2. validation that needs no peer (dtype/op, ring membership, hierarchical shape, sizes);
//   3. the agreement check (RINGREDUCE_CHECK=1), around the call's ring only;
//   4. nothing to do (numel 0, a ring of one) -> no work;
//   5. the working buffers (the torch layer makes them on the caller's stream), the stages;
//   6. protect(): every buffer the internal streams will touch is recordStream'ed BEFORE
//      anything is enqueued, so a half-enqueued failure cannot hand a block still written by
//      drained kernels back to the caching allocator;
//   7. CudaRing::enqueue(), or CudaRing::enqueueOneShot() for a flat all-reduce of at most
//      gpuOneShotBytes() (Note [GPU one-shot all-reduce], csrc/core/one_shot_body.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../core/call_options.h"
#include "../core/dtype.h"
#include "../core/frame.h"
#include "cuda_ring.h"

namespace rr {

// One call: its options (the one struct both runtimes take, csrc/core/call_options.h) and what the
// torch layer says about its tensor, its ring and its stream.
struct CudaCallRequest {
  CallOptions options;            // kind (kReduceScatter / kAllGather: a ring half), op, ...
  DType dtype = DType::kFloat32;
  int64_t numel = 0;              // of the input
  int64_t out_numel = 0;          // ring halves: of the output
  std::vector<int64_t> shape;     // of the input (agreement frame)
  bool direct = true;             // all-reduce: the tensor is row-major contiguous (no working copy)
  bool async_op = false;
  std::string group_name;
  std::vector<int> members;       // ranks of the group in ring order; empty: all
  cudaStream_t caller = nullptr;
};

// The GPU pipeline's overrides in `options` (Note [GPU pipeline rule], gpu_pipeline.h).
inline GpuKnobs gpuKnobs(const CallOptions& options) {
  GpuKnobs k;
  k.segment_bytes = options.segment_bytes;
  k.slots = options.num_slots;
  k.lanes = options.lanes;
  k.one_shot_bytes = options.one_shot_bytes;
  return k;
}

// What only the torch layer can do. Every callback runs on the calling thread, without the GIL.
struct CudaCallBuffers {
  // The contiguous elements the ring runs on: the tensor itself, or a working copy made on the
  // caller's stream (in `dtype`; ring halves: see runCudaCall). `ring_index`: this rank's index.
  std::function<void*(DType dtype, int ring_index)> data;
  std::function<void*(int64_t elems)> accum;  // `elems` float32s: room for the partials (either width)
  std::function<void()> protect;              // recordStream of every buffer (step 6)
  std::function<void()> epilogue;             // on the compute stream inside the call, or empty
  std::function<void()> trivial;              // numel > 0 on a ring of one: what to do instead
};

// Runs steps 1-7. Returns the enqueued work, or null when there was nothing to enqueue.
// all-reduce: data() gives the tensor (direct) or its working copy, in float32 when the
// hierarchical float32 mode upcasts. reduce-scatter: data() gives a private copy of the input;
// all-gather: the output, with this rank's block already in place. Throws rr::Error.
std::shared_ptr<CudaWork> runCudaCall(CudaRing& ring, const CudaCallRequest& req, CudaCallBuffers& buf);

// The refusal frame of a rank that refused a call locally (RINGREDUCE_CHECK=1), around `members`.
void sendCudaRefusal(CudaRing& ring, CallKind kind, int error, RedOp op, const std::string& group_name,
                     const std::vector<int>& members);

// What build_info() reports of the GPU part ("" / -1: unknown).
struct CudaBuildFacts {
  std::string nccl_version;          // "X.Y.Z", compiled against
  int nccl_version_code = 0;
  std::string nccl_runtime_version;  // loaded library
  int nccl_runtime_version_code = -1;
  std::vector<std::string> cuda_archs;  // RR_CUDA_ARCHS (setup.py)
  int cuda_runtime_version = -1;
  int cuda_compiled_version = 0;
};
CudaBuildFacts cudaBuildFacts();

}  // namespace rr
