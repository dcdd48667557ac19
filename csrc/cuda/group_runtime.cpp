#include "group_runtime.h"

#include <cstdio>
#include <algorithm>

#include "../core/agreement.h"
#include "cuda_check.h"
#include "direct_executor.h"
#include "event_pool.h"
#include "host_interrupt.h"
#include "nccl_frame_transport.h"
#include "one_shot_kernels.cuh"
#include "reduce_kernels.cuh"

namespace rr {

namespace {

constexpr auto kHostPoll = std::chrono::microseconds(20);
constexpr auto kWatchdogBusyPoll = std::chrono::milliseconds(1);
constexpr auto kWatchdogIdlePoll = std::chrono::milliseconds(100);
constexpr auto kMaxDrain = std::chrono::milliseconds(10000);

// Note [Streams outlive the ring] (group_runtime.h): per device, the stream pairs of shut-down rings.
// Deliberately leaked (never destroyed, not even by a static destructor at exit).
struct StreamPair {
  cudaStream_t comm = nullptr;
  cudaStream_t compute = nullptr;
};
std::mutex& streamPoolMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
std::map<int, std::vector<StreamPair>>& streamPool() {
  static auto* pool = new std::map<int, std::vector<StreamPair>>;
  return *pool;
}

}  // namespace

// The DeviceBackend of real GPUs.

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(CudaRing& ring, CudaWork& work, cudaStream_t caller, const std::function<void()>& epilogue)
      : ring_(ring), work_(work), caller_(caller), epilogue_(epilogue) {}

  bool enqueuedAnything() const { return enqueued_; }
  // The call's timeout starts when a comm stream reaches its first exchange (Note [Ordering, lifetime,
  // failure]).
  void startTimer(cudaStream_t comm_stream) {
    if (work_.timer_recorded_) return;
    RR_CUDA_CHECK(cudaEventRecord(work_.timer_, comm_stream));
    work_.timer_recorded_ = true;
  }

  void prepare(int32_t num_events, int32_t lanes) override {
    RR_CHECK(lanes >= 1 && lanes <= ring_.numLanes(), kRuntime, "ringreduce internal error: a call on ", lanes,
             " lanes of a ring with ", ring_.numLanes());
    for (int32_t k = 0; k < lanes; ++k) {
      CudaRing::Lane& l = ring_.lanes_[static_cast<size_t>(k)];
      while (static_cast<int32_t>(l.plan_events.size()) < num_events) l.plan_events.push_back(ring_.pool_->acquire());
      if (l.stage_event == nullptr) l.stage_event = ring_.pool_->acquire();
      if (l.done_event == nullptr) l.done_event = ring_.pool_->acquire();
    }
  }

  void setLane(int32_t lane) override {
    RR_CHECK(lane >= 0 && lane < ring_.numLanes(), kRuntime, "ringreduce internal error: lane ", lane);
    lane_ = &ring_.lanes_[static_cast<size_t>(lane)];
  }

  void exchange(const void* send, size_t send_bytes, int send_peer, void* recv, size_t recv_bytes,
                int recv_peer, Launch launch) override {
    enqueued_ = true;
    startTimer(lane_->comm_stream);
    // Note [Which exchanges hand off] (ring_executor.h), on the lane's communicator.
    lane_->comm->sendRecv(send, send_bytes, send_peer, recv, recv_bytes, recv_peer, lane_->comm_stream,
                          launch == Launch::kHandOff);
  }

  void group(const std::vector<PeerOp>& ops, Launch launch) override {
    enqueued_ = true;
    startTimer(lane_->comm_stream);
    lane_->comm->group(ops, lane_->comm_stream, launch == Launch::kHandOff);
  }

  void reduceInOrder(const OneShotLaunch& l) override {
    enqueued_ = true;
    launchOneShotReduce(l, lane_->compute_stream);
  }

