// ringreduce tests: the fake CUDA runtime and NCCL of fake_cuda.h (Note [Fake CUDA runtime]).
#include "fake_cuda.h"

#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <tuple>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

struct CUevent_st {
  uint64_t enqueued = 0;  // generation of the latest enqueued record (0: never recorded)
  uint64_t fired = 0;
};

struct ncclComm {
  bool aborted = false;
  // The abort flag NCCL shares between a parent and its split-shared children: set by the abort
  // of any of them, it lets the kernels of all of them exit.
  std::shared_ptr<bool> shared_abort = std::make_shared<bool>(false);
  bool blocking = false;
  int level = 0;  // 0: created by ncclCommInitRankConfig; 1: by ncclCommSplit
  uint64_t id = 0;  // the unique id it was created from (its children inherit it)
  // Linked communicators (rrfake::linkRanks) move their messages; the others only pass time.
  bool linked = false;
  uint64_t world = 0;
  int rank = 0;
  std::chrono::steady_clock::time_point ready_at;
  bool never_ready = false;
  // A split of this (non-blocking) communicator still in progress: the child, and where its handle
  // goes once the parent's state leaves ncclInProgress.
  ncclComm* split_child = nullptr;
  ncclComm** split_out = nullptr;
  // (send?, peer) connected so far; shared with split-shared children as NCCL's connectors are.
  std::shared_ptr<std::set<std::pair<bool, int>>> connected = std::make_shared<std::set<std::pair<bool, int>>>();
};

