#include "group_runtime.h"

#include "host_reduce.h"

#include <algorithm>
#include <cstring>
#ifdef __linux__
#include <pthread.h>
#endif

namespace rr {

namespace {

// Note [Failed calls keep their buffers]: memory a late message may still land in.
std::mutex g_graveyard_mu;
std::vector<std::unique_ptr<char[]>>* g_graveyard = new std::vector<std::unique_ptr<char[]>>();  // leaked

using Clock = std::chrono::steady_clock;
double usSince(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

// Note [Tags]: the whole group uses slot 0, a rank-list ring 1 + (FNV-1a of its ranks) mod 63.
int tagSlot(const RingMembers& ring, bool whole_group) {
  if (whole_group) return 0;
  uint64_t h = 1469598103934665603ull;
  for (int m : ring.ranks) h = (h ^ static_cast<uint64_t>(m)) * 1099511628211ull;
  return 1 + static_cast<int>(h % static_cast<uint64_t>(kTagSlots - 1));
}

}  // namespace

GroupRuntime::GroupRuntime(std::unique_ptr<Transport> transport, std::chrono::milliseconds default_timeout,
                           std::string name, std::vector<int> members)
    : transport_(std::move(transport)),
      default_timeout_(default_timeout),
      name_(std::move(name)),
      ring_(resolveRing(members, transport_->size(), transport_->rank())),
      whole_group_(ringKey(ring_.ranks, transport_->size()).empty()),
      ring_transport_(*transport_, ring_.ranks, ring_.index),
      rank_(ring_.index),
      size_(ring_.size()),
      tag_slot_(tagSlot(ring_, whole_group_)),
      frames_(size_, rank_, kFrameTagBase + tag_slot_, whole_group_ && transport_->rendezvousSends(),
              static_cast<size_t>(oneShotBytes(size_))),
      sent_(new std::atomic<int64_t>[static_cast<size_t>(transport_->size())]()),
      payload_(*transport_, sent_.get()) {
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
      worker_.detach();  // shutdown from a completion callback on the worker itself
    } else {
      worker_.join();
    }
  }
}

uint64_t GroupRuntime::submit(std::shared_ptr<CallBody> body, CallOptions options) {
  Call call{std::move(body), std::move(options), 0};
  bool fail_now = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    RR_CHECK(!stop_, kRuntime, "ringreduce: ", name_, " is shut down (interpreter exiting)");
    call.seq = next_seq_++;
    // Note [A failed group keeps no thread]: a poisoned group's worker has exited; its calls fail
    // right here, at once.
    fail_now = poisoned_;
    if (!fail_now) queue_.push_back(call);
  }
  if (fail_now) {
    execute(call);
  } else {
    cv_.notify_all();
  }
  return call.seq;
}

void GroupRuntime::loop() {
#ifdef __linux__
  // Named like gloo's threads (gloo_tcp_loop, pt_gloo_runloop), so that top -H and perf tell it apart.
  pthread_setname_np(pthread_self(), "rr_cpu_worker");
#endif
  for (;;) {
    Call call;
    std::deque<Call> orphans;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || poisoned_ || !queue_.empty(); });
      if (poisoned_) {
        // Note [A failed group keeps no thread]: after a transport failure the group is unusable,
        // so the worker fails what is queued and exits.
        orphans.swap(queue_);
      } else if (queue_.empty()) {
        return;  // stop_ and drained
      } else {
        call = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (!call.body) {
      for (auto& c : orphans) execute(c);
      return;
    }
    execute(call);
  }
}

void GroupRuntime::execute(Call& call) {
  CallTiming timing;
  bool ok = false;
  ErrorKind kind = ErrorKind::kRuntime;
  std::string msg;
  try {
    run(call, timing);
    ok = true;
  } catch (const Error& e) {
    kind = e.kind();
    msg = e.what();
  } catch (const std::exception& e) {
    kind = ErrorKind::kBackend;
    msg = std::string("ringreduce: call failed on ") + name_ + ": " + e.what();
  }
  call.body->complete(ok, kind, msg, timing);
}

