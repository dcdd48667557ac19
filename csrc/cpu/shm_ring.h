// ringreduce CPU: the all-reduce of ranks that share a host, through one shared-memory segment per
// ring (torch-free; the segment comes from agreeOnSegment, csrc/cpu/shm_segment.h).
//
// Note [Shared-memory all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The segment holds, per rank, two frame slots and two data buffers of kShmBufferBytes (alternating
// by call and by piece, so a rank writing the next never overwrites what a slower rank still reads)
// and an arrival counter for the barrier. A call writes its frame and first piece and meets the
// others at a barrier, where every rank compares all frames (no message: always checked). A "full"
// piece (two ranks, or at most kShmFullPieceBytes) is reduced whole by every rank into its tensor
// (one barrier); a "split" piece is reduced 1/n per rank into its buffer and copied out by all (two
// barriers). Where the ranks outnumber the host's online cores, a full piece's n reductions of the
// whole take turns on the cores, so pieces above kShmSharedCoresFullPieceBytes are split (4 ranks on
// 2 cores: 256 KiB in 0.66-0.84x the full pieces' time, docs/performance.md). Elements combine
// in the ring's order (hostReduceInOrder): bitwise the TCP ring's result, full or split.
// Note [Half types in shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Float32 partials cost no bytes here, so a float16/bfloat16 SUM or AVG sums in float32 by default
// and rounds once when it stores (AVG: divided first). accum_dtype set to the tensor's dtype
// (CallOptions::accum_narrow) keeps the ring's per-hop rounding (docs/design.md section 1.5).
// Note [Shared-memory 16-bit wire]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Float32 with 16-bit partials must round at the ring's hops, so larger calls run the ring itself
// in the segment (allReduceWire), round g covering segment g of every chunk. At step s rank r makes
// chunk r - s's partial: s = 0 converts (Note [First hop] in plan.h), 0 < s < n - 1 adds to the
// previous rank's 16-bit partial, s = n - 1 stores the scaled float32 result into tensor and buffer;
// ranks meet after each step, and the next round's first step copies the finished segments out.
// Buffers alternate by step. Same arithmetic, so the same bits, as the gloo ring and the one-shot.
//
// The barrier (Note [Barrier wait rule] in shm_ring.cpp): a rank publishes its arrival (release),
// spins briefly on the others' counters, then sleeps on a futex word that every arrival bumps.
// A dead peer (or an unreaped zombie) is noticed by its pid within kShmLivenessPoll, a silent one at the timeout: both
// raise rr::Error(kBackend) and the ring is never used again. A rank whose barrier fails marks
// itself gone in the segment, so the others raise at their next liveness poll; so does a rank whose
// ring is released (~ShmRing of a ring that owns its mapping, which it unmaps). Nothing is read
// from the segment into user memory before the barrier that publishes it, so a peer dying
// mid-call cannot leave garbage in the tensor of a call that succeeds.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../core/dtype.h"
#include "../core/frame.h"
#include "../core/functors.h"
#include "shm_segment.h"

namespace rr {

constexpr size_t kShmBufferBytes = 1 << 20;         // per rank and parity
constexpr size_t kShmFullPieceBytes = 256 << 10;    // larger pieces are split between ranks (n > 2)
constexpr size_t kShmSharedCoresFullPieceBytes = 64 << 10;  // the same when the ranks outnumber the cores
constexpr auto kShmLivenessPoll = std::chrono::milliseconds(100);
constexpr auto kShmAbortPoll = std::chrono::milliseconds(50);

class ShmRing {
 public:
  // Bytes of the segment of a ring of `size` ranks (about 2 x size x kShmBufferBytes).
  static size_t segmentBytes(int size);

