// recv_only waits (Note [One ring, two transports, one plan], plan.h): the plans ask for the
// receive half of an exchange wherever that is all a hazard needs, keep full waits where an op
// overwrites what an exchange sends, and the CPU executor waits exactly the requests the plan
// asks for, receive requests first.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "core/plan.h"
#include "support/plan_checker.h"
#include "support/inproc_transport.h"
#include "cpu/ring_executor.h"

using namespace rr;

namespace {

bool overlaps(const Plan& p, const Span& a, const Span& b) {
  if (a.empty() || b.empty() || a.buf != b.buf) return false;
  if (a.buf == BufKind::kStaging && a.slot != b.slot) return false;
  const int64_t ea = spanElemSize(p, a), eb = spanElemSize(p, b);
  return a.offset * ea < (b.offset + b.count) * eb && b.offset * eb < (a.offset + a.count) * ea;
}

// What kCompute knows, walking the list: it learns about exchanges only from its own waits (it
// never waits for compute events), so this is exact.
struct ComputeKnowledge {
  std::vector<char> received, complete;
  explicit ComputeKnowledge(const Plan& p)
      : received(static_cast<size_t>(p.num_exchanges), 0), complete(static_cast<size_t>(p.num_exchanges), 0) {}
  void see(const Op& o) {
    if (o.kind != OpKind::kWait || o.queue != Queue::kCompute || o.event % 2 != 0) return;
    received[static_cast<size_t>(o.event / 2)] = 1;
    if (!o.recv_only) complete[static_cast<size_t>(o.event / 2)] = 1;
  }
};

struct Shape {
  int reduces = 0;
  int self_full = 0;          // reduces whose own exchange is waited in full right before them
  int accum_self = 0;         // reduces that overwrite what their own exchange sends (kAccum)
  int recv_only_waits = 0;    // on kCompute
  int full_waits = 0;         // on kCompute
};

// Checks, independently of the builder and the checker, that every reduce/copy of `p` is ordered
// after what it needs: the receive of each earlier exchange that wrote a span it reads or writes,
// and the whole of each earlier exchange that sends a span it writes. And that kCompute ends
// knowing every exchange complete. Returns counts for the caller's expectations.
Shape checkComputeWaits(const Plan& p, const std::string& what) {
  Shape sh;
  ComputeKnowledge k(p);
  std::vector<int> issued;  // op indices of exchanges so far
  std::vector<const Op*> waits_before;  // kCompute waits since the last compute
  for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
    const Op& o = p.ops[i];
    k.see(o);
    if (o.kind == OpKind::kWait && o.queue == Queue::kCompute) {
      (o.recv_only ? sh.recv_only_waits : sh.full_waits) += o.event % 2 == 0;
      waits_before.push_back(&o);
    }
    if (o.kind == OpKind::kExchange) issued.push_back(i);
    if (o.kind != OpKind::kReduce && o.kind != OpKind::kCopy) continue;
    for (int xi : issued) {
      const Op& x = p.ops[xi];
      const bool reads_received = overlaps(p, x.recv, o.recv) || overlaps(p, x.recv, o.a);
      const bool writes_received = overlaps(p, x.recv, o.dst);
      const bool writes_sent = overlaps(p, x.send, o.dst);
      if (reads_received || writes_received)
        CHECK_MSG(k.received[x.exchange], what << ": " << describeOp(p, i) << " runs before the receive of "
                                               << describeOp(p, xi) << " is known complete\n" << p.describe());
      if (writes_sent)
        CHECK_MSG(k.complete[x.exchange], what << ": " << describeOp(p, i) << " overwrites what "
                                               << describeOp(p, xi) << " sends before it is known complete\n"
                                               << p.describe());
    }
    if (o.kind == OpKind::kReduce) {
      ++sh.reduces;
      for (int xi : issued)
        if (p.ops[xi].exchange == o.exchange) sh.accum_self += overlaps(p, p.ops[xi].send, o.dst);
      for (const Op* w : waits_before)
        if (w->event == Plan::exchangeEvent(o.exchange) && !w->recv_only) ++sh.self_full;
    }
    waits_before.clear();
  }
  for (int xi : issued)
    CHECK_MSG(k.complete[p.ops[xi].exchange], what << ": the plan ends before " << describeOp(p, xi)
                                                   << " is known complete\n" << p.describe());
  return sh;
}

}  // namespace

