#include "cuda_ring.h"

#include <cstdio>
#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "../core/agreement.h"
#include "cuda_check.h"
#include "nccl_frame_transport.h"
#include "reduce_kernels.cuh"

namespace rr {

namespace {

constexpr auto kHostPoll = std::chrono::microseconds(20);
constexpr auto kWatchdogBusyPoll = std::chrono::milliseconds(1);
constexpr auto kWatchdogIdlePoll = std::chrono::milliseconds(100);
constexpr auto kMaxDrain = std::chrono::milliseconds(10000);

// Note [Streams outlive the ring] (cuda_ring.h): per device, the stream pairs of shut-down rings.
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

// ---- EventPool ---------------------------------------------------------------------------------

EventPool::~EventPool() {
  // Destroying an event whose record is pending is allowed (resources are freed on completion).
  for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
}

cudaEvent_t EventPool::acquire() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  DeviceGuard guard(device_);
  cudaEvent_t e = nullptr;
  RR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void EventPool::release(cudaEvent_t event) {
  if (event == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(event);
}

// ---- CudaWork ----------------------------------------------------------------------------------

CudaWork::CudaWork(std::shared_ptr<EventPool> pool, std::shared_ptr<NcclComm> comm, uint64_t seq, int device,
                   std::string what)
    : pool_(std::move(pool)), comm_(std::move(comm)), seq_(seq), device_(device), what_(std::move(what)) {}

CudaWork::~CudaWork() {
  pool_->release(start_);
  pool_->release(done_);
  pool_->release(timer_);
}

void CudaWork::fail(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  int expected = kPending;
  if (state_.compare_exchange_strong(expected, kFailed)) error_ = reason;
}

void CudaWork::settle() {
  if (comm_->aborted()) {
    fail("the NCCL communicator was aborted before the call was seen to finish: " + comm_->abortReason());
    return;
  }
  int expected = kPending;
  state_.compare_exchange_strong(expected, kDone);
}

std::string CudaWork::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

bool CudaWork::isCompleted() {
  if (state_.load() != kPending) return true;
  if (!eventFired(done_)) return false;
  settle();
  return true;
}

void CudaWork::streamWait(cudaStream_t stream) {
  if (state_.load() == kFailed) {
    RR_THROW(kBackend, "ringreduce: ", what_, " #", seq_, " on ", comm_->name(), " failed: ", error());
  }
  DeviceGuard guard(device_);
  RR_CUDA_CHECK(cudaStreamWaitEvent(stream, done_, 0));
}

void CudaWork::synchronize(std::chrono::milliseconds timeout) {
  const auto limit = timeout.count() > 0 ? timeout : comm_->timeout();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!isCompleted()) {
    if (std::chrono::steady_clock::now() > deadline) {
      RR_THROW(kBackend, "ringreduce: ", what_, " #", seq_, " on ", comm_->name(), " (rank ", comm_->rank(),
               ") did not finish within ", limit.count(), " ms");
    }
    std::this_thread::sleep_for(kHostPoll);
  }
  if (state_.load() == kFailed) {
    RR_THROW(kBackend, "ringreduce: ", what_, " #", seq_, " on ", comm_->name(), " failed: ", error());
  }
}

bool CudaWork::wait(cudaStream_t stream, int64_t timeout_ms) {
  streamWait(stream);
  if (timeout_ms < 0) return true;
  try {
    synchronize(std::chrono::milliseconds(timeout_ms > 0 ? timeout_ms : 1));
  } catch (const Error&) {
    if (!isCompleted()) return false;  // still running: the caller reports the timeout
    throw;
  }
  return true;
}

std::string CudaWork::errorMessage() const {
  const std::string e = error();
  return e.empty() ? e : "ringreduce: CUDA " + what_ + " #" + std::to_string(seq_) + " failed: " + e;
}

// ---- CudaBackend: the DeviceBackend of real GPUs -------------------------------------------------

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(CudaRing& ring, CudaWork& work, DType dtype, cudaStream_t caller,
              const std::function<void()>& epilogue)
      : ring_(ring), work_(work), dtype_(dtype), caller_(caller), epilogue_(epilogue) {}

