// ringreduce GPU: the plan interpreter, generic over a stream-ordered "device backend".
//
// Note [Driving the plan on streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The GPU transport *enqueues* the plan: every op (plan.h) goes, in list order, to a DeviceBackend
// that puts it on kComm (one grouped send(next)+recv(prev) per kExchange), kCompute (a kernel per
// kReduce, a device copy per kCopy) or kCaller (only the call's first and last events); kRecord/kWait
// become event records and stream waits. A stream wait captures the event's latest record when it is
// enqueued, so every wait must be enqueued after the record it names: the list order guarantees it.
// Call framing (the same for every backend, so the fakes test it too):
//   1. record kCallStart on kCaller; kComm and kCompute wait it (the call sees the tensor's producer);
//   2. kComm waits kPrevCallDone: staging slots and events are shared between calls, and the previous
//      call's reduces may still read a slot this call's first exchange overwrites;
//   3. the plan's ops;
//   4. backend.finish(), then kCallDone on kCompute: every plan ends with kCompute waiting every
//      exchange, so kCallDone covers the whole call, sends included;
//   5. synchronous calls: kCaller waits kCallDone (asynchronous ones in Work.wait()).
// Only plan events some op waits for are recorded, each on its own physical event (EventMap), so no
// wait is captured by a later re-record. Between two stages of a call (RingStage) kCompute records
// kStageDoneEvent and kComm waits it, so the next stage's first send sees the last reduce. Each lane
// (Note [Lanes] in plan.h) has its own kComm, kCompute, plan events and communicator (setLane): steps
// 1-2 run on every lane, and before step 4 lane 0's kCompute waits laneDoneEvent(k) of every lane k.
//
// Note [Sub-rings on one communicator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A plan speaks of ring indices; a ring over some of the communicator's ranks (a DeviceMesh slice,
// a stage of the hierarchical all-reduce) maps ring index i to communicator rank members[i]
// (RingStage::members), here and in the agreement frames. No communicator is ever created for a
// sub-ring, so nothing collective over the whole group happens behind the back of the ranks outside
// it. NCCL matches point-to-point messages per (sender, receiver) pair in posting order, and every
// stage enumerates its exchanges in the same order on both ends of each pair, so rings that share
// ranks never cross their messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../core/collectives.h"
#include "../core/direct.h"
#include "../core/dtype.h"
#include "../core/one_shot_body.h"
#include "../core/plan.h"
#include "reduce_args.h"

