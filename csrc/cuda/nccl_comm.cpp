#include "nccl_comm.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <thread>

#include "cuda_check.h"
#include "host_interrupt.h"

namespace rr {

namespace {
constexpr auto kPollInterval = std::chrono::microseconds(50);
// Note [Non-blocking NCCL and abort]: poll busily first, then yielding, then sleeping.
constexpr auto kBusyPoll = std::chrono::microseconds(200);
constexpr auto kSpinPoll = std::chrono::microseconds(2000);

std::string describeNccl(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') {
    s += " (";
    s += last;
    s += ")";
  }
  return s;
}
}  // namespace

bool primaryContextActive(int device) {
  // The driver API through the runtime's entry-point lookup: no link against libcuda, so the
  // extension still loads on machines without a driver. CUdevice and CUresult are ints.
  using DeviceGet = int (*)(int*, int);
  using CtxState = int (*)(int, unsigned int*, int*);
  static const std::pair<DeviceGet, CtxState> fns = []() {
    void* get = nullptr;
    void* state = nullptr;
    cudaDriverEntryPointQueryResult r1 = cudaDriverEntryPointSymbolNotFound;
    cudaDriverEntryPointQueryResult r2 = cudaDriverEntryPointSymbolNotFound;
    const bool ok = cudaGetDriverEntryPointByVersion("cuDeviceGet", &get, 12000, cudaEnableDefault, &r1) ==
                        cudaSuccess &&
                    cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &state, 12000, cudaEnableDefault,
                                                     &r2) == cudaSuccess &&
                    r1 == cudaDriverEntryPointSuccess && r2 == cudaDriverEntryPointSuccess;
    if (!ok) (void)cudaGetLastError();
    return ok ? std::make_pair(reinterpret_cast<DeviceGet>(get), reinterpret_cast<CtxState>(state))
              : std::make_pair(DeviceGet(nullptr), CtxState(nullptr));
  }();
  if (fns.first == nullptr || fns.second == nullptr) return true;  // cannot tell: behave as before
  int dev = 0;
  unsigned int flags = 0;
  int active = 0;
  if (fns.first(&dev, device) != 0 || fns.second(dev, &flags, &active) != 0) return true;
  return active != 0;
}

void restoreDevice(int previous) {
  if (previous < 0) return;
  int now = -1;
  if (cudaGetDevice(&now) != cudaSuccess || now == previous) return;
  if (!primaryContextActive(previous)) return;  // Note [Do not create a context on GPU 0]
  if (cudaSetDevice(previous) != cudaSuccess) (void)cudaGetLastError();
}

DeviceGuard::DeviceGuard(int device) {
  RR_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) RR_CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() { restoreDevice(previous_); }

