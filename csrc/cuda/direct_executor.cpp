#include "direct_executor.h"

#include "../core/error.h"

namespace rr {

int64_t directQueuedOps(const DirectPlan& p) {
  const int64_t converts = p.wire() ? static_cast<int64_t>(p.nranks) + 1 : 0;
  return 12 + static_cast<int64_t>(p.rounds) * (8 + converts);
}

void enqueueDirect(const DirectCall& call, DeviceBackend& be) {
  RR_CHECK(call.plan != nullptr, kRuntime, "ringreduce internal error: a direct call without a plan");
  const DirectPlan& p = *call.plan;
  const int n = p.nranks;
  const int r = p.rank;
  const int rounds = p.rounds;
  const int depth = p.depth;
  const DeviceBuffers& b = call.buffers;
  RR_CHECK(static_cast<int>(call.members.size()) == n && n >= 2 && n <= kOneShotMaxRanks, kValue,
           "ringreduce: a direct all-reduce of ", n, " ranks (2..", kOneShotMaxRanks, ") with ", call.members.size(),
           " members");
  RR_CHECK(p.gather_into_data && !p.gather16() && b.data != nullptr, kRuntime,
           "ringreduce internal error: a GPU direct all-reduce gathers into the tensor, in its own type");
  RR_CHECK(static_cast<int32_t>(b.slots.size()) >= p.numBuffers() &&
               (p.numBuffers() == 0 || static_cast<int64_t>(b.slot_bytes) >= p.buffer_bytes),
           kRuntime, "ringreduce internal error: a direct all-reduce needs ", p.numBuffers(), " buffers of ",
           p.buffer_bytes, " bytes, has ", b.slots.size(), " of ", b.slot_bytes);
  checkSupported(p.dtype, p.reduce.op);
  const size_t elem = dtypeSize(p.dtype);
  const size_t celem = dtypeSize(p.contrib);
  char* data = static_cast<char*>(b.data);
  auto at = [&](int64_t i) { return data + static_cast<size_t>(i) * elem; };
  auto buffer = [&](int k) { return b.slots[static_cast<size_t>(k)]; };
  // Plan events (dense): convert(g), scattered(g), reduced(g), and the last group's end.
  auto converted = [&](int g) { return g; };
  auto scattered = [&](int g) { return rounds + g; };
  auto reduced = [&](int g) { return 2 * rounds + g; };
  const int32_t gathered = 3 * rounds;
  const Launch later = p.handsOffEveryRound() ? Launch::kHandOff : Launch::kQueued;

  be.prepare(gathered + 1, 1);
  beginCall(be, 1);
  if (rounds == 0) {
    endCall(be, call.caller_waits);
    return;
  }
  // Note [First hop]'s convert of every piece of round g this rank contributes (on kCompute).
  auto convertRound = [&](int g) {
    for (int c = 0; c < n; ++c) {
      const Range pc = p.piece(c, g);
      if (pc.empty()) continue;
      Scaling sc;
      sc.predivide = p.convert_predivide;
      be.reduce(ReduceLaunch{at(pc.begin), p.dtype, nullptr, p.contrib, buffer(p.convertBuffer(g, c)), p.contrib,
                             pc.size(), sc, p.reduce.op});
    }
    be.record(Stream::kCompute, converted(g));
  };
  for (int g = 0; p.wire() && g < depth && g < rounds; ++g) convertRound(g);
  for (int g = 0; g < rounds; ++g) {
    const Range mine = p.piece(r, g);
    if (p.wire()) be.wait(Stream::kComm, converted(g));
    if (g >= depth) be.wait(Stream::kComm, reduced(g - depth));
    std::vector<PeerOp> ops;
    for (int k = 1; k < n; ++k) {
      const int q = (r + k) % n;
      const Range pq = p.piece(q, g);
      if (pq.empty()) continue;
      void* src = p.wire() ? buffer(p.convertBuffer(g, q)) : static_cast<void*>(at(pq.begin));
      ops.push_back(PeerOp{true, src, static_cast<size_t>(pq.size()) * celem, call.members[static_cast<size_t>(q)]});
    }
    for (int k = 1; k < n && !mine.empty(); ++k) {
      const int q = (r - k + n) % n;
      ops.push_back(PeerOp{false, buffer(p.recvBuffer(g, q)), static_cast<size_t>(mine.size()) * celem,
                           call.members[static_cast<size_t>(q)]});
    }
    if (!ops.empty()) be.group(ops, g == 0 ? Launch::kHandOff : later);
    be.record(Stream::kComm, scattered(g));
    be.wait(Stream::kCompute, scattered(g));
    if (!mine.empty()) {
      OneShotLaunch l;
      l.op = p.reduce.op;
      l.dtype = p.reduce.dtype;
      l.partial = p.reduce.partial;
      l.dst = p.reduce.dst;
      l.args.n = n;
      l.args.count = mine.size();
      l.args.chunk = 0;  // rank order
      l.args.scaling = p.reduce.scaling;
      l.args.dst = at(mine.begin);
      for (int k = 0; k < kOneShotMaxRanks; ++k) l.args.in[k] = nullptr;
      for (int k = 0; k < n; ++k) {
        if (k != r) l.args.in[k] = buffer(p.recvBuffer(g, k));
        else l.args.in[k] = p.wire() ? buffer(p.convertBuffer(g, r)) : static_cast<void*>(at(mine.begin));
      }
      be.reduceInOrder(l);
    }
    be.record(Stream::kCompute, reduced(g));
    if (p.wire() && g + depth < rounds) convertRound(g + depth);
  }
  for (int g = 0; g < rounds; ++g) {
    const Range mine = p.piece(r, g);
    be.wait(Stream::kComm, reduced(g));
    std::vector<PeerOp> ops;
    for (int k = 1; k < n && !mine.empty(); ++k)
      ops.push_back(PeerOp{true, at(mine.begin), static_cast<size_t>(mine.size()) * elem,
                           call.members[static_cast<size_t>((r + k) % n)]});
    for (int k = 1; k < n; ++k) {
      const int q = (r - k + n) % n;
      const Range pq = p.piece(q, g);
      if (!pq.empty())
        ops.push_back(PeerOp{false, at(pq.begin), static_cast<size_t>(pq.size()) * elem,
                             call.members[static_cast<size_t>(q)]});
    }
    if (!ops.empty()) be.group(ops, later);
  }
  be.record(Stream::kComm, gathered);
  be.wait(Stream::kCompute, gathered);
  endCall(be, call.caller_waits);
}

}  // namespace rr
