// The ring schedule: chunk ownership depends only on (n, numel, element size), chunk bounds sit on
// 16-byte boundaries, chunks and segments partition [0, numel).
#include <vector>

#include "check.h"
#include "core/dtype.h"
#include "core/plan.h"
#include "core/schedule.h"

using namespace rr;

namespace {

std::vector<int64_t> awkwardCounts(int n) {
  std::vector<int64_t> c = {0, 1, 2, 3, 7, 13, 31, 61, 127, 257, 1021, 4099, 65537};
  c.push_back(n > 1 ? n - 1 : 0);
  c.push_back(n + 1);
  c.push_back(16 * n);
  c.push_back(16 * n + 1);
  if (n <= 4 || n == 7 || n == 16) c.push_back((1 << 20) + 3);
  return c;
}

const int64_t kElemSizes[] = {1, 2, 4, 8, 16};
const int64_t kSegBytes[] = {16, 48, 64, 1000, 4096, 65536, 1 << 20};

void checkOne(int n, int64_t numel, int64_t es) {
  const RingSchedule ref = makeRingSchedule(n, numel, es, es, 1 << 20);
  for (int64_t wire : {es, std::max<int64_t>(es, 4)}) {
    for (int64_t seg : kSegBytes) {
      const RingSchedule s = makeRingSchedule(n, numel, es, wire, seg);
      // Ownership: same chunk bounds for every segment size and wire width.
      CHECK_EQ(s.chunk, ref.chunk);
      for (int c = 0; c < n; ++c) {
        CHECK_EQ(s.chunkRange(c).begin, ref.chunkRange(c).begin);
        CHECK_EQ(s.chunkRange(c).end, ref.chunkRange(c).end);
      }
      if (numel == 0) continue;
      CHECK((s.chunk * es) % 16 == 0);
      CHECK((s.segment * es) % 16 == 0);
      CHECK(s.segment >= 1 && s.segment <= s.chunk);
      // A segment is at most max(cap, one 16-byte unit) and at most half a chunk (rounded).
      CHECK(s.segment * wire <= seg || s.segment == s.align);
      CHECK(s.segment <= roundUp(ceilDiv(s.chunk, 2), s.align));
      CHECK(static_cast<int64_t>(s.nsegs) * s.segment >= s.chunk);
      CHECK(static_cast<int64_t>(s.nsegs - 1) * s.segment < s.chunk);
      // Chunks partition [0, numel) in order; segments partition each chunk in order.
      int64_t at = 0;
      for (int c = 0; c < n; ++c) {
        const Range ch = s.chunkRange(c);
        CHECK_EQ(ch.begin, std::min(at, numel));
        CHECK((ch.begin * es) % 16 == 0 || ch.begin == numel);
        // Every segment of small chunks; the first and last 256 of long ones (the rest is the same
        // arithmetic, and walking millions of 16-byte segments would only slow the sanitizers).
        int64_t sat = ch.begin;
        for (int j = 0; j < s.nsegs; ++j) {
          if (s.nsegs > 512 && j == 256) {
            j = s.nsegs - 256;
            sat = std::min(ch.begin + s.segmentOffset(j), ch.end);
          }
          const Range sg = s.segmentRange(c, j);
          CHECK_EQ(sg.begin, sat);
          CHECK(sg.end >= sg.begin && sg.end <= ch.end);
          CHECK_EQ(sg.begin - ch.begin, std::min<int64_t>(s.segmentOffset(j), ch.size()));
          sat = sg.end;
        }
        CHECK_EQ(sat, ch.end);
        at = ch.end;
      }
      CHECK_EQ(at, numel);
      // Owner of chunk c is rank c - 1.
      for (int r = 0; r < n; ++r) CHECK_EQ(s.ownedChunk(r), (r + 1) % n);
    }
  }
}

}  // namespace

TEST_CASE(schedule_partitions_and_ownership) {
  for (int n = 1; n <= 16; ++n)
    for (int64_t numel : awkwardCounts(n))
      for (int64_t es : kElemSizes) checkOne(n, numel, es);
}

TEST_CASE(plan_schedule_ignores_segment_size_and_accum) {
  // The plan's chunk bounds are those of makeRingSchedule with the element size, whatever the
  // options; accum_dtype changes only the segment (wire width), never ownership.
  for (int n : {2, 3, 5, 8}) {
    for (int64_t numel : {int64_t(1), int64_t(n + 1), int64_t(1000), int64_t(4099)}) {
      for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt8, DType::kComplex128}) {
        const int64_t es = static_cast<int64_t>(dtypeSize(t));
        const RingSchedule ref = makeRingSchedule(n, numel, es, es, 1 << 20);
        for (int64_t seg : {int64_t(16), int64_t(64), int64_t(1 << 20)}) {
          for (bool accum : {false, true}) {
            PlanOptions o;
            o.max_segment_bytes = seg;
            o.accum_float32 = accum;
            const Plan p = buildPlan(n, n - 1, numel, t, o);
            CHECK_EQ(p.sched.chunk, ref.chunk);
            for (int c = 0; c < n; ++c) CHECK_EQ(p.sched.chunkRange(c).end, ref.chunkRange(c).end);
          }
        }
      }
    }
  }
}

