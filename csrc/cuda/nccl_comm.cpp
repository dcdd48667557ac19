#include "nccl_comm.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>
#include <utility>

#include "cuda_check.h"
#include "host_interrupt.h"

namespace rr {

namespace {
constexpr auto kPollInterval = std::chrono::microseconds(50);
// Note [Non-blocking NCCL and abort]: poll busily first, then yielding, then sleeping.
constexpr auto kBusyPoll = std::chrono::microseconds(200);
constexpr auto kSpinPoll = std::chrono::microseconds(2000);

std::string describeNccl(ncclResult_t r, ncclComm_t comm) {
  const std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  return last != nullptr && last[0] != '\0' ? s + " (" + last + ")" : s;
}
// NCCL's reading of an integer variable (src/misc/param.cc ncclLoadParam): strtoll, base 0; unset,
// empty or out of range: not set.
bool ncclIntVar(const char* value, long long* out) {
  if (value == nullptr || value[0] == '\0') return false;
  errno = 0;
  const long long v = std::strtoll(value, nullptr, 0);
  if (errno != 0) return false;
  *out = v;
  return true;
}

// Once per process and message, on stderr (Note [NCCL versions, environment and the simplest path]).
void announce(const std::string& message) {
  static std::mutex* mu = new std::mutex;
  static std::set<std::string>* said = new std::set<std::string>;
  std::lock_guard<std::mutex> lock(*mu);
  if (!said->insert(message).second) return;
  std::fprintf(stderr, "[ringreduce] warning: %s\n", message.c_str());
}

// Stops NCCL communicators, one list per lane (Note [Stopping every lane at once]): in one group
// when `grouped`, else one thread per lane; within a lane in order (parent, then child).
void stopHandles(int device, const std::vector<std::vector<ncclComm_t>>& lanes, bool grouped) {
  size_t count = 0;
  for (const auto& l : lanes) count += l.size();
  if (count == 0) return;
  // NCCL's teardown needs the device. Errors are ignored (watchdog thread, destructors): the
  // communicators are gone either way and every later use reports the abort reason.
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device) (void)cudaSetDevice(device);
  if (grouped) {
    (void)ncclGroupStart();
    for (const auto& l : lanes)
      for (ncclComm_t h : l) (void)ncclCommAbort(h);
    (void)ncclGroupEnd();
  } else {
    std::vector<std::thread> others;
    for (size_t k = 1; k < lanes.size(); ++k) {
      if (lanes[k].empty()) continue;
      others.emplace_back([device, &l = lanes[k]] {
        (void)cudaSetDevice(device);
        for (ncclComm_t h : l) (void)ncclCommAbort(h);
      });
    }
    for (ncclComm_t h : lanes[0]) (void)ncclCommAbort(h);
    for (std::thread& t : others) t.join();
  }
  restoreDevice(previous);
}
}  // namespace

