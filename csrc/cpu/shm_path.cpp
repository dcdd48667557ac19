#include "shm_path.h"

#include <cstdio>

#include "../core/agreement.h"
#include "../core/direct.h"
#include "host_reduce.h"

namespace rr {

namespace {

using Clock = std::chrono::steady_clock;
double usSince(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

// Note [Shared-memory segments]: a ring's store keys are ringreduce/shm/<prefix><its group ranks>.
std::string shmRingId(std::string prefix, const std::vector<int>& ranks) {
  for (int m : ranks) prefix += std::to_string(m) + ",";
  return prefix;
}

}  // namespace

ShmPath::ShmPath(std::string name, std::vector<int> ranks, int index, bool whole_group,
                 std::shared_ptr<KeyValueStore> store, AbortCheck abort)
    : name_(std::move(name)),
      ranks_(std::move(ranks)),
      index_(index),
      size_(static_cast<int>(ranks_.size())),
      whole_group_(whole_group),
      store_(std::move(store)),
      abort_(std::move(abort)) {}

std::unique_ptr<ShmRing> ShmPath::setUp(const std::string& ring_id, const std::vector<int>& ranks, int index,
                                        bool want, std::chrono::milliseconds timeout, std::string* why) {
  // Note [Shared-memory segments]: one agreement per ring and setup, under keys of its own.
  const int size = static_cast<int>(ranks.size());
  const std::string base = "ringreduce/shm/" + ring_id;
  const int64_t setup = (store_->add(base + "/setups", 1) - 1) / size;
  ShmMapping mapping;
  *why = agreeOnSegment(*store_, base + "/" + std::to_string(setup), index, size, ShmRing::segmentBytes(size), want,
                        timeout, &mapping, abort_);
  if (!why->empty()) {
    // Warn only when shared memory should have worked (RINGREDUCE_SHM=0 and several hosts are choices).
    if (why->rfind("RINGREDUCE_SHM=0", 0) != 0 && why->find("more than one host") == std::string::npos)
      std::fprintf(stderr, "[ringreduce] warning: %s uses gloo point-to-point instead of shared memory: %s\n",
                   name_.c_str(), why->c_str());
    return nullptr;
  }
  auto ring = std::make_unique<ShmRing>(mapping, index, size, /*owns_mapping=*/true);
  ring->setAbortCheck(abort_);
  return ring;
}

bool ShmPath::ensure(bool want, std::chrono::milliseconds timeout) {
  if (tried_) return ring_ != nullptr;
  tried_ = true;
  if (!store_ || size_ < 2) {
    std::lock_guard<std::mutex> g(mu_);
    state_ = "tcp";
    return false;
  }
  std::string why;
  std::unique_ptr<ShmRing> ring = setUp(whole_group_ ? "all" : shmRingId("", ranks_), ranks_, index_, want, timeout, &why);
  std::lock_guard<std::mutex> g(mu_);
  if (!ring) {
    state_ = "tcp (" + why + ")";
    return false;
  }
  ring_ = std::move(ring);
  state_ = "shm";
  ready_.store(true, std::memory_order_release);
  return true;
}

void ShmPath::spansNodes() {
  std::lock_guard<std::mutex> g(mu_);
  if (state_.empty()) state_ = "tcp (the ring spans several nodes)";
}

ShmRing* ShmPath::node(bool want, const RingStage& node_stage, std::chrono::milliseconds timeout) {
  if (!store_ || node_stage.members.size() < 2) return nullptr;
  if (node_tried_) return node_ && node_members_ == node_stage.members ? node_.get() : nullptr;
  node_tried_ = true;
  node_members_ = node_stage.members;
  std::string why;
  std::unique_ptr<ShmRing> ring =
      setUp(shmRingId("node:", node_stage.members), node_stage.members, node_stage.index(), want, timeout, &why);
  std::lock_guard<std::mutex> g(mu_);
  node_state_ = ring ? "shm" : "tcp (" + why + ")";
  node_ = std::move(ring);
  return node_.get();
}

void ShmPath::arm(std::chrono::milliseconds timeout, std::chrono::microseconds spin) {
  ring_->setTimeout(timeout);
  ring_->setSpinCap(spin);
}

bool ShmPath::run(const CallOptions& opt, const Frame& mine, const CallBuffer& buf, bool refused, uint64_t seq,
                  CallBody& body, const std::function<std::vector<RingStage>()>& stages, CallTiming& timing) {
  const Clock::time_point started = Clock::now();
  const bool direct = !refused && opt.directAllReduce();
  const bool flat = !refused && opt.allReduce() && (direct || !opt.hierarchical(size_));
  // Note [Shared-memory 16-bit wire]: larger float32 all-reduces with a 16-bit wire run the ring.
  // Note [Half types in shared memory]: half-type sums accumulate in float32 by default.
  const DType partial = flat ? opt.shmPartial(buf.dtype, size_) : buf.dtype;
  const bool wire_ring = flat && !direct && buf.dtype == DType::kFloat32 && isHalfType(partial) &&
                         ShmRing::wireRingPays(buf.numel);
  const std::vector<Frame> frames = ring_->begin(mine, flat && !wire_ring ? buf.data : nullptr, buf.numel, buf.dtype);
  timing.check_us = usSince(started);
  const std::string verdict = compareFrames(frames, name_);
  RR_CHECK(verdict.empty(), kRuntime, verdict);
  RR_CHECK(!refused, kRuntime, "ringreduce: call #", seq, " refused on this rank");
  const Clock::time_point moved = Clock::now();
  if (!flat) {
    if (opt.allReduce()) return false;  // an explicit algorithm="hierarchical" on one host: its stages
    // The ring halves in the segment: rank r's block is reduced (or copied) from every rank's.
    ring_->runHalf(stages()[0], buf.data, opt.kind == CallKind::kReduceScatter);
  } else if (direct) {  // Note [Direct all-reduce]: every element in rank order, as over gloo
    ring_->allReduce(buf.data, buf.numel, directInOrder(buf.dtype, size_, opt.directOptions(buf.dtype)),
                     /*rank_order=*/true);
  } else if (wire_ring) {
    ring_->allReduceWire(static_cast<float*>(buf.data), buf.numel, opt.op, partial,
                         opt.flatFinalScaling(buf.dtype, size_, partial));
  } else {
    ring_->allReduce(buf.data, buf.numel, buf.dtype, opt.op, partial, opt.flatFinalScaling(buf.dtype, size_, partial));
  }
  body.finish(index_, size_);
  timing.ring_us = usSince(moved);
  return true;
}

int64_t ShmPath::memoryBytes() {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int64_t>((ring_ ? ShmRing::segmentBytes(size_) + kReduceInOrderScratchBytes : 0) +
                              (node_ ? ShmRing::segmentBytes(static_cast<int>(node_members_.size())) +
                                           kReduceInOrderScratchBytes
                                     : 0));
}

std::string ShmPath::info() {
  std::lock_guard<std::mutex> g(mu_);
  return node_state_.empty() ? state_ : state_ + "; node stages: " + node_state_;
}

}  // namespace rr
