// ringreduce torch layer: the CPU path. One GroupRuntime per c10d process group: a worker thread
// with a queue that runs calls in submission order over the group's gloo backend (send/recv of
// the caller's own ProcessGroup), and the ringreduce-owned staging memory they receive into.
//
// Note [Why one worker per group]
// A single global worker deadlocks when ranks order async calls on two groups differently: rank 0
// runs group A's ring and waits for rank 1, which is stuck behind group B's ring in the same queue.
// With one queue per group, each group's calls run in the order every rank submitted them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/call_tags.h"
#include "../core/dtype.h"
#include "../core/error.h"
#include "../core/frame.h"
#include "../core/plan.h"
#include "../core/transport.h"
#include "../cpu/ring_executor.h"

namespace rr {

// Note [Tags]
// Reserved tag range [2^30, 2^31), split between rings: a ring over a rank list of the group (a
// DeviceMesh dimension) has its own runtime and tag space, slot 1 + hash(members) mod 63 (the
// whole group: slot 0), so it can run concurrently with the group's other rings. Frames travel on
// kFrameTagBase + slot (matched in order, so a rank that skipped a call is reported by sequence
// number); stage s of a call on kPayloadTagBase + slot * kPayloadTagsPerSlot + (g * kStagesPerCall
// + s) * kTagsPerCall, where g is the call's tag group (Note [Retired tag groups]).
constexpr int kTagSlots = 64;
constexpr int kFrameTagBase = 1 << 30;
constexpr int kPayloadTagBase = (1 << 30) + kTagSlots;
constexpr int kPayloadTagsPerSlot = ((1 << 30) - kTagSlots) / kTagSlots;
constexpr int kStagesPerCall = 3;  // the hierarchical all-reduce runs three rings per call
// Note [Receives before the verdict]: a first segment sent before the verdict is at most this
// large, and a receive posted before it has room for this much (part of the wire protocol).
constexpr int64_t kLeadBytes = 1 << 20;
// The group's staging memory (DESIGN.md section 5: <= 8 MiB by default): with the default slots
// (Note [Staging slots] in plan.h) at most kAutoStagingBytes plus kLeadBytes.
constexpr int64_t kStagingCapBytes = 8 << 20;

struct CallOptions {
  RedOp op = RedOp::kSum;
  bool accum_float32 = false;
  int32_t kind = 0;           // CallKind
  int32_t local_error = 0;    // FrameError: this rank refuses; exchange frames only
  int32_t ntensors = 1;
  bool check = true;          // exchange agreement frames first
  int64_t segment_bytes = 1 << 20;
  int32_t num_slots = 4;
  int64_t timeout_ms = -1;    // <0: the group's own timeout
  // Hierarchical all-reduce (Note [Hierarchical all-reduce]): the ring's members are ordered node
  // by node, local_size per node; 0 = the flat ring.
  int32_t local_size = 0;
  bool recv_only_waits = true;  // PlanOptions::recv_only_waits (RINGREDUCE_RECV_ONLY_WAITS)
  std::vector<int> node_order;  // hierarchical: the ring's ranks (of the pg) node by node; empty: ring order
  // reduce_scatter / all_gather (Note [Ring halves] in plan.h).
  int32_t phases = 3;
  int32_t owner_shift = 0;
  bool exact_chunks = false;
};

// One submitted call: what Python's Work wraps.
class CallHandle {
 public:
  // Blocks (the caller releases the GIL) until done or until timeout_ms (<0: forever).
  bool wait(int64_t timeout_ms);
  bool isCompleted();
  bool ok();
  int errorKind();  // ErrorKind as int; valid when completed and !ok()
  std::string errorMessage();
  uint64_t seq() const { return seq_; }
  c10::intrusive_ptr<c10::ivalue::Future> future() const { return future_; }

 private:
  friend class GroupRuntime;
  void finish(bool ok, int kind, const std::string& msg);

