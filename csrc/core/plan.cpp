#include "plan.h"

#include <algorithm>
#include <deque>
#include <sstream>
#include <unordered_map>

#include "error.h"

namespace rr {

namespace {

// Note [Hazard tracking]
// ~~~~~~~~~~~~~~~~~~~~~~
// Every span is one whole "region" (segment j of chunk c of kData, segment j of kAccum, or staging
// slot k) and starts at the region's start, so two accesses conflict exactly when they name the same
// region. Per region the builder keeps the last writer and the readers since, and before an op it
// emits the waits that order it after every conflicting earlier op:
//   * earlier exchange X: the op's queue waits exchangeEvent(X) unless it knows enough of X already;
//     a conflict with X's receive (a write) needs a recv_only wait, one with X's send (a read) a
//     full wait (Note [One ring, two transports, one plan] in plan.h);
//   * earlier compute C, exchange op: kComm waits computeEvent(C) (covering, transitively, every
//     earlier compute and what it waited for); earlier compute, compute op: nothing (in order).
// Each queue remembers per exchange whether it knows the receive, or the whole exchange, completed;
// kComm also knows what kCompute knew before a compute whose event kComm waited.
struct Access {
  int64_t region;
  bool write;
};

struct OpRef {
  bool is_compute;
  int32_t exchange;
  bool send_half = false;  // an exchange's send (its read); else its receive (its write)
};

// An exchange an op must be ordered after, and whether it needs all of it or only the receive.
struct ExchangeNeed {
  int32_t exchange;
  bool full;
};

struct RegionState {
  bool has_writer = false;
  OpRef writer{false, -1};
  std::vector<OpRef> readers;
};

// Compute ops are identified by a compute id: c < E is the reduce/copy that consumes exchange c's
// receive, E + e the convert that makes exchange e's send (Note [First hop] in plan.h).
struct Builder {
  Plan& plan;
  int S;
  int num_rs;
  bool recv_only_waits;
  int32_t E = 0;
  std::vector<char> has_compute;      // per exchange: a reduce/copy consumes its receive
  std::vector<char> has_convert;      // per exchange: a convert makes its send
  // per exchange: the exchange whose send's convert reads its receive (Note [16-bit all-gather]), -1
  std::vector<int32_t> forward_after;
  std::vector<int32_t> compute_pos;   // per compute id: position in compute order, -1 if not emitted
  std::vector<Op> computes;           // per compute id
  std::vector<std::vector<Access>> ex_access, co_access;  // per exchange, per compute id
  std::deque<int32_t> pending;        // exchanges whose compute is not yet emitted, in order
  std::unordered_map<int64_t, RegionState> regions;
  int32_t computes_emitted = 0;
  std::vector<int32_t> compute_order;  // position in compute order -> compute id

  int32_t eventOf(int32_t c) const { return c < E ? Plan::computeEvent(c) : plan.convertEvent(c - E); }
  // What each queue knows has completed, per exchange: the whole exchange (`_x`) or at least its
  // receive (`_recv`; set by full waits too).
  std::vector<int32_t> compute_saw_x;     // compute position before which kCompute waited it fully, -1
  std::vector<int32_t> compute_saw_recv;  // compute position before which kCompute knew its receive, -1
  std::vector<char> comm_saw_x;           // kComm waited it fully
  std::vector<char> comm_saw_recv;        // kComm waited it (either way)
  int32_t comm_knows_compute = -1;        // kComm waited computeEvent of the compute at this position

  int32_t index(Phase phase, int step, int seg) const {
    return (phase == Phase::kReduceScatter ? 0 : num_rs) + step * S + seg;
  }

  void emit(const Op& op) { plan.ops.push_back(op); }

  void emitEvent(OpKind kind, Queue q, int32_t event, bool recv_only = false) {
    Op w{kind, q};
    w.event = event;
    w.recv_only = recv_only;
    emit(w);
  }
  void emitWait(Queue q, int32_t event, bool recv_only = false) { emitEvent(OpKind::kWait, q, event, recv_only); }

  bool computeKnows(const ExchangeNeed& x) const {
    return (x.full ? compute_saw_x : compute_saw_recv)[x.exchange] >= 0;
  }

