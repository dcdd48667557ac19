// ringreduce GPU: the ring all-reduce over one NCCL communicator per lane.
//
// CudaRing owns everything one process group needs on one GPU (docs/design.md section 2.4, "GPU transport"):
//   * one NCCL communicator per lane (nccl_comm.h: a non-blocking parent and its blocking child;
//     Note [Lanes] in plan.h), lane 0's also carrying the agreement frames;
//   * per lane, a communication stream (grouped ncclSend/ncclRecv) and a reduce stream (kernels), so
//     that the reduction of segment k overlaps the transfer of segment k + 1, and lanes overlap;
//   * the staging (kGpuStagingBytes), shared by all calls on the group: each call lays its slots out
//     in it as its plans say (Note [GPU pipeline rule], gpu_pipeline.h);
//   * the event pool (plan events, reused call after call; per-call start/done events);
//   * a watchdog thread that polls in-flight calls and ncclCommGetAsyncError and aborts the
//     communicator on an error or when a started call exceeds the timeout.
// The stages of a call (ring_driver.h: flat ring, ring halves, hierarchical, each possibly in
// lanes) are enqueued by enqueueRingStages(), a one-shot by enqueueOneShot(), through CudaBackend
// below; nothing in this file decides which buffer or segment a step touches. Rings over rank
// lists of the group (Note [Sub-rings on one communicator]) share the communicators, streams,
// staging and events with the group's own ring; each ring (rank list) has its own call counter, as
// the CPU path's per-ring runtimes do.
//
// Note [Ordering, lifetime, failure]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// * A call is ordered after everything the caller enqueued on its stream before the call (start
//   event), and after the previous call on this communicator, whatever its ring (its done event,
//   Note [Driving the plan on streams]). Calls on one communicator are serialized on the GPU in
//   call order.
// * CudaWork::streamWait() makes another stream wait for the call; a synchronous call does that to
//   the caller's stream before returning. Nothing here blocks the host except synchronize() and
//   the opt-in agreement check (exchangeFrames()).
// * The caller keeps the tensor alive for the streams (the torch glue calls recordStream); the
//   ring keeps its staging until shutdown().
// * On an NCCL error, a failed launch, or a timeout, the communicator is aborted: NCCL's kernels
//   return, the streams drain (the results are garbage), every in-flight CudaWork is marked
//   failed, and every later call on the ring throws rr::Error(kBackend). The watchdog prints
//   the reason to stderr at once, since a synchronous caller may already have returned.
// * Failed before aborted: the in-flight works are marked failed *before* the communicator is
//   aborted, and a work becomes done (pending -> done, compare-exchange) only when its done event
//   fired *and* the communicator is not aborted. An abort lets NCCL's kernels exit, so the done
//   event of an aborted call fires over garbage; it must never read as success.
// * The timeout of a call runs from its timer event, recorded on the communication stream right
//   before its first exchange (after the caller's start event and the previous call), so calls
//   queued behind others (DDP's buckets) are not charged for their predecessors.
// * Note [Streams outlive the ring]: the caching allocator keeps the streams a tensor was
//   recordStream'ed on and records events on them when the tensor is freed, possibly long after
//   shutdown(). So the two streams are never destroyed: shutdown() drains them and hands them to
//   a per-device pool from which the next ring on that device takes its streams.
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
#include "../core/frame.h"
#include "../core/plan.h"
#include "gpu_pipeline.h"
#include "nccl_comm.h"
#include "ring_driver.h"

namespace rr {

// Note [Bounded launch queue]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Queued exchanges (Note [Hand-off and queued exchanges], nccl_comm.h) launch in the enqueueing
// thread, under the communicator's lock. CUDA's queue of pending launches is finite; once full, a
// launch blocks until the GPU drains it, and a GPU whose NCCL kernel waits for a dead peer never
// does. Blocked inside NCCL, the enqueueing thread would hold the lock the watchdog needs to abort,
// and nothing would ever end the wait. So a ring keeps at most kCudaMaxQueuedOps stream operations
// (exchanges, kernels, copies, event records and waits) of unfinished calls: before enqueueing a
// call that would exceed it, the caller waits on the host for the oldest calls to finish (or fail:
// the watchdog still runs, and an abort ends the wait with DistBackendError; so does Ctrl-C, after
// aborting: Note [Interrupting a host wait on CUDA] in host_interrupt.h). A single call larger
// than the bound (only with a tiny RINGREDUCE_SEGMENT_BYTES) is enqueued alone. Training loops
// rarely wait here: a 64 MiB all-reduce on 8 ranks is ~100 operations with the default pipeline.
constexpr int64_t kCudaMaxQueuedOps = 1024;

// A pool of cudaEventDisableTiming events on one device, shared by a ring and its works.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool();
  cudaEvent_t acquire();             // throws kBackend
  void release(cudaEvent_t event);   // never throws

 private:
  int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

// One enqueued call. Shared by the caller's handle and the watchdog.
class CudaWork {
 public:
  ~CudaWork();
  CudaWork(const CudaWork&) = delete;
  CudaWork& operator=(const CudaWork&) = delete;