  bool enqueuedAnything() const { return enqueued_; }
  bool timerRecorded() const { return work_.timer_recorded_; }

  void prepare(int32_t num_events) override {
    while (static_cast<int32_t>(ring_.plan_events_.size()) < num_events)
      ring_.plan_events_.push_back(ring_.pool_->acquire());
    if (ring_.stage_event_ == nullptr) ring_.stage_event_ = ring_.pool_->acquire();
  }

  // The peers are communicator ranks, already mapped through the stage's members by the driver
  // (Note [Sub-rings on one communicator]).
  void exchange(const void* send, size_t send_bytes, int send_peer, void* recv, size_t recv_bytes,
                int recv_peer) override {
    enqueued_ = true;
    if (!work_.timer_recorded_) {
      // The call's timeout starts when the comm stream reaches its first exchange.
      RR_CUDA_CHECK(cudaEventRecord(work_.timer_, ring_.comm_stream_));
      work_.timer_recorded_ = true;
    }
    ring_.comm_->sendRecv(send, send_bytes, send_peer, recv, recv_bytes, recv_peer, ring_.comm_stream_);
  }

  void reduce(const ReduceLaunch& l) override {
    enqueued_ = true;
    launchReduce(l.op, l.a, l.a_type, l.b, l.b_type, l.dst, l.dst_type, l.count, l.scaling, ring_.compute_stream_);
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    enqueued_ = true;
    RR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ring_.compute_stream_));
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
      case Stream::kComm: return ring_.comm_stream_;
      case Stream::kCompute: return ring_.compute_stream_;
      case Stream::kCaller: return caller_;
    }
    RR_THROW(kRuntime, "ringreduce internal error: unknown stream");
  }
  cudaEvent_t eventOf(int32_t e) const {
    if (e == kCallStartEvent) return work_.start_;
    if (e == kCallDoneEvent) return work_.done_;
    if (e == kStageDoneEvent) return ring_.stage_event_;
    RR_CHECK(e >= 0 && static_cast<size_t>(e) < ring_.plan_events_.size(), kRuntime,
             "ringreduce internal error: event ", e, " outside the pool");
    return ring_.plan_events_[static_cast<size_t>(e)];
  }

  CudaRing& ring_;
  CudaWork& work_;
  DType dtype_;
  cudaStream_t caller_;
  const std::function<void()>& epilogue_;
  bool enqueued_ = false;
};

// ---- CudaRing ----------------------------------------------------------------------------------

CudaRing::CudaRing(std::shared_ptr<NcclComm> comm, int32_t num_slots, int64_t staging_bytes)
    : comm_(std::move(comm)), pool_(std::make_shared<EventPool>(comm_->device())), num_slots_(num_slots) {
  RR_CHECK(num_slots_ >= 1, kValue, "ringreduce: need at least one staging slot");
  // Slots are multiples of 256 bytes so that every slot starts 16-byte aligned (vector loads).
  slot_bytes_ = (staging_bytes / num_slots_) / 256 * 256;
  RR_CHECK(slot_bytes_ >= 256, kValue, "ringreduce: staging of ", staging_bytes, " bytes is too small for ",
           num_slots_, " slots");
  DeviceGuard guard(comm_->device());
  try {
    {
      std::lock_guard<std::mutex> pool_lock(streamPoolMutex());
      auto& free_pairs = streamPool()[comm_->device()];
      if (!free_pairs.empty()) {
        comm_stream_ = free_pairs.back().comm;
        compute_stream_ = free_pairs.back().compute;
        free_pairs.pop_back();
      }
    }
    if (comm_stream_ == nullptr) {
      int lo = 0, hi = 0;
      RR_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
      // The communication stream gets the higher priority: its kernels are tiny and gate the peers.
      RR_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, hi));
      RR_CUDA_CHECK(cudaStreamCreateWithPriority(&compute_stream_, cudaStreamNonBlocking, lo));
    }
    RR_CUDA_CHECK(cudaMalloc(&staging_, static_cast<size_t>(slot_bytes_) * num_slots_));
    RR_CUDA_CHECK(cudaMalloc(&frames_dev_, NcclFrameTransport::kStagingBytes));
    RR_CUDA_CHECK(cudaMallocHost(&frames_host_, NcclFrameTransport::kStagingBytes));
  } catch (...) {
    shutdown("construction failed");
    throw;
  }
  watchdog_ = std::thread([this] { watchdogLoop(); });
}

