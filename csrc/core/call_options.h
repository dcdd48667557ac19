// ringreduce core: CallOptions, what one collective call asks for: the options struct both runtimes
// take (CPU GroupRuntime, CUDA runCudaCall) and the bindings build (ringreduce._C.CallOptions).
//
// Note [Call options]
// ~~~~~~~~~~~~~~~~~~~
// Every rank must pass the same values, except local_error (its local refusal, sent in its frame).
// A runtime reads the fields that apply to it: CUDA ignores the shared-memory fields and node_order,
// the CPU lanes and one_shot_bytes. The pipeline fields are the RINGREDUCE_* knobs (read in Python
// at call time): 0 (-1 for one_shot_bytes) leaves the choice to the runtime (CUDA: Note [GPU
// pipeline rule], csrc/cuda/gpu_pipeline.h; CPU: a 1 MiB segment and Note [Staging slots]).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "direct.h"
#include "dtype.h"
#include "frame.h"
#include "functors.h"
#include "plan.h"

namespace rr {

struct CallOptions {
  // What is computed.
  CallKind kind = CallKind::kAllReduce;
  RedOp op = RedOp::kSum;
  bool accum_float32 = false;          // half types: partials travel as float32
  // Half types: accum_dtype named the tensor's own dtype: per-hop rounding even in shared memory
  // (Note [Half types in shared memory] in csrc/cpu/shm_ring.h).
  bool accum_narrow = false;
  std::optional<DType> wire_dtype;     // float32 tensors: partials travel as this 16-bit type
  // With wire_dtype: the all-gather moves it too (RINGREDUCE_WIRE_GATHER=16; Note [16-bit
  // all-gather] in plan.h). CPU only.
  bool wire_gather16 = false;
  double predivide = 0;                // predivide_factor (0: none; Note [Reduction contract])
  int32_t extra_divisor = 1;           // the final reduce also divides by it (accumulation steps)

  // The agreement check (agreement.h).
  bool check = true;                   // exchange agreement frames first
  FrameError local_error = FrameError::kNone;  // this rank refuses the call: frames only
  int32_t ntensors = 1;                // all_reduce_coalesced: tensors in the call
  uint64_t layout_hash = 0;            // all_reduce_coalesced: its list's dtypes and shapes (Frame)

  // The algorithm: direct (Note [Direct all-reduce] in direct.h: algorithm="direct", or "auto" for
  // float16/bfloat16 SUM and AVG on a flat ring); one_shot (Note [One-shot all-reduce]; false for
  // algorithm="ring"); local_size ranks per node for Note [Hierarchical all-reduce] (0: flat); on
  // CPU node_order lists the ring's ranks node by node.
  bool direct = false;
  bool one_shot = true;
  int32_t local_size = 0;
  std::vector<int> node_order;

  // The pipeline (Note [Staging slots] in plan.h; on CUDA Note [GPU pipeline rule]).
  int64_t segment_bytes = 0;           // RINGREDUCE_SEGMENT_BYTES (0: 1 MiB on CPU, the rule's on CUDA)
  int32_t num_slots = kAutoSlots;      // RINGREDUCE_SLOTS
  int32_t lanes = 0;                   // CUDA: RINGREDUCE_LANES (0: the rule's)
  int64_t one_shot_bytes = -1;         // CUDA: RINGREDUCE_ONESHOT_BYTES (-1: the rule's)
  int64_t timeout_ms = -1;             // CPU: RINGREDUCE_TIMEOUT; < 0: the group's own timeout

  // CPU shared memory (Note [Shared-memory all-reduce] in csrc/cpu/shm_ring.h): `one_node`: every
  // rank of the ring is on one node as the launcher (or RINGREDUCE_LOCAL_SIZE) sees it; `shm`: this
  // rank's RINGREDUCE_SHM, which counts only at the ring's first one_node call (the setup).
  bool one_node = true;
  bool shm = true;

  // The CPU ring's largest segment (its agreement frame carries it).
  int64_t cpuSegmentBytes() const { return segment_bytes > 0 ? segment_bytes : kCpuSegmentBytes; }
  static constexpr int64_t kCpuSegmentBytes = 1 << 20;

