// ringreduce GPU: the whole GPU driver on ONE GPU, without NCCL (a test fake).
//
// Note [Loopback ring]
// ~~~~~~~~~~~~~~~~~~~
// loopbackAllReduce() runs a ring of n ranks as n host threads in one process, all on one device.
// Each rank has its own communication and reduce streams, staging slots and plan events, and
// enqueues its plan with enqueueRingCall() exactly like CudaRing does; only the exchange differs:
// instead of ncclGroupStart/ncclSend/ncclRecv/ncclGroupEnd it is
//   sender:   record `ready` on its comm stream, post (pointer, bytes, ready) to the next rank;
//   receiver: take the matching post (in posting order, byte counts checked), make its comm stream
//             wait `ready`, cudaMemcpyAsync device-to-device into its receive buffer, record
//             `consumed`, hand `consumed` back;
//   sender:   make its comm stream wait `consumed` (NCCL's send also completes only once received).
// The host threads block only on each other's *enqueueing* (never on the GPU), in exchange order,
// so the rendezvous cannot deadlock. A single-GPU machine thereby runs the kernels, both streams
// per rank, the events, double-buffered staging and the call framing of the real driver; only the
// NCCL calls themselves need several GPUs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "../core/dtype.h"
#include "../core/plan.h"
#include "gpu_pipeline.h"

namespace rr {

// Which collective the loopback ring runs, with the stages of ring_driver.h: the flat all-reduce
// (the default), a ring half (phases = kPhaseReduceScatter: afterwards block r of data[r] holds
// the reduced block r; kPhaseAllGather: beforehand block r of data[r] holds rank r's block), or
// the hierarchical all-reduce (local_size > 1, no accum_float32). `order`: the ring's members as
// ranks 0..n-1 (empty: in order; the hierarchical ring is ordered node by node), so a permuted
// ring exercises the member mapping of Note [Sub-rings on one communicator].
struct LoopbackShape {
  uint8_t phases = kPhaseBoth;
  int local_size = 0;
  std::vector<int> order;
};

// data[r]: rank r's tensor (numel contiguous elements of dtype) on `device`. Ordered after, and
// waited for by, `caller` (as a synchronous all_reduce). Staging: the pipeline of Note [GPU
// pipeline rule] (gpu_pipeline.h) for `knobs` in kGpuStagingBytes per rank, as CudaRing's. Throws
// rr::Error (kBackend for CUDA failures, kRuntime on a rendezvous mismatch, kValue for a bad
// shape); on an error the streams are synchronized before returning.
void loopbackAllReduce(int device, const std::vector<void*>& data, int64_t numel, DType dtype, RedOp op,
                       bool accum_float32, const GpuKnobs& knobs, cudaStream_t caller,
                       const LoopbackShape& shape = LoopbackShape());

}  // namespace rr
