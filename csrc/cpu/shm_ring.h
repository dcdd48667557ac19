// ringreduce CPU: the all-reduce of ranks that share a host, through one shared-memory segment per
// ring (torch-free; the segment comes from agreeOnSegment, csrc/cpu/shm_segment.h).
//
// Note [Shared-memory all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The segment holds, per rank, two agreement-frame slots and two data buffers of kShmBufferBytes
// (alternating by call and by piece, so that a rank writing the next one never overwrites what a
// slower rank still reads), and one arrival counter per rank for the barrier. A call:
//   1. writes its frame and copies the first piece of its tensor (up to kShmBufferBytes) into its
//      own buffer, then meets the others at a barrier; every rank compares all frames (the check
//      costs no message: it is always on here) and either all go on or all raise;
//   2. "full" pieces (two ranks, or pieces of at most kShmFullPieceBytes): every rank reduces the
//      whole piece itself, reading every rank's buffer, into its own tensor; the next piece is
//      copied in and the ranks meet again (one barrier per piece);
//      "split" pieces (more ranks, larger pieces): rank r reduces its 1/n of the piece into its own
//      buffer, the ranks meet, every rank copies every rank's part out, copies the next piece in and
//      the ranks meet again (two barriers per piece);
//   3. elements are combined in the ring's order (chunk c of the ring's schedule starts with rank
//      c's elements, then c + 1's, ...: hostReduceInOrder), so results are bitwise the TCP ring's,
//      on every rank, for every segment and piece size.
// Note [Half types in shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Nothing travels over a wire here, so a float16/bfloat16 SUM or AVG costs no bytes for float32
// partials: by default every reduce keeps the sum of all ranks' elements in float32 (registers and
// the kReduceInOrderBlock scratch) and rounds once, when it stores the result (AVG: the float32 sum
// divided by n, then rounded). The result is correctly rounded wherever the float32 sum is exact,
// and identical on every rank (one owner per element in split pieces, the same order everywhere in
// full ones). accum_dtype set to the tensor's own dtype (CallOptions::accum_narrow) keeps the
// ring's per-hop rounding; gloo point-to-point and NCCL keep it by default, since there float32
// partials double the bytes (docs/design.md section 1.5).
// Note [Shared-memory 16-bit wire]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A float32 all-reduce with 16-bit partials (wire_dtype; Note [Reduction contract] in
// csrc/core/functors.h) cannot read every rank's float32 copy the way the direct algorithm does and
// still save anything: the hops of the ring are what it rounds. So larger ones run the ring itself
// in the segment (allReduceWire), round by round; round g covers segment g of every chunk of the
// ring's schedule (so ranks work on different chunks at once, as on the wire). Step s of a round:
// rank r makes the partial of chunk r - s: s = 0 converts its own float32 elements to 16 bits
// (Note [First hop] in plan.h), 0 < s < n - 1 adds its float32 elements to the previous rank's
// 16-bit partial in float32 and stores 16 bits, and s = n - 1 (its owned chunk) stores the float32
// result, scaled once, into its tensor and its buffer; after each step the ranks meet. The next
// round's first step then copies every other rank's finished float32 segment out (the all-gather).
// Partials and results alternate between the two buffers of a rank by step, so no rank writes a
// buffer that another may still read. The arithmetic is the gloo ring's, step for step, so the bits
// are the same as over gloo and the one-shot path (and as allReduce's emulation for small tensors).
// A rank moves 2 bytes per element of a partial where the direct algorithm reads 4 per rank; the
// all-gather still moves float32 (docs/algorithm.md, docs/performance.md).
//
// The barrier: a rank publishes its arrival (release), then spins briefly on the others' counters
// and sleeps on a futex word that every arrival bumps (and wakes only when someone sleeps): with
// more busy threads than cores, a spinning waiter would take the core its peer needs. Each rank
// publishes the core it arrived on; a waiter does not spin at all while a missing peer last ran on
// its own core (two ranks that the scheduler put on one core, beside other load: 2 ranks, 1 KiB on
// 2 vCPUs pinned to one core, 290 us per call spinning out the 200 us, 62-70 us sleeping at once;
// 16 us on two cores either way). A peer that
// dies is noticed by its pid within kShmLivenessPoll; a silent one at the timeout: both are
// rr::Error(kBackend), and the ring is never used again. A rank whose barrier fails (a dead or
// silent peer, Ctrl-C) marks itself as gone in the segment, so that the others raise at their next
// liveness poll instead of at their timeout. Nothing is ever read from the segment
// into user memory before the barrier that publishes it, so a peer that dies mid-call cannot leave
// garbage in a tensor of a call that then succeeds.
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
constexpr auto kShmLivenessPoll = std::chrono::milliseconds(100);
constexpr auto kShmAbortPoll = std::chrono::milliseconds(50);

