// ringreduce GPU: the whole GPU driver on ONE GPU, without NCCL (a test fake).
//
// Note [Loopback ring]
// ~~~~~~~~~~~~~~~~~~~
// loopbackAllReduce() runs a ring of n ranks as n host threads on one device, each with its own
// streams, staging slots and plan events, enqueueing its stages through ring_executor.h like CudaRing.
// Only the exchange differs: the sender records `ready` on its comm stream and posts (pointer,
// bytes, ready) to the peer; the receiver takes the matching post (in posting order, bytes checked),
// makes its comm stream wait `ready`, copies device-to-device, records `consumed` and hands it
// back; the sender's comm stream waits `consumed` (an NCCL send also completes only once received).
// The threads block only on each other's enqueueing (never on the GPU), in exchange order, so the
// rendezvous cannot deadlock. One GPU thus runs everything of the real driver but the NCCL calls.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "../core/dtype.h"
#include "../core/plan.h"
#include "gpu_pipeline.h"

namespace rr {

// The collective: the flat all-reduce (default), a ring half (kPhaseReduceScatter: afterwards block
// r of data[r] is the reduced block r; kPhaseAllGather: beforehand block r of data[r] is rank r's),
// or the hierarchical all-reduce (local_size > 1, no accum_float32). `order`: the ring's members
// (empty: 0..n-1), so a permuted ring exercises Note [Sub-rings on one communicator].
struct LoopbackShape {
  uint8_t phases = kPhaseBoth;
  int local_size = 0;
  std::vector<int> order;
};

// data[r]: rank r's tensor on `device`; ordered after and waited for by `caller`. Staging as
// CudaRing's (Note [GPU pipeline rule], one lane). Throws rr::Error (kBackend: CUDA, kRuntime: a
// rendezvous mismatch, kValue: a bad shape), after synchronizing the streams.
void loopbackAllReduce(int device, const std::vector<void*>& data, int64_t numel, DType dtype, RedOp op,
                       bool accum_float32, const GpuKnobs& knobs, cudaStream_t caller,
                       const LoopbackShape& shape = LoopbackShape());

}  // namespace rr