std::vector<RingStage> GroupRuntime::stagesFor(const CallOptions& opt, const CallBuffer& buf) const {
  PlanOptions base;
  base.max_segment_bytes = opt.segment_bytes;
  base.num_slots = opt.num_slots;
  base.accum_float32 = opt.accum_float32;
  base.gather_into_data = false;  // late messages must land in staging, never in user memory
  switch (opt.kind) {
    case CallKind::kReduceScatter:
      return ringHalfStages(ring_, buf.numel, buf.dtype, opt.op, base, kPhaseReduceScatter);
    case CallKind::kAllGather:
      return ringHalfStages(ring_, buf.numel, buf.dtype, RedOp::kSum, base, kPhaseAllGather);
    default:
      break;
  }
  if (!opt.hierarchical(size_)) return flatRingStages(ring_, buf.numel, buf.dtype, opt.op, base);
  // The call runs on this ring's runtime (its tags, its sequence numbers) whatever the node order:
  // a launcher that numbers ranks across nodes gives another order, not another ring.
  RR_CHECK(opt.node_order.empty() || opt.node_order.size() == ring_.ranks.size(), kValue,
           "ringreduce: the node order names ", opt.node_order.size(), " ranks for a ring of ", ring_.ranks.size());
  const RingMembers ordered =
      opt.node_order.empty() ? ring_ : resolveRing(opt.node_order, transport_->size(), transport_->rank());
  base.accum_float32 = false;  // half types with float32 accumulation come as a float32 copy
  return hierarchicalStages(ordered, opt.local_size, buf.numel, buf.dtype, opt.op, base);
}

// Staging (Note [Staging slots] in plan.h): slot k holds the plan's segment, slot 0 also
// `lead_room` bytes for a leading receive (Note [Receives before the verdict]). Slots grow and are
// kept for later calls; when keeping them would take the ring's staging past kStagingCapBytes
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

void GroupRuntime::retireLeading(const std::vector<int>& slots, int tag_group) {
  // The leading receives stay posted inside the transport (never waited, never released); the
  // slots they write into are replaced and kept.
  {
    std::lock_guard<std::mutex> g(mu_);
    std::lock_guard<std::mutex> gy(g_graveyard_mu);
    for (int k : slots) {
      std::unique_ptr<char[]>& slot = slots_.at(static_cast<size_t>(k));
      if (!slot) continue;
      g_graveyard->push_back(std::move(slot));
      slot.reset(new char[static_cast<size_t>(slot_sizes_.at(static_cast<size_t>(k)))]);
    }
  }
  call_tags_.retire(tag_group);
}

void GroupRuntime::poison(const std::string& reason) {
  transport_->abandon();
  frames_.abandon();
  {
    std::lock_guard<std::mutex> g(mu_);
    std::lock_guard<std::mutex> gy(g_graveyard_mu);
    for (auto& s : slots_) g_graveyard->push_back(std::move(s));
    slots_.clear();
    slot_sizes_.clear();
    poisoned_ = true;
    poison_reason_ = reason;
  }
  cv_.notify_all();  // wakes the worker, which exits (see loop())
}

