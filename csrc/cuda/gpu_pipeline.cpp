#include "gpu_pipeline.h"

#include "../core/error.h"
#include "../core/schedule.h"

namespace rr {

GpuPipeline gpuPipeline(int nranks, int64_t numel, DType dtype, bool accum_float32, int64_t staging_bytes,
                        const GpuKnobs& knobs, int32_t max_lanes) {
  RR_CHECK(knobs.segment_bytes == 0 || knobs.segment_bytes >= 16, kValue,
           "ringreduce: RINGREDUCE_SEGMENT_BYTES must be >= 16, got ", knobs.segment_bytes);
  RR_CHECK(knobs.slots >= 0, kValue, "ringreduce: RINGREDUCE_SLOTS must be >= 1, got ", knobs.slots);
  RR_CHECK(knobs.lanes >= 0 && knobs.lanes <= kGpuMaxLanes, kValue, "ringreduce: RINGREDUCE_LANES must be 1..",
           kGpuMaxLanes, ", got ", knobs.lanes);
  GpuPipeline p;
  const int64_t elem = static_cast<int64_t>(dtypeSize(dtype));
  const int64_t wire = accum_float32 && isHalfType(dtype) ? 4 : elem;
  const int64_t chunk = nranks > 0 && numel > 0 ? roundUp(ceilDiv(numel, nranks), maxI64(1, 16 / elem)) : 0;
  // Note [GPU pipeline rule]: lanes while each gets two segments of kGpuMinLaneSegmentBytes.
  const int32_t available = max_lanes >= 1 ? max_lanes : 1;
  if (knobs.lanes > 0) {
    p.lanes = knobs.lanes < available ? knobs.lanes : available;
  } else {
    p.lanes = available;
    while (p.lanes > 1 && chunk * wire < 2 * kGpuMinLaneSegmentBytes * p.lanes) --p.lanes;
  }
  p.slots = knobs.slots > 0 ? knobs.slots : kGpuSlots;
  // Multiples of 256 bytes: every slot starts 16-byte aligned (vector loads).
  p.slot_bytes = staging_bytes / (static_cast<int64_t>(p.lanes) * p.slots) / 256 * 256;
  RR_CHECK(p.slot_bytes >= 256, kValue, "ringreduce: ", staging_bytes, " bytes of staging are too small for ",
           p.lanes, " lanes of ", p.slots, " slots (RINGREDUCE_LANES x RINGREDUCE_SLOTS)");
  int64_t cap = knobs.segment_bytes > 0 ? minI64(knobs.segment_bytes, p.slot_bytes) : p.slot_bytes;
  if (p.lanes > 1 && chunk > 0) {
    // At least two segments per lane in every chunk (the schedule itself guarantees two per chunk).
    cap = minI64(cap, maxI64(16, roundUp(ceilDiv(chunk * wire, 2 * static_cast<int64_t>(p.lanes)), 16)));
  }
  p.max_segment_bytes = maxI64(16, cap);
  return p;
}

int64_t gpuOneShotBytes(int nranks, int64_t staging_bytes, const GpuKnobs& knobs) {
  if (nranks < 2) return 0;
  // The n - 1 received tensors live in the staging (Note [GPU one-shot all-reduce]).
  int64_t limit = staging_bytes / (nranks - 1) / 256 * 256;
  // As on CPU, a set RINGREDUCE_SEGMENT_BYTES caps it (tests that shrink it keep the ring).
  if (knobs.segment_bytes > 0) limit = minI64(limit, knobs.segment_bytes);
  if (knobs.one_shot_bytes >= 0) return minI64(knobs.one_shot_bytes, limit);
  const int64_t rule = nranks <= 4 ? (1 << 20) : nranks <= 8 ? (256 << 10) : (64 << 10);
  return minI64(rule, limit);
}

}  // namespace rr
