// ringreduce core: the step plan that every transport executes.
//
// Note [One ring, two transports, one plan]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// buildPlan() turns (world size, rank, numel, dtype, options) into the ordered ops one rank performs
// for a ring all-reduce: 2(n-1) ring steps, each cut into `nsegs` segment exchanges (send one segment
// to the next rank, receive one from the previous), and the reduces and copies that consume them.
// Execution model (both transports and the checker implement it):
//   * kCompute (reduce/copy/convert: the GPU's reduce stream, the CPU worker) runs its ops in order,
//     each done before the next. kComm (exchanges: the NCCL stream, posted gloo send/recv) issues
//     its ops in order, but they may complete in any order.
//   * kExchange sends `send` to `next` and receives `recv` from `prev` as one group; it completes
//     when both halves have. Exchange e of rank r pairs with exchange e of its neighbours.
//   * kRecord(event) fires when every earlier op of its queue has completed; kWait(event) holds back
//     the later ops of its queue until then. Every wait follows its record in list order, so a
//     transport that walks the list sequentially (the CPU) never waits for an unrecorded event.
//   * exchangeEvent(e): exchange e complete (kComm); computeEvent(e): its reduce/copy complete;
//     convertEvent(e): the convert that makes its send complete (kCompute; Note [First hop]).
//   * A kWait on exchangeEvent(e) with `recv_only` needs only e's RECEIVE half (its send may still be
//     reading). Treating it as a full wait is always safe (the GPU does; the CPU waits the receive
//     request, and the send at a later full wait on the same event).
// Every wait derives from a buffer hazard (RAW, WAR, WAW per segment of each buffer) and nothing
// else, so a missing wait is a race, which the plan checker finds by running plans with random
// completion orders. An exchange's send reads and its receive writes: reading or overwriting what
// e received needs a recv_only wait; overwriting what e sends needs a full one (an all-gather copy
// or receive over a tensor segment sent during the reduce-scatter; with float32 partials, the
// reduce of e itself, which overwrites the kAccum segment e sends). The plan ends with kCompute
// knowing every exchange fully complete. recv_only_waits = false builds full waits only.
//
// Buffers: kData is the tensor (numel contiguous elements); kAccum one chunk of partials in the
// plan's partial type (float32 with accum_dtype=float32 on half types, 16 bits with a 16-bit wire;
// absent otherwise); kStaging slot k receives `slot_elems` elements of the widest type received.
// A late message must never land in user memory, so the CPU receives every segment into staging;
// the GPU may receive the all-gather into kData (gather_into_data): NCCL aborts rather than
// delivers late.
//
// Note [First hop]
// ~~~~~~~~~~~~~~~~
// The reduce-scatter's first hop sends the local value itself. When that must change first (a
// 16-bit wire, a predivide factor, or both), a kConvert on kCompute makes it: dst = ConvertStep(a)
// (functors.h), into kAccum (16-bit wire) or in place (predivide only). Every other contribution
// enters as a reduce's local operand, divided on load: each element of each rank is divided exactly
// once (the checker verifies it), with no extra pass over the tensor.
//
// Note [16-bit all-gather]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// With a 16-bit wire, wire_gather16 makes the all-gather move 16 bits too (full ring only): the
// owner's final reduce rounds its finished float32 value (after AVG's division) once to the wire
// type and stores it widened (Scaling::wire_round), so the owner keeps exactly what it sends. Every
// all-gather send reads 16 bits from kAccum (free after the reduce-scatter): at step 0 a kConvert
// makes them from the owner's segment (exact); a segment received at step s lands in a slot read by
// two computes, the kCopy that widens it into the tensor and the kConvert that copies it into kAccum
// for the send of step s + 1 (emitted with the copy at the latest, so the slot frees once both ran).
// Every rank widens the same bits, so results stay identical across ranks. buildPlan refuses it with
// gather_into_data (the GPU's).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "dtype.h"
#include "functors.h"
#include "schedule.h"