void GroupRuntime::runOneShot(const Call& call, const CallBuffer& buf, int tag_group, CallTiming& timing) {
  const CallOptions& opt = call.opt;
  const size_t bytes = static_cast<size_t>(buf.numel) * dtypeSize(buf.dtype);
  const Clock::time_point started = Clock::now();
  Frame mine = call.body->frame();
  mine.rank = transport_->rank();
  mine.seq = call.seq;
  mine.flags |= kFrameOneShot;
  frames_.send(ring_transport_, mine, buf.data, bytes);
  std::string post_error;
  const std::vector<Frame> frames = frames_.collect(ring_transport_, mine, &post_error);
  timing.check_us = usSince(started);
  const std::string verdict = compareFrames(frames, name_);
  if (!verdict.empty()) {
    // Ranks that took the ring for this call may have posted leading messages on its tags: every
    // rank retires the call's tag group (Note [Retired tag groups]).
    call_tags_.retire(tag_group);
    transport_->callDone();
    RR_THROW(kRuntime, verdict);
  }
  if (!post_error.empty()) {
    std::lock_guard<std::mutex> g(mu_);
    poisoned_ = true;
    poison_reason_ = "during call #" + std::to_string(call.seq) +
                     ", the next call's agreement-frame receives could not be posted (did a peer leave?): " + post_error;
  }
  const Clock::time_point reduced = Clock::now();
  for (int p = 0; p < size_; ++p)  // Note [Traffic counters]: the payload went to every peer
    if (p != rank_) sent_[ring_.ranks[static_cast<size_t>(p)]].fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  const size_t elem = dtypeSize(buf.dtype);
  // Chunk c, in the ring's order: rank c's elements first, then c + 1's, ... (the schedule's bounds
  // depend on (n, numel, element sizes) only).
  const RingSchedule sched = makeRingSchedule(size_, buf.numel, static_cast<int64_t>(elem),
                                              static_cast<int64_t>(dtypeSize(wireDType(buf.dtype, opt.accum_float32))),
                                              opt.segment_bytes);
  // hostReduceInOrder's scratch: two chunks of partials; with two ranks one chunk of elements (only a
  // first input that is the destination is copied).
  const size_t partial = opt.accum_float32 && isHalfType(buf.dtype) ? sizeof(float) : elem;
  const size_t need = (size_ == 2 ? 1 : 2) * static_cast<size_t>(sched.chunk) * (size_ == 2 ? elem : partial);
  if (scratch_.size() * sizeof(float) < need) {
    std::lock_guard<std::mutex> g(mu_);
    scratch_.resize((need + sizeof(float) - 1) / sizeof(float));
  }
  std::vector<const void*> inputs(static_cast<size_t>(size_));
  for (int c = 0; c < size_; ++c) {
    const Range range = sched.chunkRange(c);
    if (range.size() <= 0) continue;
    const size_t offset = static_cast<size_t>(range.begin) * elem;
    for (int j = 0; j < size_; ++j) {
      const int p = (c + j) % size_;
      const char* base = p == rank_ ? static_cast<const char*>(buf.data) : frames_.payload(p);
      inputs[static_cast<size_t>(j)] = base + offset;
    }
    hostReduceInOrder(buf.dtype, opt.op, inputs, static_cast<char*>(buf.data) + offset, range.size(),
                      opt.op == RedOp::kAvg ? size_ : 0, opt.accum_float32, scratch_.data());
  }
  call.body->finish(rank_, size_);
  timing.ring_us = usSince(reduced);
  transport_->callDone();
}

