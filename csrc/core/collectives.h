// ringreduce core: every collective as a list of ring stages, the one composition both transports
// run (the CPU group runtime executes the stages one after another over its Transport, the GPU
// driver enqueues them on its streams).
//
// Note [Hierarchical all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The ring's members are ordered node by node: member k * L + l is local rank l of node k (L ranks
// per node, M nodes). Three rings run one after another over the same transport (rank lists,
// Note [Sub-rings by rank list] in transport.h; on CPUs with the node stages in shared memory, a
// large call is cut into pieces whose stages overlap: Note [Pipelined hierarchical all-reduce] in
// csrc/cpu/node_pipeline.cpp):
//   1. reduce-scatter inside the node (ring of L): local rank l ends with the node's reduction of
//      chunk (l + 1) mod L - the same element range on every node, since it depends on (L, numel)
//      only; AVG sums here;
//   2. a full ring all-reduce of that range among the M ranks with local rank l (one per node),
//      AVG dividing once, by the whole ring's size M * L, at its final reduce;
//   3. all-gather inside the node.
// Each rank sends 2 (L-1)/L S bytes inside its node and 2 (M-1)/M S/L across nodes (S = tensor
// bytes), against 2 (n-1)/n S across nodes for the flat ring's ranks at a node boundary. The
// result is bitwise identical on every rank (stage 2 is a ring all-reduce, stage 3 copies), but its
// rounding differs from the flat ring's, as the summation order does. Half types with float32
// accumulation reduce a float32 copy of the tensor (stagesDType below; the caller makes it), so
// the stages never carry float32 partials; a 16-bit wire is refused (the flat ring has it). A
// predivide factor divides every contribution in stage 1, and stage 2's final reduce scales once
// (Note [Reduction contract] in functors.h).
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

// The identity of a ring for its call counter (agreement frames carry it): empty for every rank
// of the group in order, else the list. Two rank lists are one ring iff their keys match.
std::vector<int> ringKey(const std::vector<int>& members, int comm_size);

// One ring of a call: `plan` over the group ranks `members` (ring index -> group rank,
// members.size() == plan.sched.nranks), on the elements [offset, offset + plan.sched.numel) of the
// call's buffer, reducing with `op`.
struct RingStage {
  Plan plan;
  RedOp op = RedOp::kSum;
  int64_t offset = 0;
  std::vector<int> members;
  // Note [Lanes] (plan.h): the lane this stage runs on (plan.lane); stages of one lane run one after
  // another, lanes side by side.
  int32_t lane = 0;
  // This process's index in `members` (plan.rank).
  int index() const { return plan.rank; }
};

// The stages of each collective (`base`: the transport's plan options; phases/owner_shift/
// exact_chunks/average are set where the collective fixes them):
//   * flatRingStages: one full ring all-reduce over `ring` (base.avg_divisor is kept), as
//     base.lanes stages, one per lane (Note [Lanes]);
//   * ringHalfStages: reduce_scatter (phases = kPhaseReduceScatter) or all_gather
//     (kPhaseAllGather) over `ring`: Note [Ring halves] in plan.h, owner_shift -1 and exact
//     blocks, so ring index r owns block r of numel / n elements; one stage per lane too;
//   * hierarchicalStages: Note [Hierarchical all-reduce] over `ring` ordered node by node with
//     `local_size` ranks per node, on one lane (base.lanes is ignored). base.accum_float32 and
//     base.wire_dtype must be off. local_size <= 1 or >= the ring's size is the flat ring. Throws
//     kValue when local_size does not divide the ring's size.
std::vector<RingStage> flatRingStages(const RingMembers& ring, int64_t numel, DType dtype, RedOp op,
                                      const PlanOptions& base);
std::vector<RingStage> ringHalfStages(const RingMembers& ring, int64_t numel, DType dtype, RedOp op,
                                      const PlanOptions& base, uint8_t phases);
std::vector<RingStage> hierarchicalStages(const RingMembers& ring, int local_size, int64_t numel, DType dtype,
                                          RedOp op, const PlanOptions& base);

// The dtype an all-reduce's stages run in, for a tensor of `dtype`: the tensor's own, except for
// the hierarchical all-reduce with float32 accumulation of a half type. Its three rings cannot
// hand float32 partials from one to the next, so the whole reduction runs on a float32 copy,
// rounded once at the end, as the flat ring's accumulation mode promises. Both the CPU and the GPU
// call path make their working copy in this dtype.
DType stagesDType(DType dtype, bool hierarchical, bool accum_float32);

}  // namespace rr
