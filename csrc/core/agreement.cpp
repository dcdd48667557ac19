#include "agreement.h"

#include <cstring>

#include "error.h"

namespace rr {

std::vector<Frame> exchangeFrames(Transport& t, const Frame& mine, int tag) {
  const int n = t.size();
  const int r = t.rank();
  std::vector<Frame> frames(static_cast<size_t>(n));
  frames[static_cast<size_t>(r)] = mine;
  if (n <= kDirectFrameRanks && !t.neighboursOnly()) {
    // Straight to every other rank: one message latency instead of the ring's n-1.
    std::vector<int64_t> reqs;
    reqs.reserve(static_cast<size_t>(2 * (n - 1)));
    for (int p = 0; p < n; ++p)
      if (p != r) reqs.push_back(t.irecv(&frames[static_cast<size_t>(p)], kFrameBytes, p, tag));
    for (int p = 0; p < n; ++p)
      if (p != r) reqs.push_back(t.isend(&frames[static_cast<size_t>(r)], kFrameBytes, p, tag));
    for (int64_t q : reqs) t.wait(q);
    return frames;
  }
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;
  // Note [Frames around the ring]: hop h forwards the frame of rank (r - h) and receives the
  // frame of rank (r - h - 1).
  for (int h = 0; h < n - 1; ++h) {
    const int out = (r - h + n) % n;
    const int in = (r - h - 1 + 2 * n) % n;
    const int64_t rq = t.irecv(&frames[static_cast<size_t>(in)], kFrameBytes, prev, tag);
    const int64_t sq = t.isend(&frames[static_cast<size_t>(out)], kFrameBytes, next, tag);
    t.wait(rq);
    t.wait(sq);
  }
  return frames;
}

FrameAgreement::FrameAgreement(int size, int rank, int tag, bool keep_posted, size_t payload_room)
    : size_(size),
      rank_(rank),
      tag_(tag),
      keep_posted_(keep_posted && size <= kDirectFrameRanks),
      payload_room_(payload_room) {}

FrameAgreement::~FrameAgreement() {
  // Receives may still be posted: their memory is leaked (Note [Failed calls keep their buffers]),
  // unless the transport was closed first (transportClosed()).
  if (leaked_ || !recvs_.empty()) {
    for (auto& buf : in_) (void)buf.release();
    (void)out_.release();
  }
}

void FrameAgreement::postReceives(Transport& t) {
  recvs_.assign(static_cast<size_t>(size_), -1);
  for (int p = 0; p < size_; ++p)
    if (p != rank_) recvs_[static_cast<size_t>(p)] = t.irecv(inSlot(posted_, p), slotBytes(), p, tag_);
}

void FrameAgreement::send(Transport& t, const Frame& mine, const void* payload, size_t payload_bytes) {
  RR_CHECK(direct() && !t.neighboursOnly(), kRuntime,
           "ringreduce internal error: ring frames are exchanged by collect() or exchangeFrames()");
  RR_CHECK(payload_bytes <= payloadRoom(), kRuntime, "ringreduce internal error: a payload of ", payload_bytes,
           " bytes in a frame message with room for ", payloadRoom());
  if (!out_) {
    for (auto& buf : in_) buf.reset(new char[static_cast<size_t>(size_ - 1) * slotBytes()]);
    out_.reset(new char[slotBytes()]);
    allocated_.store(true, std::memory_order_relaxed);
  }
  if (recvs_.empty()) postReceives(t);
  std::memcpy(out_.get(), &mine, kFrameBytes);
  if (payload_bytes > 0) std::memcpy(out_.get() + kFrameBytes, payload, payload_bytes);
  sends_.clear();
  for (int p = 0; p < size_; ++p)
    if (p != rank_) sends_.push_back(t.isend(out_.get(), kFrameBytes + payload_bytes, p, tag_));
}

std::vector<Frame> FrameAgreement::collect(Transport& t, const Frame& mine, std::string* post_error) {
  if (!direct()) return exchangeFrames(t, mine, tag_);
  RR_CHECK(!recvs_.empty(), kRuntime, "ringreduce internal error: frames collected before they were sent");
  for (int64_t q : recvs_)
    if (q >= 0) t.wait(q);
  for (int64_t q : sends_) t.wait(q);
  sends_.clear();
  collected_ = posted_;
  std::vector<Frame> frames(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) frames[static_cast<size_t>(p)] = mine;
    else std::memcpy(&frames[static_cast<size_t>(p)], inSlot(collected_, p), kFrameBytes);
  }
  recvs_.clear();
  if (keep_posted_) {
    posted_ = 1 - collected_;
    try {
      postReceives(t);
    } catch (const Error& e) {
      // The call has its frames: a peer that left after sending its own is the next call's problem.
      abandon();
      if (post_error != nullptr) *post_error = e.what();
    }
  }
  return frames;
}

const char* FrameAgreement::payload(int p) const {
  RR_CHECK(in_[collected_] != nullptr && p >= 0 && p < size_, kRuntime, "ringreduce internal error: no payload of rank ", p);
  return inSlot(collected_, p) + kFrameBytes;
}

void FrameAgreement::transportClosed() {
  leaked_ = false;
  recvs_.clear();
  sends_.clear();
}

void FrameAgreement::abandon() {
  // The buffers are never freed now (a late frame may land in them); the last payloads stay readable.
  leaked_ = true;
  recvs_.clear();
  sends_.clear();
}

}  // namespace rr
