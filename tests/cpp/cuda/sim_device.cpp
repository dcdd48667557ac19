#include "sim_device.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "../../../csrc/core/error.h"
#include "../../../csrc/core/one_shot_body.h"
#include "../../../csrc/core/reduce_body.h"
#include "../../../csrc/core/reduce_dispatch.h"

namespace rr {
namespace sim {

struct Event {
  int64_t latest_enqueued = -1;  // record id of the latest enqueued record of this event
};

struct Msg {
  std::vector<unsigned char> bytes;
  bool consumed = false;
  std::string what;
};

struct Op {
  enum Kind { kRecord, kWait, kExchange, kWork } kind = kWork;
  std::string what;
  int64_t record_id = -1;  // kRecord: own record; kWait: captured record (-1: no-op)
  // kExchange: one NCCL group of sends and receives (peers are communicator ranks, Note [Sub-rings
  // on one communicator]), launched on the hand-off or the queued communicator.
  std::vector<PeerOp> parts;
  int launch = 0;  // Launch (Note [Which exchanges hand off])
  int lane = 0;    // Note [Lanes]: whose communicator carries it
  int phase = 0;   // 0 not started, 1 sends posted, 2 receives done
  std::vector<std::shared_ptr<Msg>> outs;
  // kWork and kExchange
  std::vector<SimDevice::Access> reads, writes;
  std::function<void()> fn;
  uint64_t epoch = 0;
};

namespace {
// Per rank: kComm and kCompute of each of up to kSimLanes lanes (Note [Lanes]), then kCaller.
constexpr int kSimLanes = 4;
constexpr int kStreams = 2 * kSimLanes + 1;
int streamIndex(Stream s, int lane) { return s == Stream::kCaller ? 2 * kSimLanes : 2 * lane + static_cast<int>(s); }
std::string streamName(int s) {
  if (s == 2 * kSimLanes) return "caller";
  const std::string lane = s >= 2 ? " (lane " + std::to_string(s / 2) + ")" : "";
  return (s % 2 == 0 ? "comm" : "compute") + lane;
}
}  // namespace

struct SimDevice::Impl {
  struct StreamState {
    std::deque<std::unique_ptr<Op>> q;
  };
  struct RecordState {
    bool fired = false;
    std::vector<uint64_t> vc;
    std::string what;
  };
  struct AccessRec {
    uintptr_t lo, hi;
    bool write;
    int comp;
    uint64_t epoch;
    std::string what;
  };

  int n;
  std::mt19937_64 rng;
  std::vector<StreamState> streams;            // n * 3
  std::vector<std::vector<uint64_t>> vcs;      // per stream: vector clock over n * 3 components
  std::vector<RecordState> records;
  // Point-to-point channels as NCCL matches them: per communicator (the hand-off one or the queued
  // one, Note [Which exchanges hand off]) and (sender, receiver) pair, in posting order.
  using Channel = std::tuple<int, int, int, int>;  // lane, launch, sender, receiver
  std::map<Channel, std::vector<std::shared_ptr<Msg>>> channels;
  std::map<Channel, size_t> received;
  std::vector<int> hand_offs;                // per rank
  std::set<std::tuple<int, int, int, int>> contacted;  // (lane, rank, peer, 0 send / 1 receive) handed off
  std::vector<std::vector<SimDevice::PeerUse>> peers;  // per rank: every exchange's peers
  std::vector<std::vector<AccessRec>> accesses;           // per rank
  std::string failure;

  Impl(int nranks, uint64_t seed) : n(nranks), rng(seed), streams(static_cast<size_t>(nranks * kStreams)) {
    vcs.assign(static_cast<size_t>(n * kStreams), std::vector<uint64_t>(static_cast<size_t>(n * kStreams), 0));
    peers.resize(static_cast<size_t>(n));
    accesses.resize(static_cast<size_t>(n));
    hand_offs.assign(static_cast<size_t>(n), 0);
  }