  bool commKnows(const ExchangeNeed& x) const {
    if ((x.full ? comm_saw_x : comm_saw_recv)[x.exchange]) return true;
    // kComm waited a compute at or after the point where kCompute learnt it.
    const int32_t at = (x.full ? compute_saw_x : compute_saw_recv)[x.exchange];
    return at >= 0 && at <= comm_knows_compute;
  }

  // kCompute waits exchange x (fully, or only its receive) before the next compute.
  void computeWaits(const ExchangeNeed& x) {
    emitWait(Queue::kCompute, Plan::exchangeEvent(x.exchange), !x.full);
    if (x.full) compute_saw_x[x.exchange] = computes_emitted;
    if (compute_saw_recv[x.exchange] < 0) compute_saw_recv[x.exchange] = computes_emitted;
  }

  void commWaits(const ExchangeNeed& x) {
    emitWait(Queue::kComm, Plan::exchangeEvent(x.exchange), !x.full);
    if (x.full) comm_saw_x[x.exchange] = 1;
    comm_saw_recv[x.exchange] = 1;
  }

  // The exchanges among `deps` (other than `self`), in first-seen order; full when any conflict is
  // with the exchange's send (or recv_only waits are off).
  std::vector<ExchangeNeed> exchangeNeeds(const std::vector<OpRef>& deps, int32_t self) const {
    std::vector<ExchangeNeed> out;
    for (const OpRef& d : deps) {
      if (d.is_compute || d.exchange == self) continue;
      const bool full = d.send_half || !recv_only_waits;
      auto it = std::find_if(out.begin(), out.end(),
                             [&](const ExchangeNeed& x) { return x.exchange == d.exchange; });
      if (it == out.end()) out.push_back({d.exchange, full});
      else it->full = it->full || full;
    }
    return out;
  }

  // Conflicting earlier ops for `acc` (for writes: the writer and readers; for reads: the writer).
  void conflicts(const Access& acc, std::vector<OpRef>& out) {
    auto it = regions.find(acc.region);
    if (it == regions.end()) return;
    if (it->second.has_writer) out.push_back(it->second.writer);
    if (acc.write)
      for (const OpRef& r : it->second.readers) out.push_back(r);
  }

  void record(const Access& acc, OpRef self) {
    self.send_half = !self.is_compute && !acc.write;
    RegionState& st = regions[acc.region];
    if (acc.write) {
      st.has_writer = true;
      st.writer = self;
      st.readers.clear();
    } else {
      st.readers.push_back(self);
    }
  }

  void emitCompute(int32_t c) {
    std::vector<OpRef> deps;
    for (const Access& a : co_access[c]) conflicts(a, deps);
    // Earlier computes need nothing: kCompute is in order.
    for (const ExchangeNeed& x : exchangeNeeds(deps, -1))
      if (!computeKnows(x)) computeWaits(x);
    emit(computes[c]);
    emitEvent(OpKind::kRecord, Queue::kCompute, eventOf(c));
    for (const Access& a : co_access[c]) record(a, OpRef{true, c});
    compute_pos[c] = computes_emitted++;
    compute_order.push_back(c);
    // Note [16-bit all-gather]: the slot's other reader goes with it, before the slot can be reused.
    if (c < E && forward_after[c] >= 0 && compute_pos[E + forward_after[c]] < 0) emitCompute(E + forward_after[c]);
  }

  void popCompute() {
    const int32_t front = pending.front();
    pending.pop_front();
    emitCompute(front);
  }

  static bool clash(const std::vector<Access>& x, const std::vector<Access>& y) {
    for (const Access& a : x)
      for (const Access& c : y)
        if (a.region == c.region && (a.write || c.write)) return true;
    return false;
  }

  // Emits the pending computes up to the last one that clashes with `accesses`.
  void flushClashing(const std::vector<Access>& accesses) {
    for (size_t i = pending.size(); i-- > 0;) {
      if (clash(co_access[pending[i]], accesses)) {
        const int32_t target = pending[i];
        while (compute_pos[target] < 0) popCompute();
        break;
      }
    }
  }

