// ringreduce CPU: one GroupRuntime per ring (a process group, or a rank list of one): a worker thread
// with a queue that runs the ring's calls in submission order over the group's Transport, the
// ringreduce-owned staging memory they receive into, the agreement check, and what happens when a
// call fails. Torch-free: the caller (csrc/torch/cpu_ops.cpp) hands in the transport and, per call, a
// CallBody that says which memory to reduce and how to report the result.
//
// Note [Why one worker per group]
// A single global worker deadlocks when ranks order async calls on two groups differently: rank 0
// runs group A's ring and waits for rank 1, which is stuck behind group B's ring in the same queue.
// With one queue per ring, each ring's calls run in the order every rank submitted them.
//
// Note [Failed calls keep their buffers]
// After a transport failure (dead peer, timeout) a receive may still be posted inside the transport.
// The transport keeps its request alive (C10dTransport::abandon) and the runtime never frees or
// reuses the memory it writes into (staging slots, frame buffers): a late message then lands in
// ringreduce-owned memory that nobody reads, never in user memory or freed memory. The group is
// marked unusable ("poisoned"): later calls fail at once.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/agreement.h"
#include "../core/call_options.h"
#include "../core/call_tags.h"
#include "../core/collectives.h"
#include "../core/error.h"
#include "../core/frame.h"
#include "../core/plan.h"
#include "../core/transport.h"
#include "ring_executor.h"
#include "shm_ring.h"
#include "shm_segment.h"

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
// Note [Pipelined hierarchical all-reduce] (node_pipeline.cpp): a piece is at least this many bytes,
// and a call has at most this many pieces.
constexpr int64_t kNodePieceBytes = 4 << 20;
constexpr int64_t kMaxNodePieces = 8;
constexpr int kStagesPerCall = 3;  // the hierarchical all-reduce runs three rings per call
// Note [Receives before the verdict]: a first segment sent before the verdict is at most this
// large, and a receive posted before it has room for this much (part of the wire protocol).
constexpr int64_t kLeadBytes = 1 << 20;
// The ring's staging memory (docs/design.md, memory: <= 8 MiB by default): with the default slots
// (Note [Staging slots] in plan.h) at most kAutoStagingBytes plus kLeadBytes.
constexpr int64_t kStagingCapBytes = 8 << 20;
// How long a shared-memory barrier spins on the ring's worker (async calls) before it sleeps.
constexpr std::chrono::microseconds kWorkerSpin{10};

// Note [One-shot all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A ring all-reduce costs 2 (n - 1) message latencies, each a rendezvous on gloo; for a small tensor
// that latency is the whole cost, and on a host with fewer cores than busy threads every hand-off
// may wait for a scheduler tick. So a checked all-reduce over the whole group (algorithm "auto")
// whose tensor is at most oneShotBytes(n), and at most the segment size (so that tests with tiny
// segments keep covering the ring), sends its tensor with its agreement frame, in the one message
// per peer that the check sends anyway (Note [Payload in the frame message] in
// csrc/core/agreement.h). Once the frames agree, every rank reduces the n tensors itself, chunk by
// chunk of the ring's schedule, in the ring's order: chunk c starts with rank c's elements and
// takes rank c + 1's, c + 2's, ... as each hop of the ring would (local elements first operand,
// partial second, half types rounded at every hop unless accum_dtype=float32, a 16-bit wire's
// partials rounded at every hop from the first hop's convert on, every contribution divided by the
// predivide factor, the complete sum scaled once: hostReduceInOrder with the plan's partial type and
// final Scaling). The result is therefore bitwise the ring's, on every rank, for every segment
// size. Bytes: (n - 1) S per rank instead of 2 (n - 1) / n S, in one latency instead of 2 (n - 1):
// the same bytes for two ranks, where it takes tensors up to 1 MiB (measured back-to-back on 2 vCPUs:
// 0.52-0.77x gloo's time from 256 KiB to 1 MiB, the ring 1.14-1.27x), 64 KiB up to 8 ranks and 32 KiB
// beyond (docs/performance.md). Its memory, 2 (n - 1) receive buffers and one send buffer of
// kFrameBytes (160 B) + oneShotBytes(n) each and 256 KiB of scratch, is at most kOneShotMemoryBytes (3.3 MiB at
// 2 ranks, under 1.3 MiB beyond), on top of the staging slots.
constexpr int64_t oneShotBytes(int ranks) { return ranks <= 2 ? 1 << 20 : ranks <= 8 ? 64 << 10 : 32 << 10; }
constexpr int64_t kOneShotMemoryBytes = 4 << 20;

// The memory a call's rings run over: `numel` contiguous elements of `dtype`.
struct CallBuffer {
  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
};

// Where a completed call spent its time (RINGREDUCE_DEBUG=DETAIL logs it).
struct CallTiming {
  double check_us = 0;  // the agreement frames (0 with the check off)
  double ring_us = 0;   // the stages, copies included
};

