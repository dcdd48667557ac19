// ringreduce tests: a simulated GPU for the GPU ring executor, run on the host.
//
// Note [Simulated streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// SimDevice gives every rank of an in-process ring a kComm and a kCompute stream per lane (up to
// 4, Note [Lanes] in plan.h; each lane also its own communicator) and a kCaller stream, with CUDA's
// semantics, and a DeviceBackend (ring_executor.h) that only *enqueues* onto them, exactly
// like the CUDA backend. A seeded random scheduler then advances one stream at a time, across all
// ranks, so every interleaving CUDA allows can occur:
//   * a stream runs its ops in order; an event record fires when it is reached; a stream wait
//     captures, when it is enqueued, the event's latest enqueued record (none: a no-op, as in CUDA)
//     and blocks until that record fired;
//   * an exchange posts its send to its send peer when it reaches the head of kComm, then blocks
//     until the matching message from its receive peer arrived (matched per communicator - the
//     hand-off or the queued one of Note [Which exchanges hand off] - and (sender, receiver) pair,
//     in posting order, like NCCL p2p; byte counts must agree) and its own message was
//     consumed (strict rendezvous, so a cyclic wait shows as a deadlock instead of passing by
//     luck). Ranks are communicator ranks: a sub-ring (Note [Sub-rings on one communicator]) talks
//     to the peers its members name, and peersUsed() reports them. A queued exchange with a peer
//     (in that direction) that no hand-off reached before fails the run; handOffs() counts a
//     rank's hand-offs (its host waits on the GPU);
//   * reduces and converts run the same ReduceBody/ConvertBody, through the same dispatch, as the
//     CUDA kernels (on a simulated grid of threads); copies are memcpy.
// Every memory access is checked for races with vector clocks (one component per rank and
// stream): two accesses of one rank to overlapping bytes, at least one a write, must be ordered by
// stream order and captured event waits; otherwise the run fails naming both ops. An exchange's
// accesses count from the moment it started until it completed. So a missing wait, a staging slot
// reused before its reduce finished, or a call that reads the tensor before the caller's producer
// wrote it fails deterministically, not only when the data happens to come out wrong.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../../../csrc/core/plan.h"
#include "../../../csrc/cuda/ring_executor.h"

namespace rr {
namespace sim {

// The interpreter decisions a test may break on purpose, to prove that the simulator notices.
enum class Fault : int {
  kNone = 0,
  kSkipPrevCallWait = 1,   // kComm does not wait for the previous call
  kSkipCallerStart = 2,    // kComm/kCompute do not wait for the caller's stream
  kDropFirstPlanWait = 3,  // the first kWait of the plan on kCompute is not enqueued
  kShiftReduce = 4,        // one reduce writes one element too far
  kSkipCallerDone = 5,     // the caller does not wait for the call's end
  kSkipStageWait = 6,      // kComm does not wait for the previous stage of the call
  kUnmappedPeers = 7,      // exchanges talk to communicator ranks r +- 1, ignoring the members
  kWrongLaunch = 8,        // rank 0 launches its second exchange on the other communicator
  kSkipLaneJoin = 9,       // lane 0 does not wait for the other lanes' ends (Note [Lanes])
};

struct Event;   // a physical event
struct Op;      // an enqueued stream op

class SimDevice;

// Per-rank persistent state (what CudaRing owns): staging slots and the plan-event pool.
struct SimRank {
  int rank = 0;
  std::vector<std::vector<unsigned char>> slots;
  size_t slot_bytes = 0;
  std::vector<std::vector<std::shared_ptr<Event>>> plan_events;  // per lane
  std::shared_ptr<Event> last_done;  // kPrevCallDoneEvent
};

// One call's framing events.
struct SimCall {
  std::shared_ptr<Event> start;
  std::shared_ptr<Event> done;
  std::vector<std::shared_ptr<Event>> stage;      // kStageDoneEvent, per lane
  std::vector<std::shared_ptr<Event>> lane_done;  // laneDoneEvent(k)
};

class SimDevice {
 public:
  SimDevice(int nranks, int num_slots, size_t slot_bytes, uint64_t seed);
  ~SimDevice();

  int nranks() const { return nranks_; }
  SimRank& rank(int r) { return *ranks_[static_cast<size_t>(r)]; }

  // A backend enqueueing one call of communicator rank r (lives as long as the call's ops are
  // enqueued). Each reduce uses the op of its ReduceLaunch.
  std::unique_ptr<DeviceBackend> backend(int r, DType dtype, Fault fault, SimCall* call);

  // The communicator ranks each exchange of rank r named, in enqueue order (-1: that side empty).
  struct PeerUse {
    int send_peer;
    int recv_peer;
  };
  const std::vector<PeerUse>& peersUsed(int r) const;
  // Exchanges of rank r launched as hand-offs (Note [Which exchanges hand off]).
  int handOffs(int r) const;

  // Caller-stream op: runs `fn` when reached; `reads`/`writes` are its accesses (checked).
  struct Access {
    const void* ptr;
    size_t bytes;
  };
  void callerOp(int r, const std::string& what, std::vector<Access> reads, std::vector<Access> writes,
                std::function<void()> fn);
  // Caller-stream wait for a call's done event (what Work.wait() enqueues).
  void callerWait(int r, const SimCall& call);

  // Runs every stream of every rank to the end. Returns "" or the first failure (race,
  // deadlock, size mismatch, ...).
  std::string run();

  // For DeviceBackend implementations.
  void enqueue(int r, Stream s, std::unique_ptr<Op> op, int lane = 0);
  std::shared_ptr<Event> newEvent();
  int64_t enqueueRecordId(const std::shared_ptr<Event>& e);

 private:
  struct Impl;
  int nranks_;
  std::vector<std::unique_ptr<SimRank>> ranks_;
  std::unique_ptr<Impl> impl_;
};

// Enqueues one synchronous call of communicator rank r as the torch glue does: the producer (the
// caller's kernel that writes `input` into `tensor` right before the call), the call's `stages`
// (enqueueRingStages(), the caller's stream waiting at the end), and the consumer (copying
// `tensor` to `output` on the caller's stream). `bytes`: the tensor's size; `accum`: float32
// partials of a single flat stage, or null. Throws what the driver throws.
void enqueueSyncCall(SimDevice& dev, int r, DType dtype, const std::vector<RingStage>& stages, void* tensor,
                     size_t bytes, const void* input, void* output, void* accum, Fault fault, SimCall* call);

// The one-shot reduce of the CUDA kernel, on the host: OneShotBody over `nthreads` simulated
// threads, dispatched as launchOneShotReduce() dispatches the kernels (inputs of l.dtype, partials
// of l.partial, the result of l.dst).
void hostOneShotReduce(const OneShotLaunch& l, int nthreads);

// The reduce of the CUDA kernel, on the host: ReduceBody (ConvertBody when b is null) over
// `nthreads` simulated threads, dispatched by reduce_dispatch.h exactly as launchReduce()
// dispatches the kernels.
void hostKernelReduce(RedOp op, const void* a, DType a_type, const void* b, DType b_type, void* dst, DType dst_type,
                      int64_t count, const Scaling& scaling, int nthreads);

}  // namespace sim
}  // namespace rr
