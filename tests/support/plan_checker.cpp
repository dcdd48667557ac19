#include "plan_checker.h"

#include <algorithm>
#include <array>
#include <climits>
#include <deque>
#include <queue>
#include <random>
#include <sstream>
#include <unordered_map>

#include "core/error.h"

namespace rr {

namespace {

using detail::concat;

constexpr int32_t kNever = INT32_MAX;

const char* bufText(BufKind k) {
  switch (k) {
    case BufKind::kNone: return "none";
    case BufKind::kData: return "data";
    case BufKind::kAccum: return "accum";
    case BufKind::kStaging: return "slot";
  }
  return "?";
}

std::string spanText(const Span& s) {
  if (s.empty()) return "-";
  std::ostringstream os;
  os << bufText(s.buf);
  if (s.buf == BufKind::kStaging) os << s.slot;
  os << "[" << s.offset << "+" << s.count << "," << dtypeName(s.type) << "]";
  return os.str();
}

std::string maskText(uint64_t mask) {
  std::ostringstream os;
  os << "{";
  const char* sep = "";
  for (int r = 0; r < 64; ++r) {
    if (mask >> r & 1u) {
      os << sep << r;
      sep = ",";
    }
  }
  os << "}";
  return os.str();
}

std::string eventText(const Plan& p, int32_t ev, bool recv_only = false) {
  if (ev >= 2 * p.num_exchanges) return concat(ev, " (convert for exchange ", ev - 2 * p.num_exchanges, ")");
  if (recv_only && ev % 2 == 0) return concat(ev, " (receive of exchange ", ev / 2, " complete)");
  return concat(ev, ev % 2 == 0 ? " (exchange " : " (compute of exchange ", ev / 2,
                ev % 2 == 0 ? " complete)" : ")");
}

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::string phaseMaskText(uint8_t phases) {
  switch (phases) {
    case kPhaseReduceScatter: return "reduce-scatter only";
    case kPhaseAllGather: return "all-gather only";
    case kPhaseBoth: return "both halves";
  }
  return concat("bad phase mask ", int(phases));
}

const char* phaseText(Phase phase) {
  return phase == Phase::kReduceScatter ? "reduce-scatter" : "all-gather";
}
uint8_t phaseBit(Phase phase) {
  return phase == Phase::kReduceScatter ? kPhaseReduceScatter : kPhaseAllGather;
}

int qIndex(Queue q) { return q == Queue::kCompute ? 0 : 1; }
const char* qText(int qi) { return qi == 0 ? "kCompute" : "kComm"; }

// Per rank: the ops of each queue in order, and where exchanges and records sit.
struct RankIndex {
  std::vector<int> q[2];          // op indices; q[0] kCompute, q[1] kComm
  std::vector<int32_t> pos;       // per op: 1-based position within its queue
  std::vector<int> exchange_op;   // per exchange: the kExchange op, -1
  std::vector<int> record_op;     // per event: the kRecord op, -1
  // Per queue, per exchange: the first position of a wait on its exchangeEvent of either kind
  // (from there on the queue knows the receive completed), and of a full one (the whole exchange).
  std::vector<int32_t> first_wait_recv[2];
  std::vector<int32_t> first_wait_full[2];
};

struct Shared {
  const std::vector<Plan>& plans;
  const CheckOptions& opt;
  int n = 0;
  int64_t narrow = 0;      // bytes of a tensor element
  int64_t slot_bytes = 0;  // bytes of one staging slot
  std::vector<RankIndex> idx;

  Shared(const std::vector<Plan>& p, const CheckOptions& o) : plans(p), opt(o) {}