// The caller's side of one call: its memory and its completion (the torch glue implements it).
class CallBody {
 public:
  virtual ~CallBody() = default;
  // This rank's agreement frame; the runtime fills in rank and sequence number.
  virtual Frame frame() const = 0;
  // On the worker, before the frames are compared (never called for a locally refused call): the
  // buffer the rings run over, given this process's index in the ring and the ring's size. It may
  // not change anything the caller can see: all_reduce hands in the tensor or a working copy,
  // reduce_scatter a private copy of its input, all_gather its fresh output with this rank's block
  // filled in.
  virtual CallBuffer prepare(int ring_rank, int ring_size) = 0;
  // On the worker, after every ring succeeded: results to where the caller expects them.
  virtual void finish(int ring_rank, int ring_size) = 0;
  // Exactly once, when the call is over (on the worker, or on the submitting thread when the
  // group is already unusable). Must not throw.
  virtual void complete(bool ok, ErrorKind kind, const std::string& message, const CallTiming& timing) = 0;
};

class GroupRuntime {
 public:
  // `transport`: the whole group's (ranks are group ranks); `members`: the ring's ranks in it, in
  // ring order (empty: every rank, in rank order); `default_timeout`: the group's; `name`: for
  // messages. Starts the ring's worker thread.
  // `store`: where the ranks agree on a shared-memory segment (null: never shared memory).
  GroupRuntime(std::unique_ptr<Transport> transport, std::chrono::milliseconds default_timeout, std::string name,
               std::vector<int> members, std::shared_ptr<KeyValueStore> store = nullptr);
  ~GroupRuntime();
  GroupRuntime(const GroupRuntime&) = delete;
  GroupRuntime& operator=(const GroupRuntime&) = delete;

  // Queues a call behind the calls submitted before it and returns its sequence number (identical
  // on every rank that submits the same calls). A call on an unusable group completes, failed,
  // before this returns.
  //
  // Note [Synchronous calls in shared memory]
  // A synchronous call (the caller blocks until it completes) on a ring that runs in shared memory
  // runs on the calling thread when nothing is queued or running before it: two thread hand-offs
  // (to the worker and back) would cost more than a small all-reduce in shared memory takes
  // (tens of microseconds on a 2-vCPU host). On gloo the worker stays: its calls interleave with
  // gloo's own threads, and measured slower inline (docs/performance.md).
  // `interrupted`: asked while a call that runs on the calling thread waits (at least every 50 ms);
  // true means Ctrl-C: the call fails as interrupt() makes it, and the caller raises.
  uint64_t submit(std::shared_ptr<CallBody> body, CallOptions options, bool synchronous = false,
                  std::function<bool()> interrupted = nullptr);
  // Finishes the queued calls and joins the worker (interpreter exit).
  void shutdown();
  // From any thread: the running call and every later one fail with `reason`, and the group
  // becomes unusable (Note [Interrupting a wait] in c10d_transport.cpp).
  void interrupt(const std::string& reason);

  int rank() const { return rank_; }  // this process's index in the ring
  int size() const { return size_; }
  int64_t stagingBytes();                       // the staging slots (Note [Staging slots] in plan.h)
  int64_t memoryBytes();                        // everything the ring holds: slots, frames, scratch
  std::vector<int64_t> bytesSent(bool reset);   // Note [Traffic counters], by group rank
  // "" before the ring's first call, then "shm", "tcp" or "tcp (<why not shared memory>)", followed by
  // "; node stages: ..." once a hierarchical call set its node ring up.
  std::string transportInfo();

