// ringreduce core: every collective as a list of ring stages, the one composition both transports
// run (the CPU runs them in order over its Transport, the GPU enqueues them on its streams).
//
// Note [Hierarchical all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The ring's members are ordered node by node: member k * L + l is local rank l of node k (L ranks
// per node, M nodes). Three rings run over the same transport (rank lists, Note [Sub-rings by rank
// list] in transport.h; pipelined on CPUs with shared memory: Note [Pipelined hierarchical
// all-reduce] in csrc/cpu/node_pipeline.cpp):
//   1. reduce-scatter inside the node: local rank l ends with the node's sum of chunk (l + 1) mod L,
//      the same range on every node (it depends on (L, numel) only); AVG sums here;
//   2. a full ring all-reduce of that range among the M ranks with local rank l, AVG dividing once
//      by the whole ring's size M * L at its final reduce;
//   3. all-gather inside the node.
// Each rank sends 2 (L-1)/L S bytes inside its node and 2 (M-1)/M S/L across nodes, against
// 2 (n-1)/n S across nodes for the flat ring. The result is bitwise identical on every rank, but
// rounds differently from the flat ring (another summation order). A predivide factor divides
// every contribution in stage 1; stage 2's final reduce scales once (Note [Reduction contract]).
#pragma once

#include <cstdint>
#include <vector>

#include "dtype.h"
#include "plan.h"

namespace rr {

// A ring over ranks of a group (a communicator, a process group) of `comm_size` ranks, explicit:
// ranks[i] is the group rank of ring index i; `index` is this process's ring index.
struct RingMembers {
  std::vector<int> ranks;
  int index = 0;
  int size() const { return static_cast<int>(ranks.size()); }
};

// Checks a rank list (empty: every rank of the group in order) and makes it explicit.
// Throws rr::Error(kValue) for ranks out of range, duplicates, or a list without `comm_rank`.
RingMembers resolveRing(const std::vector<int>& members, int comm_size, int comm_rank);

// A ring's identity for its call counter (frames carry it): empty for every rank of the group in
// order, else the list.
std::vector<int> ringKey(const std::vector<int>& members, int comm_size);

// One ring of a call: `plan` over the group ranks `members` (ring index -> group rank), on elements
// [offset, offset + plan.sched.numel) of the call's buffer, reducing with `op`.
struct RingStage {
  Plan plan;
  RedOp op = RedOp::kSum;
  int64_t offset = 0;
  std::vector<int> members;
  int32_t lane = 0;  // Note [Lanes] (plan.h): stages of one lane run in order, lanes side by side
  int index() const { return plan.rank; }  // this process's index in `members`
};

// The stages of each collective (`base`: the transport's plan options; phases, owner_shift,
// exact_chunks and average are set here):
//   * flatRingStages: one full ring all-reduce over `ring`, one stage per lane (Note [Lanes]);
//   * ringHalfStages: reduce_scatter or all_gather (Note [Ring halves] in plan.h): ring index r owns
//     block r of numel / n elements; one stage per lane too;
//   * hierarchicalStages: Note [Hierarchical all-reduce], with `local_size` ranks per node, on one
//     lane. base.accum_float32 must be off. local_size <= 1 or >= the ring's size is the flat ring;
//     throws kValue when it does not divide the ring's size.
std::vector<RingStage> flatRingStages(const RingMembers& ring, int64_t numel, DType dtype, RedOp op,
                                      const PlanOptions& base);
std::vector<RingStage> ringHalfStages(const RingMembers& ring, int64_t numel, DType dtype, RedOp op,
                                      const PlanOptions& base, uint8_t phases);
std::vector<RingStage> hierarchicalStages(const RingMembers& ring, int local_size, int64_t numel, DType dtype,
                                          RedOp op, const PlanOptions& base);

// The dtype an all-reduce's stages run in: the tensor's, except a hierarchical all-reduce of a half
// type with float32 accumulation, whose three rings cannot hand float32 partials on, so it reduces a
// float32 copy (made by the CPU and GPU call paths) rounded once at the end.
DType stagesDType(DType dtype, bool hierarchical, bool accum_float32);

}  // namespace rr
