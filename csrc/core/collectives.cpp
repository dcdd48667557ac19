#include "collectives.h"

#include "error.h"

namespace rr {

RingMembers resolveRing(const std::vector<int>& members, int comm_size, int comm_rank) {
  RR_CHECK(comm_size >= 1 && comm_rank >= 0 && comm_rank < comm_size, kValue, "ringreduce: rank ", comm_rank,
           " of a communicator of ", comm_size);
  RingMembers ring;
  if (members.empty()) {
    for (int i = 0; i < comm_size; ++i) ring.ranks.push_back(i);
    ring.index = comm_rank;
    return ring;
  }
  std::vector<char> seen(static_cast<size_t>(comm_size), 0);
  ring.index = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    const int m = members[i];
    RR_CHECK(m >= 0 && m < comm_size, kValue, "ringreduce: rank ", m, " of the ring is outside the group of ",
             comm_size, " ranks");
    RR_CHECK(!seen[static_cast<size_t>(m)], kValue, "ringreduce: rank ", m, " appears twice in the ring's rank list");
    seen[static_cast<size_t>(m)] = 1;
    if (m == comm_rank) ring.index = static_cast<int>(i);
  }
  RR_CHECK(ring.index >= 0, kValue, "ringreduce: this process (rank ", comm_rank,
           " of the group) is not in the ring's rank list");
  ring.ranks = members;
  return ring;
}

std::vector<int> ringKey(const std::vector<int>& members, int comm_size) {
  bool identity = static_cast<int>(members.size()) == comm_size;
  for (size_t i = 0; identity && i < members.size(); ++i) identity = members[i] == static_cast<int>(i);
  return identity ? std::vector<int>{} : members;
}

namespace {
// One stage per lane of `o` (Note [Lanes]).
std::vector<RingStage> laneStages(const RingMembers& ring, int64_t numel, DType dtype, RedOp op, PlanOptions o) {
  const int32_t lanes = o.lanes >= 1 ? o.lanes : 1;
  std::vector<RingStage> stages(static_cast<size_t>(lanes));
  for (int32_t k = 0; k < lanes; ++k) {
    o.lanes = lanes;
    o.lane = k;
    RingStage& st = stages[static_cast<size_t>(k)];
    st.plan = buildPlan(ring.size(), ring.index, numel, dtype, o);
    st.op = op;
    st.members = ring.ranks;
    st.lane = k;
  }
  return stages;
}
}  // namespace

std::vector<RingStage> flatRingStages(const RingMembers& ring, int64_t numel, DType dtype, RedOp op,
                                      const PlanOptions& base) {
  PlanOptions o = base;
  o.phases = kPhaseBoth;
  o.average = op == RedOp::kAvg;
  return laneStages(ring, numel, dtype, op, o);
}

std::vector<RingStage> ringHalfStages(const RingMembers& ring, int64_t numel, DType dtype, RedOp op,
                                      const PlanOptions& base, uint8_t phases) {
  RR_CHECK(phases == kPhaseReduceScatter || phases == kPhaseAllGather, kValue,
           "ringreduce: a ring half is the reduce-scatter or the all-gather, got phase mask ", int(phases));
  PlanOptions o = base;
  o.phases = phases;
  o.owner_shift = -1;  // ring index r owns block r
  o.exact_chunks = true;
  o.accum_float32 = false;
  o.average = phases == kPhaseReduceScatter && op == RedOp::kAvg;
  return laneStages(ring, numel, dtype, phases == kPhaseAllGather ? RedOp::kSum : op, o);
}

std::vector<RingStage> hierarchicalStages(const RingMembers& ring, int local_size, int64_t numel, DType dtype,
                                          RedOp op, const PlanOptions& base) {
  const int n = ring.size();
  const int L = local_size;
  if (L <= 1 || L >= n) return flatRingStages(ring, numel, dtype, op, base);
  PlanOptions one_lane = base;  // the three stages run one after another on one lane
  one_lane.lanes = 1;
  one_lane.lane = 0;
  one_lane.wire_dtype.reset();  // the node stages: no wire (Note [Hierarchical 16-bit wire])
  one_lane.wire_gather16 = false;
  one_lane.owner_shift = 0;
  one_lane.exact_chunks = false;
  RR_CHECK(n % L == 0, kValue, "ringreduce: hierarchical all-reduce over ", n, " ranks needs equal nodes, got ", L,
           " ranks per node");
  RR_CHECK(!base.accum_float32, kValue,
           "ringreduce internal error: the hierarchical stages never carry float32 partials (reduce a float32 copy)");
  // Note [Hierarchical 16-bit wire]: only the cross-node ring (stage 2), where bytes cost, has the
  // wire; node sums stay float32 and are rounded to 16 bits once, as the flat ring's first hop rounds
  // its inputs. Stage 2's all-gather carries the owners' finished values (or their 16-bit rounding).
  const int M = n / L;
  const int node = ring.index / L;
  const int local = ring.index % L;
  std::vector<int> intra, inter;
  for (int l = 0; l < L; ++l) intra.push_back(ring.ranks[static_cast<size_t>(node * L + l)]);
  for (int k = 0; k < M; ++k) inter.push_back(ring.ranks[static_cast<size_t>(k * L + local)]);

  std::vector<RingStage> stages(3);
  // 1. Reduce-scatter inside the node (the owned range depends on (L, numel, dtype) only).
  PlanOptions p1 = one_lane;
  p1.phases = kPhaseReduceScatter;
  p1.average = false;
  p1.avg_divisor = 0;
  p1.post_factor = 0;  // every contribution is divided by the predivide factor here, scaled in stage 2
  p1.extra_divisor = 1;
  stages[0].plan = buildPlan(L, local, numel, dtype, p1);
  stages[0].op = op == RedOp::kAvg ? RedOp::kSum : op;
  stages[0].members = intra;
  // 2. A full ring over that range among the M ranks with local rank `local`; AVG divides by n.
  const RingSchedule& sc = stages[0].plan.sched;
  const Range mine = numel > 0 ? sc.chunkRange(sc.ownedChunk(local)) : Range{0, 0};
  PlanOptions p2 = one_lane;
  p2.phases = kPhaseBoth;
  p2.average = op == RedOp::kAvg;
  p2.avg_divisor = n;
  p2.pre_factor = 0;  // its inputs are node sums, divided in stage 1 already
  p2.wire_dtype = base.wire_dtype;
  p2.wire_gather16 = base.wire_gather16;  // Note [16-bit all-gather]: stage 2's all-gather moves 16 bits
  stages[1].plan = buildPlan(M, node, mine.size(), dtype, p2);
  stages[1].op = op;
  stages[1].offset = mine.begin;
  stages[1].members = inter;
  // 3. All-gather inside the node.
  PlanOptions p3 = p1;
  p3.phases = kPhaseAllGather;
  p3.pre_factor = 0;
  stages[2].plan = buildPlan(L, local, numel, dtype, p3);
  stages[2].op = RedOp::kSum;
  stages[2].members = intra;
  return stages;
}

DType stagesDType(DType dtype, bool hierarchical, bool accum_float32) {
  return hierarchical && accum_float32 && isHalfType(dtype) ? DType::kFloat32 : dtype;
}

}  // namespace rr
