// ringreduce GPU: the ring all-reduce over one NCCL communicator per lane (docs/design.md section
// 2.4): CudaRing owns per lane (Note [Lanes] in plan.h) a communicator and a communication and a
// reduce stream; the staging; the event pool; and the watchdog thread. ring_executor.h decides what
// each step touches; CudaBackend only puts it on the streams. Sub-rings share all of this.
//
// Note [Ordering, lifetime, failure]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// * A call is ordered after the caller's stream and after the previous call on this communicator,
//   whatever its ring (Note [Driving the plan on streams]). Only synchronize() and the opt-in
//   agreement check block the host.
// * The caller keeps the tensor alive for the streams (the torch glue calls recordStream); the
//   ring keeps its staging until shutdown().
// * On an NCCL error, a failed launch or a timeout, the communicator is aborted: every in-flight
//   CudaWork fails and every later call throws rr::Error(kBackend). The watchdog prints the reason
//   at once (a synchronous caller may already have returned).
// * Failed before aborted: in-flight works are marked failed *before* the abort, and a work becomes
//   done (compare-exchange from pending) only if its done event fired *and* the communicator is not
//   aborted: the done event of an aborted call fires over garbage and must never read as success.
// * A call's timeout runs from its timer event, recorded on the communication stream right before
//   its first exchange, so calls queued behind others (DDP's buckets) are not charged for them.
// * Note [Streams outlive the ring]: the caching allocator records events on the streams a tensor
//   was recordStream'ed on when it frees it, possibly after shutdown(). So the streams are never
//   destroyed: shutdown() drains them into a per-device pool the next ring on that device takes from.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/collectives.h"
#include "../core/direct.h"
#include "../core/frame.h"
#include "../core/plan.h"
#include "gpu_pipeline.h"
#include "nccl_comm.h"
#include "ring_executor.h"

namespace rr {

// Note [Bounded launch queue]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Queued exchanges launch under the communicator's lock, and CUDA's launch queue is finite: once
// full, a launch blocks until the GPU drains it, which it never does while an NCCL kernel waits for a
// dead peer, and the lock the watchdog needs to abort stays held. So a ring keeps at most
// kCudaMaxQueuedOps stream operations of unfinished calls; beyond, the caller waits on the host for
// the oldest to finish or fail (or Ctrl-C). A single call larger than the bound goes alone.
constexpr int64_t kCudaMaxQueuedOps = 1024;

class EventPool;  // cudaEventDisableTiming events of one device, shared by a ring and its works

// One enqueued call. Shared by the caller's handle and the watchdog.
class CudaWork {
 public:
  ~CudaWork();
  CudaWork(const CudaWork&) = delete;
  CudaWork& operator=(const CudaWork&) = delete;

  uint64_t seq() const { return seq_; }
  int device() const { return device_; }
  bool isCompleted();          // finished or failed (never blocks)
  std::string error() const;   // why the call failed, else ""
  // Makes `stream` wait for the call (no host sync). Throws kBackend if the call already failed.
  void streamWait(cudaStream_t stream);
  // Blocks the host until the call finished; throws kBackend on failure or after `timeout` (<= 0:
  // the ring's), which does not abort the communicator by itself.
  void synchronize(std::chrono::milliseconds timeout);
  // torch's NCCL Work.wait(): `stream` waits for the call; with timeout_ms >= 0 the host also waits
  // up to timeout_ms, false if still running. Throws kBackend if the call failed.
  bool wait(cudaStream_t stream, int64_t timeout_ms);
  // "" or "ringreduce: CUDA <what> #<seq> failed: <reason>".
  std::string errorMessage() const;
  bool failed() const { return state_.load() == kFailed; }

 private:
  friend class CudaRing;
  friend class CudaBackend;
  CudaWork(std::shared_ptr<EventPool> pool, std::shared_ptr<NcclComm> comm, uint64_t seq, int device,
           std::string what);
  void fail(const std::string& reason);
  // The done event fired: done unless the communicator was aborted (then failed).
  void settle();

  static constexpr int kPending = 0;
  static constexpr int kDone = 1;
  static constexpr int kFailed = 2;

