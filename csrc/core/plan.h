// ringreduce core: the step plan that every transport executes.
//
// Note [One ring, two transports, one plan]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// buildPlan() turns (world size, rank, numel, dtype, options) into the ordered list of operations
// one rank performs for a ring all-reduce: 2(n-1) ring steps, each cut into `nsegs` segment
// *exchanges* (send one segment to the next rank, receive one from the previous rank), and the
// reductions and copies that consume what was received.
//
// Execution model (what both transports and the checker implement):
//   * Two queues per rank. kCompute (reduce/copy/convert; the reduce stream on GPU, the worker thread
//     on CPU) runs its ops in order, each completing before the next starts. kComm (exchanges; the
//     NCCL stream on GPU, posted gloo send/recv on CPU) *issues* its ops in order, but they may
//     complete in any order (the CPU transport keeps several exchanges in flight).
//   * kExchange: send `send` (if non-empty) to rank `next` and receive into `recv` (if non-empty)
//     from rank `prev`, as one group (ncclGroupStart/End on GPU). It completes when both halves
//     have completed. The exchange with index e of rank r pairs with the exchange of the same index
//     on its neighbours: r's send of exchange e is next's receive of exchange e (same byte count).
//   * kRecord(event) marks a point in its queue: the event fires when every earlier op of that
//     queue has completed. kWait(event) holds back every later op of its queue until the event has
//     fired. Every event is recorded once and every wait comes after its record in list order, so
//     a transport that walks the list sequentially (the CPU transport) never waits for an event
//     it has not yet recorded.
//   * Event ids: exchangeEvent(e) = "exchange e complete" (recorded on kComm right after it),
//     computeEvent(e) = "the reduce/copy of exchange e complete" (recorded on kCompute),
//     convertEvent(e) = "the convert that makes exchange e's send complete" (kCompute; Note [First
//     hop]).
//   * A kWait on exchangeEvent(e) with `recv_only` set asks for less: it holds back the later ops
//     of its queue only until the RECEIVE half of exchange e has completed (its send may still be
//     reading). A transport may treat it as a full wait, which is always safe: the GPU does (one
//     event after the NCCL group covers both halves); the CPU executor waits only the receive
//     request, and waits the send request at a later full wait on the same event.
// The builder derives every wait from buffer hazards (read-after-write, write-after-read,
// write-after-write on each segment of each buffer) and adds nothing else, so a missing wait is a
// race; the plan checker runs plans with random completion orders and detects it. The two halves
// of an exchange are separate accesses: its send reads, its receive writes. A later op that reads
// or overwrites what an exchange received needs only the receive half (a recv_only wait), e.g. the
// reduce of exchange e reading the slot e received into; a later op that overwrites what an
// exchange sends needs the whole exchange (a full wait): an all-gather copy or receive over a
// tensor segment sent during the reduce-scatter, and, with float32 partials, the reduce of
// exchange e itself, which overwrites the kAccum segment that e sends (with 16-bit partials, at
// every step; the first hop's convert writes it before e). The plan still ends with
// kCompute knowing every exchange fully complete (full waits, sends included). For a transport
// that waits for both halves anyway, recv_only waits only add waits (a full one follows later);
// PlanOptions::recv_only_waits = false builds plans with full waits only.
//
// Buffers: kData is the tensor (contiguous, numel elements of the tensor's dtype); kAccum is one
// chunk of partials in the plan's partial type (float32 with accum_dtype=float32 on half types,
// 16 bits with a 16-bit wire on float32; absent otherwise); kStaging slot k is a receive buffer of
// `slot_elems` elements of the widest type received. Every span names its element type (the
// tensor's or the partial type). A late message must never land in user memory, so the CPU
// transport receives every segment into staging; the GPU transport may receive the all-gather
// straight into kData (gather_into_data), since NCCL aborts rather than delivers late.
//
// Note [First hop]
// ~~~~~~~~~~~~~~~~
// The reduce-scatter's first hop sends the local value itself. When that value must change first -
// a 16-bit wire (float32 rounded to 16 bits), a predivide factor (divided, in place) or both - a
// kConvert op on kCompute makes it before the exchange sends it: dst = ConvertStep(a) (functors.h),
// from the tensor's segment into kAccum (a 16-bit wire) or back into itself (a predivide only). Every
// other contribution of a rank enters as the local operand of a reduce, which divides it on load:
// each element of each rank is divided exactly once, and the plan checker verifies it. The convert
// reads the segment once and writes it once (half the bytes on a 16-bit wire): no pass over the
// whole tensor.
//
// Note [16-bit all-gather]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// With a 16-bit wire, PlanOptions::wire_gather16 makes the all-gather move the wire's 16 bits too
// (a full ring only): the owner's final reduce rounds its finished float32 value (after AVG's
// division) once to the wire type and stores it widened (Scaling::wire_round, functors.h), so the
// owner keeps exactly what it sends. Every all-gather send then reads 16 bits from kAccum (free
// after the reduce-scatter): at step 0 a kConvert makes them from the owner's segment (exact: the
// values are 16-bit values); a 16-bit segment received at step s lands in a staging slot, where two
// computes read it: the kCopy that widens it into the tensor and the kConvert (16 bits to 16 bits)
// that copies it into kAccum for the send of step s + 1 (the convert of that exchange, emitted with
// the copy at the latest, so the slot is free again once both ran; it waits for step s's send from
// the same kAccum segment). Every rank widens the same 16 bits: results stay bitwise identical across
// ranks. Bytes per rank: (n - 1) / n x S / 2 in each half (0.5 of float32). The GPU transport, which
// may receive the all-gather straight into the tensor, does not run it (buildPlan refuses
// gather_into_data with it).
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
// A plan may run only one half of the ring:
//   * reduce-scatter only: afterwards rank r holds the fully reduced (AVG: divided) owned chunk
//     sched.ownedChunk(r) in kData; every other chunk of kData holds unspecified partials.
//   * all-gather only: beforehand rank r must hold the finished owned chunk in kData; afterwards
//     every rank holds every chunk.
// owner_shift rotates the owner map (rank r owns chunk r + 1 + shift): reduce_scatter and
// all_gather use shift = -1 so that rank r owns block r. exact_chunks makes every chunk exactly
// numel / n elements (the caller's blocks), which the 16-byte rounding would otherwise move. The
// hierarchical all-reduce runs one half on a node's ring and a full ring on a sub-range with
// avg_divisor = the whole group's size.
// Note [Staging slots]
// ~~~~~~~~~~~~~~~~~~~~
// Staging slot k receives exchanges k, k + num_slots, ...: a slot is reused once the reduce or copy
// (and, with a 16-bit all-gather, the convert) of its previous receive has run, so num_slots also bounds the receives a rank can have posted
// (and the segments in flight). kAutoSlots gives every staged receive of the call a slot of its own
// when all of them fit in kAutoStagingBytes, and kDefaultSlots otherwise (large tensors, where the
// slots are max_segment_bytes each). With a slot per receive, a transport can post every receive
// of the call at its start (Note [Receives posted early] in csrc/cpu/ring_executor.cpp); why that
// matters on gloo: Note [gloo pair locks] in csrc/cpu/c10d_transport.h. 6 MiB keeps the CPU
// staging, with its 1 MiB leading receive, within 8 MiB. At most kMaxAutoSlots receives are posted
// ahead (a ring of up to 17 ranks with two segments per chunk, the default for tensors up to 2 MiB
// per chunk, gets a slot per receive).
// Note [Lanes]
// ~~~~~~~~~~~~
// A GPU call may run its ring as K lanes: independent rings over the same ranks, each on its own
// streams and NCCL communicator, so that their transfers overlap (NCCL runs the kernels of one
// communicator one after another; NCCL itself spreads a collective over channels the same way).
// Lane k's plan is the ring's plan restricted to the segments j = k, k + K, k + 2K, ... of every
// chunk: the chunks, their owners and the order in which each element's contributions are combined
// are the one-lane ring's, so every result bit is too, whatever K (tests assert it). A lane's
// exchanges keep their indices in the full grid (they are a subset of it; the others are absent,
// like empty ones), its staging slots are numbered within the lane, and the partials of segment j
// (kAccum: float32, or a 16-bit wire's, whose first hop's convert is the lane's own too) are only
// ever touched by the lane of j, so lanes may share the partials buffer (checkLanes verifies both).
// lanes = 1 is the plain ring.
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
  // Note [Reduction contract] (functors.h): the local operands of the reduce-scatter enter divided
  // by pre_factor (0: not); the final reduce divides by avg_divisor * extra_divisor (AVG) or by
  // extra_divisor (SUM, when above 1), over post_factor, or, with neither, multiplies by
  // post_factor. A flat ring takes both factors equal (predivide_factor); the hierarchical
  // all-reduce divides in its first ring and scales in its second.
  double pre_factor = 0;
  double post_factor = 0;
  int32_t extra_divisor = 1;
  bool gather_into_data = false; // all-gather receives straight into kData (GPU transport)
  bool average = false;          // op is AVG: the final reduce divides by avg_divisor
  int32_t avg_divisor = 0;       // 0: the ring's size
  uint8_t phases = kPhaseBoth;   // PhaseMask
  int32_t owner_shift = 0;
  bool exact_chunks = false;     // numel must be a multiple of the ring's size
  // Waits that need only an exchange's receive are recv_only (Note [One ring, two transports, one
  // plan]). false: every exchange wait is a full one (for a transport that cannot wait for a
  // receive alone, such as the GPU's: fewer waits, same ordering for it).
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

// The type reduce-scatter partials travel in for a tensor of `dtype` on a ring of `nranks`: float32
// for half types with accum_float32 (when partials travel: more than two ranks), the 16-bit
// wire_dtype of a float32 tensor, else the tensor's own type.
DType partialDType(DType dtype, int nranks, bool accum_float32, const std::optional<DType>& wire_dtype);

}  // namespace rr
