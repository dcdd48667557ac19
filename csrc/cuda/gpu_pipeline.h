// ringreduce GPU: the one rule that sizes a call's pipeline and picks the one-shot (CUDA-free).
//
// Note [GPU pipeline rule]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// NCCL runs one communicator's kernels one after another, so a lane's exchanges never overlap and
// fewer, larger exchanges are better (docs/performance.md, "What bounds the GPU ring now";
// docs/design.md section 2.4, "Pipeline", "Lanes", "One-shot"). So:
//   * slots = 2 per lane (double buffering), each holding one segment of the widest element the plan
//     moves (a wire or a predivide factor never changes the pipeline);
//   * a segment is a slot, and at most half a chunk's share of a lane;
//   * lanes: the communicator's while each still gets two segments of kGpuMinLaneSegmentBytes per
//     chunk;
//   * the one-shot up to gpuOneShotBytes(n), capped by a set RINGREDUCE_SEGMENT_BYTES as on CPU and
//     by the n - 1 received tensors fitting the staging.
// None of this changes a result bit (docs/algorithm.md, "What decides the bits"). The knobs must
// agree on every rank (the agreement frame carries the segment).
#pragma once

#include <cstdint>

#include "../core/dtype.h"
#include "../core/plan.h"

namespace rr {

// User overrides (docs/design.md 1.6); 0 (or -1 for one_shot_bytes) leaves it to the rule.
struct GpuKnobs {
  int64_t segment_bytes = 0;    // RINGREDUCE_SEGMENT_BYTES: the largest segment, >= 16
  int32_t slots = 0;            // RINGREDUCE_SLOTS: staging slots per lane, >= 1
  int32_t lanes = 0;            // RINGREDUCE_LANES: lanes, 1..kGpuMaxLanes
  int64_t one_shot_bytes = -1;  // RINGREDUCE_ONESHOT_BYTES: the one-shot threshold; 0: never
};

constexpr int32_t kGpuSlots = 2;
constexpr int32_t kGpuMaxLanes = 4;
constexpr int32_t kGpuDefaultLanes = 2;
constexpr int64_t kGpuMinLaneSegmentBytes = 1 << 20;
// Staging of one communicator (all lanes, and the one-shot's receive buffers): docs/design.md 5.
constexpr int64_t kGpuStagingBytes = 16 << 20;

struct GpuPipeline {
  int64_t max_segment_bytes = 0;  // PlanOptions::max_segment_bytes
  int32_t slots = 0;              // staging slots per lane
  int64_t slot_bytes = 0;         // bytes of each slot (a multiple of 256)
  int32_t lanes = 1;
};

// The pipeline of a ring call (float32 partials when `accum_float32`) in `staging_bytes`, with at
// most `max_lanes` lanes. Throws kValue for knobs out of range or staging too small for the slots.
GpuPipeline gpuPipeline(int nranks, int64_t numel, DType dtype, bool accum_float32, int64_t staging_bytes,
                        const GpuKnobs& knobs, int32_t max_lanes = kGpuDefaultLanes);

// The largest tensor (bytes) a flat all-reduce over `nranks` ranks takes in one shot, 0 for none.
int64_t gpuOneShotBytes(int nranks, int64_t staging_bytes, const GpuKnobs& knobs);

}  // namespace rr