std::string ncclVersionString(int code) {
  // NCCL_VERSION(X, Y, Z): X*10000 + Y*100 + Z since 2.9, X*1000 + Y*100 + Z before.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

NcclSetup ncclSetupFor(int version, const std::function<const char*(const char*)>& env) {
  NcclSetup s;
  s.version = version;
  s.launcher = version < 22300;
  s.group_abort = version >= 22400;
  const std::string nccl = "NCCL " + ncclVersionString(version);
  const auto simple = [&s](const std::string& why) {
    s.why_simple += (s.simple ? "; " : "") + why;
    s.simple = true;
  };
  if (s.launcher) {
    simple(nccl + " is older than 2.23 (its non-blocking groups launch inline); upgrade torch or the "
           "nvidia-nccl wheel to NCCL >= 2.23 for the full path");
  }
  long long v = 0;
  const char* blocking = env("NCCL_COMM_BLOCKING");
  if (ncclIntVar(blocking, &v)) {
    RR_CHECK(v != 1, kValue, "ringreduce: NCCL_COMM_BLOCKING=", blocking, " is set, and ", nccl,
             " applies it over every communicator's config: ringreduce's communicator would block in init, "
             "connections and launches without a deadline, so a dead peer would hang the process. Unset "
             "NCCL_COMM_BLOCKING in the processes that run ringreduce on GPUs (torch's NCCL backend has its own "
             "switch, TORCH_NCCL_USE_COMM_NONBLOCKING).");
    if (v == 0) simple("NCCL_COMM_BLOCKING=" + std::string(blocking) + " makes the queued child communicator "
                       "non-blocking; unset it for the full path");
  }
  const char* share = env("NCCL_COMM_SPLIT_SHARE_RESOURCES");
  if (ncclIntVar(share, &v) && v != 1) {
    simple("NCCL_COMM_SPLIT_SHARE_RESOURCES=" + std::string(share) + " keeps the queued child communicator "
           "from sharing its parent's connections and abort flag; unset it for the full path");
  }
  for (const char* name : {"NCCL_WORK_ARGS_BYTES", "NCCL_WORK_FIFO_BYTES"}) {
    const char* value = env(name);
    if (value == nullptr || value[0] == '\0') continue;
    s.warnings.push_back(std::string(name) + "=" + value + " is set: with " + nccl + " a launch whose work does "
                         "not fit the kernel arguments waits for NCCL's work FIFO without looking at the abort "
                         "flag, so a dead peer may hang ringreduce instead of raising DistBackendError; unset it");
  }
  const char* knob = env("RINGREDUCE_NCCL_SIMPLE");
  if (knob != nullptr && knob[0] != '\0') {
    const std::string k = knob;
    RR_CHECK(k == "0" || k == "1", kValue, "ringreduce: RINGREDUCE_NCCL_SIMPLE=", k,
             " must be 0 (the full GPU path where NCCL allows it) or 1 (the simplest path)");
    if (k == "1") simple("RINGREDUCE_NCCL_SIMPLE=1 asks for it");
  }
  return s;
}

// Note [Do not create a context on GPU 0] (nccl_comm.h).
static bool primaryContextActive(int device) {
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
  // Note [NCCL versions, environment and the simplest path]: before anything is created.
  setup_ = ncclSetupFor(runtimeVersion(), [](const char* name) { return std::getenv(name); });
  for (const std::string& w : setup_.warnings) announce("ringreduce: " + w);
  if (setup_.simple) {
    const std::string nccl = "NCCL " + ncclVersionString(setup_.version);
    const bool named = setup_.why_simple.find(nccl) != std::string::npos;
    announce("ringreduce: " + setup_.why_simple + (named ? "" : " (" + nccl + ")") +
             ". ringreduce's GPU communicators take the simplest path: one lane, no one-shot, every exchange "
             "handed off and waited on one non-blocking communicator (correct, slower; RINGREDUCE_NCCL_SIMPLE=1 "
             "forces it)");
  }
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
  if (setup_.simple) return;  // no child: every exchange is a hand-off
  // The blocking child of Note [Hand-off and queued exchanges].
  ncclConfig_t queued = NCCL_CONFIG_INITIALIZER;
  queued.blocking = 1;
  queued.commName = queue_name_.c_str();
  // A failed split names the way around it.
  const std::string simpler = ". The simplest GPU path runs without this child: set RINGREDUCE_NCCL_SIMPLE=1 on "
                              "every rank (NCCL " + ncclVersionString(setup_.version) + ")";
  const ncclResult_t s = ncclCommSplit(comm_, /*color=*/0, /*key=*/rank_, &queue_, &queued);
  if (s != ncclSuccess && s != ncclInProgress) {
    failLocked(std::string("ncclCommSplit (the queued communicator) failed: ") + describeNccl(s, comm_), simpler);
  }
  // Whatever the split returned, the child is made in the background (src/init.cc): NCCL may return
  // ncclSuccess, keep the parent's state ncclInProgress until the child is done and only then write
  // the handle. So the wait is on the parent's state, then on the handle itself.
  waitReady(lock, ncclInProgress, "ncclCommSplit", deadline);
  while (__atomic_load_n(&queue_, __ATOMIC_ACQUIRE) == nullptr && std::chrono::steady_clock::now() < deadline) {
    lock.unlock();
    std::this_thread::sleep_for(kPollInterval);
    lock.lock();
  }
  if (queue_ == nullptr) failLocked("ncclCommSplit returned no communicator", simpler);
}

NcclComm::~NcclComm() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    defer_abort_ = false;  // whatever the ring did, the handles stop now
    abortLocked("the communicator was destroyed");
  }
  {
    std::lock_guard<std::mutex> lock(launch_mu_);
    launch_stop_ = true;
  }
  launch_cv_.notify_all();
  if (launcher_.joinable()) launcher_.join();
}