  // Compute E + e: the convert that makes exchange e's send, reading `a` and writing `dst`.
  void addConvert(int32_t e, const Span& a, int64_t a_region, const Span& dst, int64_t dst_region) {
    Op c{OpKind::kConvert, Queue::kCompute};
    c.exchange = e;
    c.a = a;
    c.dst = dst;
    co_access[E + e].insert(co_access[E + e].end(), {{a_region, false}, {dst_region, true}});
    computes[E + e] = c;
    has_convert[e] = 1;
  }

  void emitExchange(int32_t e) {
    // Program order is "e's convert, e, e's compute"; deferred computes still come before e, so a
    // pending one that touches e's regions (or its convert's) is emitted now, with those before it.
    if (has_convert[e] && compute_pos[E + e] < 0) {
      flushClashing(co_access[E + e]);
      emitCompute(E + e);
    }
    flushClashing(ex_access[e]);
    std::vector<OpRef> deps;
    for (const Access& a : ex_access[e]) conflicts(a, deps);
    // Computes first: a wait on the latest of them covers the earlier ones.
    int32_t need_compute = -1;
    for (const OpRef& d : deps) {
      if (!d.is_compute) continue;
      while (compute_pos[d.exchange] < 0) popCompute();
      if (compute_pos[d.exchange] > comm_knows_compute && compute_pos[d.exchange] > need_compute)
        need_compute = compute_pos[d.exchange];
    }
    if (need_compute >= 0) {
      emitWait(Queue::kComm, eventOf(compute_order[static_cast<size_t>(need_compute)]));
      comm_knows_compute = need_compute;
    }
    for (const ExchangeNeed& x : exchangeNeeds(deps, e))
      if (!commKnows(x)) commWaits(x);
    Op ex{OpKind::kExchange, Queue::kComm};
    ex.exchange = e;
    ex.send = ex_send[e];
    ex.recv = ex_recv[e];
    emit(ex);
    emitEvent(OpKind::kRecord, Queue::kComm, Plan::exchangeEvent(e));
    for (const Access& a : ex_access[e]) record(a, OpRef{false, e});
  }