  void reduce(const ReduceLaunch& l) override {
    enqueued_ = true;
    launchReduce(l, lane_->compute_stream);
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    enqueued_ = true;
    RR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, lane_->compute_stream));
  }

  void record(Stream stream, int32_t event) override {
    enqueued_ = true;
    RR_CUDA_CHECK(cudaEventRecord(eventOf(event), streamOf(stream)));
  }

  void finish() override {
    if (epilogue_) {
      enqueued_ = true;
      epilogue_();
    }
  }

  void wait(Stream stream, int32_t event) override {
    if (event == kPrevCallDoneEvent) {
      if (!ring_.last_work_) return;  // first call on this ring
      RR_CUDA_CHECK(cudaStreamWaitEvent(streamOf(stream), ring_.last_work_->done_, 0));
      return;
    }
    RR_CUDA_CHECK(cudaStreamWaitEvent(streamOf(stream), eventOf(event), 0));
  }

 private:
  cudaStream_t streamOf(Stream s) const {
    switch (s) {
      case Stream::kComm: return lane_->comm_stream;
      case Stream::kCompute: return lane_->compute_stream;
      case Stream::kCaller: return caller_;
    }
    RR_THROW(kRuntime, "ringreduce internal error: unknown stream");
  }
  cudaEvent_t eventOf(int32_t e) const {
    if (e == kCallStartEvent) return work_.start_;
    if (e == kCallDoneEvent) return work_.done_;
    if (e == kStageDoneEvent) return lane_->stage_event;
    if (isLaneDoneEvent(e)) return ring_.lanes_.at(static_cast<size_t>(laneOfDoneEvent(e))).done_event;
    RR_CHECK(e >= 0 && static_cast<size_t>(e) < lane_->plan_events.size(), kRuntime,
             "ringreduce internal error: event ", e, " outside the pool");
    return lane_->plan_events[static_cast<size_t>(e)];
  }

  CudaRing& ring_;
  CudaWork& work_;
  cudaStream_t caller_;
  const std::function<void()>& epilogue_;
  bool enqueued_ = false;
  CudaRing::Lane* lane_ = &ring_.lanes_[0];
};

CudaRing::CudaRing(std::shared_ptr<NcclComm> comm, int64_t staging_bytes, int64_t max_queued_ops,
                   std::vector<std::shared_ptr<NcclComm>> more_lanes)
    : comm_(std::move(comm)),
      pool_(std::make_shared<EventPool>(comm_->device())),
      staging_bytes_(staging_bytes > 0 ? staging_bytes : kGpuStagingBytes),
      max_queued_ops_(max_queued_ops) {
  RR_CHECK(staging_bytes_ >= 512, kValue, "ringreduce: staging of ", staging_bytes_, " bytes is too small");
  RR_CHECK(more_lanes.size() < static_cast<size_t>(kGpuMaxLanes), kValue, "ringreduce: at most ", kGpuMaxLanes,
           " lanes");
  if (comm_->simplePath() && !more_lanes.empty()) {
    // The simplest path runs one lane (Note [NCCL versions, environment and the simplest path]).
    std::vector<NcclComm*> idle;
    for (const auto& c : more_lanes) idle.push_back(c.get());
    NcclComm::abortTogether(idle, "the simplest GPU path runs one lane");
    more_lanes.clear();
  }
  lanes_.resize(1 + more_lanes.size());
  lanes_[0].comm = comm_;
  for (size_t k = 0; k < more_lanes.size(); ++k) {
    RR_CHECK(more_lanes[k] && more_lanes[k]->size() == comm_->size() && more_lanes[k]->rank() == comm_->rank() &&
                 more_lanes[k]->device() == comm_->device(),
             kValue, "ringreduce: lane ", k + 1, "'s communicator differs from lane 0's in size, rank or device");
    lanes_[k + 1].comm = std::move(more_lanes[k]);
  }
  if (lanes_.size() > 1)
    for (Lane& l : lanes_) l.comm->deferAbortToRing();  // Note [Stopping every lane at once]
  DeviceGuard guard(comm_->device());
  try {
    for (Lane& l : lanes_) {
      {
        std::lock_guard<std::mutex> pool_lock(streamPoolMutex());
        auto& free_pairs = streamPool()[comm_->device()];
        if (!free_pairs.empty()) {
          l.comm_stream = free_pairs.back().comm;
          l.compute_stream = free_pairs.back().compute;
          free_pairs.pop_back();
        }
      }
      if (l.comm_stream == nullptr) {
        int lo = 0, hi = 0;
        RR_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
        // The communication stream gets the higher priority: its kernels are tiny and gate the peers.
        RR_CUDA_CHECK(cudaStreamCreateWithPriority(&l.comm_stream, cudaStreamNonBlocking, hi));
        RR_CUDA_CHECK(cudaStreamCreateWithPriority(&l.compute_stream, cudaStreamNonBlocking, lo));
      }
    }
    RR_CUDA_CHECK(cudaMalloc(&staging_, static_cast<size_t>(staging_bytes_)));
    RR_CUDA_CHECK(cudaMalloc(&frames_dev_, NcclFrameTransport::kStagingBytes));
    RR_CUDA_CHECK(cudaMallocHost(&frames_host_, NcclFrameTransport::kStagingBytes));
  } catch (...) {
    shutdown("construction failed");
    throw;
  }
  watchdog_ = std::thread([this] { watchdogLoop(); });
}

