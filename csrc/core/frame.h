// ringreduce core: the fixed-size agreement frame that precedes every payload.
//
// Note [Cross-rank agreement]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Before any payload moves, every rank's Frame is all-gathered. The frame has one size for every
// call, so a disagreement never becomes a size mismatch in the transport (stock gloo aborts the
// process on one) nor silent garbage. A rank that refuses the call locally still sends its frame
// with `error` set, then raises its own error; the others raise RuntimeError naming it. Every rank
// runs compareFrames() on the same n frames, so all proceed or all raise.
#pragma once

#include <string>
#include <vector>

#include "common.h"

namespace rr {

constexpr uint32_t kFrameMagic = 0x52524652u;  // "RRFR"
constexpr uint32_t kFrameVersion = 3;
constexpr int kFrameMaxDims = 8;

enum class CallKind : int32_t {
  kAllReduce = 0,
  kAllReduceAvg = 1,
  kAllReduceCoalesced = 2,
  kReduceScatter = 3,
  kAllGather = 4,
};
constexpr int kNumCallKinds = 5;

enum class FrameError : int32_t {
  kNone = 0,
  kUnsupported = 1,  // dtype/op pair refused (e.g. AVG on integers)
  kNotATensor = 2,
  kSparse = 3,
  kDevice = 4,       // tensor on a device this group/build cannot serve
  kOther = 5,
};

enum FrameFlags : int32_t {
  // This rank posted its first payload receive before the frames (Note [Receives before the
  // verdict] in csrc/cpu/group_runtime.cpp), with room for kLeadBytes.
  kFrameLeadReceive = 1,
  // The frame message carries this rank's whole tensor (Note [One-shot all-reduce] in
  // csrc/cpu/group_runtime.h).
  kFrameOneShot = 2,
  // A direct all-reduce: this rank posted round 0's receive from every peer before the frames, each
  // with room for directLeadRoom(n) (Note [Direct before the verdict] in csrc/cpu/direct_exchange.h).
  kFrameDirectLead = 4,
};

// Frame::wire_dtype's flag: the all-gather moves the wire type too (RINGREDUCE_WIRE_GATHER=16).
constexpr int32_t kFrameWireGather16 = 0x100;

struct Frame {
  uint32_t magic = kFrameMagic;
  uint32_t version = kFrameVersion;
  int32_t rank = 0;
  int32_t kind = 0;  // CallKind
  uint64_t seq = 0;
  int32_t op = 0;     // RedOp
  int32_t dtype = 0;  // DType
  int32_t accum_float32 = 0;  // 1: accum_dtype=float32; 2: accum_dtype named the tensor's own (half) dtype
  int32_t device_type = 0;  // 0 cpu, 1 cuda
  int64_t numel = 0;
  int32_t ndim = 0;
  int32_t error = 0;  // FrameError
  int64_t dims[kFrameMaxDims] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint64_t shape_hash = 0;  // covers all dims, also beyond kFrameMaxDims
  int32_t algorithm = 0;
  int32_t ntensors = 1;  // coalesced calls
  // Largest segment the ring sends (GPU: its override, 0 for the pipeline rule's; saturated at
  // 2^31-1): the exchanges' sizes follow from it.
  int32_t segment_bytes = 0;
  int32_t flags = 0;  // FrameFlags; not compared
  // Note [Reduction contract]: the 16-bit wire's DType (-1: none; | kFrameWireGather16 when the
  // all-gather moves it), the extra divisor (accumulation steps; 1: none), the predivide (0: none).
  int32_t wire_dtype = -1;
  int32_t extra_divisor = 1;
  double predivide = 0;
  // all_reduce_coalesced: a hash of the list's dtypes and shapes in order (0: not a list), so that
  // lists of equal total size but other tensors never add unrelated elements (Note [Options of a
  // coalesced list] in ringreduce/coalesced.py).
  uint64_t layout_hash = 0;
};
static_assert(sizeof(Frame) == 168, "the frame's wire size is part of the protocol");
constexpr size_t kFrameBytes = sizeof(Frame);

const char* callKindName(int32_t kind);
const char* frameErrorName(int32_t error);

uint64_t hashShape(const int64_t* dims, int ndim);
void setShape(Frame& f, const int64_t* dims, int ndim);
std::string describeFrame(const Frame& f);  // "all_reduce(op=SUM, dtype=float32, shape=[4, 5], ...)"

// Returns "" when all frames agree (frames[i] is rank i's), else a message naming the call, its
// sequence number, every differing rank and what it passed. `group` names the group for humans.
std::string compareFrames(const std::vector<Frame>& frames, const std::string& group);

}  // namespace rr