namespace rr {

enum class Queue : uint8_t { kComm = 0, kCompute = 1 };
enum class BufKind : uint8_t { kNone = 0, kData = 1, kAccum = 2, kStaging = 3 };
enum class OpKind : uint8_t { kExchange = 0, kReduce = 1, kCopy = 2, kRecord = 3, kWait = 4, kConvert = 5 };
enum class Phase : uint8_t { kReduceScatter = 0, kAllGather = 1 };

// A run of elements in one buffer. `type`: their element type, the tensor's (plan.dtype) or the
// plan's partial type (plan.partial). Offsets and counts are in elements of that type.
struct Span {
  BufKind buf = BufKind::kNone;
  int32_t slot = -1;  // staging slot, for kStaging
  DType type = DType::kFloat32;
  int64_t offset = 0;
  int64_t count = 0;
  bool empty() const { return count <= 0; }
};

struct Op {
  OpKind kind;
  Queue queue;
  int32_t exchange = -1;  // exchange index (kExchange, kReduce, kCopy, kConvert: the exchange it feeds)
  int32_t event = -1;     // kRecord, kWait
  Span send;              // kExchange: what goes to `next`
  Span recv;              // kExchange: where data from `prev` lands; kReduce/kCopy: the source
  Span a;                 // kReduce: the local operand; kConvert: the source
  Span dst;               // kReduce/kCopy/kConvert: the destination
  bool final = false;     // kReduce: last reduction of the owned chunk (AVG divides here)
  bool recv_only = false; // kWait on an exchangeEvent: only the receive half must have completed
};

// Static description of one exchange (for transports, tests and diagnostics).
struct ExchangeInfo {
  Phase phase;
  int32_t step;     // ring step within the phase, 0..n-2
  int32_t segment;  // segment index within the chunk
  int32_t send_chunk;
  int32_t recv_chunk;
};

// Which halves of the ring a plan runs (Note [Ring halves]).
enum PhaseMask : uint8_t { kPhaseReduceScatter = 1, kPhaseAllGather = 2, kPhaseBoth = 3 };

// Note [Ring halves]
// ~~~~~~~~~~~~~~~~~~
// A plan may run one half of the ring: reduce-scatter only (rank r ends with its reduced, AVG:
// divided, owned chunk sched.ownedChunk(r) in kData; other chunks hold unspecified partials), or
// all-gather only (rank r must hold its finished owned chunk; every rank ends with every chunk).
// reduce_scatter and all_gather use owner_shift = -1 (rank r owns block r) and exact_chunks (chunks
// of exactly numel / n elements, the caller's blocks, which 16-byte rounding would move).
// Note [Staging slots]
// ~~~~~~~~~~~~~~~~~~~~
// Slot k receives exchanges k, k + num_slots, ...; a slot is reused once the compute ops that read
// its previous receive have run, so num_slots also bounds the receives posted (segments in flight).
// kAutoSlots gives every staged receive its own slot when all fit in kAutoStagingBytes (at most
// kMaxAutoSlots), else kDefaultSlots. A slot per receive lets a transport post every receive at the
// call's start (Note [Receives posted early] in csrc/cpu/ring_executor.cpp; why it matters on gloo:
// Note [gloo pair locks] in csrc/cpu/c10d_transport.h). 6 MiB keeps the CPU staging, with its
// 1 MiB leading receive, within 8 MiB.
// Note [Lanes]
// ~~~~~~~~~~~~
// A GPU call may run its ring as K lanes: rings over the same ranks on their own streams and NCCL
// communicators, so their transfers overlap (NCCL serializes one communicator's kernels). Lane k
// runs segments j = k, k + K, ... of every chunk: chunks, owners and combine order are the one-lane
// ring's, so the result bits are too, whatever K. A lane keeps the full grid's exchange indices,
// numbers its own staging slots, and alone touches the partials of its segments, so lanes may share
// the partials buffer (checkLanes verifies both). lanes = 1 is the plain ring.
constexpr int32_t kAutoSlots = 0;
constexpr int32_t kDefaultSlots = 4;
constexpr int32_t kMaxAutoSlots = 64;
constexpr int64_t kAutoStagingBytes = 6 << 20;

struct PlanOptions {
  int64_t max_segment_bytes = 1 << 20;
  int32_t num_slots = kDefaultSlots;  // staging slots (kAutoSlots: Note [Staging slots]); also
                                      // bounds the exchanges in flight
  bool accum_float32 = false;    // half types: partials travel as float32
  // float32 tensors: reduce-scatter partials travel as this 16-bit type (Note [First hop]).
  std::optional<DType> wire_dtype;
  // With wire_dtype on a full ring: the all-gather moves the wire type too (Note [16-bit all-gather]).
  bool wire_gather16 = false;
  // Note [Reduction contract] (functors.h): reduce-scatter operands enter divided by pre_factor (0:
  // not); the final reduce divides by avg_divisor * extra_divisor (AVG) or extra_divisor (SUM), over
  // post_factor, or else multiplies by post_factor. The hierarchical all-reduce splits the two.
  double pre_factor = 0;
  double post_factor = 0;
  int32_t extra_divisor = 1;
  bool gather_into_data = false; // all-gather receives straight into kData (GPU transport)
  bool average = false;          // op is AVG: the final reduce divides by avg_divisor
  int32_t avg_divisor = 0;       // 0: the ring's size
  uint8_t phases = kPhaseBoth;   // PhaseMask
  int32_t owner_shift = 0;
  bool exact_chunks = false;     // numel must be a multiple of the ring's size
  // false: every exchange wait is a full one (a transport that cannot wait for a receive alone, as
  // the GPU's; Note [One ring, two transports, one plan]).
  bool recv_only_waits = true;
  int32_t lanes = 1;  // Note [Lanes]: this plan is lane `lane` of `lanes`
  int32_t lane = 0;
};

struct Plan {
  RingSchedule sched;
  DType dtype = DType::kFloat32;
  DType partial = DType::kFloat32;  // type of kAccum: float32 (accum), 16 bits (wire), else dtype
  int32_t rank = 0;
  int32_t next = 0;
  int32_t prev = 0;
  int32_t num_slots = 0;
  int64_t slot_elems = 0;   // elements (of the widest wire type) per staging slot
  int64_t accum_elems = 0;  // elements (of `partial`) of kAccum (one chunk), 0 when unused
  bool accum_float32 = false;
  bool wire16 = false;      // 16-bit partials of a float32 tensor (PlanOptions::wire_dtype)
  bool gather16 = false;    // the all-gather moves them too (Note [16-bit all-gather])
  double pre_factor = 0;    // PlanOptions
  double post_factor = 0;
  int32_t extra_divisor = 1;
  bool gather_into_data = false;
  uint8_t phases = kPhaseBoth;
  int32_t avg_divisor = 1;    // what a final AVG reduce divides by
  int32_t lanes = 1;          // Note [Lanes]
  int32_t lane = 0;
  int32_t num_exchanges = 0;  // exchanges in the full grid (indices 0..num_exchanges-1)
  int32_t num_events = 0;     // 2 per exchange, 3 when the plan has converts
  std::vector<ExchangeInfo> exchanges;  // indexed by exchange id
  std::vector<Op> ops;