std::vector<cudaStream_t> CudaRing::streams() const {
  std::vector<cudaStream_t> out;
  for (const Lane& l : lanes_) {
    if (l.comm_stream != nullptr) out.push_back(l.comm_stream);
    if (l.compute_stream != nullptr) out.push_back(l.compute_stream);
  }
  return out;
}

int64_t CudaRing::handOffs() const {
  int64_t n = 0;
  for (const Lane& l : lanes_) n += l.comm->handOffs();
  return n;
}

bool CudaRing::aborted() const {
  for (const Lane& l : lanes_)
    if (l.comm->aborted()) return true;
  return false;
}

void CudaRing::abortLanes(const std::string& reason) {
  // Note [Stopping every lane at once]; every lane is marked aborted before any is stopped, so no
  // work settles as done meanwhile (Note [Ordering, lifetime, failure]).
  std::vector<NcclComm*> comms;
  for (Lane& l : lanes_) comms.push_back(l.comm.get());
  NcclComm::abortTogether(comms, reason);
}

CudaRing::~CudaRing() { shutdown("the ring was destroyed"); }

void CudaRing::checkOpen() const {
  RR_CHECK(!shut_down_, kBackend, "ringreduce: the NCCL communicator ", comm_->name(), " is unusable: ",
           comm_->abortReason(), ". Create a new process group to continue.");
  RR_CHECK(poisoned_.empty(), kRuntime, poisoned_);
  for (const Lane& l : lanes_) l.comm->checkUsable();
}

void CudaRing::checkNotCapturing(cudaStream_t caller, const std::string& what) const {
  DeviceGuard guard(device());
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RR_CUDA_CHECK(cudaStreamIsCapturing(caller, &capture));
  RR_CHECK(capture == cudaStreamCaptureStatusNone, kRuntime,
           "ringreduce: ", what, " on CUDA tensors cannot be captured in a CUDA graph (its NCCL "
           "communicator is non-blocking and its ring is driven from the host); call it outside "
           "torch.cuda.graph() or use the torch.distributed collective inside the graph");
}

PlanOptions CudaRing::planOptions(RedOp op, bool accum_float32, int nranks, int64_t numel, DType dtype,
                                  const GpuKnobs& knobs) const {
  const GpuPipeline p = gpuPipeline(nranks, numel, dtype, accum_float32, staging_bytes_, knobs, numLanes());
  PlanOptions o = gpuPlanOptions(op, accum_float32, p.max_segment_bytes, p.slots, p.slot_bytes);
  o.lanes = p.lanes;
  return o;
}

uint64_t CudaRing::nextSeq(const std::vector<int>& ring_key) const {
  std::lock_guard<std::mutex> lock(call_mu_);
  auto it = next_seq_.find(ring_key);
  return it == next_seq_.end() ? 0 : it->second;
}

