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
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../core/dtype.h"
#include "../core/plan.h"

namespace rr {

enum class Stream : uint8_t { kComm = 0, kCompute = 1, kCaller = 2 };

// Framing events (negative ids; plan events are dense ids >= 0 from EventMap).
constexpr int32_t kCallStartEvent = -1;
constexpr int32_t kCallDoneEvent = -2;
constexpr int32_t kPrevCallDoneEvent = -3;

// Arguments of one reduce launch, mirroring hostReduce()/launchReduce().
struct ReduceLaunch {
  const void* a;
  bool a_wide;
  const void* b;
  bool b_wide;
  void* dst;
  bool dst_wide;
  int64_t count;
  int divisor;     // > 0: AVG's final division by the world size
  bool round_sum;  // round the sum to the destination type before dividing
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // Called once per call before anything else: at least `num_events` plan events must exist.
  virtual void prepare(int32_t num_events) = 0;
  // On kComm: send `send_bytes` from `send` to the next rank and receive `recv_bytes` into `recv`
  // from the previous rank, as one group. Either side may be empty (null, 0 bytes).
  virtual void exchange(const void* send, size_t send_bytes, void* recv, size_t recv_bytes) = 0;
  // On kCompute.
  virtual void reduce(const ReduceLaunch& launch) = 0;
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
  void* accum = nullptr;       // plan.accum_elems float32 elements (accum_float32 only)
  std::vector<void*> slots;    // plan.num_slots receive buffers of >= slot bytes each
  size_t slot_bytes = 0;       // capacity of each slot, checked against the plan
};

// Maps plan event ids to dense indices: only events some op waits for get one.
struct EventMap {
  std::vector<int32_t> dense;  // per plan event: dense index or -1 (never waited: not recorded)
  int32_t count = 0;
};
EventMap mapWaitedEvents(const Plan& plan);

// Enqueues one whole call (framing + plan) on `backend`. `op` is the reduction; AVG's division is
// fused into the final reduce of the owned chunk. `caller_waits`: step 5 above. Throws rr::Error
// (kRuntime) if the buffers do not fit the plan, before anything is enqueued.
void enqueueRingCall(const Plan& plan, RedOp op, const DeviceBuffers& buffers, DeviceBackend& backend,
                     bool caller_waits);

// The plan options of the GPU transport: the all-gather lands in the output (gather_into_data);
// segment_bytes <= 0 means the default (1 MiB); segments are capped so that one fits a slot.
constexpr int64_t kGpuDefaultSegmentBytes = 1 << 20;
PlanOptions gpuPlanOptions(RedOp op, bool accum_float32, int64_t segment_bytes, int32_t num_slots,
                           int64_t slot_bytes);

// Bytes one staging slot needs for `plan`.
size_t slotBytesFor(const Plan& plan);

}  // namespace rr
