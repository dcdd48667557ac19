// The GPU pipeline rule (csrc/cuda/gpu_pipeline.h, Note [GPU pipeline rule]) as a ctest: segments
// grow with the tensor up to a staging slot, the staging stays within its bound, the knobs
// override, bad knobs raise, and every pipeline shape the rule produces - segments, slots, both
// ring halves, float32 partials - passes the plan checker (tests/support/plan_checker.h), which
// runs all ranks' plans with random completion orders.
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "../../../csrc/core/error.h"
#include "../../../csrc/core/plan.h"
#include "../../../csrc/cuda/gpu_pipeline.h"
#include "../../../csrc/cuda/ring_executor.h"
#include "../check.h"
#include "support/plan_checker.h"

namespace {

using namespace rr;

// Lane 0's plan (lanes as the rule picks them for a communicator of `max_lanes` lanes).
Plan planFor(int n, int r, int64_t numel, DType dtype, bool accum, int64_t staging, const GpuKnobs& knobs,
             uint8_t phases = kPhaseBoth, int32_t max_lanes = 1) {
  const GpuPipeline p = gpuPipeline(n, numel, dtype, accum, staging, knobs, max_lanes);
  PlanOptions o = gpuPlanOptions(RedOp::kSum, accum, p.max_segment_bytes, p.slots, p.slot_bytes);
  o.lanes = p.lanes;
  o.phases = phases;
  if (phases != kPhaseBoth) {
    o.owner_shift = -1;
    o.exact_chunks = true;
  }
  return buildPlan(n, r, numel, dtype, o);
}

int exchangesOf(const Plan& p) {
  int k = 0;
  for (const Op& o : p.ops) k += o.kind == OpKind::kExchange ? 1 : 0;
  return k;
}

bool throwsValue(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.kind() == ErrorKind::kValue;
  }
  return false;
}

}  // namespace