TEST_CASE(two_rank_reduces_wait_for_the_receive_only) {
  // The measured case: 2 ranks, float32, no float32 partials. Every wait kCompute does before a
  // reduce is recv_only (the reduce reads only the slot its exchange received into and a tensor
  // segment that exchange does not send), including the one on the reduce's own exchange.
  int plans = 0, reduces = 0;
  for (int64_t numel : {int64_t(1), int64_t(37), int64_t(1000), int64_t(4099), int64_t(1) << 18}) {
    for (int64_t seg : {int64_t(16), int64_t(64), int64_t(4096), int64_t(1) << 20}) {
      if (numel * 4 / seg > 2048) continue;
      for (int slots = 1; slots <= 4; ++slots) {
        for (bool gather : {false, true}) {
          for (uint8_t phases : {uint8_t(kPhaseBoth), uint8_t(kPhaseReduceScatter)}) {
            PlanOptions o;
            o.max_segment_bytes = seg;
            o.num_slots = slots;
            o.gather_into_data = gather;
            o.phases = phases;
            for (int r = 0; r < 2; ++r) {
              const Plan p = buildPlan(2, r, numel, DType::kFloat32, o);
              const std::string what = detail::concat("n=2 rank ", r, " numel=", numel, " seg=", seg,
                                                      " slots=", slots, gather ? " gather" : "",
                                                      phases == kPhaseBoth ? "" : " reduce-scatter only");
              ++plans;
              const Shape sh = checkComputeWaits(p, what);
              reduces += sh.reduces;
              CHECK_MSG(sh.self_full == 0, what << "\n" << p.describe());
              std::vector<char> own_waited(static_cast<size_t>(p.num_exchanges), 0);
              int last_reduce = -1;
              for (int i = 0; i < static_cast<int>(p.ops.size()); ++i)
                if (p.ops[i].kind == OpKind::kReduce) last_reduce = i;
              for (int i = 0; i <= last_reduce; ++i) {
                const Op& w = p.ops[i];
                if (w.kind == OpKind::kWait && w.queue == Queue::kCompute) {
                  CHECK_MSG(w.recv_only, what << ": " << describeOp(p, i) << " before a reduce\n" << p.describe());
                  if (w.event % 2 == 0) own_waited[static_cast<size_t>(w.event / 2)] = 1;
                }
                if (w.kind == OpKind::kReduce)
                  CHECK_MSG(own_waited[static_cast<size_t>(w.exchange)], what << ": " << describeOp(p, i));
              }
            }
          }
        }
      }
    }
  }
  CHECK(plans > 100);
  CHECK(reduces > plans);
  // The same plans pass the checker (a sample; the sweeps cover the rest).
  for (bool gather : {false, true}) {
    PlanOptions o;
    o.max_segment_bytes = 64;
    o.num_slots = 3;
    o.gather_into_data = gather;
    const std::string err = checkPlans(2, 1000, DType::kFloat32, o, 7, 4);
    CHECK_MSG(err.empty(), err);
  }
}

TEST_CASE(accum_plans_keep_the_needed_full_waits) {
  // float32 partials: the non-final reduce of reduce-scatter step s >= 1 writes the kAccum segment
  // that its own exchange sends, so it must wait that exchange in full (n >= 4 has such steps;
  // n = 3 goes from step 0, which sends the tensor, straight to the final reduce). Every other
  // need is checked from the spans alike, and the other waits before reduces stay recv_only.
  for (int n = 3; n <= (rrtest::kSanitized ? 5 : 8); ++n) {
    int accum_self = 0;
    for (DType t : {DType::kFloat16, DType::kBFloat16}) {
      for (int64_t numel : {int64_t(n), int64_t(61), int64_t(50 * n + 3)}) {
        for (int64_t seg : {int64_t(16), int64_t(64), int64_t(1) << 20}) {
          for (int slots = 1; slots <= 3; ++slots) {
            for (bool gather : {false, true}) {
              PlanOptions o;
              o.max_segment_bytes = seg;
              o.num_slots = slots;
              o.gather_into_data = gather;
              o.accum_float32 = true;
              for (int r = 0; r < n; ++r) {
                const Plan p = buildPlan(n, r, numel, t, o);
                const std::string what = detail::concat("n=", n, " rank ", r, " ", dtypeName(t), " numel=", numel,
                                                        " seg=", seg, " slots=", slots, gather ? " gather" : "",
                                                        " accum");
                const Shape sh = checkComputeWaits(p, what);
                if (!p.accum_float32 || sh.reduces == 0) continue;
                CHECK_MSG(sh.recv_only_waits > 0, what << "\n" << p.describe());
                CHECK_MSG(sh.self_full == sh.accum_self, what << "\n" << p.describe());
                accum_self += sh.accum_self;
              }
            }
          }
        }
      }
    }
    CHECK_MSG(n >= 4 ? accum_self > 0 : accum_self == 0, "n=" << n << ": " << accum_self);
  }
  for (int n : {3, 4, 6}) {
    PlanOptions o;
    o.max_segment_bytes = 32;
    o.num_slots = 2;
    o.accum_float32 = true;
    o.average = true;
    const std::string err = checkPlans(n, 40 * n + 1, DType::kFloat16, o, 3, 4);
    CHECK_MSG(err.empty(), err);
  }
}

