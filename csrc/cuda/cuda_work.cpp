// ringreduce CUDA: CudaWork (group_runtime.h), one enqueued call's handle: its events, its state and
// the waits on it; the ring's watchdog settles or fails it (group_runtime.cpp).
#include "group_runtime.h"

#include <chrono>
#include <string>
#include <thread>

#include "cuda_check.h"
#include "event_pool.h"

namespace rr {

namespace {

constexpr auto kHostPoll = std::chrono::microseconds(20);

}  // namespace

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
  RR_CHECK(state_.load() != kFailed, kBackend, "ringreduce: ", what_, " #", seq_, " on ", comm_->name(),
           " failed: ", error());
  DeviceGuard guard(device_);
  RR_CUDA_CHECK(cudaStreamWaitEvent(stream, done_, 0));
}

void CudaWork::synchronize(std::chrono::milliseconds timeout) {
  const auto limit = timeout.count() > 0 ? timeout : comm_->timeout();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!isCompleted()) {
    RR_CHECK(std::chrono::steady_clock::now() <= deadline, kBackend, "ringreduce: ", what_, " #", seq_, " on ",
             comm_->name(), " (rank ", comm_->rank(), ") did not finish within ", limit.count(), " ms");
    std::this_thread::sleep_for(kHostPoll);
  }
  RR_CHECK(state_.load() != kFailed, kBackend, "ringreduce: ", what_, " #", seq_, " on ", comm_->name(),
           " failed: ", error());
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

}  // namespace rr