  uint64_t seq() const { return seq_; }
  int device() const { return device_; }
  const std::string& what() const { return what_; }  // "all-reduce", "reduce-scatter", ...
  // True once the GPU finished the call or the call failed (never blocks).
  bool isCompleted();
  // The call failed (communicator aborted before it finished): the reason, else "".
  std::string error() const;
  // Makes `stream` wait for the call (no host sync). Throws kBackend if the call already failed.
  void streamWait(cudaStream_t stream);
  // Blocks the host until the call finished; throws kBackend on failure or after `timeout`
  // (timeout <= 0: the ring's timeout; a timeout does not abort the communicator by itself).
  void synchronize(std::chrono::milliseconds timeout);
  // torch.distributed's NCCL Work.wait(): `stream` waits for the call; with timeout_ms >= 0 the
  // host also waits up to timeout_ms and gets false if the call is still running then. Throws
  // kBackend if the call failed.
  bool wait(cudaStream_t stream, int64_t timeout_ms);
  // "" or "ringreduce: CUDA <what> #<seq> failed: <reason>".
  std::string errorMessage() const;
  cudaEvent_t doneEvent() const { return done_; }
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
  // Takes ownership of an initialized communicator (lane 0) and of `more_lanes`, communicators of
  // the same ranks on the same device for lanes 1.. (Note [Lanes] in plan.h; each lane gets its own
  // streams, so its transfers overlap the others'). Creates the streams, the staging and the
  // watchdog thread on the communicator's device.
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
  // Lane 0's streams (the one-lane ring's, the agreement frames', a call's epilogue's).
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

  // The plan options of a call of `numel` elements of `dtype` over a ring of `nranks` ranks of this
  // communicator: gpuPlanOptions (the all-gather lands in the output) with the pipeline of Note
  // [GPU pipeline rule] (gpu_pipeline.h) in this ring's staging. Throws kValue for bad knobs.
  PlanOptions planOptions(RedOp op, bool accum_float32, int nranks, int64_t numel, DType dtype,
                          const GpuKnobs& knobs) const;

  // Enqueues one call: `stages` (ring_driver.h; their members are ranks of this communicator and
  // name this rank) on `data`, the call's contiguous elements on this device; `accum`: the float32
  // partials of a single-stage plan (or null when it needs none). `ring_key` (ringKey()) names the
  // ring whose call counter the call takes; `what` names the collective in messages. Ordered after
  // `caller`'s prior work; if `caller_waits`, `caller` waits for the result. Throws kBackend
  // (communicator unusable, NCCL or CUDA failure: the communicator is then aborted), kRuntime (CUDA
  // graph capture), kValue (stages that do not fit this communicator). `epilogue` (may be empty)
  // runs on the enqueueing thread after the last stage, to enqueue more work on computeStream()
  // that the call's done event must cover.
  std::shared_ptr<CudaWork> enqueue(const std::vector<RingStage>& stages, void* data, void* accum,
                                    const std::vector<int>& ring_key, const std::string& what,
                                    cudaStream_t caller, bool caller_waits,
                                    const std::function<void()>& epilogue = {});

  // The one-shot all-reduce (Note [GPU one-shot all-reduce], csrc/core/one_shot_body.h) of `data`
  // (numel elements of `dtype`) over `ring`, receiving the others' tensors into the staging
  // ((ring.size() - 1) x the tensor's bytes must fit it), with the arithmetic of the flat ring that
  // `options` plan (ring_driver.h's enqueueOneShot). Otherwise as enqueue().
  std::shared_ptr<CudaWork> enqueueOneShot(const RingMembers& ring, int64_t numel, DType dtype, RedOp op,
                                           const PlanOptions& options, void* data, const std::vector<int>& ring_key,
                                           const std::string& what, cudaStream_t caller, bool caller_waits,
                                           const std::function<void()>& epilogue = {});

  // All-gather of one agreement frame per ring member (Note [Cross-rank agreement]) around
  // `ring` only (Note [Sub-rings on one communicator]); frames[i] is ring index i's. Runs core's
  // exchangeFrames over NcclFrameTransport (Note [Host messages over NCCL]). Blocks the host
  // until done or the timeout (then aborts and throws kBackend).
  std::vector<Frame> exchangeFrames(const Frame& mine, const RingMembers& ring);

  // The `seq` of the next call on the ring `ring_key` (frames carry it; empty: the whole group).
  uint64_t nextSeq(const std::vector<int>& ring_key = {}) const;

  // Throws kRuntime if `caller` is capturing a CUDA graph (before anything else of a call runs:
  // the agreement check would otherwise run, fail and abort the communicator under capture).
  void checkNotCapturing(cudaStream_t caller, const std::string& what) const;

  // Marks the in-flight works failed, aborts the communicator (without waiting for a call in
  // progress: it sees the abort at its next poll), stops the watchdog, then waits for the streams
  // to drain for at most min(timeout, 10 s). Frees staging only if they drained and not
  // `at_exit` (at interpreter exit the process frees everything). Idempotent; never throws.
  void shutdown(const std::string& reason, bool at_exit = false);
  bool isShutdown() const { return shut_down_.load(); }

 private:
  friend class CudaBackend;
  void watchdogLoop();
  // Note [Bounded launch queue]: waits until `ops` more stream operations fit (call_mu_ held).
  void makeRoom(int64_t ops);
  // Buffers of a call: `data`, and `slots` staging slots of slot_stride bytes (kRuntime if they do
  // not fit the staging).
  DeviceBuffers layOut(void* data, int64_t slot_stride, int32_t slots) const;
  // The part of a call common to the ring and the one-shot (call_mu_ held): room in the launch
  // queue, the work and its events, `drive` on the CUDA backend, the failure handling of Note
  // [Ordering, lifetime, failure], the bookkeeping.
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

}  // namespace rr
