// The GPU pipeline rule (csrc/cuda/gpu_pipeline.h, Note [GPU pipeline rule]) as a ctest: segments
// grow with the tensor up to a staging slot, the staging stays within its bound, the knobs
// override, bad knobs raise, and every pipeline shape the rule produces - segments, slots, both
// ring halves, float32 partials - passes the plan checker (tests/support/plan_checker.h), which
// runs all ranks' plans with random completion orders.
#include <functional>
#include <string>
#include <vector>

#include "../../../csrc/core/error.h"
#include "../../../csrc/core/plan.h"
#include "../../../csrc/cuda/gpu_pipeline.h"
#include "../../../csrc/cuda/ring_driver.h"
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

// Note [Lanes]: every lane count with every pipeline shape: each lane's plan set passes the checker
// and the lanes split the tensor, every element to exactly one lane.
TEST_CASE(lanes_split_the_tensor_and_pass_the_plan_checker) {
  int checked = 0;
  for (int n : {2, 3, 4})
    for (int lanes : {1, 2, 3, 4})
      for (int64_t numel : {int64_t{1}, int64_t{n + 1}, int64_t{517}, int64_t{3001}})
        for (bool accum : {false, true}) {
          if (rrtest::kSanitized && numel > 600) continue;
          const DType dt = accum ? DType::kFloat16 : DType::kFloat32;
          GpuKnobs k;
          k.lanes = lanes;
          const GpuPipeline p = gpuPipeline(n, numel, dt, accum, 8192, k, kGpuMaxLanes);
          CHECK_EQ(p.lanes, lanes);
          PlanOptions o = gpuPlanOptions(RedOp::kAvg, accum, p.max_segment_bytes, p.slots, p.slot_bytes);
          o.lanes = p.lanes;
          const std::string bad = checkLanes(n, numel, dt, o, 31 * n + numel + lanes, 1);
          CHECK_MSG(bad.empty(), bad);
          ++checked;
        }
  CHECK(checked > 50);
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

TEST_MAIN()
