#include "cpu_group.h"

#include <c10/core/ScalarType.h>

#include <cstdlib>
#include <map>

#include "../core/plan.h"
#include "../core/transport.h"
#include "../cpu/ring_executor.h"

namespace rr {

namespace {

// Note [Failed calls keep their buffers]
// After a transport failure (dead peer, timeout) a receive may still be posted inside gloo. Its
// Work object and the memory it writes into are moved here and never freed: a late message then
// lands in ringreduce-owned memory that nobody reads, never in user memory or freed memory.
std::mutex g_graveyard_mu;
std::vector<c10::intrusive_ptr<c10d::Work>>* g_graveyard_works =
    new std::vector<c10::intrusive_ptr<c10d::Work>>();  // intentionally leaked
std::vector<std::unique_ptr<char[]>>* g_graveyard_mem = new std::vector<std::unique_ptr<char[]>>();

// rr::Transport over the point-to-point calls of a c10d backend (gloo for CPU tensors).
class C10dTransport final : public Transport {
 public:
  C10dTransport(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size,
                std::chrono::milliseconds timeout, const std::string& group)
      : backend_(std::move(backend)), rank_(rank), size_(size), timeout_(timeout), group_(group) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  int64_t isend(const void* data, size_t bytes, int peer, int tag) override {
    std::vector<at::Tensor> t{blob(const_cast<void*>(data), bytes)};
    return post([&] { return backend_->send(t, peer, tag); }, "send to", peer);
  }
  int64_t irecv(void* data, size_t bytes, int peer, int tag) override {
    std::vector<at::Tensor> t{blob(data, bytes)};
    return post([&] { return backend_->recv(t, peer, tag); }, "receive from", peer);
  }
  void wait(int64_t request) override {
    auto& w = works_.at(static_cast<size_t>(request));
    if (!w) return;
    try {
      w->wait(timeout_);
    } catch (const std::exception& e) {
      RR_THROW(kBackend, "ringreduce: point-to-point transfer on ", group_, " failed (rank ", rank_,
               ", timeout ", timeout_.count(), " ms): ", firstLine(e.what()));
    }
    w.reset();
  }
  void abandon() override {
    std::lock_guard<std::mutex> g(g_graveyard_mu);
    for (auto& w : works_)
      if (w) g_graveyard_works->push_back(std::move(w));
    works_.clear();
  }

 private:
  static at::Tensor blob(void* data, size_t bytes) {
    return at::from_blob(data, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  }
  static std::string firstLine(const char* what) {
    std::string s(what);
    const size_t nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  }
  template <typename F>
  int64_t post(F&& f, const char* verb, int peer) {
    try {
      works_.push_back(f());
    } catch (const std::exception& e) {
      RR_THROW(kBackend, "ringreduce: could not post a ", verb, " rank ", peer, " on ", group_, ": ",
               firstLine(e.what()));
    }
    return static_cast<int64_t>(works_.size()) - 1;
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::string group_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

std::mutex g_registry_mu;
std::map<const c10d::ProcessGroup*, std::shared_ptr<GroupRuntime>>& registry() {
  static auto* r = new std::map<const c10d::ProcessGroup*, std::shared_ptr<GroupRuntime>>();
  return *r;  // leaked on purpose: never destroyed from a static destructor (workers are joined
              // by shutdownAll(), called from Python's atexit)
}

Frame makeFrame(const at::Tensor& t, const CallOptions& opt, int rank, uint64_t seq) {
  Frame f;
  f.rank = rank;
  f.seq = seq;
  f.kind = opt.kind;
  f.op = static_cast<int32_t>(opt.op);
  f.error = opt.local_error;
  f.ntensors = opt.ntensors;
  f.accum_float32 = opt.accum_float32 ? 1 : 0;
  if (t.defined() && opt.local_error == 0) {
    f.dtype = static_cast<int32_t>(toDType(t.scalar_type()));
    f.numel = t.numel();
    f.device_type = t.is_cuda() ? 1 : 0;
    std::vector<int64_t> dims(t.sizes().begin(), t.sizes().end());
    setShape(f, dims.data(), static_cast<int>(dims.size()));
  }
  return f;
}

}  // namespace

DType toDType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kChar: return DType::kInt8;
    case at::kShort: return DType::kInt16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    case at::kBool: return DType::kBool;
    case at::kComplexFloat: return DType::kComplex64;
    case at::kComplexDouble: return DType::kComplex128;
    default: break;
  }
  RR_THROW(kType, "ringreduce: dtype ", c10::toString(t),
           " is not supported (supported: float32, float64, float16, bfloat16, int8, int16, int32, "
           "int64, uint8, bool, complex64, complex128)");
}

// ---------------------------------------------------------------------------------------------
// CallHandle

bool CallHandle::wait(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_ms < 0) {
    cv_.wait(lk, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return done_; });
}
bool CallHandle::isCompleted() {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}
bool CallHandle::ok() {
  std::lock_guard<std::mutex> g(mu_);
  return ok_;
}
int CallHandle::errorKind() {
  std::lock_guard<std::mutex> g(mu_);
  return error_kind_;
}
std::string CallHandle::errorMessage() {
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}
void CallHandle::finish(bool ok, int kind, const std::string& msg) {
  // The future first (its callbacks may run Python: no lock held), then the waiters, so that a
  // returned wait() always sees a completed future.
  if (ok) {
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>{tensor_}));
  } else {
    future_->setError(std::make_exception_ptr(std::runtime_error(msg)));
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    done_ = true;
    ok_ = ok;
    error_kind_ = kind;
    error_ = msg;
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// GroupRuntime

GroupRuntime::GroupRuntime(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string name)
    : pg_(std::move(pg)), name_(std::move(name)) {
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
  try {
    backend_ = pg_->getBackend(c10::DeviceType::CPU);
  } catch (const std::exception&) {
    RR_THROW(kValue, "ringreduce: ", name_, " has no CPU backend (it was created with backend=",
             pg_->getBackendName(), "), so CPU tensors cannot be reduced on it. Create the group with "
             "backend=\"gloo\" (or \"cpu:gloo,cuda:nccl\"), or move the tensor to the GPU");
  }
  worker_ = std::thread([this] { loop(); });
}

GroupRuntime::~GroupRuntime() { shutdown(); }

void GroupRuntime::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();  // shutdown from a future callback on the worker itself
    } else {
      worker_.join();
    }
  }
}

