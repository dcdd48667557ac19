// ringreduce GPU: the one rule that sizes a call's pipeline and picks the one-shot (CUDA-free).
//
// Note [GPU pipeline rule]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// NCCL runs the kernels of one communicator one after another (src/enqueue.cc), so a lane's
// exchanges never overlap and a call costs about (exchanges) x (launch and start-up) + (bytes) /
// (p2p bandwidth), the reduces hidden behind the next exchange (docs/performance.md, "What bounds
// the GPU ring now"). Fewer, larger exchanges are better, limited only by the staging (a segment
// must fit a slot) and the pipelining. So:
//   * slots = 2 (RINGREDUCE_SLOTS): double buffering is all a serialized lane needs;
//   * a slot holds one segment of the widest element the plan moves (Plan::slotBytes: float32 with
//     accum_dtype=float32 on a half type; a 16-bit wire never widens it), so a wire or a predivide
//     factor never changes the pipeline;
//   * a segment is a slot (staging / (lanes x slots); RINGREDUCE_SEGMENT_BYTES caps it), and at most
//     half a chunk's share of a lane, so every lane of every chunk pipelines two segments;
//   * lanes (Note [Lanes] in plan.h): the communicator's (kGpuDefaultLanes unless RINGREDUCE_LANES
//     said otherwise at its creation) while each still gets two segments of kGpuMinLaneSegmentBytes
//     per chunk; RINGREDUCE_LANES overrides per call. Each lane is its own NCCL communicator, and
//     NCCL gives one send/recv between two GPUs only a few channels (src/graph/paths.cc), so K lanes
//     are K such operations in flight;
//   * the one-shot all-reduce (Note [GPU one-shot all-reduce], one_shot_body.h) up to
//     gpuOneShotBytes(n): 1 MiB up to 4 ranks, 256 KiB up to 8, 64 KiB beyond (cost model defaults;
//     RINGREDUCE_ONESHOT_BYTES overrides, 0 turns it off), capped by a set RINGREDUCE_SEGMENT_BYTES
//     as on CPU, and the n - 1 received tensors must fit the staging.
// None of this changes a result bit (docs/algorithm.md, "What decides the bits"): chunk ownership
// depends on (n, numel) only, lanes split segments, not chunks, and the one-shot reduces in the
// ring's order. The knobs must agree on every rank (the agreement frame carries the segment).
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