  std::shared_ptr<EventPool> pool_;
  std::shared_ptr<NcclComm> comm_;
  uint64_t seq_;
  int device_;
  std::string what_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t done_ = nullptr;
  cudaEvent_t timer_ = nullptr;  // on the comm stream before the first exchange (the timeout's start)
  bool timer_recorded_ = false;
  std::atomic<int> state_{kPending};
  mutable std::mutex mu_;
  std::string error_;
  // watchdog bookkeeping (watchdog thread only)
  bool started_ = false;
  std::chrono::steady_clock::time_point started_at_;
};

class CudaRing {
 public:
  // Owns `comm` (lane 0) and `more_lanes` (communicators of the same ranks and device, lanes 1..);
  // creates the streams, the staging and the watchdog on that device.
  explicit CudaRing(std::shared_ptr<NcclComm> comm, int64_t staging_bytes = kGpuStagingBytes,
                    int64_t max_queued_ops = kCudaMaxQueuedOps,
                    std::vector<std::shared_ptr<NcclComm>> more_lanes = {});
  ~CudaRing();  // shutdown("ring destroyed") if not done yet
  CudaRing(const CudaRing&) = delete;
  CudaRing& operator=(const CudaRing&) = delete;

  NcclComm& comm() { return *comm_; }
  int device() const { return comm_->device(); }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  // Lane 0's streams (the agreement frames', a call's epilogue's).
  cudaStream_t commStream() const { return lanes_.empty() ? nullptr : lanes_[0].comm_stream; }
  cudaStream_t computeStream() const { return lanes_.empty() ? nullptr : lanes_[0].compute_stream; }
  // Every internal stream (every lane's), which a call's buffers must be protected on.
  std::vector<cudaStream_t> streams() const;
  int32_t numLanes() const { return static_cast<int32_t>(lanes_.size()); }
  // Hand-offs of every lane's communicator (Note [Hand-off and queued exchanges]).
  int64_t handOffs() const;
  // True once any lane's communicator was aborted.
  bool aborted() const;
  int64_t stagingBytes() const { return staging_bytes_; }

  // gpuPlanOptions with the pipeline of Note [GPU pipeline rule] in this ring's staging, for a call
  // of `numel` elements over `nranks` ranks. Throws kValue for bad knobs.
  PlanOptions planOptions(RedOp op, bool accum_float32, int nranks, int64_t numel, DType dtype,
                          const GpuKnobs& knobs) const;

  // Enqueues `stages` (ring_executor.h; members are communicator ranks) on `data`, the call's
  // contiguous elements; `accum`: a single-stage plan's partials, or null. `ring_key` (ringKey())
  // picks the call counter; `what` names the collective in messages. Ordered after `caller`, which
  // waits for the result if `caller_waits`. `epilogue` (may be empty) runs after the last stage to
  // enqueue more work on computeStream() that the done event covers. Throws kBackend (unusable
  // communicator, NCCL or CUDA failure: then aborted), kRuntime (graph capture), kValue (bad stages).
  std::shared_ptr<CudaWork> enqueue(const std::vector<RingStage>& stages, void* data, void* accum,
                                    const std::vector<int>& ring_key, const std::string& what,
                                    cudaStream_t caller, bool caller_waits,
                                    const std::function<void()>& epilogue = {});

  // The one-shot all-reduce (Note [GPU one-shot all-reduce]) of `data` over `ring`, the others'
  // tensors received into the staging, reduced by `launch` (ringOneShotLaunch, directOneShotLaunch).
  // Otherwise as enqueue().
  std::shared_ptr<CudaWork> enqueueOneShot(const RingMembers& ring, const OneShotLaunch& launch, void* data,
                                           const std::vector<int>& ring_key, const std::string& what,
                                           cudaStream_t caller, bool caller_waits,
                                           const std::function<void()>& epilogue = {});

  // The direct all-reduce `plan` (Note [Direct all-reduce], csrc/core/direct.h; built with
  // directOptions()) of `data` over `ring`, its buffers in the staging. Otherwise as enqueue().
  std::shared_ptr<CudaWork> enqueueDirect(const DirectPlan& plan, const RingMembers& ring, void* data,
                                          const std::vector<int>& ring_key, const std::string& what,
                                          cudaStream_t caller, bool caller_waits,
                                          const std::function<void()>& epilogue = {});
  // A direct all-reduce's options on this ring: `base` with its staging (buffers aligned to 256
  // bytes) and segments up to `segment_bytes` (RINGREDUCE_SEGMENT_BYTES; 0: the staging decides),
  // the all-gather received into the tensor.
  DirectOptions directOptions(DirectOptions base, int64_t segment_bytes) const;

