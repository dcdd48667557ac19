#include "ring_executor.h"

#include <cstring>

#include "../core/error.h"
#include "host_reduce.h"

namespace rr {

namespace {

char* spanPtr(const Plan& plan, const RingBuffers& b, const Span& s) {
  const int64_t elem = spanElemSize(plan, s);
  char* base = nullptr;
  switch (s.buf) {
    case BufKind::kData: base = static_cast<char*>(b.data); break;
    case BufKind::kAccum: base = static_cast<char*>(b.accum); break;
    case BufKind::kStaging: base = static_cast<char*>(b.slots.at(static_cast<size_t>(s.slot))); break;
    case BufKind::kNone: break;
  }
  RR_CHECK(base != nullptr, kRuntime, "ringreduce internal error: plan names a missing buffer");
  return base + s.offset * elem;
}

size_t spanBytes(const Plan& plan, const Span& s) {
  return static_cast<size_t>(s.count * spanElemSize(plan, s));
}

}  // namespace

void executePlan(const Plan& plan, RedOp op, Transport& t, const RingBuffers& buffers, int tag) {
  // Requests of each exchange (-1: that half is empty) and which of them were waited.
  struct Pending {
    int64_t send = -1;
    int64_t recv = -1;
    bool send_waited = false;
    bool recv_waited = false;
  };
  std::vector<Pending> pending(static_cast<size_t>(plan.num_exchanges));
  const bool round_sum = !plan.accum_float32;

  // A recv_only wait (Note [One ring, two transports, one plan]) waits the receive request only;
  // a full wait also the send request, whenever it comes.
  auto waitExchange = [&](int32_t e, bool recv_only) {
    Pending& p = pending.at(static_cast<size_t>(e));
    if (!p.recv_waited) {
      if (p.recv >= 0) t.wait(p.recv);
      p.recv_waited = true;
    }
    if (recv_only || p.send_waited) return;
    if (p.send >= 0) t.wait(p.send);
    p.send_waited = true;
  };

  for (const Op& o : plan.ops) {
    switch (o.kind) {
      case OpKind::kExchange: {
        Pending& p = pending.at(static_cast<size_t>(o.exchange));
        // Receive first so the peer's data has somewhere to land as soon as it is sent.
        // One tag per exchange (mod kTagsPerCall): several exchanges in flight on one tag make
        // gloo match them strictly one after another, each paying a full round trip.
        const int xtag = tag + (o.exchange % kTagsPerCall);
        if (!o.recv.empty())
          p.recv = t.irecv(spanPtr(plan, buffers, o.recv), spanBytes(plan, o.recv), plan.prev, xtag);
        if (!o.send.empty())
          p.send = t.isend(spanPtr(plan, buffers, o.send), spanBytes(plan, o.send), plan.next, xtag);
        break;
      }
      case OpKind::kWait:
        // Even events are "exchange complete"; odd ones are computes, which already ran inline.
        if (o.event % 2 == 0) waitExchange(o.event / 2, o.recv_only);
        break;
      case OpKind::kRecord:
        break;
      case OpKind::kReduce:
        hostReduce(plan.dtype, op, spanPtr(plan, buffers, o.a), o.a.wide, spanPtr(plan, buffers, o.recv),
                   o.recv.wide, spanPtr(plan, buffers, o.dst), o.dst.wide, o.dst.count,
                   (o.final && op == RedOp::kAvg) ? plan.avg_divisor : 0, round_sum);
        break;
      case OpKind::kCopy:
        std::memcpy(spanPtr(plan, buffers, o.dst), spanPtr(plan, buffers, o.recv), spanBytes(plan, o.dst));
        break;
    }
  }
  // The plan ends with full waits for every exchange; this is a cheap guarantee, not a second wait.
  for (int32_t e = 0; e < plan.num_exchanges; ++e) {
    const Pending& p = pending[static_cast<size_t>(e)];
    RR_CHECK((p.send < 0 || p.send_waited) && (p.recv < 0 || p.recv_waited), kRuntime,
             "ringreduce internal error: plan left the ", p.recv >= 0 && !p.recv_waited ? "receive" : "send",
             " of exchange ", e, " unwaited");
  }
}

std::vector<Frame> exchangeFrames(Transport& t, const Frame& mine, int tag) {
  const int n = t.size();
  const int r = t.rank();
  std::vector<Frame> frames(static_cast<size_t>(n));
  frames[static_cast<size_t>(r)] = mine;
  if (n <= kDirectFrameRanks) {
    // Every rank sends its frame straight to every other rank: one message latency instead of
    // the ring's n-1 (the agreement check is on every CPU call, so its latency matters).
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
  // Larger groups: a ring all-gather. Hop h forwards the frame of rank (r - h) and receives the
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

}  // namespace rr