  std::string opText(int r, int i) const { return concat("rank ", r, " ", describeOp(plans[r], i)); }
};

// ------------------------------------------------------------------------------------------------
// 1. Static checks.

std::string checkSpan(const Shared& sh, int r, int i, const Span& s, const char* role) {
  if (s.empty()) {
    if (s.count < 0) return concat(sh.opText(r, i), ": ", role, " span has a negative count");
    return "";
  }
  const Plan& p = sh.plans[r];
  auto where = [&] { return concat(sh.opText(r, i), ": ", role, " span ", spanText(s)); };
  if (s.offset < 0) return concat(where(), " has a negative offset");
  if (s.type != p.dtype && s.type != p.partial)
    return concat(where(), " holds ", dtypeName(s.type), ", neither the tensor's ", dtypeName(p.dtype),
                  " nor the plan's partial type ", dtypeName(p.partial));
  switch (s.buf) {
    case BufKind::kNone: return concat(where(), " names no buffer");
    case BufKind::kData:
      if (s.type != p.dtype) return concat(where(), ": the tensor holds ", dtypeName(p.dtype), " only");
      if (s.offset + s.count > p.sched.numel)
        return concat(where(), " exceeds the tensor's ", p.sched.numel, " elements");
      return "";
    case BufKind::kAccum:
      if (s.type != p.partial || p.partial == p.dtype)
        return concat(where(), ": the accumulator holds partials of ", dtypeName(p.partial), " only (and exists only "
                      "when they differ from the tensor's type)");
      if (s.offset + s.count > p.accum_elems)
        return concat(where(), " exceeds the accumulator's ", p.accum_elems, " elements");
      return "";
    case BufKind::kStaging:
      if (s.slot < 0 || s.slot >= p.num_slots)
        return concat(where(), " names slot ", s.slot, " of ", p.num_slots);
      if ((s.offset + s.count) * spanElemSize(p, s) > sh.slot_bytes)
        return concat(where(), " exceeds the slot's ", sh.slot_bytes, " bytes");
      return "";
  }
  return concat(where(), " names an unknown buffer");
}

std::string staticChecks(Shared& sh) {
  const std::vector<Plan>& P = sh.plans;
  const int n = sh.n;
  const Plan& ref = P[0];
  sh.narrow = static_cast<int64_t>(dtypeSize(ref.dtype));
  sh.slot_bytes = ref.slot_elems * std::max<int64_t>(sh.narrow, static_cast<int64_t>(dtypeSize(ref.partial)));
  sh.idx.assign(static_cast<size_t>(n), RankIndex{});
  // Note [Ring halves] (plan.h): what the plans compute is fixed by the phase mask, the owner map
  // and the AVG divisor; ranks that disagree on any of them run different collectives. Checked
  // first, so that the message names the disagreement rather than one of its consequences.
  for (int r = 0; r < n; ++r) {
    const Plan& p = P[r];
    if (p.phases < kPhaseReduceScatter || p.phases > kPhaseBoth)
      return concat("rank ", r, "'s plan has the ", phaseMaskText(p.phases), " (1..3)");
    if (p.phases != ref.phases)
      return concat("the ranks disagree on the phase mask: rank ", r, "'s plan runs ", phaseMaskText(p.phases),
                    ", rank 0's ", phaseMaskText(ref.phases));
    if (p.sched.shift < 0 || p.sched.shift >= n)
      return concat("rank ", r, "'s owner shift ", p.sched.shift, " is outside [0, ", n, ")");
    if (p.sched.shift != ref.sched.shift)
      return concat("the ranks disagree on the owner map: rank ", r, "'s shift is ", p.sched.shift, ", rank 0's ",
                    ref.sched.shift, " (a chunk would have two owners or none)");
    if (p.avg_divisor != ref.avg_divisor)
      return concat("the ranks disagree on the AVG divisor: rank ", r, "'s is ", p.avg_divisor, ", rank 0's ",
                    ref.avg_divisor);
    if (p.lanes != ref.lanes || p.lane != ref.lane || p.lanes < 1 || p.lane < 0 || p.lane >= p.lanes)
      return concat("the ranks disagree on the lane (Note [Lanes]): rank ", r, " runs lane ", p.lane, " of ", p.lanes,
                    ", rank 0 lane ", ref.lane, " of ", ref.lanes);
    if (p.avg_divisor < n)
      return concat("rank ", r, "'s AVG divisor ", p.avg_divisor, " is smaller than its ring's size ", n,
                    " (AVG divides the sum of at least the ring's contributions)");
    if (p.pre_factor != ref.pre_factor || p.post_factor != ref.post_factor || p.extra_divisor != ref.extra_divisor)
      return concat("the ranks disagree on the scaling: rank ", r, "'s pre/post factors and divisor are ", p.pre_factor,
                    "/", p.post_factor, "/", p.extra_divisor, ", rank 0's ", ref.pre_factor, "/", ref.post_factor, "/",
                    ref.extra_divisor);
  }
  for (int r = 0; r < n; ++r) {
    const Plan& p = P[r];
    const RingSchedule& a = p.sched;
    const RingSchedule& b = ref.sched;
    if (p.rank != r || p.next != (r + 1) % n || p.prev != (r + n - 1) % n)
      return concat("plan ", r, " is for rank ", p.rank, " (next ", p.next, ", prev ", p.prev, ")");
    if (a.nranks != n || a.numel != b.numel || a.chunk != b.chunk || a.segment != b.segment ||
        a.nsegs != b.nsegs || a.align != b.align)
      return concat("rank ", r, "'s schedule (n ", a.nranks, ", numel ", a.numel, ", chunk ", a.chunk,
                    ", segment ", a.segment, ") differs from rank 0's (n ", b.nranks, ", numel ", b.numel,
                    ", chunk ", b.chunk, ", segment ", b.segment, ")");
    if (a.chunk < 0 || (a.numel > 0 && n > 1 && (a.chunk * n < a.numel || a.segment <= 0 ||
                                                  static_cast<int64_t>(a.nsegs) * a.segment < a.chunk)))
      return concat("rank ", r, "'s schedule (numel ", a.numel, ", chunk ", a.chunk, ", segment ", a.segment,
                    ", nsegs ", a.nsegs, ") does not cover the tensor");
    if (p.dtype != ref.dtype || p.partial != ref.partial || p.accum_float32 != ref.accum_float32 ||
        p.wire16 != ref.wire16 || p.gather16 != ref.gather16 || p.num_slots != ref.num_slots || p.slot_elems != ref.slot_elems ||
        p.accum_elems != ref.accum_elems || p.num_exchanges != ref.num_exchanges ||
        (p.num_events != 2 * p.num_exchanges && p.num_events != 3 * p.num_exchanges))
      return concat("rank ", r, "'s plan parameters (dtype, slots, accumulator, exchanges) differ from rank 0's");
    // One grid of (n - 1) steps x nsegs segments per half the mask names, nothing for one rank or
    // an empty tensor.
    const int halves = ((p.phases & kPhaseReduceScatter) ? 1 : 0) + ((p.phases & kPhaseAllGather) ? 1 : 0);
    const int64_t want_exchanges =
        (n > 1 && a.numel > 0) ? static_cast<int64_t>(halves) * (n - 1) * a.nsegs : 0;
    if (p.num_exchanges != want_exchanges || static_cast<int64_t>(p.exchanges.size()) != p.num_exchanges)
      return concat("rank ", r, "'s plan has ", p.num_exchanges, " exchanges (", p.exchanges.size(),
                    " described); ", phaseMaskText(p.phases), " on ", n, " ranks with ", a.nsegs,
                    " segments per chunk needs ", want_exchanges);

    RankIndex& ix = sh.idx[r];
    const int E = p.num_exchanges;
    ix.pos.assign(p.ops.size(), 0);
    ix.exchange_op.assign(static_cast<size_t>(E), -1);
    ix.record_op.assign(static_cast<size_t>(p.num_events), -1);
    for (int qi = 0; qi < 2; ++qi) {
      ix.first_wait_recv[qi].assign(static_cast<size_t>(E), kNever);
      ix.first_wait_full[qi].assign(static_cast<size_t>(E), kNever);
    }
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
      const Op& o = p.ops[i];
      const int qi = qIndex(o.queue);
      ix.q[qi].push_back(i);
      ix.pos[i] = static_cast<int32_t>(ix.q[qi].size());
      std::string err;
      if (o.recv_only && (o.kind != OpKind::kWait || !p.isExchangeEvent(o.event)))
        return concat(sh.opText(r, i), ": recv_only is only meaningful on a wait for an exchange event");
      switch (o.kind) {
        case OpKind::kExchange:
          if (o.queue != Queue::kComm) return concat(sh.opText(r, i), ": an exchange must be on kComm");
          if (o.exchange < 0 || o.exchange >= E)
            return concat(sh.opText(r, i), ": exchange index outside [0, ", E, ")");
          if (ix.exchange_op[o.exchange] >= 0)
            return concat(sh.opText(r, i), ": exchange ", o.exchange, " was already issued by op #",
                          ix.exchange_op[o.exchange]);
          if (!(p.phases & phaseBit(p.exchanges[o.exchange].phase)))
            return concat(sh.opText(r, i), ": a ", phaseText(p.exchanges[o.exchange].phase),
                          " exchange in a plan that runs ", phaseMaskText(p.phases));
          ix.exchange_op[o.exchange] = i;
          if (!(err = checkSpan(sh, r, i, o.send, "send")).empty()) return err;
          if (!(err = checkSpan(sh, r, i, o.recv, "receive")).empty()) return err;
          break;
        case OpKind::kReduce:
        case OpKind::kCopy: {
          const bool red = o.kind == OpKind::kReduce;
          if (o.queue != Queue::kCompute)
            return concat(sh.opText(r, i), ": reduce and copy must be on kCompute");
          if (o.exchange < 0 || o.exchange >= E)
            return concat(sh.opText(r, i), ": exchange index outside [0, ", E, ")");
          // A reduce consumes a reduce-scatter receive, a copy an all-gather one.
          const Phase want_phase = red ? Phase::kReduceScatter : Phase::kAllGather;
          if (p.exchanges[o.exchange].phase != want_phase)
            return concat(sh.opText(r, i), ": ", red ? "a reduce" : "a copy", " consumes ",
                          phaseText(p.exchanges[o.exchange].phase), " exchange ", o.exchange, " in a plan that runs ",
                          phaseMaskText(p.phases));
          if (o.recv.empty() || o.dst.empty() || (red && o.a.empty()))
            return concat(sh.opText(r, i), ": has an empty operand");
          if (o.recv.count != o.dst.count || (red && o.a.count != o.dst.count))
            return concat(sh.opText(r, i), ": operand counts differ");
          // Note [16-bit all-gather] (plan.h): a copy may widen received 16-bit values into the tensor.
          if (!red && o.recv.type != o.dst.type &&
              !(p.gather16 && o.recv.type == p.partial && o.dst.type == p.dtype && o.dst.buf == BufKind::kData))
            return concat(sh.opText(r, i), ": a copy cannot change the element type",
                          p.gather16 ? " (but widen 16-bit values into the tensor)" : "");
          if (!(err = checkSpan(sh, r, i, o.recv, "source")).empty()) return err;
          if (!(err = checkSpan(sh, r, i, o.dst, "destination")).empty()) return err;
          if (red && !(err = checkSpan(sh, r, i, o.a, "local operand")).empty()) return err;
          if (red && (o.a.buf != BufKind::kData || o.dst.type != (o.final ? p.dtype : o.dst.type)))
            return concat(sh.opText(r, i), ": a reduce's local operand is the tensor, and its final reduce writes "
                          "the tensor's type");
          break;
        }
        case OpKind::kConvert: {
          // Note [First hop] (plan.h): the local segment of a first reduce-scatter send, into kAccum
          // (a 16-bit wire) or into itself (a predivide only).
          if (o.queue != Queue::kCompute) return concat(sh.opText(r, i), ": a convert must be on kCompute");
          if (!p.wire16 && p.pre_factor <= 0)
            return concat(sh.opText(r, i), ": a convert in a plan without a 16-bit wire or predivide factor");
          // Note [16-bit all-gather]: also the owner's first all-gather send, into kAccum.
          const bool gather = o.exchange >= 0 && o.exchange < E && p.gather16 &&
                              p.exchanges[o.exchange].phase == Phase::kAllGather;
          if (o.exchange < 0 || o.exchange >= E ||
              (!gather && (p.exchanges[o.exchange].phase != Phase::kReduceScatter || p.exchanges[o.exchange].step != 0)))
            return concat(sh.opText(r, i), ": a convert feeds a first reduce-scatter exchange",
                          p.gather16 ? " or an all-gather one" : "", ", not exchange ", o.exchange);
          if (gather) {
            // Note [16-bit all-gather]: the owner's tensor segment at step 0, later a received 16-bit
            // segment from staging; always into kAccum.
            const bool first = p.exchanges[o.exchange].step == 0;
            if (o.a.empty() || o.a.count != o.dst.count || o.dst.buf != BufKind::kAccum ||
                o.dst.type != p.partial ||
                (first ? o.a.buf != BufKind::kData : (o.a.buf != BufKind::kStaging || o.a.type != p.partial)))
              return concat(sh.opText(r, i), ": an all-gather convert copies ", first ? "the tensor" : "16-bit staging",
                            " into as many 16-bit elements of kAccum");
            if (!(err = checkSpan(sh, r, i, o.a, "source")).empty()) return err;
            if (!(err = checkSpan(sh, r, i, o.dst, "destination")).empty()) return err;
            break;
          }
          if (o.a.empty() || o.a.count != o.dst.count || o.a.buf != BufKind::kData)
            return concat(sh.opText(r, i), ": a convert reads a non-empty tensor segment into as many elements");
          if (p.wire16 ? (o.dst.buf != BufKind::kAccum)
                       : (o.dst.buf != BufKind::kData || o.dst.offset != o.a.offset))
            return concat(sh.opText(r, i), ": a convert writes ", p.wire16 ? "kAccum (16-bit wire)" : "its source in place");
          if (!(err = checkSpan(sh, r, i, o.a, "source")).empty()) return err;
          if (!(err = checkSpan(sh, r, i, o.dst, "destination")).empty()) return err;
          break;
        }
        case OpKind::kRecord: {
          if (o.event < 0 || o.event >= p.num_events)
            return concat(sh.opText(r, i), ": event outside [0, ", p.num_events, ")");
          if (ix.record_op[o.event] >= 0)
            return concat(sh.opText(r, i), ": event ", eventText(p, o.event), " already recorded by op #",
                          ix.record_op[o.event]);
          ix.record_op[o.event] = i;
          const int32_t x = o.event / 2;
          if (p.isExchangeEvent(o.event)) {
            if (o.queue != Queue::kComm)
              return concat(sh.opText(r, i), ": exchange events must be recorded on kComm");
            if (ix.exchange_op[x] < 0)
              return concat(sh.opText(r, i), ": records ", eventText(p, o.event),
                            " before exchange ", x, " is issued (the GPU event would not cover it)");
          } else if (o.queue != Queue::kCompute) {
            return concat(sh.opText(r, i), ": compute events must be recorded on kCompute");
          }
          break;
        }
        case OpKind::kWait: {
          if (o.event < 0 || o.event >= p.num_events)
            return concat(sh.opText(r, i), ": event outside [0, ", p.num_events, ")");
          if (ix.record_op[o.event] < 0)
            return concat(sh.opText(r, i), ": waits on event ", eventText(p, o.event),
                          " before it is recorded in list order (the CPU executor would skip or "
                          "deadlock on it; cudaStreamWaitEvent would not wait)");
          if (p.isExchangeEvent(o.event)) {
            int32_t& fr = ix.first_wait_recv[qi][o.event / 2];
            fr = std::min(fr, ix.pos[i]);
            if (!o.recv_only) {
              int32_t& ff = ix.first_wait_full[qi][o.event / 2];
              ff = std::min(ff, ix.pos[i]);
            }
          }
          break;
        }
        default:
          return concat(sh.opText(r, i), ": unknown op kind");
      }
    }
  }
  // Messages are matched per (peer, tag) in posting order: the k-th non-empty send of rank r is
  // the k-th non-empty receive of rank r+1.
  for (int r = 0; r < n; ++r) {
    const int nx = (r + 1) % n;
    std::vector<int> sends, recvs;
    for (int i = 0; i < static_cast<int>(P[r].ops.size()); ++i)
      if (P[r].ops[i].kind == OpKind::kExchange && !P[r].ops[i].send.empty()) sends.push_back(i);
    for (int i = 0; i < static_cast<int>(P[nx].ops.size()); ++i)
      if (P[nx].ops[i].kind == OpKind::kExchange && !P[nx].ops[i].recv.empty()) recvs.push_back(i);
    const size_t common = std::min(sends.size(), recvs.size());
    for (size_t k = 0; k < common; ++k) {
      const Op& s = P[r].ops[sends[k]];
      const Op& v = P[nx].ops[recvs[k]];
      if (s.exchange != v.exchange || s.send.count != v.recv.count || s.send.type != v.recv.type)
        return concat("send/recv mismatch: message ", k, " from rank ", r, " to rank ", nx, " is ",
                      sh.opText(r, sends[k]), " (sends ", spanText(s.send), ") but it is matched with ",
                      sh.opText(nx, recvs[k]), " (receives ", spanText(v.recv),
                      "): exchange indices, element counts and types must agree");
    }
    if (sends.size() > common)
      return concat("send/recv mismatch: ", sh.opText(r, sends[common]), " sends to rank ", nx,
                    ", which posts no matching receive (", sends.size(), " sends, ", recvs.size(),
                    " receives)");
    if (recvs.size() > common)
      return concat("send/recv mismatch: ", sh.opText(nx, recvs[common]), " receives from rank ", r,
                    ", which sends no matching message (", sends.size(), " sends, ", recvs.size(),
                    " receives)");
  }
  return "";
}

// ------------------------------------------------------------------------------------------------
// 2. Exact happens-before and race detection.

class HappensBefore {
 public:
  explicit HappensBefore(const Shared& sh) : sh_(sh), n_(sh.n), w_(2 * sh.n) {}