TEST_CASE(segments_grow_with_the_tensor_up_to_a_slot) {
  const GpuKnobs none;
  // 2 ranks, float32: the segment is half a chunk until it reaches a slot (16 MiB / 2 slots).
  struct Want {
    int64_t bytes;
    int64_t segment_bytes;
    int exchanges;
  };
  for (const Want& w : {Want{1 << 20, 256 << 10, 4}, Want{16 << 20, 4 << 20, 4}, Want{64 << 20, 8 << 20, 8},
                        Want{256 << 20, 8 << 20, 32}}) {
    const Plan p = planFor(2, 0, w.bytes / 4, DType::kFloat32, false, kGpuStagingBytes, none);
    CHECK_MSG(p.sched.segment * 4 == w.segment_bytes, w.bytes << " B: segment " << p.sched.segment * 4);
    CHECK_MSG(exchangesOf(p) == w.exchanges, w.bytes << " B: " << exchangesOf(p) << " exchanges");
    CHECK_EQ(p.num_slots, kGpuSlots);
    CHECK(p.stagingBytes() <= kGpuStagingBytes);
  }
  // A communicator of 2 lanes (the default): both from 4 MiB chunks on, each with 4 MiB slots and at
  // least two segments per chunk; the staging bound holds for all lanes together.
  for (const Want& w : {Want{1 << 20, 256 << 10, 4}, Want{16 << 20, 2 << 20, 4}, Want{64 << 20, 4 << 20, 8},
                        Want{256 << 20, 4 << 20, 32}}) {
    const GpuPipeline p = gpuPipeline(2, w.bytes / 4, DType::kFloat32, false, kGpuStagingBytes, none);
    const Plan lane0 = planFor(2, 0, w.bytes / 4, DType::kFloat32, false, kGpuStagingBytes, none, kPhaseBoth,
                               kGpuDefaultLanes);
    CHECK_EQ(p.lanes, w.bytes >= (4 << 20) ? 2 : 1);
    CHECK_MSG(lane0.sched.segment * 4 == w.segment_bytes,
              w.bytes << " B, 2 lanes: segment " << lane0.sched.segment * 4);
    CHECK_MSG(exchangesOf(lane0) == w.exchanges, w.bytes << " B, 2 lanes: " << exchangesOf(lane0) << " exchanges");
    CHECK(lane0.stagingBytes() * p.lanes <= kGpuStagingBytes);
  }
  // 8 ranks, bfloat16 with float32 partials: slots hold float32, the staging bound holds.
  for (int64_t bytes : {int64_t{1} << 10, int64_t{1} << 20, int64_t{64} << 20, int64_t{1} << 30}) {
    const Plan p = planFor(8, 3, bytes / 2, DType::kBFloat16, true, kGpuStagingBytes, none, kPhaseBoth, kGpuMaxLanes);
    CHECK_MSG(p.stagingBytes() * p.lanes <= kGpuStagingBytes, bytes << " B: staging " << p.stagingBytes());
    CHECK(p.sched.nsegs >= 2 || p.sched.chunk * 2 <= 16);
  }
  // The one-shot threshold: the rule's, capped by what n - 1 tensors in the staging allow.
  CHECK_EQ(gpuOneShotBytes(2, kGpuStagingBytes, none), int64_t(1) << 20);
  CHECK_EQ(gpuOneShotBytes(4, kGpuStagingBytes, none), int64_t(1) << 20);
  CHECK_EQ(gpuOneShotBytes(8, kGpuStagingBytes, none), int64_t(256) << 10);
  CHECK_EQ(gpuOneShotBytes(9, kGpuStagingBytes, none), int64_t(64) << 10);
  CHECK_EQ(gpuOneShotBytes(1, kGpuStagingBytes, none), int64_t(0));
  GpuKnobs big;
  big.one_shot_bytes = int64_t(1) << 30;
  CHECK_EQ(gpuOneShotBytes(5, kGpuStagingBytes, big), kGpuStagingBytes / 4);
  GpuKnobs off;
  off.one_shot_bytes = 0;
  CHECK_EQ(gpuOneShotBytes(2, kGpuStagingBytes, off), int64_t(0));
  GpuKnobs small_segments;  // as on CPU: a set segment size caps the one-shot
  small_segments.segment_bytes = 64;
  CHECK_EQ(gpuOneShotBytes(2, kGpuStagingBytes, small_segments), int64_t(64));
}

TEST_CASE(knobs_override_the_rule_and_bad_knobs_raise) {
  GpuKnobs seg;
  seg.segment_bytes = 1 << 20;
  const Plan a = planFor(2, 1, (64 << 20) / 4, DType::kFloat32, false, kGpuStagingBytes, seg);
  CHECK_EQ(a.sched.segment * 4, int64_t(1) << 20);
  CHECK_EQ(exchangesOf(a), 64);
  GpuKnobs slots;
  slots.slots = 4;
  const Plan b = planFor(2, 1, (64 << 20) / 4, DType::kFloat32, false, kGpuStagingBytes, slots);
  CHECK_EQ(b.num_slots, 4);
  CHECK_EQ(b.sched.segment * 4, int64_t(4) << 20);
  GpuKnobs bad;
  bad.segment_bytes = 8;
  CHECK(throwsValue([&] { gpuPipeline(2, 100, DType::kFloat32, false, kGpuStagingBytes, bad); }));
  bad = GpuKnobs();
  bad.lanes = kGpuMaxLanes + 1;
  CHECK(throwsValue([&] { gpuPipeline(2, 100, DType::kFloat32, false, kGpuStagingBytes, bad); }));
  bad = GpuKnobs();
  bad.slots = 1 << 20;  // slots of less than 256 bytes
  CHECK(throwsValue([&] { gpuPipeline(2, 100, DType::kFloat32, false, kGpuStagingBytes, bad); }));
}