namespace {

using Clock = std::chrono::steady_clock;

// One ncclSend or ncclRecv of a group.
struct FakeTask {
  bool is_send = false;
  const void* src = nullptr;
  void* dst = nullptr;
  size_t bytes = 0;
  int peer = 0;
};

struct FakeOp {
  enum Kind { kRecord, kWait, kExchange, kCopy } kind;
  std::vector<FakeTask> tasks;  // kExchange on a linked communicator
  bool sent = false;            // its sends are in the mailboxes
  CUevent_st* event = nullptr;
  uint64_t gen = 0;
  ncclComm* comm = nullptr;
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

struct FakeStream {
  std::deque<FakeOp> q;
  bool destroyed = false;
  bool capturing = false;
};

struct State {
  std::mutex mu;
  uint64_t gen = 0;
  std::vector<std::unique_ptr<FakeStream>> streams;
  int budget = -1;
  bool abort_releases = true;
  int abort_sleep_ms = 0;
  int init_ms = 0;
  int default_handoff_ms = 0;
  std::deque<int> handoffs;
  bool global_capture = false;
  bool capture_invalidated = false;
  bool ctx[64] = {};
  int streams_destroyed = 0;
  int sync_timeouts = 0;
  int abort_calls = 0;
  int exchanges_run = 0;
  int task_calls = 0;
  bool link = false;    // communicators created now are linked
  uint64_t world = 1;   // of the linked communicators created now
  int size_mismatches = 0;
  // Messages of linked communicators by (world, unique id, level, src, dst), in sending order: NCCL
  // matches point-to-point messages per communicator, so a parent's message never meets a child's
  // receive, nor one lane's another's.
  std::map<std::tuple<uint64_t, uint64_t, int, int, int>, std::deque<std::vector<char>>> mail;
  int host_waits = 0;     // ncclInProgress handed to the caller, stream/event synchronizations
  int queued_groups = 0;  // blocking ncclGroupEnd calls that enqueued an exchange
  int fail_queued_at = -1;  // the queued group end (0-based) that fails, -1: none
  int version = NCCL_VERSION_CODE;  // what ncclGetVersion reports, and the behaviour modelled
  bool abort_waits = false;         // ncclCommAbort waits for its communicator's kernels
  int abort_hangs = 0;
  int grouped_aborts = 0;
  int splits = 0;
  bool fail_split = false;
  // Kept reachable (leak checkers): device memory a test leaves allocated on purpose (undrained
  // streams) and aborted communicators, which queued exchange ops may still point at.
  std::vector<void*> allocations;
  std::vector<std::unique_ptr<ncclComm>> comms;
  // Events are never freed: CUDA allows destroying an event whose record is still queued.
  std::vector<std::unique_ptr<CUevent_st>> events;
};

State& st() {
  static State* s = new State;
  return *s;
}

thread_local int t_device = 0;
thread_local cudaError_t t_last = cudaSuccess;
thread_local cudaStreamCaptureMode t_mode = cudaStreamCaptureModeGlobal;
thread_local int t_group_depth = 0;
struct ThreadTask {
  ncclComm* comm;
  cudaStream_t stream;
  FakeTask task;
};
thread_local std::vector<ThreadTask> t_tasks;
thread_local std::vector<ncclComm*> t_aborts;  // ncclCommAbort inside a group (NCCL >= 2.24)

FakeStream* fs(cudaStream_t s) { return reinterpret_cast<FakeStream*>(s); }

cudaError_t fail(cudaError_t e) {
  t_last = e;
  return e;
}

bool canRun(const State& g, const FakeOp& op) {
  switch (op.kind) {
    case FakeOp::kWait: return op.event->fired >= op.gen;
    case FakeOp::kExchange: return (*op.comm->shared_abort && g.abort_releases) || g.budget != 0;
    default: return true;
  }
}

// A linked exchange at the front of its stream: its sends go to the mailboxes the first time it
// gets there (eager, as NCCL's small messages are); it completes once every receive has its
// message. Returns whether it completed; sets *progress when it changed anything.
bool runLinkedExchange(State& g, FakeOp& op, bool* progress) {
  const ncclComm& c = *op.comm;
  if (!op.sent) {
    for (const FakeTask& t : op.tasks) {
      if (!t.is_send) continue;
      const char* src = static_cast<const char*>(t.src);
      g.mail[std::make_tuple(c.world, c.id, c.level, c.rank, t.peer)].emplace_back(src, src + t.bytes);
    }
    op.sent = true;
    *progress = true;
  }
  std::map<int, size_t> wanted;
  for (const FakeTask& t : op.tasks)
    if (!t.is_send) ++wanted[t.peer];
  for (const auto& w : wanted) {
    auto it = g.mail.find(std::make_tuple(c.world, c.id, c.level, w.first, c.rank));
    if (it == g.mail.end() || it->second.size() < w.second) return false;
  }
  for (const FakeTask& t : op.tasks) {
    if (t.is_send) continue;
    auto& box = g.mail[std::make_tuple(c.world, c.id, c.level, t.peer, c.rank)];
    const std::vector<char>& m = box.front();
    if (m.size() != t.bytes) ++g.size_mismatches;
    std::memcpy(t.dst, m.data(), std::min(m.size(), t.bytes));
    box.pop_front();
  }
  return true;
}

// Runs every op that can run (caller holds mu).
void pump(State& g) {
  bool progress = true;
  while (progress) {
    progress = false;
    for (auto& sp : g.streams) {
      FakeStream& s = *sp;
      while (!s.q.empty() && canRun(g, s.q.front())) {
        FakeOp& front = s.q.front();
        if (front.kind == FakeOp::kExchange && front.comm->linked && !(*front.comm->shared_abort && g.abort_releases) &&
            !runLinkedExchange(g, front, &progress)) {
          break;  // waits for a peer's message
        }
        FakeOp op = s.q.front();
        s.q.pop_front();
        progress = true;
        if (op.kind == FakeOp::kRecord) {
          if (op.event->fired < op.gen) op.event->fired = op.gen;
        } else if (op.kind == FakeOp::kExchange) {
          if (!(*op.comm->shared_abort && g.abort_releases) && g.budget > 0) --g.budget;
          ++g.exchanges_run;
        } else if (op.kind == FakeOp::kCopy && op.bytes > 0) {
          std::memmove(op.dst, op.src, op.bytes);
        }
      }
    }
  }
}

// NCCL's abort (src/init.cc commReclaim -> commDestroySync) synchronizes the communicator's device
// stream, which NCCL moved past its last kernel: it waits for every kernel the communicator (or a
// split-shared sharer) launched, and for whatever those wait for. Modelled when abort_waits: until
// no exchange of the communicator's family is left on any stream; after 2 s (a GPU would wait for
// ever) it gives up and counts a hang.
void waitForKernels(const ncclComm* comm) {
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  while (true) {
    {
      std::lock_guard<std::mutex> lock(st().mu);
      State& g = st();
      if (!g.abort_waits) return;
      pump(g);
      bool pending = false;
      for (const auto& sp : g.streams)
        for (const FakeOp& op : sp->q)
          pending = pending || (op.kind == FakeOp::kExchange && op.comm->shared_abort == comm->shared_abort);
      if (!pending) return;
      if (Clock::now() > deadline) {
        ++g.abort_hangs;
        return;
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void touchContext() { st().ctx[t_device] = true; }

using CUresultFake = int;
CUresultFake fakeDeviceGet(int* dev, int ordinal) {
  *dev = ordinal;
  return 0;
}
CUresultFake fakePrimaryCtxGetState(int dev, unsigned int* flags, int* active) {
  std::lock_guard<std::mutex> lock(st().mu);
  *flags = 0;
  *active = st().ctx[dev] ? 1 : 0;
  return 0;
}

}  // namespace

namespace rrfake {

void reset() {
  State& g = st();
  std::lock_guard<std::mutex> lock(g.mu);
  g.budget = -1;
  g.abort_releases = true;
  g.abort_sleep_ms = 0;
  g.init_ms = 0;
  g.default_handoff_ms = 0;
  g.handoffs.clear();
  g.global_capture = false;
  g.capture_invalidated = false;
  for (bool& c : g.ctx) c = false;
  g.streams_destroyed = g.sync_timeouts = g.abort_calls = g.exchanges_run = g.task_calls = 0;
  g.host_waits = g.queued_groups = 0;
  g.fail_queued_at = -1;
  g.version = NCCL_VERSION_CODE;
  g.abort_waits = false;
  g.abort_hangs = g.grouped_aborts = g.splits = 0;
  g.fail_split = false;
  g.link = false;
  ++g.world;
  g.size_mismatches = 0;
  g.mail.clear();
  for (auto& s : g.streams) s->q.clear();  // what an earlier test left stuck
}
int liveAllocations() {
  std::lock_guard<std::mutex> lock(st().mu);
  return static_cast<int>(st().allocations.size());
}
void setExchangeBudget(int n) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().budget = n;
}
void allowExchanges(int n) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (st().budget >= 0) st().budget += n;
}
void setAbortReleases(bool on) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().abort_releases = on;
}
void setAbortSleepMs(int ms) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().abort_sleep_ms = ms;
}
void setInitMs(int ms) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().init_ms = ms;
}
void setDefaultHandoffMs(int ms) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().default_handoff_ms = ms;
}
void pushHandoffMs(int ms) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().handoffs.push_back(ms);
}
void setGlobalCapture(bool on) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().global_capture = on;
}
bool captureInvalidated() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().capture_invalidated;
}
void setStreamCapturing(cudaStream_t s, bool on) {
  std::lock_guard<std::mutex> lock(st().mu);
  fs(s)->capturing = on;
}
bool contextActive(int device) {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().ctx[device];
}
int streamsDestroyed() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().streams_destroyed;
}
int streamSyncTimeouts() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().sync_timeouts;
}
int abortCalls() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().abort_calls;
}
int exchangesRun() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().exchanges_run;
}
int ncclTaskCalls() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().task_calls;
}
void linkRanks() {
  std::lock_guard<std::mutex> lock(st().mu);
  st().link = true;
}
int sizeMismatches() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().size_mismatches;
}
int messagesLeft() {
  std::lock_guard<std::mutex> lock(st().mu);
  int n = 0;
  for (const auto& box : st().mail) n += static_cast<int>(box.second.size());
  return n;
}
int pairsUsed() {
  std::lock_guard<std::mutex> lock(st().mu);
  return static_cast<int>(st().mail.size());
}
int hostWaits() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().host_waits;
}
int queuedGroups() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().queued_groups;
}
void failQueuedGroupAt(int k) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().fail_queued_at = k;
}
void setNcclVersion(int code) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().version = code;
}
void setAbortWaitsForKernels(bool on) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().abort_waits = on;
}
int abortHangs() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().abort_hangs;
}
int groupedAborts() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().grouped_aborts;
}
void failSplits(bool on) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().fail_split = on;
}
int splits() {
  std::lock_guard<std::mutex> lock(st().mu);
  return st().splits;
}
bool streamValid(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(st().mu);
  return s != nullptr && !fs(s)->destroyed;
}

}  // namespace rrfake