  static std::string opName(int comp, const Op& op) {
    std::ostringstream os;
    os << "rank " << comp / kStreams << " " << streamName(comp % kStreams) << ": " << op.what;
    return os.str();
  }

  bool checkAccess(int comp, const Op& op, const SimDevice::Access& a, bool write) {
    if (a.bytes == 0) return true;
    const int r = comp / kStreams;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(a.ptr);
    const uintptr_t hi = lo + a.bytes;
    const std::vector<uint64_t>& vc = vcs[static_cast<size_t>(comp)];
    for (const AccessRec& p : accesses[static_cast<size_t>(r)]) {
      if (p.hi <= lo || hi <= p.lo) continue;
      if (!p.write && !write) continue;
      if (p.comp == comp) continue;  // stream order
      if (p.epoch <= vc[static_cast<size_t>(p.comp)]) continue;  // ordered by a captured wait
      std::ostringstream os;
      os << "data race on rank " << r << ": " << (write ? "write" : "read") << " by [" << opName(comp, op)
         << "] is not ordered after the " << (p.write ? "write" : "read") << " by [rank " << r << " "
         << streamName(p.comp % kStreams) << ": " << p.what << "] (bytes overlap)";
      failure = os.str();
      return false;
    }
    accesses[static_cast<size_t>(r)].push_back(AccessRec{lo, hi, write, comp, op.epoch, op.what});
    return true;
  }

  bool startOp(int comp, Op& op) {
    std::vector<uint64_t>& vc = vcs[static_cast<size_t>(comp)];
    op.epoch = ++vc[static_cast<size_t>(comp)];
    for (const auto& a : op.reads)
      if (!checkAccess(comp, op, a, false)) return false;
    for (const auto& a : op.writes)
      if (!checkAccess(comp, op, a, true)) return false;
    return true;
  }

  // Can the head of stream `comp` make progress now?
  bool runnable(int comp) {
    StreamState& st = streams[static_cast<size_t>(comp)];
    if (st.q.empty()) return false;
    const Op& op = *st.q.front();
    const int r = comp / kStreams;
    switch (op.kind) {
      case Op::kRecord:
      case Op::kWork: return true;
      case Op::kWait: return op.record_id < 0 || records[static_cast<size_t>(op.record_id)].fired;
      case Op::kExchange: {
        if (op.phase == 0) return true;
        if (op.phase == 1) {
          // Every receive has its message (several from one peer match in order).
          std::map<Channel, size_t> need;
          for (const PeerOp& p : op.parts)
            if (!p.send && p.bytes > 0) ++need[Channel{op.lane, op.launch, p.peer, r}];
          for (const auto& kv : need) {
            auto it = channels.find(kv.first);
            if (it == channels.end() || it->second.size() < received[kv.first] + kv.second) return false;
          }
          return true;
        }
        for (const auto& m : op.outs)
          if (!m->consumed) return false;
        return true;
      }
    }
    return false;
  }

