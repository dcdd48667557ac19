#include "c10d_transport.h"

#include <ATen/ATen.h>

#include <mutex>
#include <vector>

#include "../core/error.h"

namespace rr {

namespace {

// Note [Releasing a ring's buffers] (group_runtime.h): a Work that something besides this transport
// still holds when it closes keeps its gloo buffer posted; it is moved here and never destroyed.
std::mutex g_graveyard_mu;
std::vector<c10::intrusive_ptr<c10d::Work>>* g_graveyard = new std::vector<c10::intrusive_ptr<c10d::Work>>();  // leaked

std::string firstLine(const char* what) {
  std::string s(what);
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// `bytes` bytes at `data` as a uint8 tensor, the form c10d's send/recv take.
at::Tensor byteTensor(void* data, size_t bytes) {
  return at::from_blob(data, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
}

}  // namespace

C10dTransport::C10dTransport(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size, std::string group)
    : backend_(std::move(backend)), rank_(rank), size_(size), group_(std::move(group)) {
  timeout_ = defaultTimeout();
}

C10dTransport::~C10dTransport() {
  // Requests still pending (the next call's frame receives, a failed call's) are released as by close().
  close();
}

std::chrono::milliseconds C10dTransport::defaultTimeout() const {
  try {
    return backend_->getBackendOptions()->timeout;
  } catch (const std::exception&) {
    return std::chrono::minutes(30);
  }
}

template <typename F>
int64_t C10dTransport::post(F&& f, const char* verb, int peer) {
  std::lock_guard<std::mutex> g(mu_);
  RR_CHECK(interrupted_.empty(), kBackend, interrupted_);
  RR_CHECK(!closed_, kRuntime, "ringreduce internal error: a ", verb, " rank ", peer, " on ", group_,
           " after its transport was closed");
  Request r;
  try {
    r.work = f();
  } catch (const std::exception& e) {
    RR_THROW(kBackend, "ringreduce: could not post a ", verb, " rank ", peer, " on ", group_, ": ", firstLine(e.what()));
  }
  const int64_t id = next_id_++;
  requests_.emplace(id, std::move(r));
  return id;
}

int64_t C10dTransport::isend(const void* data, size_t bytes, int peer, int tag) {
  std::vector<at::Tensor> t{byteTensor(const_cast<void*>(data), bytes)};
  return post([&] { return backend_->send(t, peer, tag); }, "send to", peer);
}

int64_t C10dTransport::irecv(void* data, size_t bytes, int peer, int tag) {
  std::vector<at::Tensor> t{byteTensor(data, bytes)};
  return post([&] { return backend_->recv(t, peer, tag); }, "receive from", peer);
}

// Note [Interrupting a wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Ctrl-C on a rank whose call waits for a silent peer (ringreduce/_interrupt.py): the waiting Python
// thread gives up and runs interrupt(), which aborts every pending gloo request (Work::abort wakes
// gloo's waitRecv/waitSend) and remembers why, so the worker's wait() throws instead of blocking
// until the timeout; the runtime then poisons the group. Later waits and posts throw at once.
void C10dTransport::wait(int64_t request) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = requests_.find(request);
    RR_CHECK(it != requests_.end(), kRuntime, "ringreduce internal error: unknown transport request ", request);
    if (it->second.waited) return;
    RR_CHECK(interrupted_.empty(), kBackend, interrupted_);
    work = it->second.work;
  }
  bool completed = false;
  try {
    completed = work->wait(timeout_);
  } catch (const std::exception& e) {
    RR_THROW(kBackend, "ringreduce: point-to-point transfer on ", group_, " failed (rank ", rank_, ", timeout ",
             timeout_.count(), " ms): ", firstLine(e.what()));
  }
  std::lock_guard<std::mutex> g(mu_);
  RR_CHECK(completed && interrupted_.empty(), kBackend,
           interrupted_.empty() ? std::string("ringreduce: a transfer on ") + group_ + " was aborted" : interrupted_);
  // Note [Works live until the call ends]: the Work (and gloo's buffer in it) is kept until
  // callDone(): destroying it right after its wait spins (sched_yield) until gloo's I/O thread has
  // finished the read that completed the wait.
  auto it = requests_.find(request);
  if (it != requests_.end()) it->second.waited = true;
}

void C10dTransport::callDone() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = requests_.begin(); it != requests_.end();) it = it->second.waited ? requests_.erase(it) : std::next(it);
}

void C10dTransport::abandon() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& kv : requests_)
    if (!kv.second.waited && kv.second.work) abandoned_.push_back(std::move(kv.second.work));
  requests_.clear();
}

// Note [Releasing a ring's buffers] (group_runtime.h): gloo posts a receive as a weak reference to its
// UnboundBuffer, which the Work owns; the UnboundBuffer's destructor waits for a read in progress
// into it and leaves every later message for it unread (gloo/common/memory.h, "If upon destruction
// there are pending operations ..."). So once the last reference to each Work is dropped here, no
// message can land in the memory its receive was posted on.
bool C10dTransport::close() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return released_;
    closed_ = true;
    for (auto& kv : requests_)
      if (kv.second.work) works.push_back(std::move(kv.second.work));
    requests_.clear();
    for (auto& w : abandoned_) works.push_back(std::move(w));
    abandoned_.clear();
  }
  bool released = true;
  for (auto& w : works) {
    if (w.use_count() == 1) {
      w.reset();  // outside mu_: the UnboundBuffer's destructor may wait for gloo's I/O thread
      continue;
    }
    released = false;  // held elsewhere too: its receive may stay posted
    std::lock_guard<std::mutex> g(g_graveyard_mu);
    g_graveyard->push_back(std::move(w));
  }
  std::lock_guard<std::mutex> g(mu_);
  released_ = released;
  return released;
}

void C10dTransport::interrupt(const std::string& reason) {
  std::lock_guard<std::mutex> g(mu_);
  if (!interrupted_.empty()) return;
  interrupted_ = reason.empty() ? std::string("ringreduce: ") + group_ + " was interrupted" : reason;
  for (auto& kv : requests_) {
    if (kv.second.waited || !kv.second.work) continue;
    try {
      kv.second.work->abort();
    } catch (const std::exception&) {
      // a backend without abort: the wait ends at the timeout instead
    }
  }
}

}  // namespace rr