std::shared_ptr<CudaWork> CudaRing::enqueue(const std::vector<RingStage>& stages, void* data, void* accum,
                                            const std::vector<int>& ring_key, const std::string& what,
                                            cudaStream_t caller, bool caller_waits,
                                            const std::function<void()>& epilogue) {
  checkNotCapturing(caller, what);  // first: nothing of a captured call may run
  std::lock_guard<std::mutex> lock(call_mu_);
  checkOpen();
  RR_CHECK(!stages.empty(), kRuntime, "ringreduce internal error: a call without a ring");
  const DType dtype = stages[0].plan.dtype;
  int64_t ops = 8;  // the call's framing
  // The staging, laid out as the plans need it (free again: kPrevCallDoneEvent). Slots start at
  // multiples of 256 bytes (16-byte aligned vector loads).
  int64_t slot_stride = 256;
  int32_t slots = 0;  // per lane (Note [Lanes])
  int32_t lanes = 1;
  for (const RingStage& st : stages) {
    checkSupported(st.plan.dtype, st.op);
    RR_CHECK(st.plan.dtype == dtype, kRuntime, "ringreduce internal error: stages of one call differ in dtype");
    // Note [Sub-rings on one communicator]: a ring of communicator ranks, this one at plan.rank.
    RR_CHECK(static_cast<int>(st.members.size()) == st.plan.sched.nranks && st.plan.rank >= 0 &&
                 st.plan.rank < st.plan.sched.nranks &&
                 st.members[static_cast<size_t>(st.plan.rank)] == rank(),
             kRuntime, "ringreduce internal error: a plan for ring index ", st.plan.rank, " of ", st.plan.sched.nranks,
             " does not place communicator rank ", rank(), " there");
    for (const int m : st.members)
      RR_CHECK(m >= 0 && m < size(), kValue, "ringreduce: ring member ", m, " outside the communicator of ", size(),
               " ranks");
    ops += static_cast<int64_t>(st.plan.ops.size()) + 2;
    slot_stride = std::max<int64_t>(slot_stride, roundUp(static_cast<int64_t>(slotBytesFor(st.plan)), 256));
    slots = std::max(slots, st.plan.num_slots);
    lanes = std::max(lanes, st.lane + 1);
  }
  RR_CHECK(lanes <= numLanes(), kRuntime, "ringreduce internal error: a call on ", lanes, " lanes of a ring with ",
           numLanes());
  DeviceBuffers buffers = layOut(data, slot_stride, slots * lanes);
  buffers.slots_per_lane = slots;
  buffers.accum = accum;
  return submit(ring_key, what, caller, epilogue, ops,
                [&](DeviceBackend& be) { enqueueRingStages(stages, buffers, be, caller_waits); });
}

std::shared_ptr<CudaWork> CudaRing::enqueueOneShot(const RingMembers& ring, const OneShotLaunch& launch, void* data,
                                                   const std::vector<int>& ring_key, const std::string& what,
                                                   cudaStream_t caller, bool caller_waits,
                                                   const std::function<void()>& epilogue) {
  checkNotCapturing(caller, what);
  std::lock_guard<std::mutex> lock(call_mu_);
  checkOpen();
  RR_CHECK(ring.index >= 0 && ring.index < ring.size() && ring.ranks[static_cast<size_t>(ring.index)] == rank(),
           kRuntime, "ringreduce internal error: a one-shot ring that does not hold this rank");
  const int64_t bytes = launch.args.count * static_cast<int64_t>(dtypeSize(launch.dtype));
  DeviceBuffers buffers = layOut(data, roundUp(std::max<int64_t>(bytes, 1), 256), ring.size() - 1);
  return submit(ring_key, what, caller, epilogue, /*ops=*/12, [&](DeviceBackend& be) {
    rr::enqueueOneShot(ring.ranks, ring.index, launch, buffers, be, caller_waits);
  });
}

DirectOptions CudaRing::directOptions(DirectOptions base, int64_t segment_bytes) const {
  base.staging_bytes = staging_bytes_;
  base.buffer_align = 256;  // 16-byte aligned vector loads in every buffer
  base.max_segment_bytes = segment_bytes > 0 ? segment_bytes : staging_bytes_;
  base.gather_into_data = true;
  base.wire_gather16 = false;  // the GPU all-gather moves the tensor's type (cuda_ops.cpp refuses 16)
  return base;
}

