// ringreduce GPU: the NCCL communicator of one process group on one device.
//
// Note [Non-blocking NCCL and abort]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The communicator is created with config.blocking = 0, so no NCCL call ever blocks the host on a
// peer: init, ncclGroupEnd and abort may return ncclInProgress, and the communicator's state (read
// with ncclCommGetAsyncError) stays ncclInProgress until the operation has been handed to the GPU.
// NCCL forbids touching the streams involved, or calling NCCL on the communicator again, until
// then (docs: usage/groups "Nonblocking Group Operation"; src/init.cc ncclCommEnsureReady refuses
// a communicator whose state is still ncclInProgress), so every such call is followed by
// waitReady(), which polls the state with the lock released between polls, at once: busily for
// the first 200 us, yielding up to 2 ms, then sleeping 50 us between polls (the hand-off usually
// takes microseconds; a sleep before the first poll cost ~100 us of host time per exchange,
// capping a 1 MiB-segment ring near 10 GB/s). NCCL >= 2.23 starts a helper thread per
// non-blocking ncclGroupEnd that has tasks (src/group.cc, ncclGroupEndInternal, returns
// ncclInProgress), so a hand-off also costs that thread's start. A rank that never arrives
// therefore costs a timeout, not a hang: waitReady() aborts the communicator when the deadline
// passes or Ctrl-C interrupts the wait (Note [Interrupting a host wait on CUDA], host_interrupt.h),
// and the watchdog (cuda_ring.h) may abort it at any time from its own thread. NCCL's
// rule for that (docs: usage/communicators "Error handling and communicator abort") is that no
// other thread may be inside an NCCL call on the communicator meanwhile: every NCCL call here holds
// mu_, and abort() takes it too.
//
// Note [Hand-off and queued exchanges]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A hand-off per exchange puts the host in lockstep with NCCL: 2(n-1) x segments waits per call.
// So the communicator has a second handle: right after init, ncclCommSplit(color 0, key = rank)
// derives a *blocking* child (config.blocking = 1) with the same ranks. The parent is created with
// config.splitShare = 1, so the child shares its resources (src/init.cc ncclCommInitChildComm):
// its channels' peer connectors (src/channel.cc initChannel takes them from sharedRes; the p2p
// taskAppend in src/enqueue.cc notes that send/recv connectors are shared among split-shared
// communicators), its abort flag, and the device stream through which NCCL orders every kernel of
// the communicators that share it. A blocking ncclGroupEnd launches in the calling thread and
// returns ncclSuccess once the kernel is on the stream (src/group.cc, the "blocking group" branch):
// no state to poll. The exchanges of a call are therefore:
//   * hand-off (sendRecv, on the non-blocking parent, waited as above): the first exchange of each
//     ring stage of a call and every one-shot group (ring_driver.h, Note [Which exchanges hand
//     off]). They make the first contact with every peer - NCCL connects a pair of ranks lazily,
//     inside the ncclGroupEnd of their first message, and a blocking communicator would do that
//     in the caller's thread without a deadline - and they detect a caller inside its own NCCL
//     group (Note [Inside a user's NCCL group]), which a blocking ncclGroupEnd cannot tell apart
//     from a launch (both return ncclSuccess);
//   * queued (queueSendRecv, on the blocking child): every other exchange. The host returns as
//     soon as the kernel is enqueued; nothing is polled. A queued exchange with a peer that no
//     hand-off has connected yet is refused as an internal error (the rule guarantees it never is).
//     The child has the parent's ranks and topology, so NCCL picks the same point-to-point channels
//     for a peer (src/enqueue.cc: from the rank schedule and the channel counts) and finds them
//     connected; were it not so, the child would connect them in the caller's thread - correct, but
//     without a deadline. The first GPU run should confirm it (NCCL_DEBUG=INFO shows connections).
// Once connected, a blocking ncclGroupEnd of a send/recv waits for nothing a peer does: its work
// item travels in the kernel's arguments (src/enqueue.cc, ncclDevWorkStorageTypeArgs), and a
// socket transport's proxy ops are taken by the proxy thread whatever the peer does. What can
// still block it is CUDA's own queue of pending launches (finite; its depth is not documented),
// which stops draining when a kernel waits for a dead peer; CudaRing bounds the launches it keeps
// queued (Note [Bounded launch queue], cuda_ring.h) so that the watchdog can always take mu_ and
// abort. Both handles are aborted together (parent first, then the child, as NCCL's split example
// does); the shared abort flag makes the kernels of both exit at the first.
//
// All uses of the ncclComm_t handles go through this class under one mutex; abort() takes the same
// mutex, then frees the communicators, so no thread can use a freed handle. After abort() every
// call throws rr::Error(kBackend) with the reason.
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
  // until every rank has joined or `connect_timeout` passes (or Ctrl-C: host_interrupt.h); then
  // aborts and throws kBackend.
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

  // One point-to-point operation of a group (bytes as ncclUint8).
  struct P2p {
    bool send = false;
    void* buf = nullptr;  // read for a send, written for a receive
    size_t bytes = 0;
    int peer = -1;
  };

  // One grouped exchange on `stream` (Note [Hand-off and queued exchanges]: a hand-off, on the
  // non-blocking parent): send `send_bytes` to `next`, receive `recv_bytes` from `prev` (either may
  // be 0). Returns once the group is on the stream. Throws kBackend, or kRuntime when called inside
  // an ncclGroupStart() of the caller's thread (Note [Inside a user's NCCL group]; the
  // communicator is then not aborted: insideUserGroup() is true).
  void sendRecv(const void* send, size_t send_bytes, int next, void* recv, size_t recv_bytes, int prev,
                cudaStream_t stream);
  // The same exchange queued on the blocking child: returns once the kernel is enqueued, without
  // polling. Both peers must have been reached by a hand-off before (kRuntime otherwise).
  void queueSendRecv(const void* send, size_t send_bytes, int next, void* recv, size_t recv_bytes, int prev,
                     cudaStream_t stream);
  // Any group of sends and receives (the one-shot all-reduce's), handed off (waited, connects new
  // peers) or queued; an empty list does nothing.
  void group(const std::vector<P2p>& ops, cudaStream_t stream, bool hand_off);

  // Hand-offs waited for so far (a diagnostic: the ring's host round trips).
  int64_t handOffs() const { return hand_offs_.load(); }

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
  // Polls ncclCommGetAsyncError of the parent until the state leaves ncclInProgress, releasing the
  // lock between polls; aborts and throws on an error, when `deadline` passes, or when the calling
  // thread's HostInterruptScope says stop (host_interrupt.h). `lock` must hold mu_.
  void waitReady(std::unique_lock<std::mutex>& lock, ncclResult_t first, const char* what,
                 std::chrono::steady_clock::time_point deadline);
  // The group on the parent (hand-off) or the child (queued); `lock` holds mu_.
  void launchLocked(std::unique_lock<std::mutex>& lock, const P2p* ops, size_t count, cudaStream_t stream,
                    bool hand_off);
  void abortLocked(const std::string& reason);
  void checkUsableLocked() const;

  int nranks_;
  int rank_;
  int device_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds connect_timeout_;
  std::string name_;
  std::string queue_name_;  // the child's commName (NCCL keeps the pointer)
  mutable std::mutex mu_;
  ncclComm_t comm_ = nullptr;   // the non-blocking parent: init, hand-offs, agreement frames
  ncclComm_t queue_ = nullptr;  // its blocking child: queued exchanges
  std::atomic<bool> aborted_{false};
  std::atomic<bool> inside_user_group_{false};
  std::atomic<int64_t> hand_offs_{0};
  std::string abort_reason_;  // guarded by mu_
  // Per peer: a hand-off sent to it / received from it reached the GPU (guarded by mu_).
  std::vector<bool> sent_to_;
  std::vector<bool> received_from_;
};

}  // namespace rr