  std::string run() {
    std::string err = buildClocks();
    if (!err.empty()) return err;
    for (int r = 0; r < n_; ++r) {
      err = findRaces(r);
      if (!err.empty()) return err;
      err = checkDrain(r);
      if (!err.empty()) return err;
    }
    return "";
  }

 private:
  const Shared& sh_;
  int n_;
  int w_;  // clock width: (kCompute position, kComm position) per rank
  std::vector<std::vector<int32_t>> qclk_[2];  // per queue: per rank: len*w_
  // Per rank: the clocks of the receive completions, E*w_. The send half of an exchange completes
  // after its issue and nothing else (eager transports), so its completion's clock is the issue's,
  // and a full wait joins both.
  std::vector<std::vector<int32_t>> cclk_;
  std::vector<std::vector<char>> completed_;  // per rank, per exchange: both completions processed
  std::vector<std::vector<int64_t>> topo_;     // per rank: per op, order of processing

  const int32_t* opClock(int r, int i) const {
    const int qi = qIndex(sh_.plans[r].ops[i].queue);
    return &qclk_[qi][r][static_cast<size_t>(sh_.idx[r].pos[i] - 1) * w_];
  }

  bool issued(int r, int32_t x) const {
    const int i = sh_.idx[r].exchange_op[x];
    return i >= 0 && topo_[r][i] >= 0;
  }

  void join(int32_t* dst, const int32_t* src) const {
    for (int k = 0; k < w_; ++k) dst[k] = std::max(dst[k], src[k]);
  }

  void tryComplete(int r, int32_t x) {
    if (completed_[r][x] || !issued(r, x)) return;
    const int i = sh_.idx[r].exchange_op[x];
    const Op& o = sh_.plans[r].ops[i];
    const int prev = sh_.plans[r].prev;
    // Data can arrive only after the sender posted it (static checks paired the indices).
    if (!o.recv.empty() && !issued(prev, x)) return;
    // The receive completes after this rank's issue and, when it receives, the sender's (an empty
    // receive counts as complete at the issue).
    int32_t* c = &cclk_[r][static_cast<size_t>(x) * w_];
    join(c, opClock(r, i));
    if (!o.recv.empty()) join(c, opClock(prev, sh_.idx[prev].exchange_op[x]));
    completed_[r][x] = 1;
  }