ncclResult_t NcclComm::onLauncher(const std::function<ncclResult_t()>& fn) {
  std::unique_lock<std::mutex> lock(launch_mu_);
  if (!launcher_.joinable()) {
    launcher_ = std::thread([this] {
      (void)cudaSetDevice(device_);
      std::unique_lock<std::mutex> l(launch_mu_);
      while (true) {
        launch_cv_.wait(l, [this] { return launch_stop_ || static_cast<bool>(launch_job_); });
        if (!launch_job_) return;  // stopped, nothing pending
        std::function<ncclResult_t()> job = std::move(launch_job_);
        launch_job_ = nullptr;
        l.unlock();
        const ncclResult_t r = job();
        l.lock();
        launch_result_ = r;
        launch_done_ = true;
        launch_cv_.notify_all();
      }
    });
  }
  launch_job_ = fn;
  launch_done_ = false;
  launch_cv_.notify_all();
  launch_cv_.wait(lock, [this] { return launch_done_; });
  return launch_result_;
}

std::pair<ncclResult_t, ncclResult_t> NcclComm::issueGroup(ncclComm_t comm, const PeerOp* ops, size_t count,
                                                            cudaStream_t stream) {
  ncclResult_t r = ncclSuccess;
  ncclResult_t end = ncclSuccess;
  const auto issue = [&]() {
    // Bytes as ncclUint8: both sides of each pair agree on the byte count (Note [One ring, two
    // transports, one plan]).
    r = ncclGroupStart();
    for (size_t i = 0; i < count && r == ncclSuccess; ++i) {
      const PeerOp& o = ops[i];
      if (o.bytes == 0) continue;
      r = o.send ? ncclSend(o.buf, o.bytes, ncclUint8, o.peer, comm, stream)
                 : ncclRecv(o.buf, o.bytes, ncclUint8, o.peer, comm, stream);
    }
    // Close the group even after a failure, so that the thread's group depth stays balanced.
    end = ncclGroupEnd();
    return end;
  };
  if (setup_.launcher) {
    (void)onLauncher(issue);
  } else {
    (void)issue();
  }
  return {r, end};
}