  bool allReduce() const { return kind != CallKind::kReduceScatter && kind != CallKind::kAllGather; }
  // The type partials travel in on a flat ring of `ring_size` ranks (partialDType, plan.h).
  DType partial(DType dtype, int ring_size) const {
    return partialDType(dtype, ring_size, accum_float32, wire_dtype);
  }
  // The partial type of a flat all-reduce in shared memory (Note [Half types in shared memory]):
  // half-type SUM and AVG accumulate in float32 unless accum_narrow; otherwise partial().
  DType shmPartial(DType dtype, int ring_size) const {
    if (isHalfType(dtype) && (op == RedOp::kSum || op == RedOp::kAvg) && !accum_narrow) return DType::kFloat32;
    return partial(dtype, ring_size);
  }
  // The Scaling of a flat ring's final reduce with partials of `partial`, for the paths without a
  // plan (one-shot, shared memory), including a 16-bit all-gather's rounding (the ring's bits).
  Scaling flatFinalScaling(DType dtype, int ring_size, DType partial_type) const {
    const bool wide = partial_type == DType::kFloat32 && isHalfType(dtype);
    Scaling s = finalScaling(op, ring_size, extra_divisor, predivide, predivide, !wide);
    if (gather16(dtype) && ring_size > 1) s.wire_round = static_cast<int32_t>(*wire_dtype);
    return s;
  }
  // Whether an all-reduce of `dtype` runs a 16-bit all-gather (Note [16-bit all-gather]).
  bool gather16(DType dtype) const {
    return wire_gather16 && wire_dtype && dtype == DType::kFloat32 && isHalfType(*wire_dtype) && allReduce() &&
           (op == RedOp::kSum || op == RedOp::kAvg);
  }
  // Whether an all-reduce on a ring of `ring_size` ranks runs the hierarchical stages.
  bool hierarchical(int ring_size) const { return allReduce() && local_size > 1 && local_size < ring_size; }
  // Whether an all-reduce runs the direct algorithm (Note [Direct all-reduce]).
  bool directAllReduce() const { return direct && allReduce(); }
  // The direct all-reduce of a tensor of `dtype` with these options, segments and staging left at
  // their defaults (the GPU sets its own).
  DirectOptions directOptions(DType dtype) const {
    DirectOptions d;
    d.op = op;
    d.accum_narrow = accum_narrow;
    d.wire_dtype = wire_dtype;
    d.wire_gather16 = gather16(dtype);
    d.pre_factor = predivide;
    d.extra_divisor = extra_divisor;
    d.max_segment_bytes = cpuSegmentBytes();
    return d;
  }
  // Frame::algorithm of a CPU call: the flat ring 0, hierarchical L, direct kFrameAlgorithmDirect.
  int32_t cpuFrameAlgorithm() const { return directAllReduce() ? kFrameAlgorithmDirect : local_size; }
};

// The agreement frame of a call with `o`, without its tensor (describeTensor) or rank and seq.
// `segment_bytes`: the runtime's segment size (saturated at 2^31-1); `algorithm`: 0 the flat ring,
// L hierarchical with L ranks per node, -1 the GPU one-shot, kFrameAlgorithmDirect (direct.h) the
// direct all-reduce, kFrameAlgorithmDirectOneShot the GPU's direct one-shot.
inline Frame callFrame(const CallOptions& o, int64_t segment_bytes, int32_t algorithm) {
  Frame f;
  f.kind = static_cast<int32_t>(o.kind);
  f.op = static_cast<int32_t>(o.op);
  f.error = static_cast<int32_t>(o.local_error);
  f.ntensors = o.ntensors;
  f.layout_hash = o.layout_hash;
  f.accum_float32 = o.accum_float32 ? 1 : o.accum_narrow ? 2 : 0;  // 2: accum_dtype = the tensor's
  f.wire_dtype = o.wire_dtype ? static_cast<int32_t>(*o.wire_dtype) | (o.wire_gather16 ? kFrameWireGather16 : 0) : -1;
  f.predivide = o.predivide;
  f.extra_divisor = o.extra_divisor;
  f.algorithm = algorithm;
  f.segment_bytes = static_cast<int32_t>(std::min<int64_t>(segment_bytes, std::numeric_limits<int32_t>::max()));
  return f;
}

// The call's tensor in its frame (a refusal frame leaves it out).
inline void describeTensor(Frame& f, DType dtype, int64_t numel, const int64_t* shape, int ndim, int32_t device_type) {
  f.dtype = static_cast<int32_t>(dtype);
  f.numel = numel;
  f.device_type = device_type;
  setShape(f, shape, ndim);
}
inline void describeTensor(Frame& f, DType dtype, int64_t numel, const std::vector<int64_t>& shape, int32_t device_type) {
  describeTensor(f, dtype, numel, shape.data(), static_cast<int>(shape.size()), device_type);
}

}  // namespace rr