  std::string buildClocks() {
    qclk_[0].resize(n_);
    qclk_[1].resize(n_);
    cclk_.resize(n_);
    completed_.resize(n_);
    topo_.resize(n_);
    std::vector<std::array<size_t, 2>> cur(static_cast<size_t>(n_), std::array<size_t, 2>{0, 0});
    for (int r = 0; r < n_; ++r) {
      const RankIndex& ix = sh_.idx[r];
      for (int qi = 0; qi < 2; ++qi) qclk_[qi][r].assign(ix.q[qi].size() * w_, 0);
      cclk_[r].assign(static_cast<size_t>(sh_.plans[r].num_exchanges) * w_, 0);
      completed_[r].assign(static_cast<size_t>(sh_.plans[r].num_exchanges), 0);
      topo_[r].assign(sh_.plans[r].ops.size(), -1);
    }
    int64_t order = 0;
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < n_; ++r) {
        const Plan& p = sh_.plans[r];
        const RankIndex& ix = sh_.idx[r];
        for (int qi = 0; qi < 2; ++qi) {
          while (cur[r][qi] < ix.q[qi].size()) {
            const size_t k = cur[r][qi];
            const int i = ix.q[qi][k];
            const Op& o = p.ops[i];
            const int32_t* src = nullptr;
            const int32_t* send_src = nullptr;
            if (o.kind == OpKind::kWait) {
              if (p.isExchangeEvent(o.event)) {
                const int32_t x = o.event / 2;
                if (!completed_[r][x]) break;
                src = &cclk_[r][static_cast<size_t>(x) * w_];
                // A full wait also follows the send's completion; a recv_only wait does not.
                if (!o.recv_only) send_src = opClock(r, ix.exchange_op[x]);
              } else {
                const int rec = ix.record_op[o.event];
                if (topo_[r][rec] < 0) break;
                src = opClock(r, rec);
              }
            }
            int32_t* c = &qclk_[qi][r][k * w_];
            if (k > 0) join(c, c - w_);
            if (src) join(c, src);
            if (send_src) join(c, send_src);
            c[2 * r + qi] = static_cast<int32_t>(k + 1);
            topo_[r][i] = order++;
            cur[r][qi] = k + 1;
            progress = true;
            if (o.kind == OpKind::kExchange) {
              tryComplete(r, o.exchange);
              if (!o.send.empty()) tryComplete(p.next, o.exchange);
            }
          }
        }
      }
    }
    for (int r = 0; r < n_; ++r) {
      for (int qi = 0; qi < 2; ++qi) {
        const RankIndex& ix = sh_.idx[r];
        if (cur[r][qi] < ix.q[qi].size()) {
          const int i = ix.q[qi][cur[r][qi]];
          return concat("deadlock (a cycle of waits, whatever the timing): ", sh_.opText(r, i), " on ",
                        qText(qi), " can never proceed; its event depends on itself through the ring");
        }
      }
    }
    return "";
  }

  // Whether a node with clock c follows the receive completion of exchange x of rank r (a wait of
  // either kind on it), or also its send completion (a full wait): completions have no other
  // successors, and a queue position in c covers every earlier op of that queue.
  bool knowsReceived(const int32_t* c, int r, int32_t x) const {
    const RankIndex& ix = sh_.idx[r];
    return c[2 * r] >= ix.first_wait_recv[0][x] || c[2 * r + 1] >= ix.first_wait_recv[1][x];
  }
  bool knowsComplete(const int32_t* c, int r, int32_t x) const {
    const RankIndex& ix = sh_.idx[r];
    return c[2 * r] >= ix.first_wait_full[0][x] || c[2 * r + 1] >= ix.first_wait_full[1][x];
  }

  struct Access {
    int op;
    int buf;  // 1 data, 2 accum, 3 + slot staging
    int64_t lo, hi;
    bool write;
    bool exchange;
    int32_t xchg;
    int32_t pos;  // queue position of a compute op
    int64_t topo;
  };

  // end(a) happens before start(b). An exchange's receive (its write) ends at the receive
  // completion, its send (its read) at the send completion.
  bool ordered(int r, const Access& a, const Access& b) const {
    const int32_t* c = opClock(r, b.op);
    if (!a.exchange) return c[2 * r] >= a.pos;
    return a.write ? knowsReceived(c, r, a.xchg) : knowsComplete(c, r, a.xchg);
  }

  std::string bufName(int buf) const {
    if (buf == 1) return "data";
    if (buf == 2) return "accum";
    return concat("staging slot ", buf - 3);
  }

  std::string raceText(int r, const Access& a, const Access& b) const {
    const int64_t lo = std::max(a.lo, b.lo), hi = std::min(a.hi, b.hi);
    const char* ka = a.write ? "writes" : "reads";
    const char* kb = b.write ? "writes" : "reads";
    std::string head = "data race";
    if (a.buf >= 3 && a.exchange != b.exchange &&
        ((a.exchange && a.write && !b.exchange && !b.write) ||
         (b.exchange && b.write && !a.exchange && !a.write)))
      head = concat("staging slot ", a.buf - 3, " reused before its reduce/copy finished");
    return concat(head, " on rank ", r, ", ", bufName(a.buf), " bytes [", lo, ", ", hi, "): ",
                  describeOp(sh_.plans[r], a.op), " ", ka, " and ", describeOp(sh_.plans[r], b.op), " ",
                  kb, ", and neither is ordered before the other by queue order, waits or exchange "
                  "completion (a wait is missing)");
  }

  std::string findRaces(int r) {
    const Plan& p = sh_.plans[r];
    std::vector<Access> acc;
    auto add = [&](int i, const Span& s, bool write) {
      if (s.empty()) return;
      const Op& o = p.ops[i];
      const int64_t es = spanElemSize(p, s);
      Access a;
      a.op = i;
      a.buf = s.buf == BufKind::kStaging ? 3 + s.slot : static_cast<int>(s.buf);
      a.lo = s.offset * es;
      a.hi = (s.offset + s.count) * es;
      a.write = write;
      a.exchange = o.kind == OpKind::kExchange;
      a.xchg = o.exchange;
      a.pos = sh_.idx[r].pos[i];
      a.topo = topo_[r][i];
      acc.push_back(a);
    };
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
      const Op& o = p.ops[i];
      if (o.kind == OpKind::kExchange) {
        add(i, o.send, false);
        add(i, o.recv, true);
      } else if (o.kind == OpKind::kReduce) {
        add(i, o.a, false);
        add(i, o.recv, false);
        add(i, o.dst, true);
      } else if (o.kind == OpKind::kCopy) {
        add(i, o.recv, false);
        add(i, o.dst, true);
      } else if (o.kind == OpKind::kConvert) {
        add(i, o.a, false);
        add(i, o.dst, true);
      }
    }
    std::stable_sort(acc.begin(), acc.end(), [](const Access& x, const Access& y) { return x.topo < y.topo; });
    const int64_t block = std::max<int64_t>(16, p.sched.segment * sh_.narrow);
    std::unordered_map<uint64_t, std::vector<int>> live;
    for (int k = 0; k < static_cast<int>(acc.size()); ++k) {
      const Access& b = acc[k];
      for (int64_t blk = b.lo / block; blk * block < b.hi; ++blk) {
        const int64_t blo = blk * block, bhi = blo + block;
        std::vector<int>& list = live[(static_cast<uint64_t>(b.buf) << 44) | static_cast<uint64_t>(blk)];
        size_t keep = 0;
        for (size_t m = 0; m < list.size(); ++m) {
          const Access& a = acc[list[m]];
          const bool overlap = a.lo < b.hi && b.lo < a.hi;
          bool drop = false;
          if (overlap && (a.write || b.write)) {
            const bool same_op = a.op == b.op;
            if (same_op && a.exchange) return raceText(r, a, b);  // send and receive overlap
            if (!same_op && !ordered(r, a, b)) return raceText(r, a, b);
          }
          // Sound pruning: a later access that races with `a` also races with `b`.
          if (overlap && b.lo <= std::max(a.lo, blo) && b.hi >= std::min(a.hi, bhi) &&
              (b.write || !a.write) && ordered(r, a, b))
            drop = true;
          if (!drop) list[keep++] = list[m];
        }
        list.resize(keep);
        list.push_back(k);
      }
    }
    return "";
  }

  std::string checkDrain(int r) {
    const Plan& p = sh_.plans[r];
    const RankIndex& ix = sh_.idx[r];
    std::vector<int32_t> zero(static_cast<size_t>(w_), 0);
    const int32_t* last = ix.q[0].empty() ? zero.data() : opClock(r, ix.q[0].back());
    for (int32_t x = 0; x < p.num_exchanges; ++x) {
      if (ix.exchange_op[x] < 0) continue;
      if (!knowsComplete(last, r, x))
        return concat("rank ", r, ": kCompute finishes without knowing that exchange ", x, " (",
                      describeOp(p, ix.exchange_op[x]), ") completed; the call would return while ",
                      "the tensor or staging may still be sent or received (a final wait is missing)");
    }
    return "";
  }
};

// ------------------------------------------------------------------------------------------------
// 3. Randomized value simulation.

struct Cell {
  uint64_t mask = 0;  // contributing ranks
  uint64_t pre = 0;   // contributions divided by the predivide factor (Note [First hop], plan.h)
  uint64_t hash = 0;  // reduction tree
  int64_t idx = -1;   // logical element index
  uint8_t divs = 0;   // final scalings applied (AVG's division, a SUM's post-scaling)
  uint8_t type = 0;   // DType the element is stored as
  uint8_t valid = 0;
  uint8_t rounded = 0;  // the owner rounded the finished value to 16 bits (Note [16-bit all-gather])
};

