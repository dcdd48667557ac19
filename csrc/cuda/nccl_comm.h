// ringreduce GPU: the NCCL communicator of one process group on one device.
//
// Note [Non-blocking NCCL and abort]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The communicator is created with config.blocking = 0: init, ncclGroupEnd and abort may return
// ncclInProgress, and until ncclCommGetAsyncError leaves it NCCL forbids touching the streams
// involved or the communicator (src/init.cc ncclCommEnsureReady). So each such call is followed by
// waitReady(), which polls with the lock released between polls: busily for 200 us, yielding up to
// 2 ms, then sleeping 50 us. A silent rank costs a timeout, not a hang: waitReady() aborts at the
// deadline or on Ctrl-C, and the watchdog (group_runtime.h) may abort at any time. No other thread
// may be inside an NCCL call on the communicator meanwhile: every NCCL call holds mu_, and abort()
// takes it, then frees the handles; every later call throws kBackend with the reason. Teardown is
// ncclCommAbort, never Destroy/Finalize, which waits for peers that may be gone at exit.
//
// Note [Hand-off and queued exchanges]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// (docs/design.md section 2.4, "One host wait per stage".) Right after init, ncclCommSplit(color 0,
// key = rank) derives a *blocking* child; with the parent's config.splitShare = 1 it shares its peer
// connectors, its abort flag and the device stream that orders their kernels (src/init.cc
// ncclCommInitChildComm). A blocking ncclGroupEnd returns ncclSuccess once the kernel is on the
// stream: nothing to poll. An exchange is either
//   * a hand-off (on the non-blocking parent, waited): the first exchange of each ring
//     stage and every one-shot group (Note [Which exchanges hand off], ring_executor.h). Only a
//     hand-off may make the first contact with a peer (NCCL connects a pair inside their first
//     ncclGroupEnd, which a blocking communicator does without a deadline) or tell a caller inside
//     its own NCCL group (Note [Inside a user's NCCL group]) from a launch;
//   * or queued (on the blocking child): every other one. One with a peer no hand-off
//     has reached is an internal error. The child has the parent's ranks and topology, so NCCL picks
//     the same, already connected, channels.
// A queued launch can still block on CUDA's finite launch queue, which stops draining when a kernel
// waits for a dead peer: Note [Bounded launch queue] (group_runtime.h) keeps mu_ free for the abort.
// Both handles are aborted together (parent, then child); the shared flag makes all their kernels exit.
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

#include "ring_executor.h"  // PeerOp

namespace rr {

// Note [Do not create a context on GPU 0]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cudaSetDevice(d) creates d's primary context (~0.5 GB) if it does not exist. A rank that never
// called torch.cuda.set_device() has device 0 current without a context; restoring it after our work
// on cuda:local_rank would put a context on GPU 0 of every rank. So restoreDevice() makes `previous`
// (>= 0) current again only if its primary context is active (or cannot be queried), as torch's own
// guards do. Never throws.
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
// Each communicator decides at creation, from ncclGetVersion and the environment (ncclSetupFor,
// whose messages say why; docs/reliability.md section 11, "What is guarded against real NCCL"),
// whether what Note [Hand-off and queued exchanges] relies on holds. NCCL < 2.23 issues every group
// from a launcher thread (group depth 0): its non-blocking ncclGroupEnd may launch inline and return
// ncclSuccess, which would read as "inside the caller's NCCL group". The simplest path: no split
// child (every exchange a hand-off with its deadline), one lane, no one-shot - never a blocking
// communicator, which would turn a dead peer into a hang. Every rank must take the same path (the
// triggers are the same on every rank started from one environment; RINGREDUCE_CHECK=1 catches a
// one-shot disagreement).
//
// Note [Stopping every lane at once]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ncclCommAbort sets its flag, then synchronizes its device stream (src/init.cc commDestroySync).
// Lanes wait for each other through events (ring_executor.cpp), so stopping lane 0 alone can wait for
// lane 1's kernel, which exits only once lane 1 is stopped: a hang (NCCL issue 1013). So
// abortTogether() marks every lane aborted, then calls ncclCommAbort on every parent and child inside
// one group with NCCL >= 2.24 (each sets its flag at once; the cleanup runs at the group's end), else
// on one thread per lane. Once deferred (deferAbortToRing), a lane's own abort (deadline, Ctrl-C,
// failed launch) only marks it; the CudaRing that catches the error stops every lane.
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

  // Joins communicator `unique_id` as `rank` of `nranks` on CUDA `device`, polling until every rank
  // joined; aborts and throws kBackend at `connect_timeout` or on Ctrl-C. `timeout` bounds each later
  // hand-off, but the first exchange with a peer (NCCL connects there) gets `connect_timeout` (<= 0:
  // `timeout`).
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

  // On `stream`: send `send_bytes` to `next`, receive `recv_bytes` from `prev` (either may be 0), as
  // a hand-off (Note [Hand-off and queued exchanges]; returns once the group is on the stream) or
  // queued on the blocking child (both peers must have been reached by a hand-off before, kRuntime
  // otherwise). Throws kBackend, or kRuntime inside the caller's ncclGroupStart() (Note [Inside a
  // user's NCCL group]; then not aborted, and insideUserGroup() is true).
  void sendRecv(const void* send, size_t send_bytes, int next, void* recv, size_t recv_bytes, int prev,
                cudaStream_t stream, bool hand_off = true);
  // Any group of sends and receives (the one-shot's; bytes as ncclUint8), as above; empty: nothing.
  void group(const std::vector<PeerOp>& ops, cudaStream_t stream, bool hand_off);

  // Hand-offs waited for so far (a diagnostic: the ring's host round trips).
  int64_t handOffs() const { return hand_offs_.load(); }

  // Polls the asynchronous error state once: "" when healthy or in progress, else why (no abort).
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

  // Note [Stopping every lane at once]: from now on an abort of this communicator alone only marks
  // it aborted; the next abortTogether() of its ring (or its destructor) stops its NCCL handles.
  void deferAbortToRing();
  // Stops `comms` (a ring's lanes, lane 0 first) together, as that Note says. Idempotent; never throws.
  static void abortTogether(const std::vector<NcclComm*>& comms, const std::string& reason);

 private:
  // Polls the parent's state until it leaves ncclInProgress (Note [Non-blocking NCCL and abort]);
  // aborts and throws on an error, at `deadline`, or on Ctrl-C. `lock` holds mu_.
  void waitReady(std::unique_lock<std::mutex>& lock, ncclResult_t first, const char* what,
                 std::chrono::steady_clock::time_point deadline);
  // The group on the parent (hand-off) or the child (queued); `lock` holds mu_.
  void launchLocked(std::unique_lock<std::mutex>& lock, const PeerOp* ops, size_t count, cudaStream_t stream,
                    bool hand_off);
  void abortLocked(const std::string& reason);
  // abortLocked(msg), then throws kBackend naming this communicator, `msg` and `hint`.
  [[noreturn]] void failLocked(const std::string& msg, const std::string& hint = "");
  void checkUsableLocked() const;
  // The group of `ops` on `comm`, in this thread or the launcher thread (setup_.launcher). Returns
  // (first failure or ncclSuccess, ncclGroupEnd's).
  std::pair<ncclResult_t, ncclResult_t> issueGroup(ncclComm_t comm, const PeerOp* ops, size_t count,
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