std::shared_ptr<CudaWork> CudaRing::enqueueDirect(const DirectPlan& plan, const RingMembers& ring, void* data,
                                                  const std::vector<int>& ring_key, const std::string& what,
                                                  cudaStream_t caller, bool caller_waits,
                                                  const std::function<void()>& epilogue) {
  checkNotCapturing(caller, what);
  std::lock_guard<std::mutex> lock(call_mu_);
  checkOpen();
  RR_CHECK(ring.size() == plan.nranks && ring.index == plan.rank &&
               ring.ranks[static_cast<size_t>(ring.index)] == rank(),
           kRuntime, "ringreduce internal error: a direct plan for ring index ", plan.rank, " of ", plan.nranks,
           " on a ring that does not place this rank there");
  DirectCall call;
  call.plan = &plan;
  call.members = ring.ranks;
  call.buffers = layOut(data, plan.buffer_bytes, plan.numBuffers());
  call.caller_waits = caller_waits;
  return submit(ring_key, what, caller, epilogue, directQueuedOps(plan),
                [&](DeviceBackend& be) { rr::enqueueDirect(call, be); });
}

DeviceBuffers CudaRing::layOut(void* data, int64_t slot_stride, int32_t slots) const {
  RR_CHECK(slot_stride * slots <= staging_bytes_, kRuntime, "ringreduce internal error: ", slots, " slots of ",
           slot_stride, " bytes do not fit the ", staging_bytes_, " bytes of staging");
  DeviceBuffers buffers;
  buffers.data = data;
  buffers.slot_bytes = static_cast<size_t>(slot_stride);
  for (int32_t k = 0; k < slots; ++k)
    buffers.slots.push_back(static_cast<char*>(staging_) + static_cast<int64_t>(k) * slot_stride);
  return buffers;
}

std::shared_ptr<CudaWork> CudaRing::submit(const std::vector<int>& ring_key, const std::string& what,
                                           cudaStream_t caller, const std::function<void()>& epilogue, int64_t ops,
                                           const std::function<void(DeviceBackend&)>& drive) {
  DeviceGuard guard(device());
  makeRoom(ops);
  uint64_t& seq = next_seq_[ring_key];
  std::shared_ptr<CudaWork> work(new CudaWork(pool_, comm_, seq, device(), what));
  work->start_ = pool_->acquire();
  work->done_ = pool_->acquire();
  work->timer_ = pool_->acquire();
  CudaBackend backend(*this, *work, caller, epilogue);
  try {
    drive(backend);
    backend.startTimer(commStream());  // a call without exchanges
  } catch (const std::exception& e) {
    if (comm_->insideUserGroup()) {
      // Note [Inside a user's NCCL group]: no abort (the user's group still uses the communicator);
      // earlier calls stay with the watchdog.
      poisoned_ = e.what();
    } else if (backend.enqueuedAnything()) {
      // Half a ring is on the streams and the peers wait for the rest: only an abort unblocks them.
      failAndAbort(std::string("enqueueing ") + what + " #" + std::to_string(seq) + " failed: " + e.what());
    }
    throw;
  }
  ++seq;
  last_work_ = work;
  queued_.emplace_back(work, ops);
  queued_ops_ += ops;
  {
    std::lock_guard<std::mutex> wl(wd_mu_);
    in_flight_.push_back(work);
  }
  wd_cv_.notify_one();
  return work;
}

void CudaRing::makeRoom(int64_t ops) {
  InterruptCheck interrupt;  // Note [Interrupting a host wait on CUDA]
  while (!queued_.empty()) {
    CudaWork& oldest = *queued_.front().first;
    const bool room = queued_ops_ + ops <= max_queued_ops_;
    if (oldest.isCompleted()) {
      // Calls fail only on the way to an abort, just before it (Note [Ordering, lifetime, failure]):
      // a call waiting for room must not be enqueued in that gap.
      RR_CHECK(!oldest.failed(), kBackend, oldest.errorMessage());
      queued_ops_ -= queued_.front().second;
      queued_.pop_front();
      continue;
    }
    if (room) return;
    // Note [Bounded launch queue]: the oldest call must finish or fail (the watchdog still runs).
    comm_->checkUsable();
    checkOpen();
    if (interrupt.requested()) {
      const std::string reason = interruptedReason(comm_->name(), "a call waiting for room in the launch queue");
      failAndAbort(reason);
      RR_THROW(kBackend, reason);
    }
    std::this_thread::sleep_for(kHostPoll);
  }
}