  // `mapping`: the ring's segment (agreeOnSegment). Publishes this process's pid. `owns_mapping`: the
  // destructor marks this rank gone and unmaps the segment (the runtime's rings); else the caller
  // unmaps it.
  ShmRing(ShmMapping mapping, int rank, int size, bool owns_mapping = false);
  // With owns_mapping, only once no thread of this process uses the ring (its worker joined): the
  // kernel frees the segment when the last process unmaps it (Note [Releasing a ring's buffers]).
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  void setTimeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  // The longest a barrier spins before it sleeps: short for a call that overlaps the caller's own
  // work (an async call on the worker), whose core the spin would take.
  void setSpinCap(std::chrono::microseconds cap) { spin_cap_ = cap; }
  // Polled while a barrier waits (at least every kShmAbortPoll): a non-empty reason ends the wait
  // with rr::Error(kBackend, reason) (Note [Interrupting a wait]). Set before a call, never during.
  void setAbortCheck(AbortCheck check) { abort_ = std::move(check); }

  // Step 1 of a call: publishes `mine` and, when `data` is not null, the first piece of the tensor,
  // meets the others, and returns every rank's frame, by ring rank.
  std::vector<Frame> begin(const Frame& mine, const void* data, int64_t numel, DType dtype);
  // Steps 2-3, after begin() with the same tensor and a passed verdict: `data` becomes the ring's
  // reduction, in place, with partials of `partial` between hops (partialDType, plan.h) and `final`
  // the last hop's scaling (finalScaling, functors.h).
  void allReduce(void* data, int64_t numel, DType dtype, RedOp op, DType partial, const Scaling& final);
  // The same with any in-order reduction of the ranks' elements (`how.dtype`: the tensor's), each
  // element's contributions combined in the ring's order of its chunk or, with `rank_order`, in rank
  // order 0 .. n - 1 (Note [Direct all-reduce] in csrc/core/direct.h: the direct exchange's bits).
  void allReduce(void* data, int64_t numel, const struct InOrderReduce& how, bool rank_order);
  // Note [Shared-memory 16-bit wire]: after begin() without data; bitwise allReduce's result.
  void allReduceWire(float* data, int64_t numel, RedOp op, DType partial, const Scaling& final);
  // Whether allReduceWire pays off for `numel` float32 elements (else allReduce emulates the hops).
  static bool wireRingPays(int64_t numel);

  // The ring halves over `sched` (Note [Ring halves] in plan.h): reduce_scatter and all_gather after
  // begin(), and the node stages of the hierarchical all-reduce (no frames: the whole ring compared
  // them). reduceScatter: this rank's owned chunk of `data` becomes its reduction in the ring's
  // order, the rest is left as it was; allGather: every owned chunk is copied from its owner.
  void reduceScatter(void* data, DType dtype, RedOp op, const struct RingSchedule& sched, const Scaling& final);
  void allGather(void* data, DType dtype, const struct RingSchedule& sched);
  // The ring half of `st` on `data`: its reduceScatter (with its final scaling), else its allGather.
  void runHalf(const struct RingStage& st, void* data, bool reduce_scatter);

 private:
  char* buffer(int rank, int parity) const;
  Frame* frameSlot(int rank, int parity) const;
  void barrier();
  // Marks this rank as gone from the ring (peers raise at their next liveness poll) and throws.
  [[noreturn]] void leave(const std::string& why);
  void reducePart(int64_t begin, int64_t end, int64_t piece_offset, int parity, void* dst,
                  const struct InOrderReduce& how, bool rank_order, const struct RingSchedule& sched);

  ShmMapping map_;
  bool owns_mapping_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_{std::chrono::minutes(30)};
  uint64_t generation_ = 0;  // barriers passed
  uint64_t calls_ = 0;       // frame parity
  uint64_t pieces_ = 0;      // buffer parity
  int64_t first_piece_ = 0;  // elements of the tensor copied in by begin()
  std::vector<char> scratch_;
  AbortCheck abort_;
  std::chrono::microseconds spin_cap_{std::chrono::microseconds::max()};
};

}  // namespace rr