void GroupRuntime::run(Call& call, CallTiming& timing) {
  const CallOptions& opt = call.opt;
  {
    std::lock_guard<std::mutex> g(mu_);
    RR_CHECK(!poisoned_, kBackend, "ringreduce: ", name_, " is unusable after an earlier failure (", poison_reason_,
             "). Tear the process group down and create a new one");
  }
  transport_->setTimeout(opt.timeout_ms > 0 ? std::chrono::milliseconds(opt.timeout_ms) : default_timeout_);
  // Every call takes the ring's next tag group, on every rank alike (Note [Retired tag groups]).
  const int tag_group = call_tags_.next();
  auto payloadTag = [&](size_t stage) {
    return kPayloadTagBase + tag_slot_ * kPayloadTagsPerSlot +
           (tag_group * kStagesPerCall + static_cast<int>(stage)) * kTagsPerCall;
  };
  const bool refused = opt.local_error != FrameError::kNone;
  try {
    CallBuffer buf;
    std::vector<RingStage> stages;
    if (!refused) {
      buf = call.body->prepare(rank_, size_);
      const int64_t bytes = buf.numel * static_cast<int64_t>(dtypeSize(buf.dtype));
      if (opt.check && opt.one_shot && opt.allReduce() && !opt.hierarchical(size_) && frames_.payloadRoom() > 0 &&
          buf.numel > 0 &&
          bytes <= std::min<int64_t>(static_cast<int64_t>(frames_.payloadRoom()), opt.segment_bytes)) {
        runOneShot(call, buf, tag_group, timing);
        return;
      }
      stages = stagesFor(opt, buf);
    }
    // Note [Receives before the verdict]: a checked flat all-reduce over the whole group posts its
    // first payload receive (and sends its first segment) before it waits for the frames.
    RingBuffers lead_bufs;
    std::unique_ptr<PlanRun> lead;
    std::vector<int> lead_slots;
    if (opt.check && frames_.direct() && whole_group_ && opt.allReduce() && stages.size() == 1 &&
        stages[0].plan.num_exchanges > 0) {
      lead_bufs = ringBuffers(stages[0].plan, buf.data, kLeadBytes);
      lead = std::make_unique<PlanRun>(stages[0].plan, stages[0].op, payload_, lead_bufs, payloadTag(0));
    }
    if (opt.check) {
      const Clock::time_point started = Clock::now();
      // The frame leaves first, so that it never queues behind the first segment on the socket;
      // its flag promises the leading receive, posted right after it and before any wait.
      Frame mine = call.body->frame();
      mine.rank = transport_->rank();
      mine.seq = call.seq;
      if (lead && lead->postsLeadingReceive()) mine.flags |= kFrameLeadReceive;
      if (frames_.direct()) frames_.send(ring_transport_, mine);
      if (lead) lead_slots = lead->postLeading(kLeadBytes, kLeadBytes);
      std::string post_error;
      const std::vector<Frame> frames = frames_.collect(ring_transport_, mine, &post_error);
      timing.check_us = usSince(started);
      const std::string verdict = compareFrames(frames, name_);
      if (!verdict.empty()) {
        // Every rank has the same frames, so every rank fails here and retires this tag group. A
        // first segment already sent to a rank that posted its leading receive for this call is
        // delivered (it reads the caller's tensor, which is the caller's again once this raises).
        if (lead && lead->leadingSend() >= 0) {
          const Frame& next = frames[static_cast<size_t>((rank_ + 1) % size_)];
          if ((next.flags & kFrameLeadReceive) != 0 && next.seq == mine.seq) payload_.wait(lead->leadingSend());
        }
        retireLeading(lead_slots, tag_group);
        transport_->callDone();
        RR_THROW(kRuntime, verdict);
      }
      if (!post_error.empty()) {
        // This call has its frames and goes on; later calls fail at once (a peer left).
        std::lock_guard<std::mutex> g(mu_);
        poisoned_ = true;
        poison_reason_ = "during call #" + std::to_string(call.seq) +
                         ", the next call's agreement-frame receives could not be posted (did a peer leave?): " +
                         post_error;
      }
    }
    RR_CHECK(!refused, kRuntime, "ringreduce: call #", call.seq, " refused on this rank");

    const Clock::time_point started = Clock::now();
    for (size_t k = 0; k < stages.size(); ++k) {
      const RingStage& st = stages[k];
      if (k == 0 && lead) {
        lead->run();
        continue;
      }
      if (st.plan.num_exchanges == 0) continue;
      void* data = static_cast<char*>(buf.data) + st.offset * static_cast<int64_t>(dtypeSize(st.plan.dtype));
      RankMapTransport t(payload_, st.members, st.index());
      executePlan(st.plan, st.op, t, ringBuffers(st.plan, data, 0), payloadTag(k));
    }
    call.body->finish(rank_, size_);
    timing.ring_us = usSince(started);
    transport_->callDone();
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kBackend) {
      const std::string what = e.what();
      poison("call #" + std::to_string(call.seq) + " failed: " + what);
      // Every error names the call (sequence number, collective) and the group.
      throw Error(ErrorKind::kBackend, "ringreduce: call #" + std::to_string(call.seq) + " (" +
                                           callKindName(static_cast<int32_t>(opt.kind)) + ") on " + name_ +
                                           " failed; the group is now unusable for ringreduce. " + what);
    }
    throw;
  }
}

int64_t GroupRuntime::stagingBytes() {
  std::lock_guard<std::mutex> g(mu_);
  int64_t total = 0;
  for (int64_t b : slot_sizes_) total += b;
  return total;
}

int64_t GroupRuntime::memoryBytes() {
  const int64_t slots = stagingBytes();
  std::lock_guard<std::mutex> g(mu_);
  return slots + static_cast<int64_t>(frames_.memoryBytes() + scratch_.size() * sizeof(float) +
                                      accum_.size() * sizeof(float));
}

std::vector<int64_t> GroupRuntime::bytesSent(bool reset) {
  std::vector<int64_t> out(static_cast<size_t>(transport_->size()), 0);
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = reset ? sent_[i].exchange(0, std::memory_order_relaxed) : sent_[i].load(std::memory_order_relaxed);
  return out;
}

}  // namespace rr