// Every shape the rule produces, through the plan checker. A small staging gives the same shapes
// (several segments per chunk, slots reused many times) at sizes the checker simulates quickly.
TEST_CASE(every_pipeline_shape_passes_the_plan_checker) {
  const int64_t staging = 4096;
  int checked = 0;
  for (int n : {2, 3, 5, 8})
    for (int64_t numel : {int64_t{1}, int64_t{n - 1}, int64_t{n + 1}, int64_t{257}, int64_t{4099}})
      for (int slots : {0, 1, 3})
        for (int64_t seg : {int64_t{0}, int64_t{48}})
          for (DType dt : {DType::kFloat32, DType::kBFloat16})
            for (bool accum : {false, true}) {
              if (numel <= 0 || (accum && dt == DType::kFloat32)) continue;
              if (rrtest::kSanitized && (numel > 300 || n > 3)) continue;
              GpuKnobs k;
              k.slots = slots;
              k.segment_bytes = seg;
              const GpuPipeline p = gpuPipeline(n, numel, dt, accum, staging, k, 1);
              PlanOptions o = gpuPlanOptions(RedOp::kAvg, accum, p.max_segment_bytes, p.slots, p.slot_bytes);
              const std::string bad = checkPlans(n, numel, dt, o, 17 * n + numel, 1);
              CHECK_MSG(bad.empty(), bad);
              ++checked;
            }
  // The ring halves, with the exact blocks of reduce_scatter and all_gather.
  for (int n : {2, 4})
    for (int64_t blk : {int64_t{1}, int64_t{63}, int64_t{1000}})
      for (uint8_t phases : {uint8_t{kPhaseReduceScatter}, uint8_t{kPhaseAllGather}}) {
        const GpuPipeline p = gpuPipeline(n, n * blk, DType::kFloat32, false, staging, GpuKnobs(), 1);
        PlanOptions o = gpuPlanOptions(RedOp::kSum, false, p.max_segment_bytes, p.slots, p.slot_bytes);
        o.phases = phases;
        o.owner_shift = -1;
        o.exact_chunks = true;
        const std::string bad = checkPlans(n, n * blk, DType::kFloat32, o, 5 * n + blk, 1);
        CHECK_MSG(bad.empty(), bad);
        ++checked;
      }
  CHECK(checked > 20);
}

// The arithmetic a plan may carry (Note [Reduction contract]): none, float32 partials of a half
// tensor, a 16-bit wire of a float32 tensor, predivide factors with and without a wire.
struct Arith {
  DType dtype;
  bool accum;
  std::optional<DType> wire;
  double predivide;
};
const Arith kAriths[] = {{DType::kFloat32, false, std::nullopt, 0},
                         {DType::kFloat16, true, std::nullopt, 0},
                         {DType::kFloat32, false, DType::kBFloat16, 0},
                         {DType::kFloat32, false, DType::kFloat16, 3},
                         {DType::kBFloat16, true, std::nullopt, 2}};

PlanOptions withArith(PlanOptions o, const Arith& a) {
  o.wire_dtype = a.wire;
  o.pre_factor = o.post_factor = a.predivide;
  return o;
}