  // Advances the head of stream `comp` by one step. Returns false on failure.
  bool step(int comp) {
    StreamState& st = streams[static_cast<size_t>(comp)];
    Op& op = *st.q.front();
    const int r = comp / kStreams;
    std::vector<uint64_t>& vc = vcs[static_cast<size_t>(comp)];
    switch (op.kind) {
      case Op::kRecord: {
        op.epoch = ++vc[static_cast<size_t>(comp)];
        RecordState& rs = records[static_cast<size_t>(op.record_id)];
        rs.fired = true;
        rs.vc = vc;
        st.q.pop_front();
        return true;
      }
      case Op::kWait: {
        if (op.record_id >= 0) {
          const RecordState& rs = records[static_cast<size_t>(op.record_id)];
          for (size_t i = 0; i < vc.size(); ++i) vc[i] = std::max(vc[i], rs.vc[i]);
        }
        st.q.pop_front();
        return true;
      }
      case Op::kWork: {
        if (!startOp(comp, op)) return false;
        if (op.fn) op.fn();
        st.q.pop_front();
        return true;
      }
      case Op::kExchange: {
        if (op.phase == 0) {
          // The exchange's accesses last until it completes; they are logged with its start epoch.
          if (!startOp(comp, op)) return false;
          for (const PeerOp& p : op.parts) {
            if (!p.send || p.bytes == 0) continue;
            auto m = std::make_shared<Msg>();
            const unsigned char* from = static_cast<const unsigned char*>(p.buf);
            m->bytes.assign(from, from + p.bytes);
            m->what = opName(comp, op);
            channels[Channel{op.lane, op.launch, r, p.peer}].push_back(m);
            op.outs.push_back(m);
          }
          op.phase = 1;
          return true;
        }
        if (op.phase == 1) {
          for (const PeerOp& p : op.parts) {
            if (p.send || p.bytes == 0) continue;
            const Channel key{op.lane, op.launch, p.peer, r};
            std::shared_ptr<Msg> m = channels[key][received[key]++];
            if (m->bytes.size() != p.bytes) {
              std::ostringstream os;
              os << "size mismatch: [" << opName(comp, op) << "] expects " << p.bytes << " bytes from rank " << p.peer
                 << ", [" << m->what << "] sent " << m->bytes.size();
              failure = os.str();
              return false;
            }
            std::memcpy(p.buf, m->bytes.data(), p.bytes);
            m->consumed = true;
          }
          op.phase = 2;
          return true;
        }
        st.q.pop_front();
        return true;
      }
    }
    return false;
  }
};

SimDevice::SimDevice(int nranks, int num_slots, size_t slot_bytes, uint64_t seed)
    : nranks_(nranks), impl_(new Impl(nranks, seed)) {
  for (int r = 0; r < nranks; ++r) {
    auto sr = std::make_unique<SimRank>();
    sr->rank = r;
    sr->slot_bytes = slot_bytes;
    // Staging is filled with garbage so that a reduce that reads a slot before the receive landed
    // produces a visibly wrong value even where the race check would not look.
    sr->slots.assign(static_cast<size_t>(num_slots), std::vector<unsigned char>(slot_bytes + 64, 0xA5));
    ranks_.push_back(std::move(sr));
  }
}

SimDevice::~SimDevice() = default;

std::shared_ptr<Event> SimDevice::newEvent() { return std::make_shared<Event>(); }

int64_t SimDevice::enqueueRecordId(const std::shared_ptr<Event>& e) {
  const int64_t id = static_cast<int64_t>(impl_->records.size());
  impl_->records.emplace_back();
  e->latest_enqueued = id;
  return id;
}

const std::vector<SimDevice::PeerUse>& SimDevice::peersUsed(int r) const {
  return impl_->peers[static_cast<size_t>(r)];
}

int SimDevice::handOffs(int r) const { return impl_->hand_offs[static_cast<size_t>(r)]; }

void SimDevice::enqueue(int r, Stream s, std::unique_ptr<Op> op, int lane) {
  RR_CHECK(lane >= 0 && lane < kSimLanes, kRuntime, "sim: lane ", lane, " (at most ", kSimLanes, ")");
  op->lane = lane;
  if (op->kind == Op::kExchange) {
    PeerUse use{-1, -1};
    // Note [Hand-off and queued exchanges] (nccl_comm.h): only a hand-off may reach a peer first.
    const bool hand_off = op->launch == static_cast<int>(Launch::kHandOff);
    if (hand_off) ++impl_->hand_offs[static_cast<size_t>(r)];
    for (const PeerOp& p : op->parts) {
      if (p.bytes == 0) continue;
      RR_CHECK(p.peer >= 0 && p.peer < nranks_ && p.peer != r, kRuntime, "sim: rank ", r, " exchanges with peer ",
               p.peer, " of ", nranks_);
      (p.send ? use.send_peer : use.recv_peer) = p.peer;
      const auto key = std::make_tuple(op->lane, r, p.peer, p.send ? 0 : 1);
      if (hand_off) {
        impl_->contacted.insert(key);
      } else if (!impl_->contacted.count(key) && impl_->failure.empty()) {
        impl_->failure = "rank " + std::to_string(r) + " queues a " + (p.send ? "send to" : "receive from") +
                         " rank " + std::to_string(p.peer) + " before any hand-off reached it: [" + op->what + "]";
      }
    }
    impl_->peers[static_cast<size_t>(r)].push_back(use);
  }
  impl_->streams[static_cast<size_t>(r * kStreams + streamIndex(s, lane))].q.push_back(std::move(op));
}

void SimDevice::callerOp(int r, const std::string& what, std::vector<Access> reads, std::vector<Access> writes,
                         std::function<void()> fn) {
  auto op = std::make_unique<Op>();
  op->kind = Op::kWork;
  op->what = what;
  op->reads = std::move(reads);
  op->writes = std::move(writes);
  op->fn = std::move(fn);
  enqueue(r, Stream::kCaller, std::move(op));
}

void SimDevice::callerWait(int r, const SimCall& call) {
  auto op = std::make_unique<Op>();
  op->kind = Op::kWait;
  op->what = "Work.wait()";
  op->record_id = call.done->latest_enqueued;
  enqueue(r, Stream::kCaller, std::move(op));
}

std::string SimDevice::run() {
  Impl& m = *impl_;
  if (!m.failure.empty()) return m.failure;
  const int total = nranks_ * kStreams;
  std::vector<int> ready;
  while (m.failure.empty()) {
    ready.clear();
    bool any = false;
    for (int c = 0; c < total; ++c) {
      if (!m.streams[static_cast<size_t>(c)].q.empty()) any = true;
      if (m.runnable(c)) ready.push_back(c);
    }
    if (!any) return "";
    if (ready.empty()) {
      std::ostringstream os;
      os << "deadlock: no stream can make progress; heads:";
      for (int c = 0; c < total; ++c) {
        const auto& q = m.streams[static_cast<size_t>(c)].q;
        if (!q.empty()) os << "\n  [" << Impl::opName(c, *q.front()) << "]";
      }
      return os.str();
    }
    const int c = ready[static_cast<size_t>(m.rng() % ready.size())];
    if (!m.step(c)) break;
  }
  return m.failure;
}

// ---- the backend -------------------------------------------------------------------------------

namespace {

class SimBackend final : public DeviceBackend {
 public:
  SimBackend(SimDevice& dev, int r, DType dtype, Fault fault, SimCall* call)
      : dev_(dev), r_(r), dtype_(dtype), fault_(fault), call_(call) {
    call_->start = dev_.newEvent();
    call_->done = dev_.newEvent();
  }

