// ringreduce GPU: one collective call, sequenced without torch.
//
// The torch layer (csrc/torch/cuda_bindings.cpp) only turns tensors into the buffers and callbacks
// below, calls runCudaCall() with the GIL released and wraps the work. runCudaCall() decides:
//   1. the CUDA graph capture check, first (the agreement check would fail under capture and abort);
//   2. validation that needs no peer (dtype/op, ring membership, hierarchical shape, sizes);
//   3. the agreement check (RINGREDUCE_CHECK=1), around the call's ring only;
//   4. nothing to do (numel 0, a ring of one) -> no work;
//   5. the working buffers (made by the torch layer on the caller's stream), the stages;
//   6. protect(): every buffer the internal streams touch is recordStream'ed BEFORE anything is
//      enqueued, so a half-enqueued failure cannot free a block drained kernels still write;
//   7. CudaRing::enqueue(), enqueueDirect() (Note [Direct all-reduce] in csrc/core/direct.h), or
//      enqueueOneShot() up to gpuOneShotBytes().
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../core/call_options.h"
#include "../core/dtype.h"
#include "../core/frame.h"
#include "group_runtime.h"

namespace rr {

// One call: its options (csrc/core/call_options.h) and its tensor, ring and stream.
struct CudaCallRequest {
  CallOptions options;            // kind (kReduceScatter / kAllGather: a ring half), op, ...
  DType dtype = DType::kFloat32;
  int64_t numel = 0;              // of the input
  int64_t out_numel = 0;          // ring halves: of the output
  std::vector<int64_t> shape;     // of the input (agreement frame)
  bool async_op = false;
  std::string group_name;
  std::vector<int> members;       // ranks of the group in ring order; empty: all
  cudaStream_t caller = nullptr;
};

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

// Runs steps 1-7; returns the work, or null when there was nothing to enqueue. data() gives: for an
// all-reduce the tensor or its working copy (float32 when the hierarchical mode upcasts);
// reduce-scatter a private copy of the input; all-gather the output with this rank's block in place.
std::shared_ptr<CudaWork> runCudaCall(CudaRing& ring, const CudaCallRequest& req, CudaCallBuffers& buf);

// The refusal frame of a rank that refused a call locally (RINGREDUCE_CHECK=1), around `members`.
void sendCudaRefusal(CudaRing& ring, CallKind kind, int error, RedOp op, const std::string& group_name,
                     const std::vector<int>& members);

}  // namespace rr
