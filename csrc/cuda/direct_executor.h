// ringreduce GPU: the direct all-reduce (Note [Direct all-reduce] in csrc/core/direct.h) enqueued on
// a DeviceBackend's streams, as ring_executor.h enqueues the ring (CUDA-free; the simulated device
// and the fake NCCL test it).
//
// Note [Direct rounds on streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Framed as every call (Note [Driving the plan on streams]), on lane 0. Reduce-scatter round g:
//   kCompute  (a wire: the converts of round g's pieces into their buffers, recording convert(g))
//   kComm     wait convert(g); wait reduced(g - depth) (its receive buffers are this round's);
//             one group: this rank's piece of chunk p to every peer p, every peer's piece of chunk r
//             into its receive buffer; record scattered(g)
//   kCompute  wait scattered(g); one in-order reduce of the n pieces into the tensor (OneShotBody
//             with chunk 0: rank order); record reduced(g); a wire: then the converts of round
//             g + depth, whose buffers round g's group has finished sending
// The converts of the first `depth` rounds go first, so the second group never waits for the first
// round's reduce. All-gather round g, once every reduce-scatter group is on kComm: wait reduced(g);
// one group sending this rank's finished piece to every peer and receiving each peer's straight into
// the tensor (NCCL aborts rather than delivers late). kCompute then waits for kComm's last group, so
// the call's done event covers it. The first group hands off (it reaches every peer: Note [Which
// exchanges hand off] in ring_executor.h), the others are queued, unless some chunk is empty: then
// every group hands off. Both ends of each message use the same rule, hence the same communicator.
// Every event is recorded once per call, before any wait on it is enqueued.
#pragma once

#include <vector>

#include "../core/direct.h"
#include "ring_executor.h"

namespace rr {

struct DirectCall {
  const DirectPlan* plan = nullptr;
  std::vector<int> members;  // the communicator rank of each of the plan's ranks
  DeviceBuffers buffers;     // data: the tensor; slots: plan.numBuffers() of >= plan.buffer_bytes bytes
  bool caller_waits = true;
};

// Enqueues the call on `backend`. Throws rr::Error(kRuntime/kValue) before enqueueing anything when
// the plan, members or buffers do not fit.
void enqueueDirect(const DirectCall& call, DeviceBackend& backend);

// Stream operations the call enqueues (Note [Bounded launch queue] in group_runtime.h).
int64_t directQueuedOps(const DirectPlan& plan);

}  // namespace rr