  void prepare(int32_t num_events, int32_t lanes) override {
    SimRank& sr = dev_.rank(r_);
    if (sr.plan_events.size() < static_cast<size_t>(lanes)) sr.plan_events.resize(static_cast<size_t>(lanes));
    for (auto& pool : sr.plan_events)
      while (static_cast<int32_t>(pool.size()) < num_events) pool.push_back(dev_.newEvent());
    while (call_->stage.size() < static_cast<size_t>(lanes)) call_->stage.push_back(dev_.newEvent());
    while (call_->lane_done.size() < static_cast<size_t>(lanes)) call_->lane_done.push_back(dev_.newEvent());
  }

  void setLane(int32_t lane) override { lane_ = lane; }

  void exchange(const void* send, size_t send_bytes, int send_peer, void* recv, size_t recv_bytes,
                int recv_peer, Launch launch) override {
    if (fault_ == Fault::kWrongLaunch && r_ == 0 && exchanges_ == 1) {
      launch = launch == Launch::kHandOff ? Launch::kQueued : Launch::kHandOff;
    }
    if (fault_ == Fault::kUnmappedPeers) {
      const int n = dev_.nranks();
      if (send_bytes > 0) send_peer = (r_ + 1) % n;
      if (recv_bytes > 0) recv_peer = (r_ + n - 1) % n;
    }
    auto op = std::make_unique<Op>();
    op->kind = Op::kExchange;
    op->what = std::string(launch == Launch::kHandOff ? "hand-off" : "queued") + " exchange #" +
               std::to_string(exchanges_++) + " send " + std::to_string(send_bytes) + "B to " +
               std::to_string(send_peer) + " recv " + std::to_string(recv_bytes) + "B from " +
               std::to_string(recv_peer);
    op->launch = static_cast<int>(launch);
    op->parts.push_back(PeerOp{true, const_cast<void*>(send), send_bytes, send_peer});
    op->parts.push_back(PeerOp{false, recv, recv_bytes, recv_peer});
    op->reads.push_back({send, send_bytes});
    op->writes.push_back({recv, recv_bytes});
    dev_.enqueue(r_, Stream::kComm, std::move(op), lane_);
  }