 private:
  struct Call {
    std::shared_ptr<CallBody> body;
    CallOptions opt;
    uint64_t seq = 0;
  };
  void loop();
  void execute(Call& call);  // run() + completion; never throws
  void run(Call& call, CallTiming& timing);
  // The stages of a call over `buf` (Note [Hierarchical all-reduce], Note [Ring halves]).
  std::vector<RingStage> stagesFor(const CallOptions& opt, const CallBuffer& buf) const;
  // Staging sized for `plan`; slot 0 with room for at least lead_room bytes.
  RingBuffers ringBuffers(const Plan& plan, void* data, int64_t lead_room);
  // A call that failed its check after posting its leading receives (Note [Receives before the
  // verdict]): they, and the staging slots they point into, are kept forever; the call's tag group
  // is retired (Note [Retired tag groups]).
  void retireLeading(const std::vector<int>& slots, int tag_group);
  // After a transport failure: Note [Failed calls keep their buffers].
  void poison(const std::string& reason);
  // This rank's agreement frame of `call`.
  Frame frameOf(const Call& call) const;
  // After a call whose frames arrived but whose next frame receives could not be posted (a peer
  // left): the call goes on, later calls fail at once with the reason.
  void failLaterCalls(const Call& call, const std::string& post_error);
  // Sets shared memory up at the ring's first one_node call (Note [Shared-memory segments]);
  // returns whether the ring has it.
  bool ensureShm(const CallOptions& opt, std::chrono::milliseconds timeout);
  // The node ring of a hierarchical call (`node_stage`: its stage 1) in shared memory, set up at the
  // first such call; null when its ranks cannot share memory (then the node stages use gloo).
  ShmRing* nodeShm(const CallOptions& opt, const struct RingStage& node_stage, std::chrono::milliseconds timeout);
  // Note [Shared-memory segments]: agrees on and maps one segment for the ring `ring_id` (store keys);
  // null with `why` when it cannot (and warns once when shared memory should have worked).
  std::unique_ptr<ShmRing> setUpShm(const std::string& ring_id, int index, int size, bool want,
                                    std::chrono::milliseconds timeout, std::string* why);
  // A call through shared memory: the frames, then the flat all-reduce, or the TCP stages of other
  // collectives (already checked).
  void runShm(const Call& call, const CallBuffer& buf, bool refused, int tag_group, CallTiming& timing);
  // The TCP stages of a call whose frames were compared already (or that runs unchecked).
  void runStages(const Call& call, const CallBuffer& buf, const std::vector<RingStage>& stages, int tag_group,
                 PlanRun* lead, CallTiming& timing);
  // One ring stage over gloo point-to-point on the call's buffer `base`, on payload tag `tag`.
  void runRing(const struct RingStage& st, void* base, int tag);
  // The tag of stage `stage` of the call in tag group `tag_group` (Note [Tags]).
  int payloadTag(int tag_group, size_t stage) const;
  // Note [Pipelined hierarchical all-reduce]: how many pieces a hierarchical all-reduce of `buf`
  // with its node stages in shared memory is cut into (1: not cut), and running them.
  static int64_t nodePieces(const CallBuffer& buf);
  void runNodePieces(const Call& call, const CallBuffer& buf, int64_t pieces, ShmRing* node, int tag_group);
  // Note [One-shot all-reduce]: the frames carry the tensors; then every rank reduces them.
  void runOneShot(const Call& call, const CallBuffer& buf, int tag_group, CallTiming& timing);

  std::unique_ptr<Transport> transport_;
  std::chrono::milliseconds default_timeout_;
  std::string name_;
  RingMembers ring_;     // the ring's ranks in the group, explicit
  bool whole_group_;     // the ring is the whole group in rank order
  RankMapTransport ring_transport_;  // transport_ in ring indices (agreement frames)
  int rank_ = 0;         // index in the ring
  int size_ = 1;
  int tag_slot_ = 0;
  // Payload tag groups, one per call (kStagesPerCall x kTagsPerCall tags each); worker-owned.
  CallTagGroups call_tags_{kPayloadTagsPerSlot / (kStagesPerCall * kTagsPerCall)};
  FrameAgreement frames_;
  std::unique_ptr<std::atomic<int64_t>[]> sent_;  // Note [Traffic counters], by group rank
  CountingTransport payload_;                     // transport_ with sent_ counting

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Call> queue_;
  bool stop_ = false;
  bool busy_ = false;       // a call is executing (on the worker or the submitting thread)
  bool shm_ready_ = false;  // the ring runs in shared memory
  uint64_t next_seq_ = 0;
  bool poisoned_ = false;
  std::string poison_reason_;
  std::thread worker_;

  // Worker-owned memory (the submitting thread only reads its size, under mu_).
  std::vector<std::unique_ptr<char[]>> slots_;
  std::vector<int64_t> slot_sizes_;  // bytes of each slot
  std::vector<float> accum_;
  std::vector<float> scratch_;  // one-shot partials: kReduceInOrderScratchBytes

  // Shared memory (worker-owned after setup; shm_state_ read by other threads under mu_).
  std::shared_ptr<KeyValueStore> store_;
  std::unique_ptr<ShmRing> shm_;
  bool shm_tried_ = false;
  std::string shm_state_;  // "" until the ring's first call decided it
  // The hierarchical all-reduce's node ring in shared memory (worker-owned; set up at the first
  // hierarchical call whose frames agreed; node_shm_state_ read under mu_).
  std::unique_ptr<ShmRing> node_shm_;
  std::vector<int> node_shm_members_;
  bool node_shm_tried_ = false;
  std::string node_shm_state_;

  // Note [Interrupting a wait]: set by interrupt() from any thread; asked by shared-memory waits.
  std::atomic<bool> interrupted_{false};
  std::string interrupt_reason_;             // under mu_
  std::function<bool()> inline_interrupted_;  // the running inline call's poll (its thread only)
  uint64_t inline_seq_ = 0;                   // and its sequence number
  std::string abortReason();                 // "" or why a shared-memory wait must stop now
};

}  // namespace rr