namespace rr {

enum class Stream : uint8_t { kComm = 0, kCompute = 1, kCaller = 2 };

// Note [Which exchanges hand off]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Only a hand-off (Note [Hand-off and queued exchanges], nccl_comm.h) may make the first contact
// with a peer or notice a caller inside its own NCCL group, so a stage's (a lane's) first exchange
// hands off and every other one is queued - unless some chunk of the stage is empty (a tensor under
// n x 16 bytes, or numel < n for exact blocks): then every exchange hands off. Both ends of a message
// launch it the same way (NCCL matches per communicator): the rule depends only on the exchange and
// the shared schedule. So a call waits on the host once per stage (checked by sim_device.h).
enum class Launch : uint8_t { kQueued = 0, kHandOff = 1 };
bool handsOffEveryExchange(const Plan& plan);  // some chunk of the plan is empty

// Framing events (negative ids; plan events are dense ids >= 0, Note [Driving the plan on streams]).
constexpr int32_t kCallStartEvent = -1;
constexpr int32_t kCallDoneEvent = -2;
constexpr int32_t kPrevCallDoneEvent = -3;
constexpr int32_t kStageDoneEvent = -4;  // between the stages of one lane of a call (kCompute -> kComm)
// Note [Lanes]: lane k's end, recorded on its kCompute, waited by lane 0's (k >= 1).
constexpr int32_t laneDoneEvent(int32_t lane) { return -16 - lane; }
constexpr bool isLaneDoneEvent(int32_t event) { return event <= -17; }
constexpr int32_t laneOfDoneEvent(int32_t event) { return -16 - event; }

// One send or receive of an NCCL group (the one-shot's; NcclComm::group).
struct PeerOp {
  bool send = false;
  void* buf = nullptr;  // read for a send, written for a receive
  size_t bytes = 0;
  int peer = -1;        // communicator rank
};

// The one-shot reduce (Note [GPU one-shot all-reduce], csrc/core/one_shot_body.h), also a direct
// all-reduce's reduce of one round (Note [Direct all-reduce], csrc/core/direct.h).
struct OneShotLaunch {
  OneShotArgs args;
  DType dtype = DType::kFloat32;    // the inputs' (the tensor's; a direct wire's 16-bit pieces)
  DType partial = DType::kFloat32;  // the partial type (the ring's: partialDType, plan.h; directPartial)
  DType dst = DType::kFloat32;      // the result's (dtype, or the float32 tensor of a direct wire)
  RedOp op = RedOp::kSum;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // First call of a call: at least `num_events` plan events on each of `lanes` lanes.
  virtual void prepare(int32_t num_events, int32_t lanes) = 0;
  // Later ops go to lane `lane` (kCaller and the framing events are shared; kStageDoneEvent is not).
  virtual void setLane(int32_t lane) = 0;
  // On kComm, one group: send `send_bytes` to communicator rank `send_peer`, receive `recv_bytes`
  // from `recv_peer`, launched as `launch` says. Either side may be empty (null, 0 bytes, peer -1).
  virtual void exchange(const void* send, size_t send_bytes, int send_peer, void* recv, size_t recv_bytes,
                        int recv_peer, Launch launch) = 0;
  // On kComm: one group with several peers (the one-shot's, a direct all-reduce's round), launched
  // as `launch` says (the one-shot's: a hand-off).
  virtual void group(const std::vector<PeerOp>& ops, Launch launch) = 0;
  // On kCompute: a reduce, or a convert (launch.b null).
  virtual void reduce(const ReduceLaunch& launch) = 0;
  virtual void reduceInOrder(const OneShotLaunch& launch) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // `event` is a dense plan event index (>= 0) or a framing event (< 0).
  virtual void record(Stream stream, int32_t event) = 0;
  virtual void wait(Stream stream, int32_t event) = 0;
  // Last work on kCompute before kCallDone (the torch glue copies a working copy back here).
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

// Enqueues one whole call (framing and every stage's plan) on `backend`. `buffers.data` is the whole
// tensor (each stage adds its offset); `buffers.accum` serves a single-stage call. Throws
// rr::Error(kRuntime) before enqueueing anything if the buffers do not fit or a stage is malformed.
void enqueueRingStages(const std::vector<RingStage>& stages, const DeviceBuffers& buffers, DeviceBackend& backend,
                       bool caller_waits);

// The one-shot's reduce with the flat ring's arithmetic over `n` ranks: from the ring's `options`
// what decides the bits (partial type, scaling). Throws kValue/kRuntime for what the ring refuses.
OneShotLaunch ringOneShotLaunch(int n, int64_t numel, DType dtype, RedOp op, const PlanOptions& options);
// The one-shot's reduce of a direct all-reduce (Note [Direct all-reduce]): every element in rank
// order with `how`'s arithmetic (its round_to must be its dtype: the tensors travel as they are).
OneShotLaunch directOneShotLaunch(int n, int64_t numel, const InOrderReduce& how);

// The one-shot all-reduce (Note [GPU one-shot all-reduce]) over `members` (this process at ring
// index `index`), framed as above: one group on kComm sends buffers.data to every other member and
// receives member j's tensor into buffers.slots[j < index ? j : j - 1], then one reduce on kCompute
// (`launch`, its tensors and result filled in here) writes buffers.data. Throws kRuntime/kValue
// before enqueueing anything.
void enqueueOneShot(const std::vector<int>& members, int index, const OneShotLaunch& launch,
                    const DeviceBuffers& buffers, DeviceBackend& backend, bool caller_waits);

// Call framing, steps 1-2 and 4-5 of Note [Driving the plan on streams] (every driver's).
void beginCall(DeviceBackend& backend, int32_t lanes);
void endCall(DeviceBackend& backend, bool caller_waits);

// A single flat ring, ring index i being communicator rank i (the tests' entry).
void enqueueRingCall(const Plan& plan, RedOp op, const DeviceBuffers& buffers, DeviceBackend& backend,
                     bool caller_waits);

// The GPU transport's plan options: the all-gather lands in the output; segments of at most
// max_segment_bytes (>= 16) that fit a slot. gpuPipeline() picks the numbers.
PlanOptions gpuPlanOptions(RedOp op, bool accum_float32, int64_t max_segment_bytes, int32_t num_slots,
                           int64_t slot_bytes);

// Bytes one staging slot needs for `plan`.
size_t slotBytesFor(const Plan& plan);

}  // namespace rr