  void group(const std::vector<PeerOp>& ops, Launch launch) override {
    auto op = std::make_unique<Op>();
    op->kind = Op::kExchange;
    op->what = std::string(launch == Launch::kHandOff ? "hand-off" : "queued") + " group #" +
               std::to_string(exchanges_++) + " of " + std::to_string(ops.size()) + " sends/receives";
    op->launch = static_cast<int>(launch);
    op->parts = ops;
    for (const PeerOp& p : ops) (p.send ? op->reads : op->writes).push_back({p.buf, p.bytes});
    dev_.enqueue(r_, Stream::kComm, std::move(op), lane_);
  }

  void reduceInOrder(const OneShotLaunch& l) override {
    OneShotLaunch x = l;
    RR_CHECK(x.dst == dtype_, kRuntime, "sim: an in-order reduce into ", dtypeName(x.dst), " in a call of ",
             dtypeName(dtype_));
    const size_t elem = dtypeSize(x.dtype);
    const size_t dst_elem = dtypeSize(x.dst);
    if (fault_ == Fault::kShiftReduce && !shifted_ && x.args.count > 1) {
      shifted_ = true;
      x.args.dst = static_cast<char*>(x.args.dst) + dst_elem;
      x.args.count -= 1;
    }
    auto op = std::make_unique<Op>();
    op->kind = Op::kWork;
    op->what = "in-order reduce of " + std::to_string(x.args.count) + " elements from " + std::to_string(x.args.n) +
               " ranks";
    for (int j = 0; j < x.args.n; ++j) op->reads.push_back({x.args.in[j], static_cast<size_t>(x.args.count) * elem});
    op->writes.push_back({x.args.dst, static_cast<size_t>(x.args.count) * dst_elem});
    op->fn = [x]() { hostOneShotReduce(x, /*nthreads=*/5); };
    dev_.enqueue(r_, Stream::kCompute, std::move(op), lane_);
  }

  void reduce(const ReduceLaunch& l) override {
    ReduceLaunch x = l;
    if (fault_ == Fault::kShiftReduce && !shifted_ && x.count > 1) {
      shifted_ = true;
      x.dst = static_cast<char*>(x.dst) + dtypeSize(x.dst_type);
      x.count -= 1;
    }
    auto op = std::make_unique<Op>();
    op->kind = Op::kWork;
    op->what = std::string(x.b ? "reduce #" : "convert #") + std::to_string(reduces_++) + " of " +
               std::to_string(x.count) + " elements" +
               (x.scaling.divisor > 0 || x.scaling.postscale > 0 ? " (final, scales)" : "");
    op->reads.push_back({x.a, static_cast<size_t>(x.count) * dtypeSize(x.a_type)});
    if (x.b) op->reads.push_back({x.b, static_cast<size_t>(x.count) * dtypeSize(x.b_type)});
    op->writes.push_back({x.dst, static_cast<size_t>(x.count) * dtypeSize(x.dst_type)});
    op->fn = [x]() {
      hostKernelReduce(x.op, x.a, x.a_type, x.b, x.b_type, x.dst, x.dst_type, x.count, x.scaling, /*nthreads=*/7);
    };
    dev_.enqueue(r_, Stream::kCompute, std::move(op), lane_);
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    auto op = std::make_unique<Op>();
    op->kind = Op::kWork;
    op->what = "copy of " + std::to_string(bytes) + "B";
    op->reads.push_back({src, bytes});
    op->writes.push_back({dst, bytes});
    op->fn = [dst, src, bytes]() { std::memcpy(dst, src, bytes); };
    dev_.enqueue(r_, Stream::kCompute, std::move(op), lane_);
  }