// Note [Lanes]: every lane count with every pipeline shape and arithmetic: each lane's plan set
// passes the checker (a 16-bit wire's converts and partial hops included: each element of each rank
// divided once, reduced once), and the lanes split the tensor and the partials they share, every
// element to exactly one lane.
TEST_CASE(lanes_split_the_tensor_and_pass_the_plan_checker) {
  int checked = 0;
  for (int n : {2, 3, 4})
    for (int lanes : {1, 2, 3, 4})
      for (int64_t numel : {int64_t{1}, int64_t{n + 1}, int64_t{517}, int64_t{3001}})
        for (const Arith& a : kAriths) {
          if (rrtest::kSanitized && numel > 600) continue;
          GpuKnobs k;
          k.lanes = lanes;
          const GpuPipeline p = gpuPipeline(n, numel, a.dtype, a.accum, 8192, k, kGpuMaxLanes);
          CHECK_EQ(p.lanes, lanes);
          PlanOptions o = withArith(gpuPlanOptions(RedOp::kAvg, a.accum, p.max_segment_bytes, p.slots, p.slot_bytes), a);
          o.lanes = p.lanes;
          const std::string bad = checkLanes(n, numel, a.dtype, o, 31 * n + numel + lanes, 1);
          CHECK_MSG(bad.empty(), bad);
          ++checked;
        }
  CHECK(checked > 150);
  // A plan set whose ranks run different lanes is refused by name.
  PlanOptions o = gpuPlanOptions(RedOp::kSum, false, 64, 2, 256);
  o.lanes = 2;
  std::vector<Plan> plans;
  for (int r = 0; r < 3; ++r) {
    o.lane = r == 1 ? 1 : 0;
    plans.push_back(buildPlan(3, r, 999, DType::kFloat32, o));
  }
  const std::string err = checkPlanSet(plans, CheckOptions());
  CHECK_MSG(err.find("lane") != std::string::npos, err);
}

// Note [GPU pipeline rule]: a slot holds a segment of the widest element the plan moves. With a
// 16-bit wire that is the float32 all-gather (the reduce-scatter's 16-bit partials fill half a slot),
// with accum_dtype=float32 the float32 partials: so the rule's segments are those of the float32
// (or float32-partial) plan, every lane's staging spans fit its slots, and all lanes' slots fit the
// staging.
TEST_CASE(slots_hold_the_widest_element_of_wire_and_accum_plans) {
  int checked = 0;
  for (int n : {2, 3, 8})
    for (int64_t bytes : {int64_t{4} << 10, int64_t{1} << 20, int64_t{64} << 20})
      for (int32_t max_lanes : {1, kGpuMaxLanes})
        for (const Arith& a : kAriths) {
          const int64_t numel = bytes / static_cast<int64_t>(dtypeSize(a.dtype));
          const GpuPipeline p = gpuPipeline(n, numel, a.dtype, a.accum, kGpuStagingBytes, GpuKnobs(), max_lanes);
          CHECK(p.slot_bytes * p.slots * p.lanes <= kGpuStagingBytes);
          PlanOptions o = withArith(gpuPlanOptions(RedOp::kSum, a.accum, p.max_segment_bytes, p.slots, p.slot_bytes), a);
          o.lanes = p.lanes;
          const PlanOptions plain = gpuPlanOptions(RedOp::kSum, a.accum, p.max_segment_bytes, p.slots, p.slot_bytes);
          for (int32_t lane = 0; lane < p.lanes; ++lane) {
            o.lane = lane;
            const Plan plan = buildPlan(n, n - 1, numel, a.dtype, o);
            const int64_t widest = plan.accum_float32 ? 4 : static_cast<int64_t>(dtypeSize(a.dtype));
            CHECK_MSG(plan.slotBytes() == plan.slot_elems * widest, "slot of " << plan.slotBytes() << " bytes");
            CHECK_MSG(static_cast<int64_t>(slotBytesFor(plan)) <= p.slot_bytes,
                      n << " ranks, " << bytes << " B, wire " << (a.wire ? dtypeName(*a.wire) : "none") << ": plan slot "
                         << slotBytesFor(plan) << " > " << p.slot_bytes);
            for (const Op& op : plan.ops)
              for (const Span* sp : {&op.send, &op.recv, &op.a, &op.dst})
                if (sp->buf == BufKind::kStaging)
                  CHECK(sp->count * static_cast<int64_t>(dtypeSize(sp->type)) <= plan.slotBytes());
            // A wire or a predivide factor never changes the pipeline's segments.
            CHECK_EQ(plan.sched.segment, buildPlan(n, n - 1, numel, a.dtype, plain).sched.segment);
            ++checked;
          }
        }
  CHECK(checked > 90);
}

TEST_MAIN()