std::string NcclComm::newUniqueId() {
  ncclUniqueId id;
  RR_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

int NcclComm::runtimeVersion() {
  int v = 0;
  RR_NCCL_CHECK(ncclGetVersion(&v));
  return v;
}

NcclComm::NcclComm(const std::string& unique_id, int nranks, int rank, int device,
                   std::chrono::milliseconds timeout, const std::string& name,
                   std::chrono::milliseconds connect_timeout)
    : nranks_(nranks),
      rank_(rank),
      device_(device),
      timeout_(timeout),
      connect_timeout_(connect_timeout.count() > 0 ? std::max(connect_timeout, timeout) : timeout),
      name_(name),
      queue_name_(name + " (queued)"),
      sent_to_(static_cast<size_t>(nranks > 0 ? nranks : 0), false),
      received_from_(static_cast<size_t>(nranks > 0 ? nranks : 0), false) {
  RR_CHECK(unique_id.size() == sizeof(ncclUniqueId::internal), kValue, "ringreduce: an NCCL unique id has ",
           sizeof(ncclUniqueId::internal), " bytes, got ", unique_id.size());
  RR_CHECK(nranks >= 1 && rank >= 0 && rank < nranks, kValue, "ringreduce: rank ", rank, " of ", nranks);
  RR_CHECK(timeout.count() > 0, kValue, "ringreduce: the NCCL timeout must be positive");
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.splitShare = 1;  // Note [Hand-off and queued exchanges]: the queued child shares connections
  config.commName = name_.c_str();
  DeviceGuard guard(device_);
  std::unique_lock<std::mutex> lock(mu_);
  const ncclResult_t r = ncclCommInitRankConfig(&comm_, nranks_, id, rank_, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    aborted_ = true;
    RR_THROW(kBackend, "ringreduce: ncclCommInitRankConfig for ", name_, " (rank ", rank_, " of ", nranks_,
             ", device ", device_, ") failed: ", describeNccl(r, nullptr));
  }
  const auto deadline = std::chrono::steady_clock::now() + connect_timeout_;
  waitReady(lock, r, "ncclCommInitRankConfig", deadline);
  // The blocking child of Note [Hand-off and queued exchanges]. Splitting a non-blocking parent is
  // itself non-blocking: the child handle is written once the parent's state leaves ncclInProgress.
  ncclConfig_t queued = NCCL_CONFIG_INITIALIZER;
  queued.blocking = 1;
  queued.commName = queue_name_.c_str();
  const ncclResult_t s = ncclCommSplit(comm_, /*color=*/0, /*key=*/rank_, &queue_, &queued);
  if (s != ncclSuccess && s != ncclInProgress) {
    const std::string msg = std::string("ncclCommSplit (the queued communicator) failed: ") + describeNccl(s, comm_);
    abortLocked(msg);
    RR_THROW(kBackend, "ringreduce: NCCL communicator ", name_, " (rank ", rank_, "): ", msg);
  }
  waitReady(lock, s, "ncclCommSplit", deadline);
  if (queue_ == nullptr) {
    abortLocked("ncclCommSplit returned no communicator");
    RR_THROW(kBackend, "ringreduce: NCCL communicator ", name_, " (rank ", rank_,
             "): ncclCommSplit returned no communicator");
  }
}

NcclComm::~NcclComm() {
  std::unique_lock<std::mutex> lock(mu_);
  abortLocked("the communicator was destroyed");
}

void NcclComm::waitReady(std::unique_lock<std::mutex>& lock, ncclResult_t first, const char* what,
                         std::chrono::steady_clock::time_point deadline) {
  ncclResult_t state = first;
  const auto busy_until = std::chrono::steady_clock::now() + kBusyPoll;
  const auto spin_until = std::chrono::steady_clock::now() + kSpinPoll;
  InterruptCheck interrupt;  // Note [Interrupting a host wait on CUDA]
  while (true) {
    if (aborted_) {
      RR_THROW(kBackend, "ringreduce: NCCL communicator ", name_, " was aborted during ", what, ": ",
               abort_reason_);
    }
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      const std::string msg = std::string(what) + " failed: " + describeNccl(state, comm_);
      abortLocked(msg);
      RR_THROW(kBackend, "ringreduce: NCCL communicator ", name_, " (rank ", rank_, "): ", msg);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      const std::string msg = std::string(what) + " did not complete within " +
                              std::to_string(timeout_.count()) + " ms (a peer did not join or died)";
      abortLocked(msg);
      RR_THROW(kBackend, "ringreduce: NCCL communicator ", name_, " (rank ", rank_, "): ", msg);
    }
    lock.unlock();
    const auto now = std::chrono::steady_clock::now();
    if (now < busy_until) {
      // busy poll: a yield can give the core away for a scheduler tick on a loaded host
    } else if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kPollInterval);
    }
    const bool interrupted = interrupt.requested();  // without mu_: it may wait for the GIL
    lock.lock();
    if (interrupted) {
      const std::string reason = interruptedReason(name_, what);
      abortLocked(reason);
      RR_THROW(kBackend, reason);
    }
    if (aborted_ || comm_ == nullptr) continue;  // reported at the top
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
    if (q != ncclSuccess) state = q;
  }
}

void NcclComm::sendRecv(const void* send, size_t send_bytes, int next, void* recv, size_t recv_bytes,
                        int prev, cudaStream_t stream) {
  const P2p ops[2] = {P2p{true, const_cast<void*>(send), send_bytes, next}, P2p{false, recv, recv_bytes, prev}};
  std::unique_lock<std::mutex> lock(mu_);
  launchLocked(lock, ops, 2, stream, /*hand_off=*/true);
}

void NcclComm::queueSendRecv(const void* send, size_t send_bytes, int next, void* recv, size_t recv_bytes,
                             int prev, cudaStream_t stream) {
  const P2p ops[2] = {P2p{true, const_cast<void*>(send), send_bytes, next}, P2p{false, recv, recv_bytes, prev}};
  std::unique_lock<std::mutex> lock(mu_);
  launchLocked(lock, ops, 2, stream, /*hand_off=*/false);
}

void NcclComm::group(const std::vector<P2p>& ops, cudaStream_t stream, bool hand_off) {
  std::unique_lock<std::mutex> lock(mu_);
  launchLocked(lock, ops.data(), ops.size(), stream, hand_off);
}