  at::Tensor tensor_;
  at::Tensor output_;  // reduce_scatter / all_gather: the result (the future's value); else undefined
  CallOptions opt_;
  uint64_t seq_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool ok_ = false;
  int error_kind_ = 0;
  std::string error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class GroupRuntime {
 public:
  // members: the ring's ranks in `pg` (ring order); empty = the whole group in rank order.
  GroupRuntime(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string name, std::vector<int> members);
  ~GroupRuntime();

  // Submit a call (tensor may be undefined for a local refusal); assigns the sequence number.
  // `output`: reduce_scatter's output block / all_gather's concatenated result (else undefined).
  // With run_inline, a call that would run next anyway (queue empty, worker idle) runs on the
  // calling thread (which has released the GIL): a synchronous call then costs no thread handoff.
  // Otherwise the call is queued for the worker, behind the calls submitted before it.
  std::shared_ptr<CallHandle> submit(const at::Tensor& tensor, const at::Tensor& output, const CallOptions& opt,
                                     bool run_inline);
  void shutdown();  // finish queued calls, join the worker
  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t stagingBytes();  // this ring's staging slots (Note [Staging slots] in plan.h)

 private:
  void loop();
  void execute(CallHandle& call);  // run() + timing + completion, never throws
  void run(CallHandle& call);
  // One ring over `t` (rank list already applied): builds the plan, sizes staging, executes.
  void runRing(Transport& t, int rank, int size, void* data, int64_t numel, DType dtype, RedOp op,
               const PlanOptions& po, int tag, RunTrace* trace = nullptr);
  // Staging sized for `plan`; slot 0 with room for at least lead_room bytes.
  RingBuffers ringBuffers(const Plan& plan, void* data, int64_t lead_room);
  // A call that failed its check after posting its leading receives (Note [Receives before the
  // verdict]): they, and the staging slots they point into, go to the graveyard; the call's tag
  // group is retired (Note [Retired tag groups]).
  void retireLeading(Transport& t, const std::vector<int>& slots, int tag_group);
  std::chrono::milliseconds timeoutFor(const CallOptions& opt) const;
  // Note [Pre-posted frame receives] (whole-group rings): the agreement frames of this call, over
  // receives posted by the previous exchange: sendFrame posts this rank's frame to every peer,
  // collectFrames waits for theirs (and for the sends), posts the next call's receives and returns
  // all frames, by rank.
  void sendFrame(const Frame& mine);
  std::vector<Frame> collectFrames(const Frame& mine, std::chrono::milliseconds timeout, uint64_t seq);
  void postFrameReceives();           // one receive from every peer
  void postNextFrames(uint64_t seq);  // after collectFrames; a failure marks the group unusable
  void abandonFrames();  // after a transport failure: pending receives and their memory are kept

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::string name_;
  std::vector<int> members_;  // empty: the whole group
  int pg_rank_ = 0;
  int rank_ = 0;              // index in the ring
  int size_ = 1;
  int tag_slot_ = 0;
  // Payload tag groups, one per call (kStagesPerCall x kTagsPerCall tags each); worker-owned.
  CallTagGroups call_tags_{kPayloadTagsPerSlot / (kStagesPerCall * kTagsPerCall)};
  // Note [Receives before the verdict]: 2 receives and first send, 1 receives only, 0 off
  // (RINGREDUCE_LEAD=0|recv, read when the runtime is created).
  int lead_mode_ = 2;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<CallHandle>> queue_;
  bool stop_ = false;
  bool busy_ = false;  // a call is executing (on the worker or inline)
  uint64_t next_seq_ = 0;
  bool poisoned_ = false;
  std::string poison_reason_;
  std::thread worker_;

  // Worker-owned memory (never touched by the submitting thread).
  std::vector<std::unique_ptr<char[]>> slots_;
  std::vector<int64_t> slot_sizes_;  // bytes of each slot
  std::vector<float> accum_;
  std::unique_ptr<char[]> frame_in_;   // size_ frames: where the pre-posted receives land
  std::unique_ptr<char[]> frame_out_;  // this rank's frame while its sends are in flight
  std::vector<c10::intrusive_ptr<c10d::Work>> frame_recvs_;  // pending, indexed by ring rank; empty: none posted
  std::vector<c10::intrusive_ptr<c10d::Work>> frame_sends_;
  std::vector<c10::intrusive_ptr<c10d::Work>> frame_done_;  // completed receives, freed at the next exchange
};

// The registry: one runtime per (ProcessGroup object, rank list), created on first use. An empty
// rank list, or one equal to 0..size-1, is the whole group.
std::shared_ptr<GroupRuntime> runtimeFor(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                         const std::string& name, const std::vector<int>& members);
void shutdownAll();

// Bytes of staging the CPU path holds for `pg` (all its rings): DESIGN.md section 5's bound.
int64_t stagingBytes(const c10d::ProcessGroup* pg);

// Payload bytes this process sent to each rank of `pg` on the CPU path (Note [Traffic counters]).
std::vector<int64_t> bytesSent(const c10d::ProcessGroup* pg, bool reset);

DType toDType(at::ScalarType t);  // throws kType for unsupported dtypes

}  // namespace rr
