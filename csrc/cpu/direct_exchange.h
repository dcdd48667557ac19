// ringreduce CPU: runs a direct all-reduce (Note [Direct all-reduce] in csrc/core/direct.h) over a
// Transport on the calling thread: gloo point-to-point between hosts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../core/direct.h"
#include "../core/transport.h"

namespace rr {

struct DirectBuffers {
  void* data = nullptr;         // numel contiguous elements of plan.dtype
  std::vector<void*> buffers;   // plan.numBuffers() staging buffers of plan.buffer_bytes each
  std::vector<int64_t> room;    // bytes each buffer holds, when more than plan.buffer_bytes (empty: exact)
  void* scratch = nullptr;      // kReduceInOrderScratchBytes (host_reduce.h)
};

// Note [Direct rounds on gloo]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The reduce-scatter posts the receives of the first `depth` rounds, then their sends (gloo's send
// waits for the receiver's notice: Note [gloo pair locks] in c10d_transport.h), each round to its
// peers in the order r + 1, r + 2, ... so that no rank is everyone's first. Round g's reduce waits
// for its receives alone; its sends are waited for before round g + depth reuses their buffers
// (the wire's converted pieces) and posts. The all-gather does the same with the finished pieces,
// once every reduce-scatter round is over (it reuses the receive buffers), and widens or copies
// each received piece into the tensor. Every receive lands in staging; every request of the call is
// waited for before it returns (the transport keeps what a failure leaves: Note [Failed calls keep
// their buffers] in group_runtime.h). Reduce-scatter round g's messages use scatter_tag + (g + 1)
// mod kTagsPerCall (offset 0 is the ring's leading exchange: Note [Direct before the verdict]), the
// all-gather's gather_tag + g mod kTagsPerCall.
//
// Note [Direct before the verdict]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checked call learns that every rank agrees only once every rank's frame arrived, a wait as long
// as the slowest rank's start. The ring spends it sending its first segment (Note [Receives before the
// verdict] in group_runtime.h); a direct all-reduce without a wire spends it on round 0 of its
// reduce-scatter: postLeading posts round 0's n - 1 receives of directLeadRoom(n) bytes each and
// the first (up to) that many bytes of each of its pieces, before the frames are compared; run()
// sends and receives the rest of a larger piece as a second message on the same tag (messages with
// equal peer and tag match in posting order). Nothing lands in the tensor before run(): receives
// land in staging, sends read the tensor.
// A rank that disagrees cannot break this: a direct rank sends at most directLeadRoom(n) bytes before
// its verdict and only on tag offset 1 (which a ring rank never posts before its verdict: it posts
// offset 0), so every message sent before a verdict fits the receive it meets, or meets none and stays
// with its sender. When the verdict fails, a rank waits for its leading send to each peer whose frame
// says kFrameDirectLead (that peer posted round 0's receives, all of them) for the same call, then
// retires the call's tag group and the receives' slots, as the ring does. The room, kDirectLeadBytes
// (the ring's kLeadBytes, 1 MiB) / (n - 1), keeps the staging within the ring's bound.
constexpr int64_t kDirectLeadBytes = 1 << 20;
constexpr int64_t directLeadRoom(int nranks) {
  return nranks > 1 ? kDirectLeadBytes / (nranks - 1) / 16 * 16 : 0;
}

// One execution of a direct plan, in two steps like the ring's PlanRun: postLeading while the caller
// waits for the frames, then run(). `plan`, `transport` and `buffers` must outlive it.
class DirectRun {
 public:
  DirectRun(const DirectPlan& plan, Transport& transport, const DirectBuffers& buffers, int scatter_tag,
            int gather_tag);
  // Whether postLeading would post round 0's receives from every peer: no wire (a wire's sends read
  // staging), and this rank's chunk has elements in round 0.
  bool postsLeadingReceives() const;
  // The staging buffers postLeading's receives land in (each needs directLeadRoom(n) bytes).
  std::vector<int32_t> leadingBuffers() const;
  // Posts round 0's receives (postsLeadingReceives) and the first directLeadRoom(n) bytes (at most) of
  // each of its sends.
  // Once, before run().
  void postLeading();
  // The leading send to group rank `peer` (else -1).
  int64_t leadingSend(int peer) const { return lead_send_.empty() ? -1 : lead_send_[static_cast<size_t>(peer)]; }
  void run();  // once

 private:
  enum class Part { kWhole, kLead, kRest };  // of a round's pieces: all, the leading part, the rest
  void postScatterRecvs(int g, std::vector<int64_t>& reqs, Part part);
  // Round g's sends of at most max_bytes each (round 0: those not posted yet); `leading`: recorded
  // as leading sends.
  void postScatterSends(int g, std::vector<int64_t>& reqs, size_t max_bytes, bool leading);

  const DirectPlan& plan_;
  Transport& t_;
  const DirectBuffers& b_;
  int scatter_tag_;
  int gather_tag_;
  bool leading_ = false;  // postLeading posted round 0's messages (no wire)
  std::vector<int64_t> lead_recvs_;
  std::vector<int64_t> lead_send_;  // per peer, -1: none
  std::vector<size_t> sent0_;       // per peer: bytes of round 0's piece sent
};

void executeDirect(const DirectPlan& plan, Transport& transport, const DirectBuffers& buffers, int scatter_tag,
                   int gather_tag);

}  // namespace rr
