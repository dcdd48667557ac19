// ringreduce GPU: the one rule that sizes a call's pipeline (segments, staging slots, lanes) and
// picks the one-shot path, from the message and the ring. CUDA-free: the host tests run it.
//
// Note [GPU pipeline rule]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// What a GPU ring costs (docs/performance.md, "What bounds the GPU ring now"): every exchange is one
// NCCL launch, and NCCL runs the kernels of one communicator one after another (src/enqueue.cc:
// each launch waits for the communicator's device stream, which then waits for the kernel), so a
// lane's exchanges never overlap each other: a call costs about
//     (number of exchanges) x (launch and start-up) + (bytes on the wire) / (p2p bandwidth),
// with the reduce kernels hidden behind the next exchange as long as a chunk has >= 2 segments.
// On NCCL's socket transport a launch costs milliseconds (measured on one H100, ranks sharing it:
// ~2.3 ms per exchange at 256 KiB and at 1 MiB alike), on NVLink microseconds; either way fewer,
// larger exchanges are better, and the only limits are the staging memory (a segment must fit a
// slot) and the pipelining (the reduce of segment j overlaps the transfer of segment j + 1). So:
//   * slots = 2 (RINGREDUCE_SLOTS overrides): double buffering is all a serialized lane needs;
//   * a slot holds one segment of the widest element the plan moves (Plan::slotBytes): the tensor's,
//     or float32 with accum_dtype=float32 on a half type; a 16-bit wire never widens it (its 16-bit
//     partials fill half a slot, the float32 all-gather all of it), so a wire or a predivide factor
//     never changes the pipeline, and the driver refuses slots smaller than a plan needs;
//   * a segment is as large as a slot (staging / (lanes x slots); RINGREDUCE_SEGMENT_BYTES caps it
//     instead), and never more than half a chunk's share of a lane (makeRingSchedule's own rule:
//     ceil(chunk / 2)), so that every lane of every chunk pipelines at least two segments. With the
//     16 MiB of staging of a communicator: 8 MiB segments, a 64 MiB all-reduce on 2 ranks in 8
//     exchanges (it was 64 with 1 MiB segments);
//   * lanes (Note [Lanes] in plan.h): as many as the communicator has (kGpuDefaultLanes = 2 unless
//     RINGREDUCE_LANES said otherwise when it was created), but only while every lane still gets
//     two segments of at least kGpuMinLaneSegmentBytes per chunk; RINGREDUCE_LANES overrides per
//     call, up to the communicator's lanes. Each lane is its own NCCL communicator, so lanes run
//     their transfers side by side; NCCL gives one send/recv between two GPUs only a few channels
//     (src/graph/paths.cc: 2 per PCIe or network peer by default, 2 per NVLink-bandwidth unit),
//     and K lanes are K such operations in flight (docs/performance.md, the model);
//   * the one-shot all-reduce (Note [GPU one-shot all-reduce], csrc/core/one_shot_body.h) for a
//     tensor of at most gpuOneShotBytes(n) bytes: 1 MiB up to 4 ranks (on 2 ranks the same bytes
//     cross the wire as in the ring, in one exchange instead of two), 256 KiB up to 8, 64 KiB
//     beyond, and at most RINGREDUCE_SEGMENT_BYTES when that is set (as on CPU: tests that shrink
//     the segment keep the ring); the n - 1 received tensors must fit the staging. Defaults from the cost model
//     (docs/performance.md), to be measured on GPUs (RINGREDUCE_ONESHOT_BYTES overrides; 0 turns
//     the one-shot off).
// None of this changes a result bit: chunk ownership depends on (n, numel) only (Note [Chunk
// ownership] in schedule.h), lanes split segments, not chunks, and the one-shot reduces in the
// ring's order (docs/algorithm.md, "What decides the bits"). Every rank computes the same pipeline
// from the same (n, numel, dtype) and knobs; the knobs must agree on every rank (the agreement
// frame carries the segment override).
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

// The pipeline of a ring call over `nranks` ranks of `numel` elements of `dtype` (float32
// partials on the wire when `accum_float32`; a 16-bit wire_dtype needs no argument: its widest
// element is the tensor's), in `staging_bytes` of staging, with at most
// `max_lanes` lanes (the communicator's). Throws kValue for knobs out of range or staging too small
// for the slots.
GpuPipeline gpuPipeline(int nranks, int64_t numel, DType dtype, bool accum_float32, int64_t staging_bytes,
                        const GpuKnobs& knobs, int32_t max_lanes = kGpuDefaultLanes);

// The largest tensor (bytes) a flat all-reduce over `nranks` ranks takes in one shot, 0 for none.
int64_t gpuOneShotBytes(int nranks, int64_t staging_bytes, const GpuKnobs& knobs);

}  // namespace rr
