// ringreduce core: the all-gather of the agreement frames (Note [Cross-rank agreement] in frame.h),
// over the Transport seam.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "frame.h"
#include "transport.h"

namespace rr {

// Up to this many ranks, frames go straight to every peer (one message latency); beyond, around
// the ring (n - 1 hops).
constexpr int kDirectFrameRanks = 16;

// All-gather of one fixed-size frame: every rank's frame, by ring rank. Posts and waits for
// everything it needs. Used by FrameAgreement and by the GPU path (CudaRing::exchangeFrames).
std::vector<Frame> exchangeFrames(Transport& transport, const Frame& mine, int tag);

// Note [Frames around the ring]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Frames go around the ring (n - 1 latencies instead of one) beyond kDirectFrameRanks ranks and on
// a transport that should reach ring neighbours only (Transport::neighboursOnly): NCCL sets up a
// connection with its own buffers for each pair on their first exchange, and a ring's payload only
// connects neighbours. Each hop posts one send to the next rank and one receive from the previous
// together and waits for both before the next hop forwards what it received.

// Note [Pre-posted frame receives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On a transport whose send is a rendezvous (Transport::rendezvousSends: gloo sends only once the
// receiver announced its receive), receives posted at call time cost a round trip before the first
// payload byte moves. A ring over a whole group therefore keeps its next frame receives posted,
// into memory this object owns, and a call only posts its sends. They are posted as soon as a call
// has collected its frames, when every peer is past its own frame sends, not at the call's end,
// when peers may still be writing segments (Note [gloo pair locks] in csrc/cpu/c10d_transport.h).
// One call's worth at a time: more slowed gloo's own collectives in the same processes. Receives
// from one peer on one tag match in order, so unchecked calls leave them for the next checked call.
// Only a whole-group ring may do this: rank-list rings share tag slots by hash, and a receive left
// posted on a shared tag could capture another ring's frame.
//
// Note [Payload in the frame message]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Pre-posted receives have room for a frame and `payload_room` bytes, so a small call can send its
// whole tensor with its frame (Note [One-shot all-reduce] in csrc/cpu/group_runtime.h). A frame sent
// alone is a shorter message, which a larger receive accepts. The receives alternate between two
// buffers, so the next call's receives never land in payloads this call still reduces.
class FrameAgreement {
 public:
  // `keep_posted`: pre-post the next call's receives (direct frames only), each with room for
  // `payload_room` bytes after the frame.
  FrameAgreement(int size, int rank, int tag, bool keep_posted, size_t payload_room = 0);
  ~FrameAgreement();
  FrameAgreement(const FrameAgreement&) = delete;
  FrameAgreement& operator=(const FrameAgreement&) = delete;

  bool direct() const { return size_ <= kDirectFrameRanks; }
  // Payload bytes a frame message may carry (0 unless the receives are pre-posted).
  size_t payloadRoom() const { return keep_posted_ ? payload_room_ : 0; }

  // Direct frames: posts this rank's frame, followed by `payload_bytes` (<= payloadRoom()) bytes
  // from `payload`, to every peer (the receives first when none is posted).
  void send(Transport& t, const Frame& mine, const void* payload = nullptr, size_t payload_bytes = 0);
  // Waits for every peer's frame (direct: sent by send(); otherwise a full exchangeFrames) and
  // returns all frames, by ring rank. With keep_posted it then posts the next call's receives;
  // when that fails (a peer left), the frames are still valid and *post_error says why.
  std::vector<Frame> collect(Transport& t, const Frame& mine, std::string* post_error);
  // Bytes of the receive and send buffers (allocated at the first send()).
  size_t memoryBytes() const {
    return allocated_.load(std::memory_order_relaxed) ? (2 * static_cast<size_t>(size_ - 1) + 1) * slotBytes() : 0;
  }
  // After collect(): the payload that came with rank p's frame (valid until the next collect()).
  const char* payload(int p) const;
  // After a transport failure (the transport abandons the requests): the memory pending receives
  // may still write into is kept for the rest of the process, unless transportClosed() follows.
  void abandon();
  // The transport closed every request this object posted and promised that nothing lands in their
  // memory any more (Transport::close): the destructor frees the buffers. Nothing is posted after it.
  void transportClosed();

 private:
  void postReceives(Transport& t);
  size_t slotBytes() const { return kFrameBytes + payloadRoom(); }
  // Peer p's receive slot in set `buffer` (no slot for this rank).
  char* inSlot(int buffer, int p) const {
    return in_[buffer].get() + static_cast<size_t>(p < rank_ ? p : p - 1) * slotBytes();
  }

  const int size_;
  const int rank_;
  const int tag_;
  const bool keep_posted_;
  const size_t payload_room_;
  std::unique_ptr<char[]> in_[2];  // two sets of size_ - 1 receive slots (Note [Payload in the frame message])
  int posted_ = 0;                 // the set the pending receives land in
  int collected_ = 0;              // the set of the last collected frames
  std::unique_ptr<char[]> out_;    // this rank's message while its sends are in flight
  std::vector<int64_t> recvs_;     // by ring rank; empty: none posted
  std::vector<int64_t> sends_;
  bool leaked_ = false;            // abandon(): the buffers are never freed
  std::atomic<bool> allocated_{false};  // memoryBytes() is read by other threads
};

}  // namespace rr