void NcclComm::waitReady(std::unique_lock<std::mutex>& lock, ncclResult_t first, const char* what,
                         std::chrono::steady_clock::time_point deadline) {
  ncclResult_t state = first;
  const auto busy_until = std::chrono::steady_clock::now() + kBusyPoll;
  const auto spin_until = std::chrono::steady_clock::now() + kSpinPoll;
  InterruptCheck interrupt;  // Note [Interrupting a host wait on CUDA]
  while (true) {
    RR_CHECK(!aborted_, kBackend, "ringreduce: NCCL communicator ", name_, " was aborted during ", what, ": ",
             abort_reason_);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) failLocked(std::string(what) + " failed: " + describeNccl(state, comm_));
    if (std::chrono::steady_clock::now() > deadline) {
      failLocked(std::string(what) + " did not complete within " + std::to_string(timeout_.count()) +
                 " ms (a peer did not join or died)");
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
                        int prev, cudaStream_t stream, bool hand_off) {
  const PeerOp ops[2] = {PeerOp{true, const_cast<void*>(send), send_bytes, next},
                         PeerOp{false, recv, recv_bytes, prev}};
  std::unique_lock<std::mutex> lock(mu_);
  launchLocked(lock, ops, 2, stream, hand_off);
}

void NcclComm::group(const std::vector<PeerOp>& ops, cudaStream_t stream, bool hand_off) {
  std::unique_lock<std::mutex> lock(mu_);
  launchLocked(lock, ops.data(), ops.size(), stream, hand_off);
}

void NcclComm::launchLocked(std::unique_lock<std::mutex>& lock, const PeerOp* ops, size_t count, cudaStream_t stream,
                            bool hand_off) {
  checkUsableLocked();
  if (setup_.simple) hand_off = true;  // no child (Note [NCCL versions, environment and the simplest path])
  bool any = false;
  bool first_contact = false;
  for (size_t i = 0; i < count; ++i) {
    const PeerOp& o = ops[i];
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
  auto [r, end] = issueGroup(comm, ops, count, stream);
  if (r == ncclSuccess || r == ncclInProgress) r = end;
  if (!hand_off) {
    // A blocking communicator's ncclGroupEnd returns once the kernel is enqueued (or failed).
    if (r != ncclSuccess) {
      failLocked(std::string("a queued ncclGroupEnd(ncclSend, ncclRecv) failed: ") + describeNccl(r, queue_));
    }
    return;
  }
  // Note [Inside a user's NCCL group]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A non-blocking communicator's outermost ncclGroupEnd with tasks returns ncclInProgress, a nested
  // one ncclSuccess without launching (src/group.cc): then the caller's thread is inside its own
  // ncclGroupStart (torch's _coalescing_manager, batch_isend_irecv), nothing may be recorded after
  // our send/recv as if they ran, and an abort would free a communicator the user's ncclGroupEnd
  // still uses. So refuse, and CudaRing poisons the ring; a call's first exchange is a hand-off, so
  // this is seen before any queued one. The launcher thread (NCCL < 2.23) has no group open.
  if (!setup_.launcher && end == ncclSuccess && r == ncclSuccess) {
    inside_user_group_ = true;
    RR_THROW(kRuntime, "ringreduce: a CUDA collective was called inside an NCCL group of this thread "
             "(ncclGroupStart; torch.distributed's _coalescing_manager or batch_isend_irecv); ringreduce "
             "cannot run there. Call it before or after the group. Group ", name_, " is unusable now.");
  }
  ++hand_offs_;
  waitReady(lock, r, "ncclGroupEnd(ncclSend, ncclRecv)",
            std::chrono::steady_clock::now() + (first_contact ? connect_timeout_ : timeout_));
  for (size_t i = 0; i < count; ++i) {
    const PeerOp& o = ops[i];
    if (o.bytes > 0) (o.send ? sent_to_ : received_from_)[static_cast<size_t>(o.peer)] = true;
  }
}

std::string NcclComm::pollError() {
  std::unique_lock<std::mutex> lock(mu_);
  // Aborted but not yet stopped (Note [Stopping every lane at once]): the ring must stop its lanes.
  if (aborted_) return comm_ != nullptr || queue_ != nullptr ? abort_reason_ : "";
  if (comm_ == nullptr) return "";
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
  if (defer_abort_) {  // Note [Stopping every lane at once]: the ring stops every lane together
    if (!aborted_.exchange(true)) abort_reason_ = reason;
    return;
  }
  std::vector<std::vector<ncclComm_t>> handles(1);
  releaseHandlesLocked(reason, &handles[0]);
  stopHandles(device_, handles, setup_.group_abort);
}

void NcclComm::failLocked(const std::string& msg, const std::string& hint) {
  abortLocked(msg);
  RR_THROW(kBackend, "ringreduce: NCCL communicator ", name_, " (rank ", rank_, "): ", msg, hint);
}

void NcclComm::releaseHandlesLocked(const std::string& reason, std::vector<ncclComm_t>* out) {
  if (!aborted_.exchange(true)) abort_reason_ = reason;
  // Parent first, then the child (Note [Hand-off and queued exchanges]).
  if (comm_ != nullptr) out->push_back(comm_);
  if (queue_ != nullptr) out->push_back(queue_);
  comm_ = nullptr;
  queue_ = nullptr;
}

void NcclComm::deferAbortToRing() {
  std::unique_lock<std::mutex> lock(mu_);
  defer_abort_ = true;
}

void NcclComm::abortTogether(const std::vector<NcclComm*>& comms, const std::string& reason) {
  // Every lock in lane order (no other code holds two), then every flag before any cleanup.
  std::vector<std::unique_lock<std::mutex>> locks;
  std::vector<std::vector<ncclComm_t>> handles;
  bool grouped = true;
  int device = -1;
  for (NcclComm* c : comms) {
    if (c == nullptr) continue;
    locks.emplace_back(c->mu_);
    handles.emplace_back();
    c->releaseHandlesLocked(reason, &handles.back());
    grouped = grouped && c->setup_.group_abort;
    device = c->device_;
  }
  if (device >= 0) stopHandles(device, handles, grouped);
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
  RR_CHECK(!aborted_, kBackend, "ringreduce: NCCL communicator ", name_, " (rank ", rank_, " of ", nranks_,
           ") is unusable after an earlier failure: ", abort_reason_, ". Create a new process group to continue.");
}

}  // namespace rr