std::vector<Frame> CudaRing::exchangeFrames(const Frame& mine, const RingMembers& ring) {
  std::lock_guard<std::mutex> lock(call_mu_);
  checkOpen();
  const int n = ring.size();
  const int r = ring.index;
  RR_CHECK(n >= 1 && n <= size() && r >= 0 && r < n && ring.ranks[static_cast<size_t>(r)] == rank(), kRuntime,
           "ringreduce internal error: agreement frames on a ring that does not hold this rank");
  DeviceGuard guard(device());
  cudaEvent_t done = pool_->acquire();
  std::vector<Frame> frames;
  try {
    // csrc/core/agreement.h's all-gather, around the members only, hop by hop over NCCL.
    NcclFrameTransport nccl(*comm_, commStream(), done, frames_dev_, frames_host_);
    RankMapTransport members(nccl, ring.ranks, r);
    frames = rr::exchangeFrames(members, mine, /*tag=*/0);
  } catch (const std::exception& e) {
    if (comm_->insideUserGroup()) {
      poisoned_ = e.what();
    } else {
      failAndAbort(std::string("agreement check failed: ") + e.what());
    }
    pool_->release(done);
    throw;
  }
  pool_->release(done);
  return frames;
}

void CudaRing::failAll(const std::string& reason) {
  std::lock_guard<std::mutex> lock(wd_mu_);
  for (auto& w : in_flight_) w->fail(reason);
  in_flight_.clear();
}

void CudaRing::failAndAbort(const std::string& reason) {
  failAll(reason);
  abortLanes(reason);
}

void CudaRing::watchdogLoop() {
  (void)cudaSetDevice(device());  // events and NCCL state of this device; failures show up below
  // Note [Polling events from any thread]: this thread never captures, so its queries may run in
  // relaxed mode for good (eventFired() also relaxes per query).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  std::unique_lock<std::mutex> lock(wd_mu_);
  while (!wd_stop_) {
    wd_cv_.wait_for(lock, in_flight_.empty() ? kWatchdogIdlePoll : kWatchdogBusyPoll);
    if (wd_stop_) break;
    if (in_flight_.empty()) continue;
    std::string reason;
    const auto now = std::chrono::steady_clock::now();
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      CudaWork& w = **it;
      try {
        if (eventFired(w.done_)) {
          w.settle();
          it = in_flight_.erase(it);
          continue;
        }
        // The timeout runs from the timer event (the comm stream reached the first exchange).
        if (!w.started_ && w.timer_recorded_ && eventFired(w.timer_)) {
          w.started_ = true;
          w.started_at_ = now;
        }
      } catch (const std::exception& e) {
        reason = std::string("CUDA error while ") + w.what_ + " #" + std::to_string(w.seq_) + " was running: " +
                 e.what();
        break;
      }
      if (w.started_ && now - w.started_at_ > comm_->timeout()) {
        reason = w.what_ + " #" + std::to_string(w.seq_) + " did not finish within " +
                 std::to_string(comm_->timeout().count()) +
                 " ms of starting (a peer died, never called, or called with a different size)";
        break;
      }
      ++it;
    }
    for (size_t k = 0; reason.empty() && !in_flight_.empty() && k < lanes_.size(); ++k)
      reason = lanes_[k].comm->pollError();
    if (!reason.empty()) {
      std::fprintf(stderr, "[ringreduce watchdog] rank %d of %d, communicator %s: %s; aborting the NCCL communicator\n",
                   rank(), size(), comm_->name().c_str(), reason.c_str());
      for (auto& w : in_flight_) w->fail(reason);  // failed before aborted (group_runtime.h)
      in_flight_.clear();
      abortLanes(reason);
    }
  }
}