TEST_CASE(full_waits_only_option) {
  // recv_only_waits = false: the plans of a transport that cannot wait for a receive alone. No
  // recv_only waits, no more waits than with them, and the checker proves them alike.
  for (int n : {2, 3, 4, 6}) {
    for (bool accum : {false, true}) {
      for (bool gather : {false, true}) {
        for (uint8_t phases : {uint8_t(kPhaseBoth), uint8_t(kPhaseReduceScatter), uint8_t(kPhaseAllGather)}) {
          PlanOptions o;
          o.max_segment_bytes = 32;
          o.num_slots = 1 + n % 3;
          o.accum_float32 = accum;
          o.gather_into_data = gather;
          o.phases = phases;
          o.average = true;
          const DType t = accum ? DType::kFloat16 : DType::kFloat32;
          const int64_t numel = 24 * n + 5;
          PlanOptions full = o;
          full.recv_only_waits = false;
          for (int r = 0; r < n; ++r) {
            const Plan split = buildPlan(n, r, numel, t, o);
            const Plan whole = buildPlan(n, r, numel, t, full);
            int split_waits = 0, whole_waits = 0;
            for (const Op& op : split.ops) split_waits += op.kind == OpKind::kWait;
            for (const Op& op : whole.ops) {
              whole_waits += op.kind == OpKind::kWait;
              CHECK(!op.recv_only);
            }
            CHECK_MSG(whole_waits <= split_waits, n << " " << whole_waits << " > " << split_waits);
          }
          const std::string err = checkPlans(n, numel, t, full, 5, 2);
          CHECK_MSG(err.empty(), err);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The CPU executor.

namespace {

// A Transport that logs the order in which requests are waited.
class RecordingTransport final : public Transport {
 public:
  explicit RecordingTransport(Transport& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int64_t isend(const void* data, size_t bytes, int peer, int tag) override {
    const int64_t id = inner_.isend(data, bytes, peer, tag);
    sends.push_back(id);
    return id;
  }
  int64_t irecv(void* data, size_t bytes, int peer, int tag) override {
    const int64_t id = inner_.irecv(data, bytes, peer, tag);
    recvs.push_back(id);
    return id;
  }
  void wait(int64_t request) override {
    waited.push_back(request);
    inner_.wait(request);
  }
  void abandon() override { inner_.abandon(); }

  bool isSend(int64_t id) const { return std::find(sends.begin(), sends.end(), id) != sends.end(); }

  std::vector<int64_t> sends, recvs, waited;  // in posting / waiting order

 private:
  Transport& inner_;
};

struct RankRun {
  std::vector<float> data;
  std::vector<int64_t> sends, recvs, waited;
  std::vector<bool> waited_is_send;
  std::string error;
  ErrorKind kind = ErrorKind::kRuntime;
};

// Runs plans[r] on thread r over one in-process hub with float32 SUM; data[r] starts as r + 1 +
// element index / 1024 (exact in float32).
std::vector<RankRun> runPlans(const std::vector<Plan>& plans, int64_t max_delay_us) {
  const int n = static_cast<int>(plans.size());
  InprocOptions io;
  io.timeout = std::chrono::milliseconds(20000);
  io.max_delay_us = max_delay_us;
  auto hub = std::make_shared<InprocHub>(n, io);
  std::vector<RankRun> runs(static_cast<size_t>(n));
  std::vector<std::vector<std::vector<float>>> slots(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    const Plan& p = plans[static_cast<size_t>(r)];
    RankRun& run = runs[static_cast<size_t>(r)];
    run.data.resize(static_cast<size_t>(p.sched.numel));
    for (int64_t i = 0; i < p.sched.numel; ++i)
      run.data[static_cast<size_t>(i)] = static_cast<float>(r + 1) + static_cast<float>(i % 1024) / 1024.0f;
    slots[static_cast<size_t>(r)].assign(static_cast<size_t>(p.num_slots),
                                         std::vector<float>(static_cast<size_t>(p.slot_elems)));
  }
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const Plan& p = plans[static_cast<size_t>(r)];
      RankRun& run = runs[static_cast<size_t>(r)];
      InprocTransport inner(hub, r);
      RecordingTransport t(inner);
      RingBuffers b;
      b.data = run.data.data();
      for (auto& s : slots[static_cast<size_t>(r)]) b.slots.push_back(s.data());
      try {
        executePlan(p, RedOp::kSum, t, b, 3);
      } catch (const Error& e) {
        run.error = e.what();
        run.kind = e.kind();
        t.abandon();
      }
      run.sends = t.sends;
      run.recvs = t.recvs;
      run.waited = t.waited;
      for (int64_t id : t.waited) run.waited_is_send.push_back(t.isSend(id));
    });
  }
  for (auto& th : threads) th.join();
  return runs;
}

std::vector<Plan> twoRankPlans(int64_t numel, uint8_t phases) {
  PlanOptions o;
  o.max_segment_bytes = 64;
  o.num_slots = 3;
  o.phases = phases;
  return {buildPlan(2, 0, numel, DType::kFloat32, o), buildPlan(2, 1, numel, DType::kFloat32, o)};
}

}  // namespace

TEST_CASE(executor_waits_receives_before_sends) {
  // 2 ranks: every reduce needs only its receive, so the executor waits the receive request of
  // every reduce-scatter exchange before the first send request (which the drain, or for the
  // all-reduce the first all-gather copy over a sent segment, waits). Each request is waited once.
  const int64_t numel = 1000;
  for (uint8_t phases : {uint8_t(kPhaseReduceScatter), uint8_t(kPhaseBoth)}) {
    for (int64_t delay : {int64_t(0), int64_t(300)}) {
      const std::vector<Plan> plans = twoRankPlans(numel, phases);
      const std::vector<RankRun> runs = runPlans(plans, delay);
      for (int r = 0; r < 2; ++r) {
        const RankRun& run = runs[static_cast<size_t>(r)];
        const Plan& p = plans[static_cast<size_t>(r)];
        CHECK_MSG(run.error.empty(), "rank " << r << ": " << run.error);
        std::vector<int64_t> sorted_waited = run.waited;
        std::sort(sorted_waited.begin(), sorted_waited.end());
        std::vector<int64_t> posted = run.sends;
        posted.insert(posted.end(), run.recvs.begin(), run.recvs.end());
        std::sort(posted.begin(), posted.end());
        CHECK_MSG(sorted_waited == posted, "rank " << r << ": every request waited exactly once");
        // The reduce-scatter receives come first among the waits.
        int rs_recvs = 0;
        for (const Op& o : p.ops)
          rs_recvs += o.kind == OpKind::kExchange && !o.recv.empty() &&
                      p.exchanges[static_cast<size_t>(o.exchange)].phase == Phase::kReduceScatter;
        CHECK(rs_recvs > 1);
        const auto first_send = std::find(run.waited_is_send.begin(), run.waited_is_send.end(), true);
        CHECK_MSG(first_send - run.waited_is_send.begin() >= rs_recvs,
                  "rank " << r << " waited a send after only " << (first_send - run.waited_is_send.begin())
                          << " receives");
        // Values: rank r's owned chunk (and for the all-reduce everything) holds the sum.
        const Range own = p.sched.chunkRange(p.sched.ownedChunk(r));
        for (int64_t i = 0; i < numel; ++i) {
          if (phases != kPhaseBoth && (i < own.begin || i >= own.end)) continue;
          const float want = 3.0f + 2.0f * static_cast<float>(i % 1024) / 1024.0f;
          if (run.data[static_cast<size_t>(i)] != want) {
            CHECK_MSG(false, "rank " << r << " element " << i << ": " << run.data[static_cast<size_t>(i)] << " != "
                                     << want);
            break;
          }
        }
      }
    }
  }
}

TEST_CASE(executor_rejects_a_plan_that_leaves_sends_unwaited) {
  // The drain's full waits weakened to recv_only: the sends are never waited, and the executor's
  // end-of-plan check says so instead of returning the tensor with sends in flight.
  std::vector<Plan> plans = twoRankPlans(1000, kPhaseReduceScatter);
  for (Plan& p : plans)
    for (Op& o : p.ops)
      if (o.kind == OpKind::kWait && o.event % 2 == 0) o.recv_only = true;
  CHECK(!checkPlanSet(plans, CheckOptions{}).empty());
  const std::vector<RankRun> runs = runPlans(plans, 0);
  for (int r = 0; r < 2; ++r) {
    const RankRun& run = runs[static_cast<size_t>(r)];
    CHECK_MSG(run.kind == ErrorKind::kRuntime && run.error.find("send of exchange") != std::string::npos,
              "rank " << r << ": " << run.error);
  }
}

TEST_MAIN()