enum class Model { kStreams, kListWalk };

class Simulation {
 public:
  Simulation(const Shared& sh, Model model, uint64_t seed) : sh_(sh), model_(model), rng_(seed), n_(sh.n) {
    // Every other trial, sends complete long after their data was read (a late acknowledgement):
    // whatever overwrites a send's bytes before a full wait for it then shows.
    late_sends_ = (rng_() & 1) != 0;
  }

  std::string run() {
    init();
    for (int r = 0; r < n_; ++r) {
      wake(r, 0, delay());
      if (model_ == Model::kStreams) wake(r, 1, delay());
    }
    while (!events_.empty() && err_.empty()) {
      const Ev ev = events_.top();
      events_.pop();
      now_ = ev.t;
      dispatch(ev);
    }
    if (!err_.empty()) return err_;
    std::string err = checkFinished();
    if (!err.empty()) return err;
    return checkResults();
  }

 private:
  enum EvKind : uint8_t { kStep, kComputeDone, kMsgRead, kMsgWrite, kSendDone, kRecvDone };
  struct Ev {
    double t;
    uint64_t seq;
    EvKind kind;
    int r;
    int a;  // queue, or message id
    int b;  // op index
    bool operator>(const Ev& o) const { return t != o.t ? t > o.t : seq > o.seq; }
  };
  struct Msg {
    int src, dst;
    int send_op, recv_op;
    std::vector<Cell> payload;
  };
  struct RankState {
    std::vector<Cell> data, accum;
    std::vector<std::vector<Cell>> slots;
    size_t cur[2] = {0, 0};  // streams: per queue (index into idx.q); list walk: cur[0] into ops
    bool busy[2] = {false, false};
    bool step_pending[2] = {false, false};
    std::vector<char> fired, rec_issued;
    std::vector<char> ex_issued, ex_complete, ex_received;  // received: the receive half completed
    std::vector<int8_t> ex_left;
    std::deque<int> send_q, recv_q;  // posted, unmatched: sends to next, receives from prev
    std::vector<int> sending;        // kExchange ops whose send is posted and not complete
  };

  const Shared& sh_;
  Model model_;
  std::mt19937_64 rng_;
  int n_;
  double now_ = 0;
  uint64_t seq_ = 0;
  std::string err_;
  std::vector<RankState> st_;
  std::vector<Msg> msgs_;
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> events_;
  uint64_t full_ = 0;
  uint64_t want_pre_ = 0;  // the contributions a finished element has divided by the predivide factor
  uint8_t want_divs_ = 0;
  uint8_t want_rounded_ = 0;  // a finished element is a 16-bit value (Note [16-bit all-gather])
  bool late_sends_ = false;

  double delay() {
    const uint64_t v = rng_();
    const double u = static_cast<double>(v >> 11) * (1.0 / 9007199254740992.0);
    switch (v % 10) {
      case 0: case 1: case 2: return 0.0;
      case 3: case 4: case 5: case 6: case 7: return u;
      default: return 40.0 * u;
    }
  }

  void push(double t, EvKind k, int r, int a, int b) { events_.push(Ev{t, seq_++, k, r, a, b}); }

  void fail(const std::string& what) {
    if (err_.empty()) err_ = what;
  }

  std::string modelText() const {
    return model_ == Model::kStreams ? "two-queue model (GPU streams)" : "list-walk model (CPU executor)";
  }

  void init() {
    const Plan& ref = sh_.plans[0];
    full_ = n_ == 64 ? ~0ull : ((1ull << n_) - 1);
    // AVG divides exactly once unless the divisor is 1 (one rank, default divisor): a ring of one
    // with a larger divisor (a hierarchical stage) still owes its caller the division.
    // A SUM scales once too when it has a post factor or an extra divisor.
    const bool scales = sh_.opt.average || ref.post_factor > 0 || ref.extra_divisor > 1;
    want_divs_ = (scales && (n_ > 1 || ref.avg_divisor != 1)) ? 1 : 0;
    want_pre_ = (ref.pre_factor > 0 && n_ > 1) ? full_ : 0;  // one rank has no reduce to divide in
    want_rounded_ = ref.gather16 && n_ > 1 ? 1 : 0;
    st_.assign(static_cast<size_t>(n_), RankState{});
    for (int r = 0; r < n_; ++r) {
      const Plan& p = sh_.plans[r];
      RankState& s = st_[r];
      s.data.resize(static_cast<size_t>(ref.sched.numel));
      const Range own = p.sched.chunkRange(p.sched.ownedChunk(r));
      for (int64_t i = 0; i < ref.sched.numel; ++i) {
        Cell& c = s.data[static_cast<size_t>(i)];
        c.idx = i;
        c.valid = 1;
        c.type = static_cast<uint8_t>(p.dtype);
        if (ref.phases != kPhaseAllGather) {
          c.mask = 1ull << r;  // this rank's contribution
          c.hash = mix64(static_cast<uint64_t>(r) * 0x100000001b3ull ^ static_cast<uint64_t>(i));
        } else if (i >= own.begin && i < own.end) {
          // All-gather only: the owned chunk is finished, as a reduce-scatter left it.
          c.mask = full_;
          c.pre = want_pre_;
          c.divs = want_divs_;
          c.hash = finishedHash(i);
        }
        // else: an empty element (no contributions), which nothing may copy or leave behind.
      }
      s.accum.assign(static_cast<size_t>(p.accum_elems), Cell{});
      s.slots.assign(static_cast<size_t>(p.num_slots),
                     std::vector<Cell>(static_cast<size_t>(sh_.slot_bytes / sh_.narrow)));
      s.fired.assign(static_cast<size_t>(p.num_events), 0);
      s.rec_issued.assign(static_cast<size_t>(p.num_events), 0);
      s.ex_issued.assign(static_cast<size_t>(p.num_exchanges), 0);
      s.ex_complete.assign(static_cast<size_t>(p.num_exchanges), 0);
      s.ex_received.assign(static_cast<size_t>(p.num_exchanges), 0);
      s.ex_left.assign(static_cast<size_t>(p.num_exchanges), 0);
    }
  }

  Cell* cells(int r, const Span& s) {
    RankState& st = st_[r];
    switch (s.buf) {
      case BufKind::kData: return &st.data[static_cast<size_t>(s.offset)];
      case BufKind::kAccum: return &st.accum[static_cast<size_t>(s.offset)];
      case BufKind::kStaging: return &st.slots[static_cast<size_t>(s.slot)][static_cast<size_t>(s.offset)];
      case BufKind::kNone: break;
    }
    return nullptr;
  }

  void wake(int r, int q, double d) {
    RankState& s = st_[r];
    if (s.step_pending[q]) return;
    s.step_pending[q] = true;
    push(now_ + d, kStep, r, q, -1);
  }
  void wakeAll(int r) {
    wake(r, 0, 0.0);
    if (model_ == Model::kStreams) wake(r, 1, 0.0);
  }

  void dispatch(const Ev& ev) {
    switch (ev.kind) {
      case kStep:
        st_[ev.r].step_pending[ev.a] = false;
        step(ev.r, ev.a);
        break;
      case kComputeDone:
        applyCompute(ev.r, ev.b);
        st_[ev.r].busy[ev.a] = false;
        wakeAll(ev.r);
        break;
      case kMsgRead: readMsg(ev.a); break;
      case kMsgWrite: writeMsg(ev.a); break;
      case kSendDone: halfDone(msgs_[ev.a].src, msgs_[ev.a].send_op, false); break;
      case kRecvDone: halfDone(msgs_[ev.a].dst, msgs_[ev.a].recv_op, true); break;
    }
  }

  bool waitReady(int r, const Op& w) const {
    const RankState& s = st_[r];
    const Plan& p = sh_.plans[r];
    // The GPU driver: one event per exchange, so a recv_only wait is a full one.
    if (model_ == Model::kStreams) return s.fired[w.event] != 0;
    // The CPU executor: even events wait for the exchange's requests (recv_only: the receive
    // request alone, its send may complete any time later); odd ones ran inline.
    if (!p.isExchangeEvent(w.event)) return true;
    const int32_t x = w.event / 2;
    return !s.ex_issued[x] || s.ex_complete[x] || (w.recv_only && s.ex_received[x]);
  }

