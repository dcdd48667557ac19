#include "cpu_group.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#ifdef __linux__
#include <pthread.h>
#endif

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

// Note [Traffic counters]
// Payload bytes this process sent to each peer, per process group (frames excluded): what the
// benchmark's --traffic mode reports as cross-node bytes for the flat and hierarchical rings.
std::mutex g_traffic_mu;
std::map<const c10d::ProcessGroup*, std::vector<int64_t>>* g_traffic =
    new std::map<const c10d::ProcessGroup*, std::vector<int64_t>>();  // intentionally leaked

void countBytes(const c10d::ProcessGroup* pg, int size, int peer, size_t bytes) {
  std::lock_guard<std::mutex> g(g_traffic_mu);
  std::vector<int64_t>& v = (*g_traffic)[pg];
  if (static_cast<int>(v.size()) < size) v.resize(static_cast<size_t>(size), 0);
  v[static_cast<size_t>(peer)] += static_cast<int64_t>(bytes);
}

// `bytes` bytes at `data` as a uint8 tensor, the form c10d's send/recv take.
at::Tensor byteTensor(void* data, size_t bytes) {
  return at::from_blob(data, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
}

// rr::Transport over the point-to-point calls of a c10d backend (gloo for CPU tensors).
class C10dTransport final : public Transport {
 public:
  C10dTransport(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size,
                std::chrono::milliseconds timeout, const std::string& group)
      : backend_(std::move(backend)), rank_(rank), size_(size), timeout_(timeout), group_(group) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // Counts payload bytes (Note [Traffic counters]) from now on.
  void countFor(const c10d::ProcessGroup* pg) { count_pg_ = pg; }

  int64_t isend(const void* data, size_t bytes, int peer, int tag) override {
    if (count_pg_ != nullptr) countBytes(count_pg_, size_, peer, bytes);
    std::vector<at::Tensor> t{byteTensor(const_cast<void*>(data), bytes)};
    return post([&] { return backend_->send(t, peer, tag); }, "send to", peer);
  }
  int64_t irecv(void* data, size_t bytes, int peer, int tag) override {
    std::vector<at::Tensor> t{byteTensor(data, bytes)};
    return post([&] { return backend_->recv(t, peer, tag); }, "receive from", peer);
  }
  void wait(int64_t request) override {
    auto& w = works_.at(static_cast<size_t>(request));
    if (!w || waited_.at(static_cast<size_t>(request))) return;
    try {
      w->wait(timeout_);
    } catch (const std::exception& e) {
      RR_THROW(kBackend, "ringreduce: point-to-point transfer on ", group_, " failed (rank ", rank_,
               ", timeout ", timeout_.count(), " ms): ", firstLine(e.what()));
    }
    // Note [Works live until the call ends]: the Work (and gloo's buffer inside it) is kept until
    // the transport is destroyed at the end of the call. Destroying gloo's buffer right after its
    // wait returns spins (sched_yield) until gloo's I/O thread lets go of it, which it does only
    // after it has finished the read that completed the wait: measured with
    // `perf stat -e syscalls:sys_enter_sched_yield`, ~200 yields per call and rank at 4 ranks.
    waited_[static_cast<size_t>(request)] = 1;
  }
  void abandon() override {
    std::lock_guard<std::mutex> g(g_graveyard_mu);
    for (size_t i = 0; i < works_.size(); ++i)
      if (works_[i] && !waited_[i]) g_graveyard_works->push_back(std::move(works_[i]));
    works_.clear();
    waited_.clear();
  }

 private:
  static std::string firstLine(const char* what) {
    std::string s(what);
    const size_t nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  }
  template <typename F>
  int64_t post(F&& f, const char* verb, int peer) {
    try {
      works_.push_back(f());
      waited_.push_back(0);
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
  const c10d::ProcessGroup* count_pg_ = nullptr;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<char> waited_;
};

std::mutex g_registry_mu;
using RegistryKey = std::pair<const c10d::ProcessGroup*, std::vector<int>>;
std::map<RegistryKey, std::shared_ptr<GroupRuntime>>& registry() {
  static auto* r = new std::map<RegistryKey, std::shared_ptr<GroupRuntime>>();
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
  f.algorithm = opt.local_size;  // 0: the flat ring; L: hierarchical with L ranks per node
  f.segment_bytes = static_cast<int32_t>(std::min<int64_t>(opt.segment_bytes, std::numeric_limits<int32_t>::max()));
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
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>{output_.defined() ? output_ : tensor_}));
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

GroupRuntime::GroupRuntime(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string name,
                           std::vector<int> members)
    : pg_(std::move(pg)), name_(std::move(name)), members_(std::move(members)) {
  pg_rank_ = pg_->getRank();
  const int pg_size = pg_->getSize();
  if (members_.empty()) {
    rank_ = pg_rank_;
    size_ = pg_size;
  } else {
    rank_ = -1;
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the rank list: the ring's tag slot
    for (size_t i = 0; i < members_.size(); ++i) {
      const int m = members_[i];
      RR_CHECK(m >= 0 && m < pg_size, kValue, "ringreduce: rank ", m, " of the ring is outside ", name_);
      for (size_t j = 0; j < i; ++j)
        RR_CHECK(members_[j] != m, kValue, "ringreduce: rank ", m, " appears twice in the ring's rank list");
      if (m == pg_rank_) rank_ = static_cast<int>(i);
      h = (h ^ static_cast<uint64_t>(m)) * 1099511628211ull;
    }
    RR_CHECK(rank_ >= 0, kValue, "ringreduce: this process (rank ", pg_rank_, ") is not in the ring's rank list");
    size_ = static_cast<int>(members_.size());
    tag_slot_ = 1 + static_cast<int>(h % static_cast<uint64_t>(kTagSlots - 1));
  }
  try {
    backend_ = pg_->getBackend(c10::DeviceType::CPU);
  } catch (const std::exception&) {
    RR_THROW(kValue, "ringreduce: ", name_, " has no CPU backend (it was created with backend=",
             pg_->getBackendName(), "), so CPU tensors cannot be reduced on it. Create the group with "
             "backend=\"gloo\" (or \"cpu:gloo,cuda:nccl\"), or move the tensor to the GPU");
  }
  const char* lead = std::getenv("RINGREDUCE_LEAD");
  lead_mode_ = lead == nullptr ? 2 : std::strcmp(lead, "0") == 0 ? 0 : std::strcmp(lead, "recv") == 0 ? 1 : 2;
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

std::shared_ptr<CallHandle> GroupRuntime::submit(const at::Tensor& tensor, const at::Tensor& output,
                                                 const CallOptions& opt, bool run_inline) {
  auto call = std::make_shared<CallHandle>();
  call->tensor_ = tensor;
  call->output_ = output;
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
#ifdef __linux__
  // Named like gloo's threads (gloo_tcp_loop, pt_gloo_runloop), so that top -H and perf tell it apart.
  pthread_setname_np(pthread_self(), "rr_cpu_worker");
#endif
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

// Staging (Note [Staging slots] in plan.h): slot k holds the plan's segment, slot 0 also
// `lead_room` bytes for a leading receive (Note [Receives before the verdict]). Slots grow and are
// kept for later calls; when keeping them would take the group's staging past kStagingCapBytes
// (kAutoSlots plans of different sizes use different slot counts), they are reallocated to exactly
// what this plan needs.
RingBuffers GroupRuntime::ringBuffers(const Plan& plan, void* data, int64_t lead_room) {
  RingBuffers bufs;
  bufs.data = data;
  const int64_t each = plan.slotBytes();
  auto need = [&](size_t k) { return k == 0 ? std::max(each, lead_room) : each; };
  const size_t count = static_cast<size_t>(plan.num_slots);
  int64_t kept = 0;   // bytes after growing in place
  int64_t exact = 0;  // bytes this plan needs (more than the cap only with RINGREDUCE_SLOTS set)
  for (size_t k = 0; k < std::max(count, slots_.size()); ++k) {
    const int64_t have = k < slot_sizes_.size() ? slot_sizes_[k] : 0;
    kept += k < count ? std::max(have, need(k)) : have;
    exact += k < count ? need(k) : 0;
  }
  const bool reset = kept > std::max(kStagingCapBytes, exact);
  bool grow = reset || slots_.size() < count;
  for (size_t k = 0; !grow && k < count; ++k) grow = slot_sizes_[k] < need(k);
  if (grow) {
    std::lock_guard<std::mutex> g(mu_);
    if (reset) {
      slots_.clear();
      slot_sizes_.clear();
    }
    if (slots_.size() < count) {
      slots_.resize(count);
      slot_sizes_.resize(count, 0);
    }
    for (size_t k = 0; k < count; ++k) {
      if (slot_sizes_[k] >= need(k)) continue;
      slots_[k].reset(new char[static_cast<size_t>(need(k))]);
      slot_sizes_[k] = need(k);
    }
  }
  for (size_t k = 0; k < count; ++k) {
    bufs.slots.push_back(slots_[k].get());
    bufs.slot_room.push_back(slot_sizes_[k]);
  }
  if (plan.accum_elems > 0) {
    if (static_cast<int64_t>(accum_.size()) < plan.accum_elems) {
      std::lock_guard<std::mutex> g(mu_);
      accum_.resize(static_cast<size_t>(plan.accum_elems));
    }
    bufs.accum = accum_.data();
  }
  return bufs;
}

void GroupRuntime::runRing(Transport& t, int rank, int size, void* data, int64_t numel, DType dtype,
                           RedOp op, const PlanOptions& po, int tag, RunTrace* trace) {
  const Plan plan = buildPlan(size, rank, numel, dtype, po);
  if (plan.num_exchanges == 0) return;
  const RingBuffers bufs = ringBuffers(plan, data, 0);
  executePlan(plan, op, t, bufs, tag, trace);
}

void GroupRuntime::retireLeading(Transport& t, const std::vector<int>& slots, int tag_group) {
  t.abandon();  // the posted receives go to the graveyard
  {
    std::lock_guard<std::mutex> g(mu_);
    std::lock_guard<std::mutex> gy(g_graveyard_mu);
    for (int k : slots) {
      std::unique_ptr<char[]>& slot = slots_.at(static_cast<size_t>(k));
      if (!slot) continue;
      g_graveyard_mem->push_back(std::move(slot));
      slot.reset(new char[static_cast<size_t>(slot_sizes_.at(static_cast<size_t>(k)))]);
    }
  }
  call_tags_.retire(tag_group);
}

// Note [Hierarchical all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The ring's members are ordered node by node: member k * L + l is local rank l of node k (L ranks
// per node, M nodes). Three rings run one after another, all over this group's transport:
//   1. reduce-scatter inside the node (ring of L): local rank l ends with the node's sum of chunk
//      (l + 1) mod L - the same element range on every node, since it depends on (L, numel) only;
//   2. a full ring all-reduce of that range among the M ranks with local rank l (one per node),
//      AVG dividing by the whole ring's size M * L once, at its final reduce;
//   3. all-gather inside the node.
// Each rank sends 2 (L-1)/L S bytes inside its node and 2 (M-1)/M S/L across nodes (S = tensor
// bytes), against 2 (n-1)/n S across nodes for the flat ring's ranks at a node boundary. The
// result is bitwise identical on every rank (stage 2 is a ring all-reduce, stage 3 copies), but
// its rounding differs from the flat ring's, as the summation order does.
void GroupRuntime::run(CallHandle& call) {
  const CallOptions& opt = call.opt_;
  {
    std::lock_guard<std::mutex> g(mu_);
    RR_CHECK(!poisoned_, kBackend, "ringreduce: ", name_, " is unusable after an earlier failure (",
             poison_reason_, "). Tear the process group down and create a new one");
  }
  const std::chrono::milliseconds timeout = timeoutFor(opt);
  C10dTransport base(backend_, pg_rank_, pg_->getSize(), timeout, name_);
  std::vector<int> all = members_;
  if (all.empty())
    for (int i = 0; i < size_; ++i) all.push_back(i);
  RankMapTransport transport(base, all, rank_);
  // Every call takes the ring's next tag group, on every rank alike (Note [Retired tag groups]).
  const int tag_group = call_tags_.next();
  auto payloadTag = [&](int stage) {
    return kPayloadTagBase + tag_slot_ * kPayloadTagsPerSlot + (tag_group * kStagesPerCall + stage) * kTagsPerCall;
  };
  try {
    at::Tensor& user = call.tensor_;
    const CallKind kind = static_cast<CallKind>(opt.kind);
    PlanOptions po;
    po.max_segment_bytes = opt.segment_bytes;
    po.num_slots = opt.num_slots;
    po.accum_float32 = opt.accum_float32;
    po.gather_into_data = false;  // late messages must land in staging, never in user memory
    po.average = opt.op == RedOp::kAvg;
    po.recv_only_waits = opt.recv_only_waits;
    const bool direct_frames = members_.empty() && size_ <= kDirectFrameRanks;
    const int L = opt.local_size;
    const bool hier = L > 1 && L < size_;

    // Elements are matched by logical index: a tensor that is not row-major contiguous (views,
    // transposes, channels_last, conj/neg views) is reduced through one contiguous copy.
    // Hierarchical with float32 accumulation for half types: the whole reduction runs on a float32
    // copy, so partials are rounded once, at the end, as the flat ring's accum mode promises.
    const bool all_reduce = kind != CallKind::kReduceScatter && kind != CallKind::kAllGather;
    at::Tensor work;
    bool direct = true;
    if (all_reduce && opt.local_error == 0 && user.defined()) {
      const bool upcast = hier && opt.accum_float32 && isHalfType(toDType(user.scalar_type()));
      direct = !upcast && user.is_contiguous() && !user.is_conj() && !user.is_neg();
      work = direct ? user : upcast ? user.to(at::kFloat).contiguous() : user.resolve_conj().resolve_neg().contiguous();
    }

    // Note [Receives before the verdict]: a checked flat all-reduce over the whole group posts its
    // first payload receive (and sends its first segment) before it waits for the frames.
    Plan lead_plan;
    RingBuffers lead_bufs;
    std::unique_ptr<PlanRun> lead;
    std::vector<int> lead_slots;
    if (opt.check && direct_frames && work.defined() && !hier && lead_mode_ > 0) {
      lead_plan = buildPlan(size_, rank_, work.numel(), toDType(work.scalar_type()), po);
      if (lead_plan.num_exchanges > 0) {
        lead_bufs = ringBuffers(lead_plan, work.data_ptr(), kLeadBytes);
        lead = std::make_unique<PlanRun>(lead_plan, opt.op, transport, lead_bufs, payloadTag(0));
      }
    }
    if (opt.check) {
      // The frame leaves first, so that it never queues behind the first segment on the socket;
      // its flag promises the leading receive, posted right after it and before any wait.
      Frame mine = makeFrame(call.tensor_, opt, pg_rank_, call.seq_);
      if (lead && lead->postsLeadingReceive()) mine.flags |= kFrameLeadReceive;
      if (direct_frames) sendFrame(mine);
      if (lead) {
        base.countFor(pg_.get());  // the first segment may leave now
        lead_slots = lead->postLeading(kLeadBytes, lead_mode_ > 1 ? kLeadBytes : 0);
      }
      const std::vector<Frame> frames = direct_frames ? collectFrames(mine, timeout, call.seq_)
                                                      : exchangeFrames(transport, mine, kFrameTagBase + tag_slot_);
      const std::string verdict = compareFrames(frames, name_);
      if (!verdict.empty()) {
        // Every rank has the same frames, so every rank fails here and retires this tag group. A
        // first segment already sent to a rank that posted its leading receive for this call is
        // delivered (it reads the caller's tensor, which is the caller's again once this raises).
        if (lead && lead->leadingSend() >= 0) {
          const Frame& next = frames[static_cast<size_t>((rank_ + 1) % size_)];
          if ((next.flags & kFrameLeadReceive) != 0 && next.seq == mine.seq) transport.wait(lead->leadingSend());
        }
        retireLeading(transport, lead_slots, tag_group);
        RR_THROW(kRuntime, verdict);
      }
    }
    RR_CHECK(opt.local_error == 0, kRuntime, "ringreduce: call #", call.seq_, " refused on this rank");
    base.countFor(pg_.get());

    if (kind == CallKind::kReduceScatter || kind == CallKind::kAllGather) {
      // Note [Ring halves]: rank r owns block r (shift -1), blocks are exactly numel / n.
      po.phases = static_cast<uint8_t>(opt.phases);
      po.owner_shift = opt.owner_shift;
      po.exact_chunks = opt.exact_chunks;
      at::Tensor& out = call.output_;
      const DType dtype = toDType(user.scalar_type());
      if (kind == CallKind::kReduceScatter) {
        // The input is left untouched (as torch's reduce_scatter_tensor): reduce a private copy.
        at::Tensor work = user.resolve_conj().resolve_neg().contiguous();
        if (work.data_ptr() == user.data_ptr()) work = work.clone();
        runRing(transport, rank_, size_, work.data_ptr(), work.numel(), dtype, opt.op, po, payloadTag(0));
        const int64_t m = work.numel() / size_;
        out.copy_(work.reshape({-1}).narrow(0, rank_ * m, m).view(out.sizes()));
      } else {
        // `out` is the contiguous concatenation, allocated by the caller; our block goes in first.
        const int64_t m = user.numel();
        out.reshape({-1}).narrow(0, rank_ * m, m).copy_(user.resolve_conj().resolve_neg().reshape({-1}));
        runRing(transport, rank_, size_, out.data_ptr(), out.numel(), dtype, RedOp::kSum, po, payloadTag(0));
      }
      return;
    }

    const DType dtype = toDType(work.scalar_type());
    if (!hier) {
      // Note [Call traces]
      const char* env = std::getenv("RINGREDUCE_TRACE");
      bool on = env != nullptr && env[0] != '\0';
      for (const char* off : {"0", "false", "False", "off"}) on = on && std::strcmp(env, off) != 0;
      RunTrace trace;
      RunTrace* tr = on ? &trace : nullptr;
      if (lead) {
        lead->run(tr);
      } else {
        runRing(transport, rank_, size_, work.data_ptr(), work.numel(), dtype, opt.op, po, payloadTag(0), tr);
      }
      if (tr != nullptr) {
        std::fprintf(stderr,
                     "[ringreduce trace] %s rank %d call #%llu numel %lld: ring %.0f us (posting %.0f, waiting "
                     "%.0f, reducing %.0f, copying %.0f); ops over %.0f us:%s\n",
                     name_.c_str(), pg_rank_, static_cast<unsigned long long>(call.seq_),
                     static_cast<long long>(work.numel()), trace.total_us, trace.post_us, trace.wait_us,
                     trace.reduce_us, trace.copy_us, RunTrace::kSlowOpUs, trace.slow.empty() ? " none" : trace.slow.c_str());
      }
    } else {
      RR_CHECK(size_ % L == 0, kValue, "ringreduce: hierarchical all-reduce over ", size_,
               " ranks needs equal nodes, got ", L, " ranks per node");
      // The call runs on this ring's runtime (its tags, its sequence numbers) whatever the node
      // order: a launcher that numbers ranks across nodes gives another order, not another ring.
      const std::vector<int>& order = opt.node_order.empty() ? all : opt.node_order;
      RR_CHECK(order.size() == all.size(), kValue, "ringreduce: the node order names ", order.size(),
               " ranks for a ring of ", all.size());
      int pos = -1;
      for (size_t i = 0; i < order.size(); ++i)
        if (order[i] == pg_rank_) pos = static_cast<int>(i);
      RR_CHECK(pos >= 0, kValue, "ringreduce: rank ", pg_rank_, " is missing from the node order");
      const int M = size_ / L;
      const int node = pos / L;
      const int local = pos % L;
      std::vector<int> intra, inter;
      for (int l = 0; l < L; ++l) intra.push_back(order[static_cast<size_t>(node * L + l)]);
      for (int k = 0; k < M; ++k) inter.push_back(order[static_cast<size_t>(k * L + local)]);
      RankMapTransport intra_t(base, intra, local);
      RankMapTransport inter_t(base, inter, node);
      const RedOp inner = opt.op == RedOp::kAvg ? RedOp::kSum : opt.op;
      PlanOptions p1 = po;
      p1.accum_float32 = false;
      p1.average = false;
      p1.phases = kPhaseReduceScatter;
      runRing(intra_t, local, L, work.data_ptr(), work.numel(), dtype, inner, p1, payloadTag(0));
      const RingSchedule sc = makeRingSchedule(L, work.numel(), static_cast<int64_t>(dtypeSize(dtype)),
                                               static_cast<int64_t>(dtypeSize(dtype)), po.max_segment_bytes);
      const Range mine = sc.chunkRange(sc.ownedChunk(local));
      PlanOptions p2 = po;
      p2.accum_float32 = false;
      p2.avg_divisor = size_;
      char* base_ptr = static_cast<char*>(work.data_ptr());
      runRing(inter_t, node, M, base_ptr + mine.begin * static_cast<int64_t>(dtypeSize(dtype)), mine.size(),
              dtype, opt.op, p2, payloadTag(1));
      PlanOptions p3 = p1;
      p3.phases = kPhaseAllGather;
      runRing(intra_t, local, L, work.data_ptr(), work.numel(), dtype, RedOp::kSum, p3, payloadTag(2));
    }
    if (!direct) user.copy_(work);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kBackend) {
      transport.abandon();
      abandonFrames();
      std::lock_guard<std::mutex> g(mu_);
      std::lock_guard<std::mutex> gy(g_graveyard_mu);
      for (auto& s : slots_) g_graveyard_mem->push_back(std::move(s));
      slots_.clear();
      slot_sizes_.clear();
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

// Note [Receives before the verdict]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With the check on, a call whose payload moves only after the frames compared equal pays for the
// check with a round trip of its own and, worse on an oversubscribed host, a wake-up: the rank's
// thread must wake from the frame wait before its first segment can leave (gloo's send is a
// rendezvous, completed on gloo's I/O thread once the receiver's notice arrives). So a checked
// flat all-reduce over the whole group builds its plan first, sends its frame, and then, before it
// waits for the others' frames, posts what precedes every other message of the call
// (PlanRun::postLeading): the first exchange's receive, with room for kLeadBytes, and the first
// exchange's send when it is at most kLeadBytes. The check rides on the first segment: that
// segment travels with the frames, and lands in staging, never in user memory, before the verdict
// is known. The frame goes first because gloo writes a pair's messages in the order they were
// posted: behind the first segment, it would reach the peer only after up to kLeadBytes of payload
// (2 ranks, 1 MiB, `python -m ringreduce.bench -b 1M -e 1M --check-cost --seconds 3`, three
// alternating pairs: the check's cost fell from 656-982 us to 81-425 us). The frame's kFrameLeadReceive flag is set from PlanRun::postsLeadingReceive before
// the receive is posted: it promises a receive posted before this rank waits for anything.
// Why this cannot turn a disagreement into a transport error or garbage:
//   * a message on this call's first tag is either a first segment sent before the verdict
//     (<= kLeadBytes) or one sent after a verdict that passed (ranks agree on numel, dtype and
//     segment size, so sizes match). Receives posted before the verdict have room for kLeadBytes
//     and those posted after it expect exactly the agreed size, so gloo never sees a message larger
//     than its receive (which aborts the pair);
//   * nothing is reduced, copied or sent from staging before the verdict; on a failed check every
//     rank has the same frames and fails too. Receives then left posted can never be matched by a
//     later call: the call's tag group is retired on every rank (Note [Retired tag groups]); they
//     and the staging slot they point into go to the graveyard (Note [Failed calls keep their
//     buffers]): one slot, >= kLeadBytes, per failed call;
//   * a first segment sent to a rank whose frame says it posted its leading receive for this call
//     (kFrameLeadReceive, same sequence number) completes, and the failed call waits for it before
//     it returns, so gloo is done reading the caller's tensor; any other first segment can never
//     be matched (retired tags), so gloo never reads it.
// RINGREDUCE_LEAD=recv posts only the receives, RINGREDUCE_LEAD=0 neither (read when the group's
// runtime is created; for comparisons, as in benchmarks/README.md).

// Note [Call traces]
// ~~~~~~~~~~~~~~~~~~~
// RINGREDUCE_TRACE=1 (read at every call; 0, false or off turn it off, as for the other knobs)
// prints one line per flat CPU all-reduce to stderr: the ring's time (after the agreement check)
// split into posting exchanges (c10d send/recv into gloo),
// waiting for them, reducing and copying, and every op that took over 0.5 ms with its end time.
// On an oversubscribed host it shows where a slow call lost its time: a post or a reduce that
// should take tens of microseconds taking a scheduler time slice means this rank was preempted (or
// blocked on a gloo pair lock whose holder was); a long wait means a peer was.
// benchmarks/trace_calls.py summarizes the lines of barrier-aligned calls.

// Note [Pre-posted frame receives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// gloo's send is a rendezvous: the payload leaves only once the receiver has announced a posted
// receive, so frames exchanged with receives posted at call time cost a round trip (and, on an
// oversubscribed host, the wake-ups of both sides) before the first payload byte moves. The
// whole-group ring therefore keeps the receives of its coming frame exchanges posted, into
// ringreduce-owned memory; a call (on any rank) only posts its sends, which leave at once.
// Each receive sends its peer a notice, and a notice that reaches a rank while its worker writes a
// segment under gloo's pair lock makes gloo's I/O thread spin on that lock (Note [Staging slots]
// in plan.h). So the next receives are posted right after a call has collected its frames, when
// every peer is at the start of the same call, past its own frame sends, rather than at the end of
// the call, when peers may still be writing their last segments. One call's worth at a time:
// posting 16 calls' worth at once made gloo's own all_reduce in the same processes ~15 % slower
// (interleaved with ringreduce, 4 ranks, 1 MiB; the cause inside gloo is not known). Receives from
// one peer on one tag match in order,
// so calls made with the check off leave them for the next calls with the check on. Only the whole
// group (tag slot 0, unique per process group) does this: rank-list rings share tag slots by hash,
// and a receive left posted on a shared tag could capture another ring's frame. After a transport
// failure the pending receives, and the memory they write into, go to the graveyard.
void GroupRuntime::sendFrame(const Frame& mine) {
  const int tag = kFrameTagBase + tag_slot_;
  if (!frame_in_) {
    frame_in_.reset(new char[static_cast<size_t>(size_) * kFrameBytes]);
    frame_out_.reset(new char[kFrameBytes]);
  }
  if (frame_recvs_.empty()) postFrameReceives();
  std::memcpy(frame_out_.get(), &mine, kFrameBytes);
  frame_sends_.clear();
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    std::vector<at::Tensor> t{byteTensor(frame_out_.get(), kFrameBytes)};
    try {
      frame_sends_.push_back(backend_->send(t, p, tag));
    } catch (const std::exception& e) {
      RR_THROW(kBackend, "ringreduce: could not post a send to rank ", p, " on ", name_, ": ", e.what());
    }
  }
}

std::vector<Frame> GroupRuntime::collectFrames(const Frame& mine, std::chrono::milliseconds timeout, uint64_t seq) {
  auto waitOne = [&](c10::intrusive_ptr<c10d::Work>& w) {
    if (!w) return;
    try {
      w->wait(timeout);
    } catch (const std::exception& e) {
      RR_THROW(kBackend, "ringreduce: agreement frames on ", name_, " failed (rank ", rank_, ", timeout ",
               timeout.count(), " ms): ", e.what());
    }
  };
  for (auto& w : frame_recvs_) waitOne(w);
  for (auto& w : frame_sends_) waitOne(w);
  std::vector<Frame> frames(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) frames[static_cast<size_t>(p)] = mine;
    else std::memcpy(&frames[static_cast<size_t>(p)], frame_in_.get() + static_cast<size_t>(p) * kFrameBytes, kFrameBytes);
  }
  postNextFrames(seq);
  return frames;
}

// The frames are collected: post the next call's receives. The call that does it has its frames,
// so a failure here (gloo refuses a post only on a pair that is closed or broken for good) must not
// fail it: the group is marked unusable for later calls instead, with the reason, and the receives
// already posted go to the graveyard with their memory.
void GroupRuntime::postNextFrames(uint64_t seq) {
  // The completed receives live until the next exchange (Note [Works live until the call ends]).
  frame_done_.swap(frame_recvs_);
  frame_recvs_.clear();
  try {
    postFrameReceives();
  } catch (const Error& e) {
    abandonFrames();
    std::lock_guard<std::mutex> g(mu_);
    poisoned_ = true;
    poison_reason_ = std::string("during call #") + std::to_string(seq) +
                     ", the next call's agreement-frame receives could not be posted (did a peer leave?): " + e.what();
    cv_.notify_all();
  }
}

void GroupRuntime::postFrameReceives() {
  const int tag = kFrameTagBase + tag_slot_;
  frame_recvs_.assign(static_cast<size_t>(size_), {});
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    std::vector<at::Tensor> t{byteTensor(frame_in_.get() + static_cast<size_t>(p) * kFrameBytes, kFrameBytes)};
    try {
      frame_recvs_[static_cast<size_t>(p)] = backend_->recv(t, p, tag);
    } catch (const std::exception& e) {
      RR_THROW(kBackend, "ringreduce: could not post a receive from rank ", p, " on ", name_, ": ", e.what());
    }
  }
}

void GroupRuntime::abandonFrames() {
  std::lock_guard<std::mutex> gy(g_graveyard_mu);
  for (auto& w : frame_recvs_)
    if (w) g_graveyard_works->push_back(std::move(w));
  for (auto& w : frame_sends_)
    if (w) g_graveyard_works->push_back(std::move(w));
  frame_recvs_.clear();
  frame_sends_.clear();
  if (frame_in_) g_graveyard_mem->push_back(std::move(frame_in_));
  if (frame_out_) g_graveyard_mem->push_back(std::move(frame_out_));
}

std::shared_ptr<GroupRuntime> runtimeFor(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                         const std::string& name, const std::vector<int>& members) {
  std::vector<int> key = members;
  bool identity = static_cast<int>(key.size()) == pg->getSize();
  for (size_t i = 0; identity && i < key.size(); ++i) identity = key[i] == static_cast<int>(i);
  if (identity) key.clear();
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto& reg = registry();
  auto it = reg.find({pg.get(), key});
  if (it != reg.end()) return it->second;
  auto rt = std::make_shared<GroupRuntime>(pg, name, key);
  reg.emplace(std::make_pair(pg.get(), key), rt);
  return rt;
}
int64_t GroupRuntime::stagingBytes() {
  std::lock_guard<std::mutex> g(mu_);
  int64_t total = 0;
  for (int64_t b : slot_sizes_) total += b;
  return total;
}

int64_t stagingBytes(const c10d::ProcessGroup* pg) {
  std::vector<std::shared_ptr<GroupRuntime>> rings;
  {
    std::lock_guard<std::mutex> g(g_registry_mu);
    for (auto& kv : registry())
      if (kv.first.first == pg) rings.push_back(kv.second);
  }
  int64_t total = 0;
  for (auto& rt : rings) total += rt->stagingBytes();
  return total;
}

std::vector<int64_t> bytesSent(const c10d::ProcessGroup* pg, bool reset) {
  std::lock_guard<std::mutex> g(g_traffic_mu);
  std::vector<int64_t> out(static_cast<size_t>(pg->getSize()), 0);
  auto it = g_traffic->find(pg);
  if (it != g_traffic->end()) {
    for (size_t i = 0; i < it->second.size() && i < out.size(); ++i) out[i] = it->second[i];
    if (reset) it->second.assign(it->second.size(), 0);
  }
  return out;
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