  void record(Stream s, int32_t event) override {
    auto op = std::make_unique<Op>();
    op->kind = Op::kRecord;
    op->what = "record " + eventName(event);
    op->record_id = dev_.enqueueRecordId(eventOf(event));
    dev_.enqueue(r_, s, std::move(op), lane_);
  }

  void wait(Stream s, int32_t event) override {
    if (fault_ == Fault::kSkipPrevCallWait && event == kPrevCallDoneEvent) return;
    if (fault_ == Fault::kSkipCallerStart && event == kCallStartEvent) return;
    if (fault_ == Fault::kSkipCallerDone && event == kCallDoneEvent) return;
    if (fault_ == Fault::kSkipStageWait && event == kStageDoneEvent) return;
    if (fault_ == Fault::kSkipLaneJoin && isLaneDoneEvent(event)) return;
    if (fault_ == Fault::kDropFirstPlanWait && event >= 0 && s == Stream::kCompute && !dropped_) {
      dropped_ = true;
      return;
    }
    std::shared_ptr<Event> e;
    if (event == kPrevCallDoneEvent) {
      e = dev_.rank(r_).last_done;
      if (!e) return;  // first call
    } else {
      e = eventOf(event);
    }
    auto op = std::make_unique<Op>();
    op->kind = Op::kWait;
    op->what = "wait " + eventName(event);
    op->record_id = e->latest_enqueued;  // captured now, as cudaStreamWaitEvent does
    dev_.enqueue(r_, s, std::move(op), lane_);
  }

  ~SimBackend() override { dev_.rank(r_).last_done = call_->done; }

 private:
  std::shared_ptr<Event> eventOf(int32_t e) {
    if (e == kCallStartEvent) return call_->start;
    if (e == kCallDoneEvent) return call_->done;
    if (e == kStageDoneEvent) return call_->stage.at(static_cast<size_t>(lane_));
    if (isLaneDoneEvent(e)) return call_->lane_done.at(static_cast<size_t>(laneOfDoneEvent(e)));
    SimRank& sr = dev_.rank(r_);
    const auto& pool = sr.plan_events.at(static_cast<size_t>(lane_));
    RR_CHECK(e >= 0 && static_cast<size_t>(e) < pool.size(), kRuntime, "sim: event ", e, " outside the pool of ",
             pool.size());
    return pool[static_cast<size_t>(e)];
  }
  static std::string eventName(int32_t e) {
    if (e == kCallStartEvent) return "call-start";
    if (e == kCallDoneEvent) return "call-done";
    if (e == kPrevCallDoneEvent) return "previous-call-done";
    if (e == kStageDoneEvent) return "stage-done";
    if (isLaneDoneEvent(e)) return "lane-done " + std::to_string(laneOfDoneEvent(e));
    return "plan-event " + std::to_string(e);
  }

