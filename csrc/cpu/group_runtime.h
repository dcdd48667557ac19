// ringreduce CPU: one GroupRuntime per ring (a process group, or a rank list of one): a worker thread
// that runs the ring's calls in submission order over the group's Transport, the staging memory
// they receive into, the agreement check, and failure handling. Torch-free: the caller
// (csrc/torch/cpu_ops.cpp) hands in the transport and, per call, a CallBody.
//
// Note [Why one worker per group]
// A single global worker deadlocks when ranks order async calls on two groups differently: rank 0
// waits in group A's ring for rank 1, stuck behind group B's ring in the same queue.
//
// Note [Failed calls keep their buffers]
// After a transport failure (dead peer, timeout) a receive may still be posted inside the transport.
// The transport keeps its request alive (C10dTransport::abandon) and the runtime neither frees nor
// reuses the memory it writes into (staging slots, frame buffers) while the ring lives, so a late
// message lands in memory nobody reads, never in user or freed memory. The group is marked unusable
// ("poisoned"). A call that fails its check after posting leading receives keeps its slots alike.
//
// Note [Releasing a ring's buffers]
// Those buffers belong to the ring, not to the process: when the ring is released (its group
// destroyed or aborted: runtime_registry.h releaseRuntimesOf), its destructor joins the worker, then
// closes the transport (Transport::close). Over gloo that destroys every request the ring ever left
// posted, and gloo guarantees that no message lands in the memory of a destroyed request's buffer
// (C10dTransport::close); only then are the kept slots and the frame buffers freed. So a process that
// re-forms its ring many times (torchft reconfigures at every membership change, aborting rings whose
// calls failed) holds the buffers of live rings only. A transport that cannot promise it (close()
// returns false: a request is still held elsewhere, or a transport without close) leaves them kept
// for the rest of the process, as before. retainedBytes() counts what is kept, both ways.
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
#include "call_body.h"
#include "direct_exchange.h"
#include "ring_executor.h"
#include "shm_path.h"
#include "shm_ring.h"
#include "shm_segment.h"

namespace rr {

// Note [Tags]
// Reserved tag range [2^30, 2^31), split into kTagSlots slots so that rings over rank lists of the
// group (DeviceMesh dimensions, each with its own runtime) run concurrently with the group's other
// rings: the whole group has slot 0, a rank-list ring 1 + hash(members) mod 63. Frames travel on
// kFrameTagBase + slot (matched in order, so a rank that skipped a call shows by sequence number);
// stage s of a call in tag group g (Note [Retired tag groups]) on kPayloadTagBase
// + slot * kPayloadTagsPerSlot + (g * kStagesPerCall + s) * kTagsPerCall.
constexpr int kTagSlots = 64;
constexpr int kFrameTagBase = 1 << 30;
constexpr int kPayloadTagBase = (1 << 30) + kTagSlots;
constexpr int kPayloadTagsPerSlot = ((1 << 30) - kTagSlots) / kTagSlots;
// Note [Pipelined hierarchical all-reduce]: a piece's least bytes, a call's most pieces.
constexpr int64_t kNodePieceBytes = 4 << 20;
constexpr int64_t kMaxNodePieces = 8;
constexpr int kStagesPerCall = 3;  // the hierarchical all-reduce runs three rings per call
// Note [Receives before the verdict]: the largest first segment sent before the verdict, and the
// room of a receive posted before it (part of the wire protocol).
constexpr int64_t kLeadBytes = 1 << 20;
// The ring's staging cap (docs/design.md: <= 8 MiB by default): kAutoStagingBytes plus kLeadBytes.
constexpr int64_t kStagingCapBytes = 8 << 20;
// How long a shared-memory barrier spins on the ring's worker (async calls) before it sleeps.
constexpr std::chrono::microseconds kWorkerSpin{10};

// Note [One-shot all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A ring costs 2 (n - 1) message latencies, the whole cost of a small tensor. So a checked
// all-reduce over the whole group of at most oneShotBytes(n) and the segment size (tests with tiny
// segments still cover the ring) sends its tensor inside its frame message (Note [Payload in the
// frame message] in agreement.h); once the frames agree every rank reduces the n tensors chunk by
// chunk in the ring's order (hostReduceInOrder with the plan's partial type and final Scaling), so
// the result is bitwise the ring's; a direct all-reduce's (Note [Direct all-reduce] in
// csrc/core/direct.h) reduces every element in rank order, as the direct exchange does. It moves (n - 1) S bytes per rank instead of 2 (n - 1) / n S,
// hence thresholds falling with n (docs/performance.md).
constexpr int64_t oneShotBytes(int ranks) { return ranks <= 2 ? 1 << 20 : ranks <= 8 ? 64 << 10 : 32 << 10; }

class GroupRuntime {
 public:
  // `transport`: the whole group's; `members`: the ring's group ranks in ring order (empty: every
  // rank); `name`: for messages; `store`: where ranks agree on shared memory (null: never). Starts
  // the ring's worker thread.
  GroupRuntime(std::unique_ptr<Transport> transport, std::chrono::milliseconds default_timeout, std::string name,
               std::vector<int> members, std::shared_ptr<KeyValueStore> store = nullptr);
  ~GroupRuntime();
  GroupRuntime(const GroupRuntime&) = delete;
  GroupRuntime& operator=(const GroupRuntime&) = delete;