std::chrono::milliseconds GroupRuntime::timeoutFor(const CallOptions& opt) const {
  if (opt.timeout_ms > 0) return std::chrono::milliseconds(opt.timeout_ms);
  try {
    return backend_->getBackendOptions()->timeout;
  } catch (const std::exception&) {
    return std::chrono::minutes(30);
  }
}

std::shared_ptr<CallHandle> GroupRuntime::submit(const at::Tensor& tensor, const CallOptions& opt,
                                                 bool run_inline) {
  auto call = std::make_shared<CallHandle>();
  call->tensor_ = tensor;
  call->opt_ = opt;
  call->future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  bool inline_now = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    RR_CHECK(!stop_, kRuntime, "ringreduce: ", name_, " is shut down (interpreter exiting)");
    call->seq_ = next_seq_++;
    if (poisoned_ || (run_inline && queue_.empty() && !busy_)) {
      // A poisoned group's worker has exited: its calls fail right here, at once.
      busy_ = true;
      inline_now = true;
    } else {
      queue_.push_back(call);
    }
  }
  if (inline_now) {
    execute(*call);
    {
      std::lock_guard<std::mutex> g(mu_);
      busy_ = false;
    }
  }
  cv_.notify_all();
  return call;
}

void GroupRuntime::loop() {
  for (;;) {
    std::shared_ptr<CallHandle> call;
    std::deque<std::shared_ptr<CallHandle>> orphans;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return !busy_ && (stop_ || poisoned_ || !queue_.empty()); });
      if (poisoned_) {
        // Note [A failed group keeps no thread]: after a transport failure the group is unusable,
        // so the worker fails what is queued and exits; later calls fail at once in submit().
        orphans.swap(queue_);
      } else if (queue_.empty()) {
        return;  // stop_ and drained
      } else {
        call = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
    }
    if (!call) {
      for (auto& c : orphans) execute(*c);
      return;
    }
    execute(*call);
    {
      std::lock_guard<std::mutex> g(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

void GroupRuntime::execute(CallHandle& call) {
  bool ok = false;
  int kind = static_cast<int>(ErrorKind::kRuntime);
  std::string msg;
  try {
    run(call);
    ok = true;
  } catch (const Error& e) {
    kind = static_cast<int>(e.kind());
    msg = e.what();
  } catch (const std::exception& e) {
    kind = static_cast<int>(ErrorKind::kBackend);
    msg = std::string("ringreduce: call failed on ") + name_ + ": " + e.what();
  }
  call.finish(ok, kind, msg);
}

void GroupRuntime::run(CallHandle& call) {
  const CallOptions& opt = call.opt_;
  {
    std::lock_guard<std::mutex> g(mu_);
    RR_CHECK(!poisoned_, kBackend, "ringreduce: ", name_, " is unusable after an earlier failure (",
             poison_reason_, "). Tear the process group down and create a new one");
  }
  const std::chrono::milliseconds timeout = timeoutFor(opt);
  C10dTransport transport(backend_, rank_, size_, timeout, name_);
  const int payload_tag =
      kPayloadTagBase + static_cast<int>((call.seq_ * kTagsPerCall) % (kPayloadTagRange - kTagsPerCall));
  try {
    if (opt.check) {
      const Frame mine = makeFrame(call.tensor_, opt, rank_, call.seq_);
      const std::vector<Frame> frames = exchangeFrames(transport, mine, kFrameTag);
      const std::string verdict = compareFrames(frames, name_);
      RR_CHECK(verdict.empty(), kRuntime, verdict);
    }
    RR_CHECK(opt.local_error == 0, kRuntime, "ringreduce: call #", call.seq_, " refused on this rank");

    at::Tensor& user = call.tensor_;
    const DType dtype = toDType(user.scalar_type());
    // Elements are matched by logical index: a tensor that is not row-major contiguous (views,
    // transposes, channels_last, conj/neg views) is reduced through one contiguous copy.
    const bool direct = user.is_contiguous() && !user.is_conj() && !user.is_neg();
    at::Tensor work = direct ? user : user.resolve_conj().resolve_neg().contiguous();

    PlanOptions po;
    po.max_segment_bytes = opt.segment_bytes;
    po.num_slots = opt.num_slots;
    po.accum_float32 = opt.accum_float32;
    po.gather_into_data = false;  // late messages must land in staging, never in user memory
    po.average = opt.op == RedOp::kAvg;
    const Plan plan = buildPlan(size_, rank_, work.numel(), dtype, po);

    RingBuffers bufs;
    bufs.data = work.data_ptr();
    // Slots are sized by the plan (Plan::stagingBytes) and only ever grow.
    const int64_t need = plan.num_slots > 0 ? plan.stagingBytes() / plan.num_slots : 0;
    if (need > slot_bytes_ || static_cast<int>(slots_.size()) < plan.num_slots) {
      std::lock_guard<std::mutex> g(mu_);
      const int64_t bytes = need > slot_bytes_ ? need : slot_bytes_;
      slots_.clear();
      for (int k = 0; k < plan.num_slots; ++k) slots_.emplace_back(new char[static_cast<size_t>(bytes)]);
      slot_bytes_ = bytes;
    }
    for (int k = 0; k < plan.num_slots; ++k) bufs.slots.push_back(slots_[static_cast<size_t>(k)].get());
    if (plan.accum_elems > 0) {
      if (static_cast<int64_t>(accum_.size()) < plan.accum_elems) {
        std::lock_guard<std::mutex> g(mu_);
        accum_.resize(static_cast<size_t>(plan.accum_elems));
      }
      bufs.accum = accum_.data();
    }

    executePlan(plan, opt.op, transport, bufs, payload_tag);
    if (!direct) user.copy_(work);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kBackend) {
      transport.abandon();
      std::lock_guard<std::mutex> g(mu_);
      std::lock_guard<std::mutex> gy(g_graveyard_mu);
      for (auto& s : slots_) g_graveyard_mem->push_back(std::move(s));
      slots_.clear();
      slot_bytes_ = 0;
      poisoned_ = true;
      poison_reason_ = std::string("call #") + std::to_string(call.seq_) + " failed: " + e.what();
      cv_.notify_all();  // wakes the worker, which exits (see loop())
      // Every error names the call (sequence number, collective) and the group.
      throw Error(ErrorKind::kBackend, std::string("ringreduce: call #") + std::to_string(call.seq_) + " (" +
                                           callKindName(opt.kind) + ") on " + name_ + " failed; the group is "
                                           "now unusable for ringreduce. " + e.what());
    }
    throw;
  }
}

std::shared_ptr<GroupRuntime> runtimeFor(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                         const std::string& name) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto& reg = registry();
  auto it = reg.find(pg.get());
  if (it != reg.end()) return it->second;
  auto rt = std::make_shared<GroupRuntime>(pg, name);
  reg.emplace(pg.get(), rt);
  return rt;
}

void shutdownAll() {
  std::vector<std::shared_ptr<GroupRuntime>> all;
  {
    std::lock_guard<std::mutex> g(g_registry_mu);
    for (auto& kv : registry()) all.push_back(kv.second);
    registry().clear();
  }
  for (auto& rt : all) rt->shutdown();
}

}  // namespace rr