TEST_CASE(segment_two_in_flight_at_one_mib) {
  // A 1 MiB message (one chunk) gets two segments even with the 1 MiB cap.
  const int n = 2;
  const int64_t numel = 2 * (1 << 20) / 4;
  const RingSchedule s = makeRingSchedule(n, numel, 4, 4, 1 << 20);
  CHECK_EQ(s.chunk, (1 << 20) / 4);
  CHECK_EQ(s.nsegs, 2);
}

TEST_CASE(auto_staging_slots) {
  // Note [Staging slots]: a slot per staged receive when all fit in kAutoStagingBytes, else
  // kDefaultSlots; never more than kMaxAutoSlots.
  auto slots = [](int n, int rank, int64_t numel, DType t, bool accum = false, int64_t seg = 1 << 20,
                  bool gather = false, uint8_t phases = kPhaseBoth) {
    PlanOptions o;
    o.num_slots = kAutoSlots;
    o.max_segment_bytes = seg;
    o.accum_float32 = accum;
    o.gather_into_data = gather;
    o.phases = phases;
    const Plan p = buildPlan(n, rank, numel, t, o);
    int32_t used = 0;  // staging receives in the plan, each in a distinct slot when auto fits
    std::vector<int> per_slot(static_cast<size_t>(std::max(p.num_slots, 1)), 0);
    for (const Op& op : p.ops)
      if (op.kind == OpKind::kExchange && op.recv.buf == BufKind::kStaging) {
        ++used;
        ++per_slot.at(static_cast<size_t>(op.recv.slot));
      }
    if (p.num_slots < kMaxAutoSlots && p.num_slots != kDefaultSlots)  // a slot per receive: none reused
      for (int c : per_slot) CHECK(c <= 1);
    return std::make_pair(p.num_slots, used);
  };
  // 1 MiB of float32 on 4 ranks: chunks of 256 KiB in two 128 KiB segments, 2 x 3 x 2 receives.
  CHECK_EQ(slots(4, 0, 1 << 18, DType::kFloat32).first, 12);
  CHECK_EQ(slots(4, 0, 1 << 18, DType::kFloat32).second, 12);
  CHECK_EQ(slots(2, 1, 1 << 18, DType::kFloat32).first, 4);   // 2 x 1 x 2
  CHECK_EQ(slots(8, 3, 1 << 18, DType::kFloat32).first, 28);  // 2 x 7 x 2
  // 4 MiB on 4 ranks: 12 receives of 512 KiB = 6 MiB, exactly the budget; 4 MiB + 64 B is over it.
  CHECK_EQ(slots(4, 2, 1 << 20, DType::kFloat32).first, 12);
  CHECK_EQ(slots(4, 2, (1 << 20) + 16, DType::kFloat32).first, kDefaultSlots);
  // Large tensors keep the default: 64 MiB on 2 ranks has 64 receives of 1 MiB.
  CHECK_EQ(slots(2, 0, 1 << 24, DType::kFloat32).first, kDefaultSlots);
  // Only the reduce-scatter stages when the all-gather lands in the tensor (GPU); halves count alone.
  CHECK_EQ(slots(4, 1, 1 << 18, DType::kFloat32, false, 1 << 20, true).first, 6);
  CHECK_EQ(slots(4, 1, 1 << 18, DType::kFloat32, false, 1 << 20, false, kPhaseAllGather).first, 6);
  // float32 partials: slots hold the wider wire type (fp16 1 MiB on 4 ranks: 128 KiB fp16 segments
  // become 256 KiB of float32 each; 12 x 256 KiB = 3 MiB fits).
  CHECK_EQ(slots(4, 0, 1 << 19, DType::kFloat16, true).first, 12);
  // Fewer elements than ranks: one non-empty chunk, received once per phase by every rank but
  // one; every rank gets the largest count (2 slots), whatever it stages itself.
  for (int r = 0; r < 4; ++r) CHECK_EQ(slots(4, r, 1, DType::kFloat32).first, 2);
  CHECK_EQ(slots(4, 0, 1, DType::kFloat32).second, 1);
  // Tiny segments: capped at kMaxAutoSlots (slots are then reused).
  CHECK_EQ(slots(4, 0, 4099, DType::kFloat32, false, 16).first, kMaxAutoSlots);
  // A one-rank ring and an empty tensor have no staging at all.
  CHECK_EQ(slots(1, 0, 1000, DType::kFloat32).first, 0);
  CHECK_EQ(slots(3, 0, 0, DType::kFloat32).first, 0);
}

TEST_MAIN()