// ---- CUDA runtime ------------------------------------------------------------------------------

extern "C" {

const char* cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorFake"; }
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    default: return "fake CUDA error";
  }
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = t_last;
  t_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return t_last; }
cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= 64) return fail(cudaErrorInvalidDevice);
  t_device = device;
  std::lock_guard<std::mutex> lock(st().mu);
  touchContext();
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  *fn = nullptr;
  if (std::strcmp(symbol, "cuDeviceGet") == 0) *fn = reinterpret_cast<void*>(&fakeDeviceGet);
  if (std::strcmp(symbol, "cuDevicePrimaryCtxGetState") == 0) *fn = reinterpret_cast<void*>(&fakePrimaryCtxGetState);
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  const cudaStreamCaptureMode old = t_mode;
  t_mode = *mode;
  *mode = old;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* lo, int* hi) {
  *lo = 0;
  *hi = -1;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int, int) {
  std::lock_guard<std::mutex> lock(st().mu);
  touchContext();
  st().streams.push_back(std::make_unique<FakeStream>());
  *s = reinterpret_cast<cudaStream_t>(st().streams.back().get());
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  return cudaStreamCreateWithPriority(s, flags, 0);
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithPriority(s, 0, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (s == nullptr || fs(s)->destroyed) return fail(cudaErrorInvalidResourceHandle);
  fs(s)->destroyed = true;
  ++st().streams_destroyed;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  std::lock_guard<std::mutex> lock(st().mu);
  *status = (s != nullptr && fs(s)->capturing) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (s == nullptr || fs(s)->destroyed) return fail(cudaErrorInvalidResourceHandle);
  pump(st());
  return fs(s)->q.empty() ? cudaSuccess : fail(cudaErrorNotReady);
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  {
    std::lock_guard<std::mutex> lock(st().mu);
    ++st().host_waits;
  }
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  while (true) {
    {
      std::lock_guard<std::mutex> lock(st().mu);
      if (s == nullptr || fs(s)->destroyed) return fail(cudaErrorInvalidResourceHandle);
      pump(st());
      if (fs(s)->q.empty()) return cudaSuccess;
      if (Clock::now() > deadline) {
        ++st().sync_timeouts;  // a real GPU would block here for ever
        return fail(cudaErrorUnknown);
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  std::lock_guard<std::mutex> lock(st().mu);
  touchContext();
  st().events.push_back(std::make_unique<CUevent_st>());
  *e = st().events.back().get();
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (s == nullptr || fs(s)->destroyed) return fail(cudaErrorInvalidResourceHandle);
  FakeOp op{FakeOp::kRecord};
  op.event = e;
  op.gen = e->enqueued = ++st().gen;
  fs(s)->q.push_back(op);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (st().global_capture && t_mode == cudaStreamCaptureModeGlobal) {
    st().capture_invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  pump(st());
  return e->fired >= e->enqueued ? cudaSuccess : fail(cudaErrorNotReady);
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (s == nullptr || fs(s)->destroyed) return fail(cudaErrorInvalidResourceHandle);
  FakeOp op{FakeOp::kWait};
  op.event = e;
  op.gen = e->enqueued;
  fs(s)->q.push_back(op);
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t bytes) {
  std::lock_guard<std::mutex> lock(st().mu);
  touchContext();
  *p = std::calloc(bytes ? bytes : 1, 1);
  st().allocations.push_back(*p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
cudaError_t cudaFree(void* p) {
  std::lock_guard<std::mutex> lock(st().mu);
  auto& a = st().allocations;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == p) {
      a[i] = a.back();
      a.pop_back();
      std::free(p);
      return cudaSuccess;
    }
  }
  return fail(cudaErrorInvalidValue);
}
cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (s == nullptr || fs(s)->destroyed) return fail(cudaErrorInvalidResourceHandle);
  FakeOp op{FakeOp::kCopy};
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  fs(s)->q.push_back(op);
  return cudaSuccess;
}

// ---- NCCL --------------------------------------------------------------------------------------

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 7, sizeof(id->internal));
  return ncclSuccess;
}
ncclResult_t ncclGetVersion(int* v) {
  std::lock_guard<std::mutex> lock(st().mu);
  *v = st().version;
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t r) { return r == ncclSuccess ? "no error" : "fake NCCL error"; }
const char* ncclGetLastError(ncclComm_t) { return ""; }
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int, ncclUniqueId id, int rank, ncclConfig_t* config) {
  std::lock_guard<std::mutex> lock(st().mu);
  touchContext();
  st().comms.push_back(std::make_unique<ncclComm>());
  *comm = st().comms.back().get();
  std::memcpy(&(*comm)->id, id.internal, sizeof(uint64_t));
  (*comm)->blocking = config != nullptr && config->blocking == 1;
  (*comm)->linked = st().link;
  (*comm)->world = st().world;
  (*comm)->rank = rank;
  (*comm)->ready_at = Clock::now() + std::chrono::milliseconds(st().init_ms);
  ++st().host_waits;
  return ncclInProgress;
}
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (comm == nullptr || newcomm == nullptr || color != 0) return ncclInvalidArgument;
  if (st().fail_split) return ncclInternalError;
  st().comms.push_back(std::make_unique<ncclComm>());
  ncclComm* child = st().comms.back().get();
  child->shared_abort = comm->shared_abort;  // the parent's config.splitShare = 1
  child->connected = comm->connected;
  ++st().splits;
  child->blocking = config != nullptr && config->blocking == 1;
  child->level = comm->level + 1;
  child->linked = comm->linked;
  child->world = comm->world;
  child->id = comm->id;
  child->rank = key;
  if (comm->blocking) {
    *newcomm = child;
    return ncclSuccess;
  }
  // A non-blocking parent, as NCCL 2.28.9 does it (src/init.cc ncclCommSplit): the call returns
  // ncclSuccess with the handle still NULL; the parent's state is ncclInProgress until the child is
  // made, and the handle is written just before that state turns ncclSuccess.
  *newcomm = nullptr;
  comm->split_child = child;
  comm->split_out = newcomm;
  comm->ready_at = Clock::now() + std::chrono::milliseconds(2);
  ++st().host_waits;
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  std::lock_guard<std::mutex> lock(st().mu);
  *state = (comm->never_ready || Clock::now() < comm->ready_at) ? ncclInProgress : ncclSuccess;
  if (*state == ncclSuccess && comm->split_out != nullptr) {
    *comm->split_out = comm->split_child;
    comm->split_out = nullptr;
    comm->split_child = nullptr;
  }
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  int sleep_ms = 0;
  {
    std::lock_guard<std::mutex> lock(st().mu);
    ++st().abort_calls;
    comm->aborted = true;
    *comm->shared_abort = true;  // the kernels of the communicator (and its sharers) exit: held exchanges pass
    pump(st());
    sleep_ms = st().abort_sleep_ms;
    if (t_group_depth > 0 && st().version >= 22400) {
      // NCCL >= 2.24: inside a group the flag is set now, the cleanup runs at the outer ncclGroupEnd.
      ++st().grouped_aborts;
      t_aborts.push_back(comm);
      return ncclSuccess;
    }
  }
  waitForKernels(comm);
  if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  // Kept in State::comms: exchange ops still queued may point at it.
  return ncclSuccess;
}
ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}
ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t, int peer, ncclComm_t comm, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(st().mu);
  ++st().task_calls;
  FakeTask t;
  t.is_send = true;
  t.src = buf;
  t.bytes = count;  // ringreduce sends ncclUint8
  t.peer = peer;
  t_tasks.push_back(ThreadTask{comm, s, t});
  return ncclSuccess;
}
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t, int peer, ncclComm_t comm, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(st().mu);
  ++st().task_calls;
  FakeTask t;
  t.dst = buf;
  t.bytes = count;
  t.peer = peer;
  t_tasks.push_back(ThreadTask{comm, s, t});
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0) return ncclInvalidUsage;
  if (--t_group_depth > 0) return ncclSuccess;  // nested: nothing is launched
  std::vector<ncclComm*> aborts;
  aborts.swap(t_aborts);
  for (ncclComm* c : aborts) waitForKernels(c);  // every flag was set before the first wait
  if (t_tasks.empty()) return ncclSuccess;
  std::lock_guard<std::mutex> lock(st().mu);
  State& g = st();
  ncclComm* comm = t_tasks.front().comm;
  cudaStream_t s = t_tasks.front().stream;
  for (const ThreadTask& t : t_tasks) {
    if (t.comm->blocking != comm->blocking) {  // NCCL: not allowed in one group
      t_tasks.clear();
      return ncclInvalidUsage;
    }
  }
  FakeOp op{FakeOp::kExchange};
  op.comm = comm;
  for (const ThreadTask& t : t_tasks) op.tasks.push_back(t.task);
  t_tasks.clear();
  if (comm->blocking) {
    // The launch happens in this call; there is no state to poll afterwards.
    if (g.queued_groups++ == g.fail_queued_at) return ncclSystemError;
    fs(s)->q.push_back(op);
    return ncclSuccess;
  }
  if (g.version < 22300) {
    // NCCL < 2.23 (src/group.cc of 2.21.5): without a connection to make, a non-blocking group
    // launches inline and returns ncclSuccess; only a first contact goes to a helper thread.
    bool known = true;
    for (const FakeTask& t : op.tasks) known = comm->connected->insert({t.is_send, t.peer}).second == false && known;
    if (known) {
      fs(s)->q.push_back(op);
      comm->never_ready = false;
      comm->ready_at = Clock::now();
      return ncclSuccess;
    }
  }
  fs(s)->q.push_back(op);
  ++g.host_waits;
  int ms = g.default_handoff_ms;
  if (!g.handoffs.empty()) {
    ms = g.handoffs.front();
    g.handoffs.pop_front();
  }
  comm->never_ready = ms < 0;
  comm->ready_at = Clock::now() + std::chrono::milliseconds(ms < 0 ? 0 : ms);
  return ncclInProgress;
}

}  // extern "C"

// ---- the reduce kernel's launcher ---------------------------------------------------------------

#include "../../../csrc/cuda/one_shot_kernels.cuh"
#include "../../../csrc/cuda/reduce_kernels.cuh"

namespace rr {
void launchReduce(const ReduceLaunch&, cudaStream_t) {}
void launchOneShotReduce(const OneShotLaunch&, cudaStream_t) {}
}  // namespace rr