  void fire(int r, int32_t event) {
    st_[r].fired[event] = 1;
    wakeAll(r);
  }

  void step(int r, int q) {
    RankState& s = st_[r];
    const Plan& p = sh_.plans[r];
    if (s.busy[q]) return;
    const std::vector<int>* list = model_ == Model::kStreams ? &sh_.idx[r].q[q] : nullptr;
    const size_t len = list ? list->size() : p.ops.size();
    if (s.cur[q] >= len) return;
    const int i = list ? (*list)[s.cur[q]] : static_cast<int>(s.cur[q]);
    const Op& o = p.ops[i];
    switch (o.kind) {
      case OpKind::kWait:
        if (!waitReady(r, o)) return;  // woken when something completes
        break;
      case OpKind::kRecord:
        if (p.isExchangeEvent(o.event)) {
          s.rec_issued[o.event] = 1;
          if (s.ex_complete[o.event / 2]) fire(r, o.event);
        } else {
          fire(r, o.event);  // every earlier kCompute op has completed (in order, not busy)
        }
        break;
      case OpKind::kExchange:
        post(r, i);
        break;
      case OpKind::kReduce:
      case OpKind::kCopy:
      case OpKind::kConvert:
        s.busy[q] = true;
        ++s.cur[q];
        push(now_ + delay(), kComputeDone, r, q, i);
        return;
    }
    ++s.cur[q];
    wake(r, q, delay());
  }

  void post(int r, int i) {
    RankState& s = st_[r];
    const Plan& p = sh_.plans[r];
    const Op& o = p.ops[i];
    s.ex_issued[o.exchange] = 1;
    s.ex_left[o.exchange] = static_cast<int8_t>((o.send.empty() ? 0 : 1) + (o.recv.empty() ? 0 : 1));
    if (o.recv.empty()) s.ex_received[o.exchange] = 1;
    if (s.ex_left[o.exchange] == 0) completeExchange(r, o.exchange);
    if (!o.send.empty()) {
      s.send_q.push_back(i);
      s.sending.push_back(i);
    }
    if (!o.recv.empty()) s.recv_q.push_back(i);
    match(r);
    match(p.prev);
  }

  void match(int src) {
    const int dst = sh_.plans[src].next;
    RankState& a = st_[src];
    RankState& b = st_[dst];
    while (!a.send_q.empty() && !b.recv_q.empty()) {
      Msg m{src, dst, a.send_q.front(), b.recv_q.front(), {}};
      a.send_q.pop_front();
      b.recv_q.pop_front();
      msgs_.push_back(std::move(m));
      push(now_ + delay(), kMsgRead, src, static_cast<int>(msgs_.size() - 1), -1);
    }
  }

  void readMsg(int id) {
    Msg& m = msgs_[id];
    const Op& o = sh_.plans[m.src].ops[m.send_op];
    const Cell* c = cells(m.src, o.send);
    m.payload.assign(c, c + o.send.count);
    for (int64_t k = 0; k < o.send.count; ++k) {
      if (!c[k].valid) {
        fail(concat(sh_.opText(m.src, m.send_op), " sends element ", k, " of its span, which was never written"));
        return;
      }
      if (c[k].type != static_cast<uint8_t>(o.send.type)) {
        fail(concat(sh_.opText(m.src, m.send_op), " sends element ", c[k].idx, " as ", dtypeName(o.send.type),
                    " but it holds ", dtypeName(static_cast<DType>(c[k].type))));
        return;
      }
    }
    push(now_ + (late_sends_ ? 40.0 : 0.0) + delay(), kSendDone, m.src, id, -1);
    push(now_ + delay(), kMsgWrite, m.src, id, -1);
  }

  // A write into bytes that a send of the same rank may still read (posted, not complete) is a
  // race whatever the values: the transport may read them at any moment until the completion.
  bool overwritesSending(int r, int i, const Span& dst) {
    const Plan& p = sh_.plans[r];
    const int64_t lo = dst.offset * spanElemSize(p, dst), hi = (dst.offset + dst.count) * spanElemSize(p, dst);
    for (int j : st_[r].sending) {
      const Span& sent = p.ops[j].send;
      if (sent.buf != dst.buf || (dst.buf == BufKind::kStaging && sent.slot != dst.slot)) continue;
      const int64_t es = spanElemSize(p, sent);
      if (sent.offset * es >= hi || (sent.offset + sent.count) * es <= lo) continue;
      fail(concat(sh_.opText(r, i), " writes ", spanText(dst), " while ", describeOp(p, j),
                  " may still be sending ", spanText(sent), " (its send has not completed)"));
      return true;
    }
    return false;
  }

  void writeMsg(int id) {
    Msg& m = msgs_[id];
    const Op& o = sh_.plans[m.dst].ops[m.recv_op];
    if (overwritesSending(m.dst, m.recv_op, o.recv)) return;
    Cell* c = cells(m.dst, o.recv);
    for (int64_t k = 0; k < o.recv.count; ++k) {
      Cell v = m.payload[static_cast<size_t>(k)];
      if (o.recv.buf == BufKind::kData && v.idx != o.recv.offset + k) {
        fail(concat(sh_.opText(m.dst, m.recv_op), " receives element ", v.idx, " into position ",
                    o.recv.offset + k));
        return;
      }
      if (o.recv.buf == BufKind::kData &&
          (v.mask != full_ || v.divs != want_divs_ || v.pre != want_pre_ || v.rounded != want_rounded_)) {
        fail(concat(sh_.opText(m.dst, m.recv_op), " receives unfinished element ", v.idx,
                    " into the tensor (contributions ", maskText(v.mask), ", divisions ", int(v.divs), ")"));
        return;
      }
      c[k] = v;
    }
    push(now_ + delay(), kRecvDone, m.dst, id, -1);
  }

  void halfDone(int r, int op, bool recv) {
    const int32_t x = sh_.plans[r].ops[op].exchange;
    RankState& s = st_[r];
    if (recv) {
      s.ex_received[x] = 1;
      wakeAll(r);  // a recv_only wait may proceed
    } else {
      const auto it = std::find(s.sending.begin(), s.sending.end(), op);
      if (it != s.sending.end()) s.sending.erase(it);
    }
    if (--s.ex_left[x] == 0) completeExchange(r, x);
  }

  void completeExchange(int r, int32_t x) {
    RankState& s = st_[r];
    s.ex_complete[x] = 1;
    if (s.rec_issued[Plan::exchangeEvent(x)]) fire(r, Plan::exchangeEvent(x));
    wakeAll(r);
  }

  int chunkOf(int64_t idx) const {
    const int64_t chunk = sh_.plans[0].sched.chunk;
    return chunk > 0 ? static_cast<int>(idx / chunk) : 0;
  }

