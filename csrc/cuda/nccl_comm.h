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
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
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

// Note [NCCL versions, environment and the simplest path]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What Note [Hand-off and queued exchanges] relies on holds for the NCCL that runs, not the one
// compiled against, and NCCL's environment can override a communicator's config. So each
// communicator decides at creation, from ncclGetVersion and the environment (ncclSetupFor):
//   * NCCL < 2.23 (older torch wheels ship it): a non-blocking ncclGroupEnd that needs no new
//     connection launches inline and returns ncclSuccess (src/group.cc of 2.21.5/2.22.3), which
//     reads as "inside the caller's NCCL group": every call after the first would be refused.
//     There, every group is issued from a launcher thread of the communicator, whose NCCL group
//     depth is always 0, so ncclSuccess means "launched" and a caller's own group can never absorb
//     our sends (a call inside one runs instead of being refused); and the simplest path below.
//   * NCCL_COMM_BLOCKING (src/init.cc envConfigOverride applies 0 or 1 over every config, the split
//     child's included): 1 makes init, connections and hand-offs blocking, without a deadline a
//     dead peer could be timed out by: refused (kValue) with what to do. 0 makes the child
//     non-blocking, so its queued exchanges would return ncclInProgress: the simplest path.
//   * NCCL_COMM_SPLIT_SHARE_RESOURCES other than 1 (NCCL sets splitShare to 0 for any other number):
//     the child would connect on its own, in the caller's thread without a deadline, and not share
//     the parent's abort flag: the simplest path.
//   * NCCL_WORK_ARGS_BYTES / NCCL_WORK_FIFO_BYTES: smaller values move a launch's work from the
//     kernel arguments into NCCL's work FIFO, whose wait for room (src/enqueue.cc
//     waitWorkFifoAvailable) spins without looking at the abort flag: a warning.
//   * NCCL_LAUNCH_ORDER_IMPLICIT=1 orders the kernels of every communicator of the device in host
//     launch order; ringreduce launches in the same order on every rank, so this costs the lanes'
//     overlap, never correctness: nothing to do.
//   * RINGREDUCE_NCCL_SIMPLE=1 asks for the simplest path (0 or unset: only the triggers above).
// The simplest path: no split child (every exchange is a hand-off on the one non-blocking
// communicator, waited with its deadline), one lane (CudaRing drops the others) and no one-shot
// (runCudaCall). It is not a blocking communicator: one of those would connect and launch without
// any deadline, and a dead peer would hang the caller instead of raising DistBackendError. It is
// announced on stderr once per process and reason, naming the NCCL version. Every rank must take
// the same path (a rank on the simplest path and one on the queued child send on different
// communicators); the triggers are the NCCL library and the environment, the same on every rank of
// a job started from one environment, and RINGREDUCE_CHECK=1 catches a one-shot disagreement.
// Note [Stopping every lane at once]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ncclCommAbort sets its own communicator's abort flag, then waits for that communicator's device
// stream (src/init.cc commReclaim -> commDestroySync: cudaStreamSynchronize), which NCCL moved
// past its last kernel, so it waits for whatever that kernel waits for. A ring's lanes depend on
// each other through events (each lane's comm stream waits for the previous call, whose done event
// follows lane 0's compute stream, which waits for every lane: ring_driver.cpp), so with two calls
// queued and a dead peer, stopping lane 0 alone waits for lane 1's kernel, which exits only once
// lane 1 is stopped: the process hangs (NCCL issue 1013, pytorch issue 150690). So a ring stops
// its communicators together (abortTogether): all are marked aborted first; then, with NCCL >=
// 2.24, ncclCommAbort of every parent and child inside one ncclGroupStart/End (inside a group each
// sets its flag at once and the cleanup, stream waits included, runs at the outer ncclGroupEnd;
// an abort makes the group blocking, so the non-blocking parent and blocking child may share it:
// src/init.cc, src/group.cc ncclAsyncLaunch), else one thread per lane, each stopping its parent
// then its child, so that no lane's flag waits for another lane's cleanup. An abort that one lane's
// own wait decides (deadline, Ctrl-C, failed launch) only marks that lane aborted once its ring
// deferred it (deferAbortToRing); the CudaRing that catches the error stops every lane together.
struct NcclSetup {
  int version = 0;             // ncclGetVersion, e.g. 22107 for 2.21.7
  bool launcher = false;       // issue every group from the launcher thread (NCCL < 2.23)
  bool group_abort = false;    // ncclCommAbort inside a group stops at once (NCCL >= 2.24)
  bool simple = false;         // the simplest path
  std::string why_simple;      // what chose it ("" when not simple)
  std::vector<std::string> warnings;
};
// The setup for NCCL `version` under the environment `env` (name -> value or nullptr). Throws
// kValue for NCCL_COMM_BLOCKING=1 and for a RINGREDUCE_NCCL_SIMPLE other than 0 or 1.
NcclSetup ncclSetupFor(int version, const std::function<const char*(const char*)>& env);
// "2.21.5" for 22105 (and 2.18.3 for the old code 2183).
std::string ncclVersionString(int code);

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

  // Note [NCCL versions, environment and the simplest path]: what this communicator runs on.
  const NcclSetup& setup() const { return setup_; }
  bool simplePath() const { return setup_.simple; }

  // Note [Stopping every lane at once]: from now on an abort of this communicator alone (a
  // deadline, Ctrl-C, a failed launch) only marks it aborted; its NCCL communicators are stopped
  // by the next abortTogether() of its ring (or its destructor).
  void deferAbortToRing();
  // Aborts every communicator of `comms` (a ring's lanes, lane 0 first) together: marks them all
  // aborted, then stops all their NCCL communicators, parents and children, in one group (NCCL >=
  // 2.24) or one thread per communicator. Idempotent; never throws.
  static void abortTogether(const std::vector<NcclComm*>& comms, const std::string& reason);

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
  // ncclGroupStart, the sends and receives of `ops` on `comm`, ncclGroupEnd: in this thread, or in
  // the launcher thread when setup_.launcher. Returns (first failure or ncclSuccess, ncclGroupEnd's).
  std::pair<ncclResult_t, ncclResult_t> issueGroup(ncclComm_t comm, const P2p* ops, size_t count,
                                                   cudaStream_t stream);
  // Runs `fn` on the launcher thread (started on first use) and returns its result.
  ncclResult_t onLauncher(const std::function<ncclResult_t()>& fn);
  // Hands over the NCCL handles not yet stopped (mu_ held) and marks the communicator aborted.
  void releaseHandlesLocked(const std::string& reason, std::vector<ncclComm_t>* out);

  NcclSetup setup_;
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
  bool defer_abort_ = false;  // Note [Stopping every lane at once] (mu_)
  // The launcher thread (setup_.launcher): one job at a time, under mu_.
  std::thread launcher_;
  std::mutex launch_mu_;
  std::condition_variable launch_cv_;
  std::function<ncclResult_t()> launch_job_;
  ncclResult_t launch_result_ = ncclSuccess;
  bool launch_done_ = false;
  bool launch_stop_ = false;
};

}  // namespace rr