CudaRing::~CudaRing() { shutdown("the ring was destroyed"); }

void CudaRing::checkOpen() const {
  RR_CHECK(!shut_down_, kBackend, "ringreduce: the NCCL communicator ", comm_->name(),
           " was shut down (process exit or an explicit abort)");
  RR_CHECK(poisoned_.empty(), kRuntime, poisoned_);
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

PlanOptions CudaRing::planOptions(RedOp op, bool accum_float32, int64_t segment_bytes) const {
  return gpuPlanOptions(op, accum_float32, segment_bytes, num_slots_, slot_bytes_);
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
  comm_->checkUsable();
  RR_CHECK(!stages.empty(), kRuntime, "ringreduce internal error: a call without a ring");
  const DType dtype = stages[0].plan.dtype;
  for (const RingStage& st : stages) {
    checkSupported(st.plan.dtype, st.op);
    RR_CHECK(st.plan.dtype == dtype, kRuntime, "ringreduce internal error: stages of one call differ in dtype");
    // Note [Sub-rings on one communicator]: every stage is a ring over ranks of this communicator
    // on which this process sits at the plan's ring index.
    RR_CHECK(static_cast<int>(st.members.size()) == st.plan.sched.nranks && st.plan.rank >= 0 &&
                 st.plan.rank < st.plan.sched.nranks &&
                 st.members[static_cast<size_t>(st.plan.rank)] == rank(),
             kRuntime, "ringreduce internal error: a plan for ring index ", st.plan.rank, " of ", st.plan.sched.nranks,
             " does not place communicator rank ", rank(), " there");
    for (const int m : st.members)
      RR_CHECK(m >= 0 && m < size(), kValue, "ringreduce: ring member ", m, " outside the communicator of ", size(),
               " ranks");
  }
  DeviceGuard guard(device());

  uint64_t& seq = next_seq_[ring_key];
  std::shared_ptr<CudaWork> work(new CudaWork(pool_, comm_, seq, device(), what));
  work->start_ = pool_->acquire();
  work->done_ = pool_->acquire();
  work->timer_ = pool_->acquire();
  DeviceBuffers buffers;
  buffers.data = data;
  buffers.accum = accum;
  buffers.slot_bytes = static_cast<size_t>(slot_bytes_);
  for (int32_t k = 0; k < num_slots_; ++k)
    buffers.slots.push_back(static_cast<char*>(staging_) + static_cast<int64_t>(k) * slot_bytes_);

  CudaBackend backend(*this, *work, dtype, caller, epilogue);
  try {
    enqueueRingStages(stages, buffers, backend, caller_waits);
    if (!backend.timerRecorded()) {
      RR_CUDA_CHECK(cudaEventRecord(work->timer_, comm_stream_));  // a call without exchanges
      work->timer_recorded_ = true;
    }
  } catch (const std::exception& e) {
    if (comm_->insideUserGroup()) {
      // Note [Inside a user's NCCL group]: our first exchange belongs to the user's group and
      // runs when it ends; aborting would free a communicator that group still uses. Earlier
      // calls are unaffected and stay with the watchdog.
      poisoned_ = e.what();
    } else if (backend.enqueuedAnything()) {
      // Half a ring is on the streams and the peers wait for the rest: only an abort unblocks them.
      failAndAbort(std::string("enqueueing ") + what + " #" + std::to_string(seq) + " failed: " + e.what());
    }
    throw;
  }
  ++seq;
  last_work_ = work;
  {
    std::lock_guard<std::mutex> wl(wd_mu_);
    in_flight_.push_back(work);
  }
  wd_cv_.notify_one();
  return work;
}

std::vector<Frame> CudaRing::exchangeFrames(const Frame& mine, const RingMembers& ring) {
  std::lock_guard<std::mutex> lock(call_mu_);
  checkOpen();
  comm_->checkUsable();
  const int n = ring.size();
  const int r = ring.index;
  RR_CHECK(n >= 1 && n <= size() && r >= 0 && r < n && ring.ranks[static_cast<size_t>(r)] == rank(), kRuntime,
           "ringreduce internal error: agreement frames on a ring that does not hold this rank");
  DeviceGuard guard(device());
  cudaEvent_t done = pool_->acquire();
  std::vector<Frame> frames;
  try {
    // The one frame all-gather of csrc/core/agreement.h, around the ring's members only (Note
    // [Sub-rings on one communicator]) and hop by hop (Note [Host messages over NCCL]).
    NcclFrameTransport nccl(*comm_, comm_stream_, done, frames_dev_, frames_host_);
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
  comm_->abort(reason);
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
        // The timeout runs from the call's timer event: the comm stream reached its first
        // exchange, i.e. the caller's prior work and the previous call are done.
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
    if (reason.empty() && !in_flight_.empty()) reason = comm_->pollError();
    if (!reason.empty()) {
      std::fprintf(stderr, "[ringreduce watchdog] rank %d of %d, communicator %s: %s; aborting the NCCL communicator\n",
                   rank(), size(), comm_->name().c_str(), reason.c_str());
      for (auto& w : in_flight_) w->fail(reason);  // failed before aborted (cuda_ring.h)
      in_flight_.clear();
      comm_->abort(reason);
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
  // After the abort NCCL's kernels return and the streams drain; wait for that with a deadline and
  // free nothing the GPU may still use.
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device()) (void)cudaSetDevice(device());
  const auto deadline = std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(comm_->timeout(), kMaxDrain);
  bool drained = false;
  while (comm_stream_ != nullptr) {
    const cudaError_t a = cudaStreamQuery(comm_stream_);
    const cudaError_t b = compute_stream_ != nullptr ? cudaStreamQuery(compute_stream_) : cudaSuccess;
    if (a != cudaSuccess || b != cudaSuccess) (void)cudaGetLastError();
    if (a != cudaErrorNotReady && b != cudaErrorNotReady) {
      drained = a == cudaSuccess && b == cudaSuccess;
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (comm_stream_ != nullptr && !drained && !at_exit) {
    std::fprintf(stderr, "[ringreduce] rank %d: the streams of %s did not drain after the abort; its staging is "
                 "leaked\n", rank(), comm_->name().c_str());
  }
  for (cudaEvent_t e : plan_events_) pool_->release(e);
  plan_events_.clear();
  pool_->release(stage_event_);
  stage_event_ = nullptr;
  last_work_.reset();
  if (drained && !at_exit && compute_stream_ != nullptr) {
    if (staging_ != nullptr) (void)cudaFree(staging_);
    if (frames_dev_ != nullptr) (void)cudaFree(frames_dev_);
    if (frames_host_ != nullptr) (void)cudaFreeHost(frames_host_);
    staging_ = frames_dev_ = frames_host_ = nullptr;
    std::lock_guard<std::mutex> pool_lock(streamPoolMutex());
    streamPool()[device()].push_back(StreamPair{comm_stream_, compute_stream_});
  }
  // Note [Streams outlive the ring]: never cudaStreamDestroy; undrained streams are left as they are.
  comm_stream_ = compute_stream_ = nullptr;
  restoreDevice(previous);
}

}  // namespace rr