  void applyCompute(int r, int i) {
    const Plan& p = sh_.plans[r];
    const Op& o = p.ops[i];
    auto where = [&] { return concat(sh_.opText(r, i), ": "); };
    if (overwritesSending(r, i, o.dst)) return;
    const bool predivide = p.pre_factor > 0;
    if (o.kind == OpKind::kConvert && p.exchanges[o.exchange].phase == Phase::kAllGather) {
      // Note [16-bit all-gather]: the owner's finished, rounded value, stored as 16 bits (exact).
      std::vector<Cell> out(static_cast<size_t>(o.dst.count));
      const Cell* src = cells(r, o.a);
      for (int64_t k = 0; k < o.dst.count; ++k) {
        Cell z = src[k];
        if (!z.valid) return fail(concat(where(), "reads ", spanText(o.a), " element ", k, ", never written"));
        if (z.type != static_cast<uint8_t>(o.a.type))
          return fail(concat(where(), "reads element ", z.idx, " as ", dtypeName(o.a.type), " but it holds ",
                             dtypeName(static_cast<DType>(z.type))));
        if (z.mask != full_ || z.divs != want_divs_ || z.pre != want_pre_ || z.rounded != want_rounded_)
          return fail(concat(where(), "converts element ", z.idx, " for the all-gather before it is finished and "
                             "rounded (contributions ", maskText(z.mask), ", divisions ", int(z.divs), ", rounded ",
                             int(z.rounded), ")"));
        z.type = static_cast<uint8_t>(o.dst.type);
        out[static_cast<size_t>(k)] = z;
      }
      Cell* dst = cells(r, o.dst);
      for (int64_t k = 0; k < o.dst.count; ++k) dst[k] = out[static_cast<size_t>(k)];
      return;
    }
    if (o.kind == OpKind::kConvert) {
      // Note [First hop]: this rank's own raw value, divided (predivide) and stored in dst's type.
      std::vector<Cell> out(static_cast<size_t>(o.dst.count));
      const Cell* src = cells(r, o.a);
      for (int64_t k = 0; k < o.dst.count; ++k) {
        const Cell x = src[k];
        if (!x.valid) return fail(concat(where(), "reads ", spanText(o.a), " element ", k, ", never written"));
        if (x.mask != (1ull << r) || x.divs || x.pre || x.type != static_cast<uint8_t>(o.a.type))
          return fail(concat(where(), "converts element ", x.idx, ", which is not this rank's raw ",
                             dtypeName(o.a.type), " value (contributions ", maskText(x.mask), ", predivided ",
                             maskText(x.pre), ")"));
        Cell z = x;
        if (predivide) z.pre = x.mask;
        z.type = static_cast<uint8_t>(o.dst.type);
        z.hash = mix64(x.hash ^ 0xc0ffee00ull ^ static_cast<uint64_t>(o.dst.type));
        out[static_cast<size_t>(k)] = z;
      }
      Cell* dst = cells(r, o.dst);
      for (int64_t k = 0; k < o.dst.count; ++k) dst[k] = out[static_cast<size_t>(k)];
      return;
    }
    Cell* src = cells(r, o.recv);
    Cell* dst = cells(r, o.dst);
    Cell* loc = o.kind == OpKind::kReduce ? cells(r, o.a) : nullptr;
    for (int64_t k = 0; k < o.dst.count; ++k) {
      const Cell y = src[k];
      if (!y.valid) return fail(concat(where(), "reads ", spanText(o.recv), " element ", k, ", never written"));
      if (y.type != static_cast<uint8_t>(o.recv.type))
        return fail(concat(where(), "reads element ", y.idx, " as ", dtypeName(o.recv.type), " but it holds ",
                           dtypeName(static_cast<DType>(y.type))));
      Cell z;
      if (o.kind == OpKind::kReduce) {
        const Cell x = loc[k];
        if (!x.valid) return fail(concat(where(), "reads ", spanText(o.a), " element ", k, ", never written"));
        if (x.idx != y.idx)
          return fail(concat(where(), "combines element ", x.idx, " with element ", y.idx,
                             " (wrong slot, offset or stale staging data)"));
        if (x.mask & y.mask)
          return fail(concat(where(), "element ", x.idx, " reduced twice: contributions ",
                             maskText(x.mask & y.mask), " are in both operands"));
        if (x.divs || y.divs)
          return fail(concat(where(), "element ", x.idx, " is reduced after AVG already divided it"));
        if (x.rounded || y.rounded)
          return fail(concat(where(), "element ", x.idx, " is reduced after its owner rounded the result"));
        if (x.type != static_cast<uint8_t>(o.a.type) || x.pre)
          return fail(concat(where(), "local operand element ", x.idx, " is not this rank's raw value (",
                             dtypeName(static_cast<DType>(x.type)), ", predivided ", maskText(x.pre), ")"));
        if (y.pre != (predivide ? y.mask : 0))
          return fail(concat(where(), "element ", y.idx, " arrives with contributions ", maskText(y.mask),
                             " of which ", maskText(y.pre), " are divided by the predivide factor (all or none)"));
        z.idx = x.idx;
        z.mask = x.mask | y.mask;
        z.pre = predivide ? z.mask : 0;  // the reduce divides its local operand on load
        z.hash = mix64(x.hash ^ ((y.hash << 23) | (y.hash >> 41)) ^ (static_cast<uint64_t>(o.dst.type) * 0x5555ull) ^
                       (o.final ? 0xaaaa0000ull : 0));
        z.valid = 1;
        if (o.final) {
          if (chunkOf(z.idx) != p.sched.ownedChunk(r))
            return fail(concat(where(), "final reduce of element ", z.idx, " (chunk ", chunkOf(z.idx),
                               ") on a rank that owns chunk ", p.sched.ownedChunk(r)));
          if (z.mask != full_)
            return fail(concat(where(), "final reduce of element ", z.idx, " has contributions ",
                               maskText(z.mask), ", missing ", maskText(full_ & ~z.mask)));
          if (want_divs_) z.divs = 1;
          if (p.gather16) {  // Note [16-bit all-gather]: the owner rounds the finished value once
            z.rounded = 1;
            z.hash = mix64(z.hash ^ 0x16b17ull);
          }
        }
      } else {
        if (y.mask != full_ || y.divs != want_divs_ || y.pre != want_pre_ || y.rounded != want_rounded_)
          return fail(concat(where(), "copies element ", y.idx, " before it is finished (contributions ",
                             maskText(y.mask), ", divisions ", int(y.divs), ", rounded ", int(y.rounded), ")"));
        z = y;
      }
      z.type = static_cast<uint8_t>(o.dst.type);
      if (o.dst.buf == BufKind::kData && z.idx != o.dst.offset + k)
        return fail(concat(where(), "writes element ", z.idx, " into tensor position ", o.dst.offset + k));
      dst[k] = z;
    }
  }

  std::string checkFinished() {
    std::ostringstream os;
    bool stuck = false;
    for (int r = 0; r < n_; ++r) {
      const RankState& s = st_[r];
      const Plan& p = sh_.plans[r];
      const int queues = model_ == Model::kStreams ? 2 : 1;
      for (int q = 0; q < queues; ++q) {
        const std::vector<int>* list = model_ == Model::kStreams ? &sh_.idx[r].q[q] : nullptr;
        const size_t len = list ? list->size() : p.ops.size();
        if (s.cur[q] < len) {
          stuck = true;
          const int i = list ? (*list)[s.cur[q]] : static_cast<int>(s.cur[q]);
          os << "\n  " << sh_.opText(r, i) << " never proceeds"
             << (model_ == Model::kStreams ? concat(" (", qText(q), ")") : std::string());
        }
      }
      for (int32_t x = 0; x < p.num_exchanges; ++x) {
        if (s.ex_issued[x] && !s.ex_complete[x]) {
          stuck = true;
          os << "\n  rank " << r << " exchange " << x << " never completes (no matching peer operation)";
        }
      }
    }
    if (stuck) return concat("deadlock in the ", modelText(), " with rendezvous sends:", os.str());
    return "";
  }

  // Note [Lanes]: whether element i is this plan set's to finish.
  bool inLane(int64_t i) const {
    const Plan& ref = sh_.plans[0];
    return ref.lanes <= 1 || laneOfElement(ref.sched, ref.lanes, i) == ref.lane;
  }

  // The value of element i that an all-gather-only plan starts from on its owner: the same on every
  // rank, whoever owns it.
  static uint64_t finishedHash(int64_t i) { return mix64(0xf1a15bedull ^ (static_cast<uint64_t>(i) << 8)); }

  std::string checkResults() {
    const Plan& ref = sh_.plans[0];
    const int64_t numel = ref.sched.numel;
    if (ref.phases == kPhaseReduceScatter) {
      // Reduce-scatter only: the owned chunk is finished, the rest of the tensor is unspecified.
      // Each chunk has one owner, so there is no cross-rank tree to compare.
      for (int r = 0; r < n_; ++r) {
        const std::vector<Cell>& d = st_[r].data;
        const int own = sh_.plans[r].sched.ownedChunk(r);
        const Range range = sh_.plans[r].sched.chunkRange(own);
        for (int64_t i = range.begin; i < range.end; ++i) {
          if (!inLane(i)) continue;
          const Cell& c = d[static_cast<size_t>(i)];
          if (c.mask != full_)
            return concat("element ", i, " of rank ", r, " (in its owned chunk ", own, ") ends with contributions ",
                          maskText(c.mask), " (missing ", maskText(full_ & ~c.mask), ")");
          if (c.divs != want_divs_)
            return concat("element ", i, " of rank ", r, " (in its owned chunk ", own, ") ends divided ",
                          int(c.divs), " times (AVG needs ", int(want_divs_), ")");
          if (c.pre != want_pre_)
            return concat("element ", i, " of rank ", r, " ends with contributions ", maskText(c.pre),
                          " divided by the predivide factor (needs ", maskText(want_pre_), ")");
        }
      }
      return "";
    }
    for (int r = 0; r < n_; ++r) {
      const std::vector<Cell>& d = st_[r].data;
      for (int64_t i = 0; i < numel; ++i) {
        if (!inLane(i)) continue;  // Note [Lanes]: another lane's element, never touched here
        const Cell& c = d[static_cast<size_t>(i)];
        if (c.mask != full_)
          return concat("element ", i, " of rank ", r, " ends with contributions ", maskText(c.mask),
                        " (missing ", maskText(full_ & ~c.mask), ")");
        if (c.divs != want_divs_)
          return concat("element ", i, " of rank ", r, " ends divided ", int(c.divs), " times (AVG needs ",
                        int(want_divs_), ")");
        if (c.pre != want_pre_)
          return concat("element ", i, " of rank ", r, " ends with contributions ", maskText(c.pre),
                        " divided by the predivide factor (needs ", maskText(want_pre_), ")");
        if (c.type != static_cast<uint8_t>(ref.dtype))
          return concat("element ", i, " of rank ", r, " ends as ", dtypeName(static_cast<DType>(c.type)));
        if (c.rounded != want_rounded_)
          return concat("element ", i, " of rank ", r, c.rounded ? " ends rounded to 16 bits" : " ends unrounded",
                        " (the plan's all-gather moves ", want_rounded_ ? "16 bits" : "float32", ")");
        if (c.hash != st_[0].data[static_cast<size_t>(i)].hash)
          return concat("element ", i, " of rank ", r, " was reduced in a different order than on rank 0 ",
                        "(the results would not be bitwise identical)");
        if (ref.phases == kPhaseAllGather && c.hash != finishedHash(i))
          return concat("element ", i, " of rank ", r, " is not the finished value its owner started with");
      }
    }
    return "";
  }
};

}  // namespace