  // Queues a call behind the earlier ones and returns its sequence number (the same on every rank
  // that submits the same calls). A call on an unusable group completes, failed, before this returns.
  //
  // Note [Synchronous calls in shared memory]
  // A synchronous call on a ring in shared memory runs on the calling thread when nothing is queued
  // or running: two thread hand-offs would cost more than a small shared-memory all-reduce. On gloo
  // the worker stays (inline calls contend with gloo's own threads).
  // `interrupted`: polled while an inline call waits (at least every 50 ms); true means Ctrl-C: the
  // call fails as interrupt() makes it, and the caller raises.
  uint64_t submit(std::shared_ptr<CallBody> body, CallOptions options, bool synchronous = false,
                  std::function<bool()> interrupted = nullptr);
  // Finishes the queued calls and joins the worker (interpreter exit, a released ring).
  void shutdown();
  // From any thread: the running call and every later one fail with `reason`, and the group
  // becomes unusable (Note [Interrupting a wait] in c10d_transport.cpp).
  void interrupt(const std::string& reason);

  int rank() const { return rank_; }  // this process's index in the ring
  int size() const { return size_; }
  int64_t stagingBytes();                       // the staging slots (Note [Staging slots] in plan.h)
  int64_t memoryBytes();                        // everything the ring holds: slots (kept ones too), frames, scratch
  std::vector<int64_t> bytesSent(bool reset);   // Note [Traffic counters], by group rank
  // Bytes of failed and retired calls' buffers that the process's rings keep (Note [Failed calls keep
  // their buffers]), live rings' and those a released ring could not free (Note [Releasing a ring's buffers]).
  static int64_t retainedBytes();
  // "" before the first call, then "shm", "tcp" or "tcp (<why not>)", plus "; node stages: ..."
  // once a hierarchical call set its node ring up.
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
  // Staging slots 0 .. need.size() - 1 with at least need[k] bytes each (Note [Staging slots]).
  void growSlots(const std::vector<int64_t>& need);
  // A call that failed its check after posting leading receives (Note [Receives before the verdict]):
  // those slots are kept forever and the call's tag group is retired (Note [Retired tag groups]).
  void retireLeading(const std::vector<int>& slots, int tag_group);
  // After a transport failure: Note [Failed calls keep their buffers].
  void poison(const std::string& reason);
  void keep(std::unique_ptr<char[]> buffer, int64_t bytes);  // under mu_: into kept_
  Frame frameOf(const Call& call) const;  // this rank's agreement frame of `call`
  // Collects the frames after this rank's went out (at `started`). A verdict retires the call's tag
  // group (and `lead`'s slots) on every rank alike and raises; when the next call's frame receives
  // could not be posted (a peer left), this call goes on and later ones fail at once.
  // `direct`: a direct all-reduce's leading messages (Note [Direct before the verdict]).
  void checkFrames(const Call& call, const Frame& mine, int tag_group, std::chrono::steady_clock::time_point started,
                   CallTiming& timing, const PlanRun* lead = nullptr, const std::vector<int>& lead_slots = {},
                   const DirectRun* direct = nullptr);
  // The stages of a call whose frames were compared already (or that runs unchecked).
  void runStages(const Call& call, const CallBuffer& buf, const std::vector<RingStage>& stages, int tag_group,
                 PlanRun* lead, CallTiming& timing);
  // One ring stage over gloo point-to-point on the call's buffer `base`, on payload tag `tag`.
  void runRing(const struct RingStage& st, void* base, int tag);
  int payloadTag(int tag_group, size_t stage) const;  // Note [Tags]
  std::chrono::milliseconds timeoutOf(const CallOptions& opt) const {
    return opt.timeout_ms > 0 ? std::chrono::milliseconds(opt.timeout_ms) : default_timeout_;
  }
  // Note [Pipelined hierarchical all-reduce]: how many pieces a call is cut into (1: not cut).
  static int64_t nodePieces(const CallBuffer& buf);
  void runNodePieces(const Call& call, const CallBuffer& buf, int64_t pieces, ShmRing* node, int tag_group);
  // Note [One-shot all-reduce]: the frames carry the tensors; then every rank reduces them.
  void runOneShot(const Call& call, const CallBuffer& buf, int tag_group, CallTiming& timing);
  // Note [Direct all-reduce] (csrc/core/direct.h) over gloo point-to-point: its plan, staging and
  // run, made before the frames (round 0 may go out before them: Note [Direct before the verdict]).
  struct DirectCall {
    DirectCall(Transport& parent, std::vector<int> members, int index) : transport(parent, std::move(members), index) {}
    RankMapTransport transport;
    DirectPlan plan;
    DirectBuffers buffers;
    std::unique_ptr<DirectRun> run;
  };
  std::unique_ptr<DirectCall> prepareDirect(const Call& call, const CallBuffer& buf, int tag_group);
  void runDirect(const Call& call, DirectCall& d, CallTiming& timing);
  void ensureScratch();  // scratch_ holds kReduceInOrderScratchBytes

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
  uint64_t next_seq_ = 0;
  bool poisoned_ = false;
  std::string poison_reason_;
  std::thread worker_;

  // Worker-owned memory (the submitting thread only reads its size, under mu_).
  std::vector<std::unique_ptr<char[]>> slots_;
  std::vector<int64_t> slot_sizes_;  // bytes of each slot
  std::vector<float> accum_;
  std::vector<float> scratch_;  // one-shot and direct partials: kReduceInOrderScratchBytes
  // Note [Failed calls keep their buffers]: slots a late message may still land in (under mu_),
  // freed once the transport is closed (Note [Releasing a ring's buffers]).
  std::vector<std::unique_ptr<char[]>> kept_;
  int64_t kept_bytes_ = 0;
  bool detached_ = false;  // shutdown() ran on the worker itself, which was detached, not joined

  // The ring's shared-memory medium (Note [Two media below the ring] in shm_path.h).
  ShmPath shm_;

  // Note [Interrupting a wait]: set by interrupt() from any thread; asked by shared-memory waits.
  std::atomic<bool> interrupted_{false};
  std::string interrupt_reason_;             // under mu_
  std::function<bool()> inline_interrupted_;  // the running inline call's poll (its thread only)
  uint64_t inline_seq_ = 0;                   // and its sequence number
  std::string abortReason();                 // "" or why a shared-memory wait must stop now
};

}  // namespace rr