  std::vector<Span> ex_send, ex_recv;
};

constexpr int64_t kRegionData = 0;
constexpr int64_t kRegionAccum = 1;
constexpr int64_t kRegionSlot = 2;
int64_t regionKey(int64_t kind, int64_t index) { return (kind << 40) | index; }

}  // namespace

int32_t laneOfElement(const RingSchedule& sc, int32_t lanes, int64_t index) {
  if (lanes <= 1 || sc.chunk <= 0 || sc.segment <= 0) return 0;
  const int64_t in_chunk = index % sc.chunk;
  return static_cast<int32_t>((in_chunk / sc.segment) % lanes);
}

int64_t Plan::slotBytes() const {
  return slot_elems * static_cast<int64_t>(std::max(dtypeSize(dtype), dtypeSize(partial)));
}

int64_t Plan::stagingBytes() const { return static_cast<int64_t>(num_slots) * slotBytes(); }

int64_t Plan::accumBytes() const { return accum_elems * static_cast<int64_t>(dtypeSize(partial)); }

Scaling Plan::finalScaling(RedOp op) const {
  Scaling s = rr::finalScaling(op, avg_divisor, extra_divisor, post_factor, pre_factor, !accum_float32);
  if (gather16) s.wire_round = static_cast<int32_t>(partial);  // Note [16-bit all-gather]
  return s;
}

double Plan::convertPredivide(const Op& o) const {
  const bool gather = o.exchange >= 0 && o.exchange < static_cast<int32_t>(exchanges.size()) &&
                      exchanges[static_cast<size_t>(o.exchange)].phase == Phase::kAllGather;
  return gather ? 0 : pre_factor;
}

Scaling Plan::scaling(RedOp op, const Op& o) const {
  if (o.kind == OpKind::kReduce && o.final) return finalScaling(op);
  Scaling s;
  if (o.kind == OpKind::kReduce) s.predivide = pre_factor;
  if (o.kind == OpKind::kConvert) s.predivide = convertPredivide(o);
  return s;
}

DType partialDType(DType dtype, int nranks, bool accum_float32, const std::optional<DType>& wire_dtype) {
  if (accum_float32 && isHalfType(dtype) && nranks > 2) return DType::kFloat32;
  if (wire_dtype && dtype == DType::kFloat32 && isHalfType(*wire_dtype)) return *wire_dtype;
  return dtype;
}

Plan buildPlan(int nranks, int rank, int64_t numel, DType dtype, const PlanOptions& options) {
  RR_CHECK(nranks >= 1, kValue, "ringreduce: world size must be >= 1, got ", nranks);
  RR_CHECK(rank >= 0 && rank < nranks, kValue, "ringreduce: rank ", rank, " outside [0, ", nranks, ")");
  RR_CHECK(numel >= 0, kValue, "ringreduce: numel must be >= 0, got ", numel);
  RR_CHECK(options.num_slots >= 1 || options.num_slots == kAutoSlots, kValue,
           "ringreduce: need at least one staging slot, got ", options.num_slots);
  RR_CHECK(options.max_segment_bytes >= 16, kValue,
           "ringreduce: the segment size must be at least 16 bytes, got ", options.max_segment_bytes);
  RR_CHECK(options.phases >= 1 && options.phases <= 3, kValue, "ringreduce: bad phase mask ",
           int(options.phases));
  RR_CHECK(!options.exact_chunks || numel % nranks == 0, kValue, "ringreduce: ", numel,
           " elements do not split into ", nranks, " equal blocks");
  RR_CHECK(options.avg_divisor >= 0, kValue, "ringreduce: bad AVG divisor ", options.avg_divisor);
  RR_CHECK(options.lanes >= 1 && options.lane >= 0 && options.lane < options.lanes, kValue, "ringreduce: lane ",
           options.lane, " of ", options.lanes);
  // A one-rank ring has no final reduce to divide in; a larger divisor would silently not divide.
  RR_CHECK(!(options.average && nranks == 1 && options.avg_divisor > 1), kValue,
           "ringreduce: a one-rank ring cannot divide by ", options.avg_divisor);
  RR_CHECK(!options.wire_dtype || (dtype == DType::kFloat32 && isHalfType(*options.wire_dtype)), kValue,
           "ringreduce: a 16-bit wire (float16/bfloat16) applies to float32 tensors, got ",
           options.wire_dtype ? dtypeName(*options.wire_dtype) : "", " for ", dtypeName(dtype));
  RR_CHECK(!options.wire_gather16 || !options.gather_into_data, kValue,
           "ringreduce: a 16-bit all-gather forwards from staging; it cannot receive straight into the tensor");
  RR_CHECK(options.pre_factor >= 0 && options.post_factor >= 0 && options.extra_divisor >= 1, kValue,
           "ringreduce: bad scaling (pre ", options.pre_factor, ", post ", options.post_factor, ", divisor ",
           options.extra_divisor, ")");
  RR_CHECK(options.pre_factor == 0 || !isIntegralType(dtype), kValue,
           "ringreduce: a predivide factor needs a floating or complex tensor, got ", dtypeName(dtype));

  Plan plan;
  plan.dtype = dtype;
  // float32 partials only matter when partials travel, i.e. with more than two ranks; with two,
  // the single (final) reduce-scatter step already accumulates in float32 and rounds once.
  plan.accum_float32 = options.accum_float32 && isHalfType(dtype) && nranks > 2;
  plan.partial = partialDType(dtype, nranks, options.accum_float32, options.wire_dtype);
  plan.wire16 = plan.partial != dtype && !plan.accum_float32;
  plan.gather16 = options.wire_gather16 && plan.wire16 && options.phases == kPhaseBoth;
  plan.pre_factor = options.pre_factor;
  plan.post_factor = options.post_factor;
  plan.extra_divisor = options.extra_divisor;
  plan.gather_into_data = options.gather_into_data;
  plan.phases = options.phases;
  plan.avg_divisor = options.avg_divisor > 0 ? options.avg_divisor : nranks;
  plan.lanes = options.lanes;
  plan.lane = options.lane;
  plan.rank = rank;
  plan.next = (rank + 1) % nranks;
  plan.prev = (rank + nranks - 1) % nranks;
  const int64_t elem = static_cast<int64_t>(dtypeSize(dtype));
  const int64_t wire_elem = std::max(elem, static_cast<int64_t>(dtypeSize(plan.partial)));
  plan.sched = makeRingSchedule(nranks, numel, elem, wire_elem, options.max_segment_bytes,
                                options.exact_chunks, options.owner_shift);
  const RingSchedule& sc = plan.sched;
  if (nranks == 1 || numel == 0) return plan;

  const int n = nranks;
  const int S = sc.nsegs;
  const bool run_rs = (options.phases & kPhaseReduceScatter) != 0;
  const bool run_ag = (options.phases & kPhaseAllGather) != 0;
  plan.num_slots = options.num_slots;
  plan.slot_elems = sc.segment;
  if (plan.num_slots == kAutoSlots) {
    // Note [Staging slots]. The rank staging the most receives gets, per staged phase, every
    // non-empty segment but the emptiest chunk's; every rank takes that count, so plans agree.
    int64_t segments = 0;
    int64_t fewest = S;
    for (int c = 0; c < n; ++c) {
      int64_t in_chunk = 0;
      for (int j = 0; j < S; ++j) in_chunk += sc.segmentRange(c, j).empty() ? 0 : 1;
      segments += in_chunk;
      fewest = std::min(fewest, in_chunk);
    }
    const int64_t staged_phases = (run_rs ? 1 : 0) + (run_ag && !plan.gather_into_data ? 1 : 0);
    const int64_t slots = std::min<int64_t>(staged_phases * (segments - fewest), kMaxAutoSlots);
    plan.num_slots =
        slots >= 1 && slots * plan.slotBytes() <= kAutoStagingBytes ? static_cast<int32_t>(slots) : kDefaultSlots;
  }
  // Note [First hop]: the reduce-scatter's first sends are converted (16-bit wire, predivide).
  const bool convert_first = run_rs && (plan.wire16 || plan.pre_factor > 0);
  plan.accum_elems = plan.accum_float32 || (plan.wire16 && run_rs) ? sc.chunk : 0;
  plan.num_exchanges = ((run_rs ? 1 : 0) + (run_ag ? 1 : 0)) * (n - 1) * S;
  plan.num_events = (convert_first || plan.gather16 ? 3 : 2) * plan.num_exchanges;
  const int32_t E = plan.num_exchanges;

  Builder b{plan, S, run_rs ? (n - 1) * S : 0, options.recv_only_waits};
  b.E = E;
  b.has_compute.assign(E, 0);
  b.has_convert.assign(E, 0);
  b.forward_after.assign(E, -1);
  b.compute_pos.assign(2 * static_cast<size_t>(E), -1);
  b.computes.resize(2 * static_cast<size_t>(E));
  b.ex_access.resize(E);
  b.co_access.resize(2 * static_cast<size_t>(E));
  b.compute_saw_x.assign(E, -1);
  b.compute_saw_recv.assign(E, -1);
  b.comm_saw_x.assign(E, 0);
  b.comm_saw_recv.assign(E, 0);
  b.ex_send.resize(E);
  b.ex_recv.resize(E);
  plan.exchanges.resize(E);

  const bool partials = plan.accum_elems > 0;  // reduce-scatter partials live in kAccum
  const DType T = dtype;
  const DType P = plan.partial;
  const int lookahead = plan.num_slots - 1;
  int32_t staged = 0;  // receives into staging so far
  auto dataRegion = [&](int chunk, int j) { return regionKey(kRegionData, int64_t(chunk) * S + j); };
  auto accumRegion = [](int j) { return regionKey(kRegionAccum, j); };
  auto accumSpan = [&](int j, int64_t count) { return Span{BufKind::kAccum, -1, P, sc.segmentOffset(j), count}; };

  const int shift = sc.shift;  // physical chunk = logical chunk + shift
  for (int phase_i = 0; phase_i < 2; ++phase_i) {
    const Phase phase = phase_i == 0 ? Phase::kReduceScatter : Phase::kAllGather;
    if (phase == Phase::kReduceScatter ? !run_rs : !run_ag) continue;
    for (int s = 0; s < n - 1; ++s) {
      for (int j = 0; j < S; ++j) {
        const int32_t e = b.index(phase, s, j);
        ExchangeInfo info;
        info.phase = phase;
        info.step = s;
        info.segment = j;
        if (phase == Phase::kReduceScatter) {
          // Reduce-scatter step s: pass on the partial of chunk (r - s), receive (r - s - 1)'s and add
          // to it; after n-1 steps rank r holds its owned chunk (r + 1) complete.
          info.send_chunk = modRing(rank - s + shift, n);
          info.recv_chunk = modRing(rank - s - 1 + shift, n);
        } else {
          // All-gather step s: pass on the completed chunk (r + 1 - s); receive chunk (r - s).
          info.send_chunk = modRing(rank + 1 - s + shift, n);
          info.recv_chunk = modRing(rank - s + shift, n);
        }
        plan.exchanges[e] = info;

        if (j % plan.lanes != plan.lane) continue;  // Note [Lanes]: another lane's segment
        const Range send_r = sc.segmentRange(info.send_chunk, j);
        const Range recv_r = sc.segmentRange(info.recv_chunk, j);
        if (send_r.empty() && recv_r.empty()) continue;  // both neighbours skip it too

        const bool rs = phase == Phase::kReduceScatter;
        // Reduce-scatter hops carry partials (after the first hop, or every hop on a 16-bit wire);
        // all-gather hops finished elements (16-bit ones with a 16-bit all-gather).
        const bool carries_partial = (!rs && plan.gather16) || (rs && partials && (s > 0 || plan.wire16));
        if (!send_r.empty()) {
          const Span data_send{BufKind::kData, -1, T, send_r.begin, send_r.size()};
          const int64_t send_region = dataRegion(info.send_chunk, j);
          if (rs && s == 0 && convert_first) {
            // Note [First hop]: the local segment, rounded to the wire and/or predivided.
            if (plan.wire16) b.addConvert(e, data_send, send_region, accumSpan(j, send_r.size()), accumRegion(j));
            else b.addConvert(e, data_send, send_region, data_send, send_region);
          }
          if (!rs && plan.gather16) {
            // Note [16-bit all-gather]: at step 0 the owner's finished segment (already a 16-bit
            // value) as 16 bits; later, what the convert set up with the previous receive copied.
            if (s == 0) b.addConvert(e, data_send, send_region, accumSpan(j, send_r.size()), accumRegion(j));
            RR_CHECK(b.has_convert[e], kRuntime, "ringreduce internal error: an all-gather forwards a segment it "
                     "never received");
          }
          if (carries_partial) {
            b.ex_send[e] = accumSpan(j, send_r.size());
            b.ex_access[e].push_back({accumRegion(j), false});
          } else {
            b.ex_send[e] = data_send;
            b.ex_access[e].push_back({send_region, false});
          }
        }
        if (!recv_r.empty()) {
          const Span data_span{BufKind::kData, -1, T, recv_r.begin, recv_r.size()};
          const int64_t recv_region = dataRegion(info.recv_chunk, j);
          if (!rs && plan.gather_into_data) {
            b.ex_recv[e] = data_span;
            b.ex_access[e].push_back({recv_region, true});
          } else {
            const int32_t slot = staged % plan.num_slots;
            ++staged;
            b.ex_recv[e] = Span{BufKind::kStaging, slot, carries_partial ? P : T, 0, recv_r.size()};
            b.ex_access[e].push_back({regionKey(kRegionSlot, slot), true});
            b.has_compute[e] = 1;
            Op c{rs ? OpKind::kReduce : OpKind::kCopy, Queue::kCompute};
            c.exchange = e;
            c.recv = b.ex_recv[e];
            b.co_access[e].push_back({regionKey(kRegionSlot, slot), false});
            if (rs) {
              c.a = data_span;
              c.final = (s == n - 2);
              b.co_access[e].push_back({recv_region, false});
            }
            const bool to_accum = rs && partials && !c.final;
            c.dst = to_accum ? accumSpan(j, recv_r.size()) : data_span;
            b.co_access[e].push_back({to_accum ? accumRegion(j) : recv_region, true});
            if (!rs && plan.gather16 && s < n - 2) {
              // Note [16-bit all-gather]: the 16 bits go on at step s + 1 from kAccum; the convert
              // that copies them there is emitted with this copy at the latest.
              const int32_t fwd = b.index(phase, s + 1, j);
              b.addConvert(fwd, b.ex_recv[e], regionKey(kRegionSlot, slot), accumSpan(j, recv_r.size()),
                           accumRegion(j));
              b.forward_after[e] = fwd;
            }
            b.computes[e] = c;
          }
        }

        b.emitExchange(e);
        if (b.has_compute[e]) b.pending.push_back(e);
        while (static_cast<int>(b.pending.size()) > lookahead) b.popCompute();
      }
    }
  }
  while (!b.pending.empty()) b.popCompute();
  // Drain: kCompute waits every exchange fully, so "kCompute done" means the whole call is done.
  for (int32_t e = 0; e < E; ++e) {
    const ExchangeNeed whole{e, true};
    if (!b.ex_access[e].empty() && !b.computeKnows(whole)) b.computeWaits(whole);
  }
  return plan;
}

namespace {
void putSpan(std::ostringstream& os, const Span& s) {
  if (s.empty()) {
    os << "-";
    return;
  }
  static const char* const kBufNames[] = {"-", "data", "accum", "slot"};  // by BufKind
  os << kBufNames[static_cast<int>(s.buf)];
  if (s.buf == BufKind::kStaging) os << s.slot;
  os << "[" << s.offset << "+" << s.count << "," << dtypeName(s.type) << "]";
}
}  // namespace

std::string Plan::describe() const {
  std::ostringstream os;
  os << "plan rank " << rank << "/" << sched.nranks << " numel " << sched.numel << " chunk "
     << sched.chunk << " segment " << sched.segment << " nsegs " << sched.nsegs << " slots "
     << num_slots << (accum_float32 ? " accum_f32" : "") << (wire16 ? std::string(" wire ") + dtypeName(partial) : "") << (gather16 ? " gather16" : "")
     << (pre_factor > 0 ? " pre " + std::to_string(pre_factor) : std::string())
     << (post_factor > 0 ? " post " + std::to_string(post_factor) : std::string())
     << (extra_divisor > 1 ? " divisor x" + std::to_string(extra_divisor) : std::string())
     << (gather_into_data ? " gather_direct" : "")
     << (phases == kPhaseReduceScatter ? " reduce_scatter_only" : "")
     << (phases == kPhaseAllGather ? " all_gather_only" : "")
     << (sched.shift != 0 ? " shift " + std::to_string(sched.shift) : std::string()) << " avg_divisor "
     << avg_divisor << (lanes > 1 ? " lane " + std::to_string(lane) + " of " + std::to_string(lanes) : std::string())
     << "\n";
  for (const Op& op : ops) {
    os << (op.queue == Queue::kComm ? "  comm    " : "  compute ");
    switch (op.kind) {
      case OpKind::kExchange:
        os << "exchange " << op.exchange << " send ";
        putSpan(os, op.send);
        os << " recv ";
        putSpan(os, op.recv);
        break;
      case OpKind::kReduce:
      case OpKind::kCopy:
      case OpKind::kConvert:
        os << (op.kind == OpKind::kReduce ? "reduce " : op.kind == OpKind::kCopy ? "copy " : "convert ") << op.exchange
           << " ";
        putSpan(os, op.dst);
        os << " = ";
        putSpan(os, op.kind == OpKind::kCopy ? op.recv : op.a);
        if (op.kind != OpKind::kReduce) break;
        os << " + ";
        putSpan(os, op.recv);
        if (op.final) os << " final";
        break;
      case OpKind::kRecord:
        os << "record " << op.event;
        break;
      case OpKind::kWait:
        os << "wait " << op.event << (op.recv_only ? " recv" : "");
        break;
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace rr