void CudaRing::shutdown(const std::string& reason, bool at_exit) {
  {
    std::lock_guard<std::mutex> lock(wd_mu_);
    if (shut_down_) return;
    shut_down_ = true;
    wd_stop_ = true;
  }
  // Abort first, without call_mu_: a call blocked in NcclComm::waitReady() holds call_mu_ and
  // sees the abort at its next poll.
  failAndAbort("the communicator was shut down: " + reason);
  wd_cv_.notify_all();
  if (watchdog_.joinable()) {
    if (watchdog_.get_id() == std::this_thread::get_id()) {
      watchdog_.detach();  // unreachable in practice: the watchdog never calls shutdown()
    } else {
      watchdog_.join();
    }
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  failAll("the communicator was shut down: " + reason);  // a call enqueued meanwhile
  queued_.clear();
  queued_ops_ = 0;
  // After the abort the streams drain: wait with a deadline; free nothing the GPU may still use.
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device()) (void)cudaSetDevice(device());
  const auto deadline = std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(comm_->timeout(), kMaxDrain);
  const std::vector<cudaStream_t> all = streams();
  bool drained = all.empty();
  while (!all.empty()) {
    bool pending = false, failed = false;
    for (cudaStream_t st : all) {
      const cudaError_t q = cudaStreamQuery(st);
      if (q != cudaSuccess) (void)cudaGetLastError();
      pending = pending || q == cudaErrorNotReady;
      failed = failed || (q != cudaSuccess && q != cudaErrorNotReady);
    }
    if (!pending) {
      drained = !failed;
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!all.empty() && !drained && !at_exit) {
    std::fprintf(stderr, "[ringreduce] rank %d: the streams of %s did not drain after the abort; its staging is "
                 "leaked\n", rank(), comm_->name().c_str());
  }
  for (Lane& l : lanes_) {
    for (cudaEvent_t e : l.plan_events) pool_->release(e);
    l.plan_events.clear();
    pool_->release(l.stage_event);
    pool_->release(l.done_event);
    l.stage_event = l.done_event = nullptr;
  }
  last_work_.reset();
  if (drained && !at_exit && !all.empty()) {
    if (staging_ != nullptr) (void)cudaFree(staging_);
    if (frames_dev_ != nullptr) (void)cudaFree(frames_dev_);
    if (frames_host_ != nullptr) (void)cudaFreeHost(frames_host_);
    staging_ = frames_dev_ = frames_host_ = nullptr;
    std::lock_guard<std::mutex> pool_lock(streamPoolMutex());
    for (const Lane& l : lanes_)
      if (l.comm_stream != nullptr && l.compute_stream != nullptr)
        streamPool()[device()].push_back(StreamPair{l.comm_stream, l.compute_stream});
  }
  // Note [Streams outlive the ring]: never cudaStreamDestroy; undrained streams are left as they are.
  for (Lane& l : lanes_) l.comm_stream = l.compute_stream = nullptr;
  restoreDevice(previous);
}

std::shared_ptr<CudaRing> connectCudaRing(const std::string& unique_id, const std::vector<std::string>& lane_ids,
                                          int nranks, int rank, int device, std::chrono::milliseconds timeout,
                                          std::chrono::milliseconds connect_timeout, const std::string& name,
                                          int64_t staging_bytes) {
  auto comm = std::make_shared<NcclComm>(unique_id, nranks, rank, device, timeout, name, connect_timeout);
  std::vector<std::shared_ptr<NcclComm>> lanes;
  try {
    for (size_t k = 0; k < lane_ids.size(); ++k)
      lanes.push_back(std::make_shared<NcclComm>(lane_ids[k], nranks, rank, device, timeout,
                                                 name + " lane " + std::to_string(k + 1), connect_timeout));
  } catch (const std::exception& e) {
    comm->abort(std::string("a lane's communicator could not be created: ") + e.what());
    throw;
  }
  return std::make_shared<CudaRing>(comm, staging_bytes, kCudaMaxQueuedOps, std::move(lanes));
}

}  // namespace rr
