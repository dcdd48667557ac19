// ringreduce GPU: the plan interpreter, generic over a stream-ordered "device backend".
//
// Note [Driving the plan on streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The GPU transport does not execute the plan; it *enqueues* it. Every op of the plan (csrc/core
// plan.h) is handed, in list order, to a DeviceBackend that puts it on one of three streams:
//   kComm     the communication stream: one grouped send(next)+recv(prev) per kExchange;
//   kCompute  the reduce stream: one reduce kernel per kReduce, one device copy per kCopy;
//   kCaller   the caller's current stream (only the call's first and last events touch it).
// kRecord/kWait become event records and stream waits. A stream wait is captured at the moment it
// is enqueued, so every wait must be enqueued after the record it names; the plan guarantees that
// in list order, and the call framing below keeps it for the framing events.
//
// Call framing (the same for every backend, so the fakes test it too):
//   1. record kCallStart on kCaller; kComm and kCompute wait it: the call sees everything the caller
//      enqueued before it (the producer of the tensor).
//   2. kComm waits kPrevCallDone, the completion of the previous call on this communicator:
//      staging slots and the event pool are shared between calls, and the previous call's reduces
//      may still read a slot the first exchange of this call overwrites. (kCompute is in order and
//      needs no such wait.)
//   3. the plan's ops.
//   4. backend.finish() (extra work on kCompute), then record kCallDone on kCompute. The plan ends with kCompute waiting every exchange, so
//      kCallDone fires when the whole call, sends included, has finished.
//   5. synchronous calls: kCaller waits kCallDone (asynchronous calls do this in Work.wait()).
//
// Plan events are numbered 0..2E-1; only those some op waits for are recorded, each on its own
// physical event (dense indices 0..k-1, see EventMap), so a wait can never be captured by a later
// re-record of a shared event. The backend owns the physical events and the framing events.
//
// A call may run several rings one after another (RingStage; the hierarchical all-reduce runs
// three). Between two stages the driver records kStageDoneEvent on kCompute and makes kComm wait
// it: every stage's plan ends with kCompute waiting all of its exchanges, so the next stage's
// first send sees the previous stage's last reduce and the staging slots are free again. kCompute
// is in order and needs nothing. Plan events are re-recorded by the next stage; every wait is
// enqueued after the record it names, within its stage, so it captures that stage's record.
//
// Lanes (Note [Lanes] in plan.h): the stages of a call may run on several lanes, each with its own
// kComm, kCompute, plan events and NCCL communicator (DeviceBackend::setLane). Steps 1-2 happen on
// every lane; the stages of one lane follow each other as above; before step 4, lane 0's kCompute
// waits for laneDoneEvent(k), recorded at the end of lane k's kCompute, for every other lane k.
// So kCallDone still means the whole call (every lane, sends included) has finished.
//
// Note [Sub-rings on one communicator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A plan speaks of ring indices (plan.rank, plan.next, plan.prev in 0..n-1). The GPU transport owns
// ONE NCCL communicator per (process group, device); a ring over some ranks of the group (a
// flattened DeviceMesh slice, a node or a cross-node ring of the hierarchical all-reduce) runs over
// that communicator, ring index i being communicator rank members[i] (RingStage::members). The
// driver maps the indices here, where the peers of each exchange are chosen, and the agreement
// frames travel around the same members (CudaRing::exchangeFrames). No communicator and no process
// group is ever created for a sub-ring, so nothing collective over the whole group happens behind
// the back of the ranks outside the ring. NCCL matches point-to-point messages per (sender,
// receiver) pair in posting order; every stage enumerates its exchanges in the same order on both
// ends of each pair, so rings that share ranks, run one after another or run side by side on
// disjoint ranks never cross their messages (the same argument as for calls in sequence).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../core/collectives.h"
#include "../core/dtype.h"
#include "../core/one_shot_body.h"
#include "../core/plan.h"