class ShmRing {
 public:
  // Bytes of the segment of a ring of `size` ranks (the memory bound: about 2 x size x kShmBufferBytes).
  static size_t segmentBytes(int size);

  // `mapping`: the ring's segment (agreeOnSegment). Publishes this process's pid.
  ShmRing(ShmMapping mapping, int rank, int size);

  void setTimeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  // The longest a barrier spins before it sleeps (Note [Shared-memory all-reduce]; the default
  // depends on ranks and cores): a call that overlaps with the caller's own work (an async call on
  // the ring's worker) spins briefly, since its spin takes a core from that work.
  void setSpinCap(std::chrono::microseconds cap) { spin_cap_ = cap; }
  // Asked while a barrier waits (at least every kShmAbortPoll): a non-empty reason ends the wait
  // with rr::Error(kBackend, reason) (Note [Interrupting a wait]). Set before a call, never during.
  void setAbortCheck(AbortCheck check) { abort_ = std::move(check); }

  // Step 1 of the call: publishes `mine` and, when `data` is not null, the first piece of the
  // call's tensor, meets the others, and returns every rank's frame, by ring rank.
  std::vector<Frame> begin(const Frame& mine, const void* data, int64_t numel, DType dtype);
  // Steps 2-3, after begin() with the same tensor and a verdict that passed: `data` becomes the
  // reduction over the ring, in place, with partials of `partial` between hops (partialDType,
  // plan.h) and `final` the scaling of the last hop (finalScaling, functors.h: AVG divides by the
  // ring's size once; its predivide applies to every contribution).
  void allReduce(void* data, int64_t numel, DType dtype, RedOp op, DType partial, const Scaling& final);
  // Note [Shared-memory 16-bit wire]: the float32 all-reduce of `data` with 16-bit partials of
  // `partial` (SUM or AVG; `final` as in allReduce), after begin() without data and a verdict that
  // passed. Bitwise allReduce's result.
  void allReduceWire(float* data, int64_t numel, RedOp op, DType partial, const Scaling& final);
  // Whether allReduceWire pays off for `numel` float32 elements (else allReduce emulates the hops).
  static bool wireRingPays(int64_t numel);

  // The ring halves over `sched` (this ring's size; owner(r) = ownedChunk(r), chunk c starting at
  // the rank after its owner): reduce_scatter and all_gather after begin() (Note [Ring halves] in
  // plan.h), and the node stages of the hierarchical all-reduce (Note [Hierarchical all-reduce] in
  // csrc/core/collectives.h), which need no frames (the whole ring compared them).
  // reduceScatter: this rank's owned chunk of `data` becomes the ring's reduction of it, combined
  // in the ring's order (AVG divides by the ring's size); the rest of `data` is left as it was.
  // allGather: every rank's owned chunk is copied from its owner into `data`.
  // `final`: the scaling of the last hop, as in allReduce (Plan::finalScaling of the stage).
  void reduceScatter(void* data, DType dtype, RedOp op, const struct RingSchedule& sched, const Scaling& final);
  void allGather(void* data, DType dtype, const struct RingSchedule& sched);

  // The next barrier's generation; the same on every rank that made the same calls (for tests).
  uint64_t generation() const { return generation_; }

 private:
  char* buffer(int rank, int parity) const;
  Frame* frameSlot(int rank, int parity) const;
  void barrier();
  // Marks this rank as gone from the ring (peers raise at their next liveness poll) and throws.
  [[noreturn]] void leave(const std::string& why);
  void reducePart(int64_t begin, int64_t end, int64_t piece_offset, int parity, void* dst, DType dtype, RedOp op,
                  DType partial, const Scaling& final, const struct RingSchedule& sched);

  ShmMapping map_;
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
