// ringreduce GPU: one non-blocking NCCL communicator.
//
// Note [Non-blocking NCCL and abort]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The communicator is created with config.blocking = 0, so no NCCL call ever blocks the host on a
// peer: init, ncclGroupEnd and abort may return ncclInProgress, and the communicator's state (read
// with ncclCommGetAsyncError) stays ncclInProgress until the operation has been handed to the GPU.
// NCCL forbids touching the streams involved until then, so every such call is followed by
// waitReady(), which polls the state with the lock released between polls, at once: busily for
// the first 200 us, yielding up to 2 ms, then sleeping 50 us between polls (the hand-off usually
// takes microseconds; a sleep before the first poll cost ~100 us of host time per exchange,
// capping a 1 MiB-segment ring near 10 GB/s). NCCL >= 2.23 starts a helper thread per
// non-blocking ncclGroupEnd that has tasks (src/group.cc, ncclGroupEndInternal, returns
// ncclInProgress), so each exchange still costs that thread's start; a blocking communicator
// after a non-blocking init would avoid it (not done: untested on a GPU). A rank that never
// arrives therefore costs a timeout, not a hang: waitReady() aborts the communicator when the
// deadline passes, and the watchdog (cuda_ring.h) may abort it at any time from its own thread.
//
// All uses of the ncclComm_t go through this class under one mutex; abort() takes the same mutex,
// then frees the communicator, so no thread can use a freed handle. After abort() every call
// throws rr::Error(kBackend) with the reason.
//
// Teardown is ncclCommAbort, never ncclCommDestroy/Finalize: finalizing waits for the peers,
// which may be gone at exit. It is triggered explicitly (abort(), the Python atexit/finalizer
// hooks); the destructor aborts only as a last resort and never runs from a static destructor
// because NcclComm objects are owned by Python objects, not by statics.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace rr {

// Note [Do not create a context on GPU 0]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cudaSetDevice(d) creates d's primary context (~0.5 GB) if it does not exist. A rank that never
// called torch.cuda.set_device() and uses cuda:local_rank has "device 0" current without a context
// there; restoring that device after our work on cuda:local_rank would put a context on GPU 0 of
// every rank. So the previous device is restored only if its primary context is active (or
// cannot be queried); otherwise the thread stays on our device, as torch's own guards do.
bool primaryContextActive(int device);
// Makes `previous` current again (>= 0, under the rule above). Never throws.
void restoreDevice(int previous);

// Makes `device` current for a scope; restores the previous one on exit (restoreDevice).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

class NcclComm {
 public:
  // NCCL_UNIQUE_ID_BYTES bytes from ncclGetUniqueId (rank 0 publishes them through the store).
  static std::string newUniqueId();
  static int runtimeVersion();  // ncclGetVersion
  static int compiledVersion() { return NCCL_VERSION_CODE; }

  // Joins the communicator `unique_id` as `rank` of `nranks` on CUDA `device`. Blocks (polling)
  // until every rank has joined or `connect_timeout` passes; then aborts and throws kBackend.
  // `timeout` bounds each later exchange's hand-off to the GPU, except the first exchange with
  // each peer (NCCL connects p2p channels lazily there): that one gets `connect_timeout` too.
  // connect_timeout <= 0 means `timeout`.
  NcclComm(const std::string& unique_id, int nranks, int rank, int device,
           std::chrono::milliseconds timeout, const std::string& name,
           std::chrono::milliseconds connect_timeout = std::chrono::milliseconds(0));
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return nranks_; }
  int device() const { return device_; }
  const std::string& name() const { return name_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  std::chrono::milliseconds connectTimeout() const { return connect_timeout_; }

  // One grouped exchange on `stream`: send `send_bytes` to `next`, receive `recv_bytes` from
  // `prev` (either may be 0). Returns once the group is on the stream. Throws kBackend, or
  // kRuntime when called inside an ncclGroupStart() of the caller's thread (Note [Inside a user's
  // NCCL group]; the communicator is then not aborted: insideUserGroup() is true).
  void sendRecv(const void* send, size_t send_bytes, int next, void* recv, size_t recv_bytes, int prev,
                cudaStream_t stream);

  // Polls the asynchronous error state once. Returns "" when healthy (or still in progress), else
  // a description; does not abort.
  std::string pollError();

  // Aborts the communicator (idempotent, thread-safe). `reason` is reported by every later call.
  void abort(const std::string& reason);
  bool aborted() const { return aborted_.load(); }
  std::string abortReason() const;

  // Throws kBackend if the communicator was aborted.
  void checkUsable() const;

  // True once sendRecv() found itself inside a group the caller's thread opened.
  bool insideUserGroup() const { return inside_user_group_.load(); }

 private:
  // Polls ncclCommGetAsyncError until the state leaves ncclInProgress, releasing the lock between
  // polls; aborts and throws on an error or when `deadline` passes. `lock` must hold mu_.
  void waitReady(std::unique_lock<std::mutex>& lock, ncclResult_t first, const char* what,
                 std::chrono::steady_clock::time_point deadline);
  void abortLocked(const std::string& reason);
  void checkUsableLocked() const;

  int nranks_;
  int rank_;
  int device_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds connect_timeout_;
  std::string name_;
  mutable std::mutex mu_;
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> inside_user_group_{false};
  std::string abort_reason_;  // guarded by mu_
  std::vector<bool> connected_;  // per peer: an exchange with it reached the GPU (guarded by mu_)
};

}  // namespace rr