  // All-gather of one agreement frame per member of `ring` (Note [Cross-rank agreement]); frames[i]
  // is ring index i's. Blocks the host; at the timeout aborts and throws kBackend.
  std::vector<Frame> exchangeFrames(const Frame& mine, const RingMembers& ring);

  // The `seq` of the next call on the ring `ring_key` (frames carry it; empty: the whole group).
  uint64_t nextSeq(const std::vector<int>& ring_key = {}) const;

  // Throws kRuntime if `caller` is capturing a CUDA graph. First thing of a call: the agreement
  // check would otherwise fail and abort the communicator under capture.
  void checkNotCapturing(cudaStream_t caller, const std::string& what) const;

  // Fails the in-flight works, aborts (a call in progress sees it at its next poll), stops the
  // watchdog, waits at most min(timeout, 10 s) for the streams to drain, and frees the staging only
  // if they did and not `at_exit`. Idempotent; never throws.
  void shutdown(const std::string& reason, bool at_exit = false);
  bool isShutdown() const { return shut_down_.load(); }

 private:
  friend class CudaBackend;
  void watchdogLoop();
  // Note [Bounded launch queue]: waits until `ops` more stream operations fit (call_mu_ held).
  void makeRoom(int64_t ops);
  // `data` and `slots` staging slots of slot_stride bytes (kRuntime if they do not fit).
  DeviceBuffers layOut(void* data, int64_t slot_stride, int32_t slots) const;
  // What the ring and the one-shot share (call_mu_ held): room in the queue, the work, `drive` on
  // the CUDA backend, the failure handling, the bookkeeping.
  std::shared_ptr<CudaWork> submit(const std::vector<int>& ring_key, const std::string& what, cudaStream_t caller,
                                   const std::function<void()>& epilogue, int64_t ops,
                                   const std::function<void(DeviceBackend&)>& drive);
  void failAll(const std::string& reason);
  // failAll, then abort the communicator (Note [Ordering, lifetime, failure]).
  void failAndAbort(const std::string& reason);
  void checkOpen() const;

  // One lane (Note [Lanes]): its communicator, streams and events. Lane 0's communicator is comm_.
  struct Lane {
    std::shared_ptr<NcclComm> comm;
    cudaStream_t comm_stream = nullptr;
    cudaStream_t compute_stream = nullptr;
    std::vector<cudaEvent_t> plan_events;
    cudaEvent_t stage_event = nullptr;  // kStageDoneEvent, re-recorded between the lane's stages
    cudaEvent_t done_event = nullptr;   // laneDoneEvent(k), the lane's end (lanes >= 1)
  };
  void abortLanes(const std::string& reason);  // every lane at once (Note [Stopping every lane at once])

  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<EventPool> pool_;
  int64_t staging_bytes_;
  std::vector<Lane> lanes_;
  void* staging_ = nullptr;
  void* frames_dev_ = nullptr;   // NcclFrameTransport's device staging, for exchangeFrames
  void* frames_host_ = nullptr;  // and its pinned host staging
  std::shared_ptr<CudaWork> last_work_;  // its done event orders the next call (kPrevCallDoneEvent)
  std::map<std::vector<int>, uint64_t> next_seq_;  // per ring (ringKey)
  mutable std::mutex call_mu_;  // one enqueue at a time
  // Note [Bounded launch queue] (call_mu_): unfinished calls and their stream operations.
  int64_t max_queued_ops_;
  std::deque<std::pair<std::shared_ptr<CudaWork>, int64_t>> queued_;
  int64_t queued_ops_ = 0;

  // watchdog
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  std::deque<std::shared_ptr<CudaWork>> in_flight_;
  bool wd_stop_ = false;
  std::thread watchdog_;
  std::atomic<bool> shut_down_{false};
  std::string poisoned_;  // Note [Inside a user's NCCL group]: why the ring refuses calls (call_mu_)
};

// A ring over a new communicator from `unique_id`, plus one more per lane from `lane_ids` (Note [Lanes]);
// a lane that cannot be created aborts lane 0's communicator. Blocks until every rank joined.
std::shared_ptr<CudaRing> connectCudaRing(const std::string& unique_id, const std::vector<std::string>& lane_ids,
                                          int nranks, int rank, int device, std::chrono::milliseconds timeout,
                                          std::chrono::milliseconds connect_timeout, const std::string& name,
                                          int64_t staging_bytes);

}  // namespace rr