namespace rr {

enum class Stream : uint8_t { kComm = 0, kCompute = 1, kCaller = 2 };

// Note [Which exchanges hand off]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The GPU transport launches an exchange either as a hand-off (the non-blocking communicator; the
// host waits until NCCL has put it on the stream) or queued (its blocking child; no wait): Note
// [Hand-off and queued exchanges] in nccl_comm.h. A hand-off is what may make the first contact
// with a peer and what notices a caller inside its own NCCL group, so:
//   * the first exchange of each stage of a call (its grid exchange 0) hands off;
//   * every other exchange is queued - unless some chunk of the stage is empty (a tensor of fewer
//     than n x 16 bytes, or numel < n for exact blocks); then every exchange of the stage hands off.
// NCCL matches point-to-point messages per communicator, so both ends of each message must launch
// it the same way. They do: the sender's exchange e and the receiver's exchange e carry the same
// message (Note [One ring, two transports, one plan] in plan.h), and the rule depends only on e and
// the schedule, which every rank of the ring shares. When no chunk is empty, every rank's exchange
// 0 sends to the next rank and receives from the previous one, so the hand-off reaches both
// neighbours of the stage before any queued exchange does. A call thus costs one host wait per
// stage (1, or 3 for the hierarchical all-reduce), whatever its size; the simulated device checks
// both properties (sim_device.h).
enum class Launch : uint8_t { kQueued = 0, kHandOff = 1 };
Launch exchangeLaunch(const Plan& plan, int32_t exchange);
bool handsOffEveryExchange(const Plan& plan);  // some chunk of the plan is empty

// Framing events (negative ids; plan events are dense ids >= 0 from EventMap).
constexpr int32_t kCallStartEvent = -1;
constexpr int32_t kCallDoneEvent = -2;
constexpr int32_t kPrevCallDoneEvent = -3;
constexpr int32_t kStageDoneEvent = -4;  // between the stages of one lane of a call (kCompute -> kComm)
// Note [Lanes]: lane k's end, recorded on its kCompute, waited by lane 0's (k >= 1).
constexpr int32_t laneDoneEvent(int32_t lane) { return -16 - lane; }
constexpr bool isLaneDoneEvent(int32_t event) { return event <= -17; }
constexpr int32_t laneOfDoneEvent(int32_t event) { return -16 - event; }

// Arguments of one reduce launch, mirroring hostReduce()/launchReduce(): dst = a (op) b, each
// operand of its own type (the tensor's or the plan's partial type). b null: a convert (Note [First
// hop] in plan.h), dst = a (divided by scaling.predivide) in dst's type, hostConvert() on the host.
struct ReduceLaunch {
  const void* a;
  DType a_type;
  const void* b;
  DType b_type;
  void* dst;
  DType dst_type;
  int64_t count;
  Scaling scaling;  // Plan::scaling(): predivide, and AVG's (or a post factor's) final scaling
  RedOp op;         // the stage's reduction (a hierarchical AVG sums in its first stage)
};

// One point-to-point operation of an NCCL group with several peers (the one-shot all-reduce's).
struct PeerOp {
  bool send = false;
  void* buf = nullptr;  // read for a send, written for a receive
  size_t bytes = 0;
  int peer = -1;        // communicator rank
};

// The one-shot reduce (Note [GPU one-shot all-reduce], csrc/core/one_shot_body.h).
struct OneShotLaunch {
  OneShotArgs args;
  DType dtype = DType::kFloat32;    // the tensor's
  DType partial = DType::kFloat32;  // the ring's partial type (partialDType, plan.h)
  RedOp op = RedOp::kSum;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // Called once per call before anything else: at least `num_events` plan events must exist on
  // each of `lanes` lanes (Note [Lanes]).
  virtual void prepare(int32_t num_events, int32_t lanes) = 0;
  // Every later op goes to lane `lane`'s streams, plan events and communicator (kCaller and the
  // call's framing events are shared by the lanes; kStageDoneEvent is per lane).
  virtual void setLane(int32_t lane) = 0;
  // On kComm: send `send_bytes` from `send` to communicator rank `send_peer` and receive
  // `recv_bytes` into `recv` from communicator rank `recv_peer`, as one group, launched as `launch`
  // says (Note [Which exchanges hand off]). Either side may be empty (null, 0 bytes; its peer is
  // then -1). The peers are the ring's neighbours mapped through the stage's members (Note
  // [Sub-rings on one communicator]).
  virtual void exchange(const void* send, size_t send_bytes, int send_peer, void* recv, size_t recv_bytes,
                        int recv_peer, Launch launch) = 0;
  // On kComm: one NCCL group of sends and receives with several peers, always a hand-off (the
  // one-shot all-reduce's exchange; Note [Which exchanges hand off]).
  virtual void group(const std::vector<PeerOp>& ops) = 0;
  // On kCompute: a reduce, or a convert (launch.b null).
  virtual void reduce(const ReduceLaunch& launch) = 0;
  virtual void reduceInOrder(const OneShotLaunch& launch) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // `event` is a dense plan event index (>= 0) or a framing event (< 0).
  virtual void record(Stream stream, int32_t event) = 0;
  virtual void wait(Stream stream, int32_t event) = 0;
  // Last work of the call on kCompute, after every plan op and before kCallDone is recorded
  // (the torch glue copies a non-contiguous tensor's working copy back here).
  virtual void finish() {}
};

// Device addresses of the buffers a plan names.
struct DeviceBuffers {
  void* data = nullptr;        // numel contiguous elements of plan.dtype
  void* accum = nullptr;       // plan.accumBytes() of partials (float32 or 16-bit), when the plan has them
  std::vector<void*> slots;    // plan.num_slots receive buffers of >= slot bytes each (per lane)
  size_t slot_bytes = 0;       // capacity of each slot, checked against the plan
  int32_t slots_per_lane = 0;  // with several lanes, lane k uses slots [k x this, (k + 1) x this)
};

// Maps plan event ids to dense indices: only events some op waits for get one.
struct EventMap {
  std::vector<int32_t> dense;  // per plan event: dense index or -1 (never waited: not recorded)
  int32_t count = 0;
};
EventMap mapWaitedEvents(const Plan& plan);

// Enqueues one whole call (framing + every stage's plan, in order) on `backend`. AVG's division is
// fused into the final reduce of the owned chunk of a stage whose op is AVG. `buffers.data` is the
// call's whole tensor (each stage adds its offset); `buffers.accum` serves a single-stage call.
// `caller_waits`: step 5 above. Throws rr::Error (kRuntime) if the buffers do not fit a plan or a
// stage is malformed, before anything is enqueued.
void enqueueRingStages(const std::vector<RingStage>& stages, const DeviceBuffers& buffers, DeviceBackend& backend,
                       bool caller_waits);

// The one-shot all-reduce (Note [GPU one-shot all-reduce]) of `numel` elements of `dtype` over the
// ring `members` (ring index -> communicator rank; this process is ring index `index`), with the
// call framing of Note [Driving the plan on streams]: one group on kComm sends buffers.data to
// every other member and receives member j's tensor into buffers.slots[j < index ? j : j - 1]
// (each of >= numel elements: buffers.slot_bytes), then one reduce on kCompute writes the result
// into buffers.data. `options` are the flat ring's plan options, of which the one-shot takes what
// decides the bits: accum_float32 and wire_dtype (the partial type), pre_factor, post_factor,
// extra_divisor and avg_divisor (the final scaling; 0: the ring's size). Throws kRuntime/kValue
// (before anything is enqueued) when the buffers do not fit or the ring is larger than
// kOneShotMaxRanks.
void enqueueOneShot(const std::vector<int>& members, int index, int64_t numel, DType dtype, RedOp op,
                    const PlanOptions& options, const DeviceBuffers& buffers, DeviceBackend& backend,
                    bool caller_waits);

// A single flat ring: `members` empty means ring index i is communicator rank i.
void enqueueRingCall(const Plan& plan, RedOp op, const DeviceBuffers& buffers, DeviceBackend& backend,
                     bool caller_waits, const std::vector<int>& members = {});

// The plan options of the GPU transport: the all-gather lands in the output (gather_into_data);
// segments of at most max_segment_bytes (>= 16), capped so that one fits a slot of slot_bytes.
// The pipeline rule (gpu_pipeline.h) picks the three numbers for a call.
PlanOptions gpuPlanOptions(RedOp op, bool accum_float32, int64_t max_segment_bytes, int32_t num_slots,
                           int64_t slot_bytes);

// Bytes one staging slot needs for `plan`.
size_t slotBytesFor(const Plan& plan);

}  // namespace rr