  SimDevice& dev_;
  int r_;
  DType dtype_;
  Fault fault_;
  SimCall* call_;
  int exchanges_ = 0;
  int reduces_ = 0;
  int32_t lane_ = 0;
  bool dropped_ = false;
  bool shifted_ = false;
};

struct HostGridLauncher {
  const void* a;
  const void* b;
  void* dst;
  int64_t count;
  Scaling scaling;
  int nthreads;
  template <typename TA, typename TB, typename TD, RedOp op>
  void run() {
    for (int t = 0; t < nthreads; ++t)
      ReduceBody<TA, TB, TD, op>::run(static_cast<const TA*>(a), static_cast<const TB*>(b), static_cast<TD*>(dst),
                                       count, scaling, t, nthreads);
  }
  template <typename TS, typename TD>
  void convert() {
    for (int t = 0; t < nthreads; ++t)
      ConvertBody<TS, TD>::run(static_cast<const TS*>(a), static_cast<TD*>(dst), count, scaling.predivide, t, nthreads);
  }
};

struct HostOneShotLauncher {
  const OneShotArgs& args;
  bool dst_float;  // as launchOneShotReduce's: float32 results of 16-bit inputs
  int nthreads;
  template <typename TA, typename TB, typename TD, RedOp op>
  void run() {
    if constexpr (!std::is_same<TB, TD>::value) {
      RR_THROW(kRuntime, "sim: the one-shot reduce dispatches (tensor, partial, partial)");
    } else if constexpr ((std::is_same<TA, Half>::value || std::is_same<TA, BFloat16>::value) &&
                         std::is_same<TB, float>::value) {
      for (int t = 0; t < nthreads; ++t) {
        if (dst_float) OneShotBody<TA, TB, op, float>::run(args, t, nthreads);
        else OneShotBody<TA, TB, op>::run(args, t, nthreads);
      }
    } else {
      RR_CHECK(!dst_float, kRuntime, "sim: a float32 result of a one-shot reduce of ", sizeof(TA), "-byte inputs");
      for (int t = 0; t < nthreads; ++t) OneShotBody<TA, TB, op>::run(args, t, nthreads);
    }
  }
};

}  // namespace

void hostOneShotReduce(const OneShotLaunch& l, int nthreads) {
  checkSupported(l.dtype, l.op);
  if (l.args.count <= 0) return;
  HostOneShotLauncher launcher{l.args, l.dst != l.dtype, nthreads < 1 ? 1 : nthreads};
  dispatchReduce(l.op, l.dtype, l.partial, l.partial, launcher);
}

std::unique_ptr<DeviceBackend> SimDevice::backend(int r, DType dtype, Fault fault, SimCall* call) {
  return std::make_unique<SimBackend>(*this, r, dtype, fault, call);
}

void enqueueSyncCall(SimDevice& dev, int r, DType dtype, const std::vector<RingStage>& stages, void* tensor,
                     size_t bytes, const void* input, void* output, void* accum, Fault fault, SimCall* call) {
  dev.callerOp(r, "producer", {}, {{tensor, bytes}}, [tensor, input, bytes]() { std::memcpy(tensor, input, bytes); });
  DeviceBuffers b;
  b.data = tensor;
  b.accum = accum;
  b.slot_bytes = dev.rank(r).slot_bytes;
  for (auto& s : dev.rank(r).slots) b.slots.push_back(s.data());
  int32_t lanes = 1;
  for (const RingStage& st : stages) lanes = std::max(lanes, st.lane + 1);
  b.slots_per_lane = static_cast<int32_t>(b.slots.size()) / lanes;  // Note [Lanes]: the slots split evenly
  {
    auto be = dev.backend(r, dtype, fault, call);
    enqueueRingStages(stages, b, *be, /*caller_waits=*/true);
  }
  dev.callerOp(r, "consumer", {{tensor, bytes}}, {}, [tensor, output, bytes]() { std::memcpy(output, tensor, bytes); });
}

void hostKernelReduce(RedOp op, const void* a, DType a_type, const void* b, DType b_type, void* dst, DType dst_type,
                      int64_t count, const Scaling& scaling, int nthreads) {
  if (count <= 0) {
    checkSupported(a_type, op);
    return;
  }
  HostGridLauncher l{a, b, dst, count, scaling, nthreads < 1 ? 1 : nthreads};
  if (b == nullptr) return dispatchConvert(a_type, dst_type, l);
  dispatchReduce(op, a_type, b_type, dst_type, l);
}

}  // namespace sim
}  // namespace rr
