// ringreduce CPU: runs a direct all-reduce (Note [Direct all-reduce] in csrc/core/direct.h) over a
// Transport on the calling thread: gloo point-to-point between hosts.
#pragma once

#include <vector>

#include "../core/direct.h"
#include "../core/transport.h"

namespace rr {

struct DirectBuffers {
  void* data = nullptr;         // numel contiguous elements of plan.dtype
  std::vector<void*> buffers;   // plan.numBuffers() staging buffers of plan.buffer_bytes each
  void* scratch = nullptr;      // kReduceInOrderScratchBytes (host_reduce.h)
};

// Note [Direct rounds on gloo]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The reduce-scatter posts the receives of the first `depth` rounds, then their sends (gloo's send
// waits for the receiver's notice: Note [gloo pair locks] in c10d_transport.h), each round to its
// peers in the order r + 1, r + 2, ... so that no rank is everyone's first. Round g's reduce waits
// for its receives alone; its sends are waited for before round g + depth reuses their buffers
// (the wire's converted pieces) and posts. The all-gather does the same with the finished pieces,
// once every reduce-scatter round is over (it reuses the receive buffers), and widens or copies
// each received piece into the tensor. Every receive lands in staging; every request of the call is
// waited for before it returns (the transport keeps what a failure leaves: Note [Failed calls keep
// their buffers] in group_runtime.h). Round g's messages use tag + g mod kTagsPerCall, each half its own tag.
void executeDirect(const DirectPlan& plan, Transport& transport, const DirectBuffers& buffers, int scatter_tag,
                   int gather_tag);

}  // namespace rr