void NcclComm::launchLocked(std::unique_lock<std::mutex>& lock, const P2p* ops, size_t count, cudaStream_t stream,
                            bool hand_off) {
  checkUsableLocked();
  bool any = false;
  bool first_contact = false;
  for (size_t i = 0; i < count; ++i) {
    const P2p& o = ops[i];
    if (o.bytes == 0) continue;
    RR_CHECK(o.peer >= 0 && o.peer < nranks_, kRuntime, "ringreduce internal error: NCCL peer ", o.peer,
             " outside the communicator of ", nranks_, " ranks");
    const bool known = (o.send ? sent_to_ : received_from_)[static_cast<size_t>(o.peer)];
    first_contact = first_contact || !known;
    // Note [Hand-off and queued exchanges]: only a hand-off may make the first contact with a peer.
    RR_CHECK(hand_off || known, kRuntime, "ringreduce internal error: a queued NCCL ",
             o.send ? "send to" : "receive from", " rank ", o.peer, " before any hand-off reached it (", name_, ")");
    any = true;
  }
  if (!any) return;
  ncclComm_t comm = hand_off ? comm_ : queue_;
  // Bytes as ncclUint8: the element type does not matter to a copy, and both sides of each
  // pair agree on the byte count (Note [One ring, two transports, one plan]).
  ncclResult_t r = ncclGroupStart();
  for (size_t i = 0; i < count && r == ncclSuccess; ++i) {
    const P2p& o = ops[i];
    if (o.bytes == 0) continue;
    r = o.send ? ncclSend(o.buf, o.bytes, ncclUint8, o.peer, comm, stream)
               : ncclRecv(o.buf, o.bytes, ncclUint8, o.peer, comm, stream);
  }
  // Always close the group, even after a failure inside it, so that this thread's group depth is
  // balanced for the next call.
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = end;
  if (!hand_off) {
    // A blocking communicator's ncclGroupEnd returns once the kernel is enqueued (or failed).
    if (r != ncclSuccess) {
      const std::string msg =
          std::string("a queued ncclGroupEnd(ncclSend, ncclRecv) failed: ") + describeNccl(r, queue_);
      abortLocked(msg);
      RR_THROW(kBackend, "ringreduce: NCCL communicator ", name_, " (rank ", rank_, "): ", msg);
    }
    return;
  }
  // Note [Inside a user's NCCL group]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A non-blocking communicator's outermost ncclGroupEnd with tasks always returns ncclInProgress
  // (NCCL src/group.cc, ncclGroupEndInternal); a nested one only decrements the thread's group
  // depth and returns ncclSuccess without launching anything. So ncclSuccess here means the
  // caller's thread is inside its own ncclGroupStart (torch's _coalescing_manager,
  // batch_isend_irecv): our send/recv now belong to that group and run when it ends. Nothing may
  // be recorded after them as if they ran, and the communicator must not be aborted (the user's
  // ncclGroupEnd will still use it): refuse, and let CudaRing poison the ring. Every call's first
  // exchange is a hand-off (Note [Hand-off and queued exchanges]), so this is seen before any
  // queued exchange could join the user's group.
  if (end == ncclSuccess && r == ncclSuccess) {
    inside_user_group_ = true;
    RR_THROW(kRuntime, "ringreduce: a CUDA collective was called inside an NCCL group of this thread "
             "(ncclGroupStart; torch.distributed's _coalescing_manager or batch_isend_irecv); ringreduce "
             "cannot run there. Call it before or after the group. Group ", name_, " is unusable now.");
  }
  ++hand_offs_;
  waitReady(lock, r, "ncclGroupEnd(ncclSend, ncclRecv)",
            std::chrono::steady_clock::now() + (first_contact ? connect_timeout_ : timeout_));
  for (size_t i = 0; i < count; ++i) {
    const P2p& o = ops[i];
    if (o.bytes > 0) (o.send ? sent_to_ : received_from_)[static_cast<size_t>(o.peer)] = true;
  }
}

std::string NcclComm::pollError() {
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_ || comm_ == nullptr) return "";
  for (ncclComm_t c : {comm_, queue_}) {
    if (c == nullptr) continue;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(c, &state);
    if (q != ncclSuccess) return std::string("ncclCommGetAsyncError failed: ") + describeNccl(q, c);
    if (state != ncclSuccess && state != ncclInProgress)
      return std::string("asynchronous NCCL error: ") + describeNccl(state, c);
  }
  return "";
}

void NcclComm::abort(const std::string& reason) {
  std::unique_lock<std::mutex> lock(mu_);
  abortLocked(reason);
}

void NcclComm::abortLocked(const std::string& reason) {
  if (aborted_.exchange(true)) return;
  abort_reason_ = reason;
  if (comm_ == nullptr && queue_ == nullptr) return;
  // The device must be current for NCCL's teardown. Errors cannot be reported to anyone useful
  // here (this also runs on the watchdog thread and in the destructor): the communicators are gone
  // either way and every later use reports abort_reason_. Parent first, then the child (Note
  // [Hand-off and queued exchanges]).
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device_) (void)cudaSetDevice(device_);
  if (comm_ != nullptr) (void)ncclCommAbort(comm_);
  if (queue_ != nullptr) (void)ncclCommAbort(queue_);
  comm_ = nullptr;
  queue_ = nullptr;
  restoreDevice(previous);
}

std::string NcclComm::abortReason() const {
  std::unique_lock<std::mutex> lock(mu_);
  return abort_reason_;
}

void NcclComm::checkUsable() const {
  std::unique_lock<std::mutex> lock(mu_);
  checkUsableLocked();
}

void NcclComm::checkUsableLocked() const {
  if (aborted_) {
    RR_THROW(kBackend, "ringreduce: NCCL communicator ", name_, " (rank ", rank_, " of ", nranks_,
             ") is unusable after an earlier failure: ", abort_reason_,
             ". Create a new process group to continue.");
  }
}

}  // namespace rr
