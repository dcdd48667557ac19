// ringreduce core: the direct all-reduce (algorithm="direct"): what each rank sends, receives and
// reduces, round by round. The CPU runs it over its Transport (csrc/cpu/direct_exchange.h), the GPU
// enqueues it on its streams (csrc/cuda/direct_executor.h); shared memory and both one-shots compute
// the same arithmetic from InOrderReduce without a plan.
//
// Note [Direct all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The reduce-scatter is a direct exchange: the tensor is cut into the ring's n chunks (Note [Chunk
// ownership] in schedule.h) and rank r owns chunk r (owner shift -1). Every rank sends its elements
// of chunk p to rank p, and rank r combines the n contributions c_0 .. c_{n-1} of each element of
// its chunk in rank order, whoever owns it:
//     partial = c_0;   partial = c_k (op) partial, k = 1 .. n - 2;   result = scale(c_{n-1} (op) partial)
// with the steps of ReduceStep (functors.h) and partials of the type directPartial() names: float32
// for float16/bfloat16 SUM and AVG (the sum is rounded once, when it is stored) and for a 16-bit
// wire; the tensor's own type otherwise (accum_dtype naming a half tensor's own dtype rounds every
// partial). c_k is rank k's element divided by the predivide factor (rounded to the tensor's type);
// with a 16-bit wire (float32 tensors, SUM and AVG) it is that value rounded once to the wire type,
// by its sender, and the pieces travel in 16 bits. AVG divides the float32 (float64) sum by n once,
// correctly rounded (never a multiply by 1/n), SUM with a predivide factor multiplies by it once.
// Then the all-gather: rank r sends its finished chunk to every peer; with a 16-bit all-gather
// (Note [16-bit all-gather] in plan.h) the owner rounds its result once to the wire type, keeps that
// value and sends 16 bits.
//
// An element's result is a function of its n inputs alone: not of the chunk bounds, the owner, the
// segments or the depth, and not of the transport (shared memory and the one-shots reduce in the
// same order with the same steps), so it is bitwise the same on every rank and every path. Bytes
// per rank are the ring's, (n - 1) / n x S per half (the reduce-scatter's in the wire type), in one
// message latency per round instead of the ring's n - 1 per segment.
//
// Rounds: round g is segment g of every chunk (the ring's segment rule, its cap lowered so that two
// rounds' buffers fit the staging). A round posts its n - 1 receives and n - 1 sends at once; `depth`
// rounds are in flight (every round of the call when all fit, so that every receive is posted at the
// start, Note [Staging slots] in plan.h). The reduce-scatter's receives land in staging; so do the
// all-gather's on the CPU (late messages never reach user memory), while the GPU receives them into
// the tensor (gather_into_data).
#pragma once

#include <cstdint>
#include <optional>

#include "dtype.h"
#include "functors.h"
#include "schedule.h"

namespace rr {

// Frame::algorithm of a direct all-reduce (0: the flat ring, L: hierarchical, -1: the GPU ring's one-shot),
// and of the GPU's direct one-shot, whose message pattern (every tensor to every peer) is the ring's
// one-shot's with other arithmetic.
constexpr int32_t kFrameAlgorithmDirect = -2;
constexpr int32_t kFrameAlgorithmDirectOneShot = -3;

// What an in-order reduction of n inputs computes (Note [Direct all-reduce]; hostReduceInOrder on the
// CPU, OneShotBody on the GPU): inputs of `dtype`, each first rounded to `round_to` when that differs
// (a float32 tensor's 16-bit wire, after the predivide), partials of `partial`, the result of `dst`.
struct InOrderReduce {
  DType dtype = DType::kFloat32;
  DType round_to = DType::kFloat32;
  DType partial = DType::kFloat32;
  DType dst = DType::kFloat32;
  RedOp op = RedOp::kSum;
  // predivide: every input (before the rounding to round_to); divisor, postscale, round_sum and
  // wire_round: the last step.
  Scaling scaling;
};

// The partial type of a direct all-reduce (Note [Direct all-reduce]).
DType directPartial(DType dtype, RedOp op, bool accum_narrow, const std::optional<DType>& wire);

// What a direct all-reduce asks for besides its tensor.
struct DirectOptions {
  RedOp op = RedOp::kSum;
  bool accum_narrow = false;         // half types: partials in their own type
  std::optional<DType> wire_dtype;   // float32 tensors, SUM and AVG: contributions travel in 16 bits
  bool wire_gather16 = false;        // with wire_dtype: the all-gather moves it too
  double pre_factor = 0;             // the predivide factor (0: none)
  int32_t extra_divisor = 1;         // the final scaling also divides by it
  int64_t max_segment_bytes = 1 << 20;  // a round's largest piece
  int64_t staging_bytes = 6 << 20;   // every buffer of the rounds in flight
  int64_t buffer_align = 16;         // each buffer's bytes are a multiple of this (the GPU: 256)
  bool gather_into_data = false;     // the all-gather receives straight into the tensor (the GPU)
};

// The InOrderReduce of a direct all-reduce of `dtype` over `nranks` ranks whose inputs are the
// ranks' own elements (shared memory, the CPU one-shot): each rounded to the wire where there is one.
InOrderReduce directInOrder(DType dtype, int nranks, const DirectOptions& o);

// One rank's direct all-reduce (Note [Direct all-reduce]).
struct DirectPlan {
  int32_t nranks = 1;
  int32_t rank = 0;
  RingSchedule sched;       // the ring's chunks, rank r owning chunk r; segment g of each is round g
  DType dtype = DType::kFloat32;    // the tensor's
  DType contrib = DType::kFloat32;  // what the reduce-scatter moves: dtype, or the 16-bit wire
  DType gather = DType::kFloat32;   // what the all-gather moves: dtype, or the wire (16-bit all-gather)
  // The owner's reduction of a piece: inputs of `contrib` (the owner's own converted first where
  // there is a wire), the result in the tensor's type. Its predivide is 0 with a wire: the convert
  // applied it.
  InOrderReduce reduce;
  double convert_predivide = 0;  // what the wire's convert divides by
  int32_t rounds = 0;            // segments per chunk
  int32_t depth = 1;             // rounds in flight
  int64_t buffer_bytes = 0;      // bytes of each staging buffer (a piece of the widest moved type)
  bool gather_into_data = false;

  bool wire() const { return contrib != dtype; }
  bool gather16() const { return gather != dtype; }
  // Elements [begin, end) of the tensor that chunk c contributes to round g.
  Range piece(int chunk, int round) const { return sched.segmentRange(chunk, round); }
  // The staging buffers: per round in flight, a receive buffer per peer (both halves), and with a
  // wire one per chunk for the converted pieces (the owner's own one doubles as the 16-bit
  // all-gather's send buffer).
  int32_t numBuffers() const;
  int32_t recvBuffer(int round, int peer) const;     // peer != rank
  int32_t convertBuffer(int round, int chunk) const; // wire() only
  int64_t stagingBytes() const { return static_cast<int64_t>(numBuffers()) * buffer_bytes; }
  // Whether every message of the call leaves through a hand-off (some chunk is empty, so some peer
  // may be first contacted in a later round: Note [Which exchanges hand off] in csrc/cuda/ring_executor.h).
  bool handsOffEveryRound() const;
};

// Builds rank `rank`'s plan in a group of `nranks`. Throws rr::Error(kValue) on bad arguments.
DirectPlan buildDirectPlan(int nranks, int rank, int64_t numel, DType dtype, const DirectOptions& options);

}  // namespace rr
