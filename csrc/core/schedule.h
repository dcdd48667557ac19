// ringreduce core: the ring schedule, i.e. which elements form which chunk and segment.
//
// Note [Chunk ownership]
// ~~~~~~~~~~~~~~~~~~~~~~
// The tensor is cut into n chunks of ceil(numel / n) elements rounded up to 16 bytes (the last ones
// shorter or empty). Chunk c starts its reduction at rank c and completes at rank c - 1, its owner:
// owner(r) = chunk (r + 1) mod n. The bounds depend on (n, numel, element size) only, never on the
// segment size, so the combine order, and every result bit, is the same for any pipelining. Each
// chunk is cut into `nsegs` segments of min(max_segment, ceil(chunk / 2)) elements rounded to 16
// bytes, so even a 1 MiB message has two segments in flight.
#pragma once

#include "common.h"

namespace rr {

struct Range {
  int64_t begin;
  int64_t end;
  RR_HD_INLINE int64_t size() const { return end - begin; }
  RR_HD_INLINE bool empty() const { return end <= begin; }
};

struct RingSchedule {
  int32_t nranks = 1;
  int64_t numel = 0;
  int64_t align = 1;    // elements per 16 bytes
  int64_t chunk = 0;    // nominal elements per chunk (multiple of align)
  int64_t segment = 0;  // elements per segment (multiple of align)
  int32_t nsegs = 0;    // segments per chunk
  int32_t shift = 0;    // owner map rotation: rank r owns chunk (r + 1 + shift) mod n

  RR_HD_INLINE Range chunkRange(int c) const {
    const int64_t b = minI64(static_cast<int64_t>(c) * chunk, numel);
    const int64_t e = minI64(static_cast<int64_t>(c + 1) * chunk, numel);
    return Range{b, e};
  }
  // Segment j of chunk c, in elements of the whole tensor.
  RR_HD_INLINE Range segmentRange(int c, int j) const {
    const Range ch = chunkRange(c);
    const int64_t b = minI64(ch.begin + static_cast<int64_t>(j) * segment, ch.end);
    const int64_t e = minI64(b + segment, ch.end);
    return Range{b, e};
  }
  // Offset of segment j inside any chunk (for buffers of one chunk, e.g. float32 partials).
  RR_HD_INLINE int64_t segmentOffset(int j) const { return static_cast<int64_t>(j) * segment; }
  RR_HD_INLINE int ownedChunk(int rank) const { return modRing(rank + 1 + shift, nranks); }
};

// elem_size: the tensor's element bytes (alignment); wire_elem_size: the widest element on the wire;
// exact_chunks: chunk = numel / n (the caller's blocks of reduce_scatter and all_gather); shift: the
// owner rotation (see ownedChunk).
RR_HD_INLINE RingSchedule makeRingSchedule(int nranks, int64_t numel, int64_t elem_size,
                                           int64_t wire_elem_size, int64_t max_segment_bytes,
                                           bool exact_chunks = false, int shift = 0) {
  RingSchedule s;
  s.nranks = nranks;
  s.numel = numel;
  s.align = maxI64(1, 16 / elem_size);
  s.shift = nranks > 0 ? modRing(shift, nranks) : 0;
  if (numel <= 0 || nranks <= 0) return s;
  s.chunk = exact_chunks ? numel / nranks : roundUp(ceilDiv(numel, nranks), s.align);
  int64_t cap = (max_segment_bytes / wire_elem_size) / s.align * s.align;
  if (cap < s.align) cap = s.align;
  s.segment = minI64(cap, roundUp(ceilDiv(s.chunk, 2), s.align));
  s.nsegs = static_cast<int32_t>(ceilDiv(s.chunk, s.segment));
  return s;
}

}  // namespace rr
