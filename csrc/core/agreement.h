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

// All-gather of one fixed-size frame: returns every rank's frame, indexed by ring rank. Posts and
// waits for everything it needs. Used by the CPU runtime (through FrameAgreement) and by the GPU
// path (CudaRing::exchangeFrames, over csrc/cuda/nccl_frame_transport.h).
std::vector<Frame> exchangeFrames(Transport& transport, const Frame& mine, int tag);

// Note [Frames around the ring]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Straight to every peer, the frames take one message latency; around the ring, n - 1. The ring
// is used beyond kDirectFrameRanks ranks, and on a transport whose messages should reach ring
// neighbours only (Transport::neighboursOnly). NCCL is one: it sets up a connection, with buffers
// of its own, for each pair of ranks the first time they exchange, and the payload of a ring only
// ever connects neighbours, so direct frames would connect every other pair just for the check.
// Each hop sends one frame to the next rank and receives one from the previous, the pair posted
// together, and waits for both before the next hop forwards what it received.

// Note [Pre-posted frame receives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On a transport whose send is a rendezvous (Transport::rendezvousSends: gloo's payload leaves
// only once the receiver has announced a posted receive), frames exchanged over receives posted
// at call time cost a round trip, and on an oversubscribed host the wake-ups of both sides, before
// the first payload byte moves. A ring over a whole group therefore keeps the receives of its next
// frame exchange posted, into memory this object owns; a call only posts its sends, which leave at
// once. The next receives are posted as soon as a call has collected its frames, when every peer
// is at the start of the same call, past its own frame sends, rather than at the end of the call,
// when peers may still be writing their last segments (on gloo a receive notice that reaches a
// rank while it writes a segment makes gloo's I/O thread spin on the pair's lock: Note [gloo pair
// locks] in csrc/cpu/c10d_transport.h). One call's worth at a time: posting 16 calls' worth made
// gloo's own all_reduce in the same processes ~15 % slower (4 ranks, 1 MiB, measured at 58875ae).
// Receives from one peer on one tag match in order, so calls made with the check off leave them for
// the next checked call. Only a ring over a whole group may do this: rank-list rings share tag
// slots by hash, and a receive left posted on a shared tag could capture another ring's frame.
//
// Note [Payload in the frame message]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With pre-posted receives, every receive has room for a frame and up to `payload_room` bytes
// after it, so a small call can send its whole tensor with its frame: one message per peer and
// call, the check included (the one-shot all-reduce, Note [One-shot all-reduce] in
// csrc/cpu/group_runtime.h). A frame sent alone is a shorter message, which a larger receive
// accepts (gloo refuses only a message larger than its receive). The receives alternate between
// two buffers, so that the next call's receives, posted as soon as this call's frames are in,
// never land in the payloads this call still reduces.
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
  // may still write into is kept for the rest of the process.
  void abandon();

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