std::string describeOp(const Plan& plan, int i) {
  std::ostringstream os;
  os << "op #" << i;
  if (i < 0 || i >= static_cast<int>(plan.ops.size())) return os.str() + " (out of range)";
  const Op& o = plan.ops[i];
  os << (o.queue == Queue::kComm ? " comm " : " compute ");
  switch (o.kind) {
    case OpKind::kExchange:
      os << "exchange " << o.exchange << " send " << spanText(o.send) << " recv " << spanText(o.recv);
      break;
    case OpKind::kReduce:
      os << "reduce x" << o.exchange << " " << spanText(o.dst) << " = " << spanText(o.a) << " + "
         << spanText(o.recv) << (o.final ? " final" : "");
      break;
    case OpKind::kCopy:
      os << "copy x" << o.exchange << " " << spanText(o.dst) << " = " << spanText(o.recv);
      break;
    case OpKind::kConvert:
      os << "convert x" << o.exchange << " " << spanText(o.dst) << " = " << spanText(o.a);
      break;
    case OpKind::kRecord: os << "record " << eventText(plan, o.event); break;
    case OpKind::kWait: os << "wait " << eventText(plan, o.event, o.recv_only); break;
    default: os << "unknown kind " << static_cast<int>(o.kind);
  }
  return os.str();
}

std::string checkPlanSet(const std::vector<Plan>& plans, const CheckOptions& options) {
  if (plans.empty() || plans.size() > 64)
    return concat("the checker needs 1..64 plans, got ", plans.size());
  Shared sh(plans, options);
  sh.n = static_cast<int>(plans.size());
  std::string err = staticChecks(sh);
  if (!err.empty()) return err;
  if (options.happens_before) {
    err = HappensBefore(sh).run();
    if (!err.empty()) return err;
  }
  for (int t = 0; t < std::max(1, options.trials); ++t) {
    for (Model m : {Model::kStreams, Model::kListWalk}) {
      const uint64_t seed = mix64(options.seed * 0x2545f4914f6cdd1dull + static_cast<uint64_t>(t) * 2 +
                                  (m == Model::kStreams ? 0 : 1));
      err = Simulation(sh, m, seed).run();
      if (!err.empty())
        return concat("simulation (", m == Model::kStreams ? "two-queue" : "list-walk", " model, trial ", t,
                      ", seed ", options.seed, "): ", err);
    }
  }
  return "";
}

std::string checkPlans(int nranks, int64_t numel, DType dtype, const PlanOptions& opt, uint64_t seed,
                       int trials) {
  auto params = [&] {
    return concat("[n=", nranks, " numel=", numel, " dtype=", dtypeName(dtype), " slots=", opt.num_slots,
                  " max_segment_bytes=", opt.max_segment_bytes, opt.accum_float32 ? " accum_f32" : "",
                  opt.wire_dtype ? concat(" wire=", dtypeName(*opt.wire_dtype)) : std::string(),
                  opt.pre_factor > 0 ? concat(" pre=", opt.pre_factor) : std::string(),
                  opt.post_factor > 0 ? concat(" post=", opt.post_factor) : std::string(),
                  opt.extra_divisor > 1 ? concat(" extra_divisor=", opt.extra_divisor) : std::string(),
                  opt.gather_into_data ? " gather_into_data" : "", opt.average ? " avg" : "",
                  opt.avg_divisor ? concat(" avg_divisor=", opt.avg_divisor) : std::string(),
                  opt.phases != kPhaseBoth ? concat(" ", phaseMaskText(opt.phases)) : std::string(),
                  opt.owner_shift ? concat(" owner_shift=", opt.owner_shift) : std::string(),
                  opt.exact_chunks ? " exact_chunks" : "", opt.recv_only_waits ? "" : " full_waits_only",
                  opt.lanes > 1 ? concat(" lane ", opt.lane, "/", opt.lanes) : std::string(), "] ");
  };
  if (nranks < 1 || nranks > 64) return params() + "the checker supports 1..64 ranks";
  std::vector<Plan> plans;
  plans.reserve(static_cast<size_t>(nranks));
  try {
    for (int r = 0; r < nranks; ++r) plans.push_back(buildPlan(nranks, r, numel, dtype, opt));
  } catch (const Error& e) {
    return params() + "buildPlan failed: " + e.what();
  }
  CheckOptions co;
  co.average = opt.average;
  co.seed = seed;
  co.trials = trials;
  const std::string err = checkPlanSet(plans, co);
  return err.empty() ? err : params() + err;
}

std::string checkLanes(int nranks, int64_t numel, DType dtype, const PlanOptions& opt, uint64_t seed, int trials) {
  const int lanes = opt.lanes;
  if (lanes < 1) return concat("[lanes=", lanes, "] needs at least one lane");
  // Which lane touches each element of the tensor, and each element of the partials buffer that the
  // lanes share (one chunk, indexed within it), -1: none yet; over every rank's plans.
  std::vector<int> owner(static_cast<size_t>(numel > 0 ? numel : 0), -1);
  std::vector<int> accum_owner;
  for (int k = 0; k < lanes; ++k) {
    PlanOptions o = opt;
    o.lane = k;
    const std::string err = checkPlans(nranks, numel, dtype, o, seed + static_cast<uint64_t>(k), trials);
    if (!err.empty()) return concat("[lane ", k, " of ", lanes, "] ", err);
    for (int r = 0; r < nranks; ++r) {
      const Plan p = buildPlan(nranks, r, numel, dtype, o);
      if (accum_owner.size() < static_cast<size_t>(p.accum_elems)) accum_owner.resize(p.accum_elems, -1);
      for (const Op& op : p.ops)
        for (const Span* sp : {&op.send, &op.recv, &op.a, &op.dst}) {
          if (sp->buf != BufKind::kData && sp->buf != BufKind::kAccum) continue;
          const bool data = sp->buf == BufKind::kData;
          const char* what = data ? "element " : "partial ";
          for (int64_t i = sp->offset; i < sp->offset + sp->count; ++i) {
            if (!data && i >= p.accum_elems) return concat("[lanes=", lanes, "] partial ", i, " outside kAccum");
            int& who = (data ? owner : accum_owner)[static_cast<size_t>(i)];
            if (who >= 0 && who != k)
              return concat("[lanes=", lanes, "] ", what, i, " is touched by lanes ", who, " and ", k);
            who = k;
            // A partial's index is its element's index within the chunk: the same lane.
            if (laneOfElement(p.sched, lanes, i) != k)
              return concat("[lanes=", lanes, "] lane ", k, " touches ", what, i, " of lane ",
                            laneOfElement(p.sched, lanes, i));
          }
        }
    }
  }
  if (nranks > 1)
    for (int64_t i = 0; i < numel; ++i)
      if (owner[static_cast<size_t>(i)] < 0) return concat("[lanes=", lanes, "] no lane touches element ", i);
  return "";
}

}  // namespace rr