  static int32_t exchangeEvent(int32_t e) { return 2 * e; }
  static int32_t computeEvent(int32_t e) { return 2 * e + 1; }
  int32_t convertEvent(int32_t e) const { return 2 * num_exchanges + e; }
  // Whether `event` is an exchangeEvent (else a compute-queue event).
  bool isExchangeEvent(int32_t event) const { return event < 2 * num_exchanges && event % 2 == 0; }

  // What the reduce `o` (or convert) scales (Note [Reduction contract] in functors.h).
  Scaling scaling(RedOp op, const Op& o) const;
  // The Scaling of a final reduce (of this plan's reduce-scatter with `op`).
  Scaling finalScaling(RedOp op) const;
  // What the convert `o` divides by: the predivide factor for a first hop (Note [First hop]), 0 for
  // an all-gather's (Note [16-bit all-gather]).
  double convertPredivide(const Op& o) const;

  int64_t slotBytes() const;     // bytes of one staging slot (slot_elems of the widest wire type)
  int64_t stagingBytes() const;  // bytes of all staging slots
  int64_t accumBytes() const;    // bytes of kAccum
  std::string describe() const;  // human-readable op list, for debugging and test failures
};

// Builds the plan of `rank` in a ring of `nranks`. Throws rr::Error(kValue) on bad arguments.
Plan buildPlan(int nranks, int rank, int64_t numel, DType dtype, const PlanOptions& options);

// Note [Lanes]: the lane that runs element `index` of a tensor with schedule `sc` in `lanes` lanes.
int32_t laneOfElement(const RingSchedule& sc, int32_t lanes, int64_t index);

// The element size of a span's elements.
inline int64_t spanElemSize(const Plan&, const Span& s) { return static_cast<int64_t>(dtypeSize(s.type)); }

// The type reduce-scatter partials travel in: float32 for half types with accum_float32 on more than
// two ranks, the 16-bit wire_dtype of a float32 tensor, else the tensor's own type.
DType partialDType(DType dtype, int nranks, bool accum_float32, const std::optional<DType>& wire_dtype);

}  // namespace rr
