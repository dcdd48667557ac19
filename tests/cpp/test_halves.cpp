// Ring halves (Note [Ring halves], plan.h): reduce_scatter (reduce-scatter only, rank r owns block
// r, exact blocks), all_gather (all-gather only, same map) and the hierarchical all-reduce's stages
// (reduce-scatter only and all-gather only with the default map, a full ring with a larger AVG
// divisor). The plan checker proves every plan set of a sweep; concrete facts pin the owner map,
// the blocks and the exchange grid; mutations show the checker's half-specific checks have teeth;
// and the CPU executor runs the plans over the in-process transport on real data.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "core/plan.h"
#include "support/plan_checker.h"
#include "support/inproc_transport.h"

using namespace rr;

namespace {

// ------------------------------------------------------------------------------------------------
// The plan options of each collective.

enum class Mode { kReduceScatter, kAllGather, kRsStage, kAgStage, kFullDivisor, kFullShifted };
const Mode kModes[] = {Mode::kReduceScatter, Mode::kAllGather, Mode::kRsStage,
                       Mode::kAgStage,       Mode::kFullDivisor, Mode::kFullShifted};

const char* modeName(Mode m) {
  switch (m) {
    case Mode::kReduceScatter: return "reduce_scatter";
    case Mode::kAllGather: return "all_gather";
    case Mode::kRsStage: return "rs_stage";
    case Mode::kAgStage: return "ag_stage";
    case Mode::kFullDivisor: return "full_divisor";
    case Mode::kFullShifted: return "full_shifted";
  }
  return "?";
}

// Whether the mode needs numel to be a multiple of n.
bool exactMode(Mode m) {
  return m == Mode::kReduceScatter || m == Mode::kAllGather || m == Mode::kFullShifted;
}

PlanOptions modeOptions(Mode m, int n) {
  PlanOptions o;
  switch (m) {
    case Mode::kReduceScatter:
      o.phases = kPhaseReduceScatter;
      o.owner_shift = -1;
      o.exact_chunks = true;
      break;
    case Mode::kAllGather:
      o.phases = kPhaseAllGather;
      o.owner_shift = -1;
      o.exact_chunks = true;
      break;
    case Mode::kRsStage: o.phases = kPhaseReduceScatter; break;
    case Mode::kAgStage: o.phases = kPhaseAllGather; break;
    case Mode::kFullDivisor: o.avg_divisor = 3 * n + 1; break;  // e.g. n ranks per node, 3+ nodes
    case Mode::kFullShifted:
      o.owner_shift = -1;
      o.exact_chunks = true;
      break;
  }
  return o;
}

struct Config {
  DType dtype;
  bool accum;
};
const Config kConfigs[] = {
    {DType::kFloat32, false}, {DType::kFloat16, false}, {DType::kFloat16, true},
    {DType::kInt8, false},    {DType::kFloat64, false},
};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);
const int64_t kSegBytes[] = {16, 64, 256, 1 << 20};

void expectOk(Mode m, int n, int64_t numel, const Config& c, int slots, int64_t seg, bool gather, bool avg,
              uint64_t seed, int trials) {
  PlanOptions o = modeOptions(m, n);
  o.max_segment_bytes = seg;
  o.num_slots = slots;
  o.accum_float32 = c.accum;
  o.gather_into_data = gather;
  o.average = avg && isFloatingType(c.dtype);
  // Known: a ring of one rank has no reduce to divide by a divisor other than 1 (see
  // one_rank_ring_with_a_larger_divisor below); the sweep leaves that combination to it.
  if (n == 1 && o.average && o.avg_divisor > 1) o.average = false;
  const std::string err = checkPlans(n, numel, c.dtype, o, seed, trials);
  CHECK_MSG(err.empty(), modeName(m) << ": " << err);
}

std::vector<int> worldSizes() {
  if (rrtest::kSanitized) return {1, 2, 3, 5, 8};
  return {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16};
}

std::vector<Plan> buildAll(int n, int64_t numel, DType dtype, const PlanOptions& o) {
  std::vector<Plan> plans;
  for (int r = 0; r < n; ++r) plans.push_back(buildPlan(n, r, numel, dtype, o));
  return plans;
}

std::string check(const std::vector<Plan>& plans, bool avg) {
  CheckOptions co;
  co.average = avg;
  co.seed = 5;
  co.trials = 1;
  return checkPlanSet(plans, co);
}

template <typename F>
ErrorKind kindOf(F&& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.kind();
  }
  return static_cast<ErrorKind>(-1);
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

}  // namespace

// ------------------------------------------------------------------------------------------------
// 1. The checker accepts every half plan set buildPlan makes.

TEST_CASE(checker_full_cross_product_small_rings) {
  // Every mode against every dtype, slot count, accumulator and all-gather destination.
  for (Mode m : kModes) {
    for (int n = 1; n <= (rrtest::kSanitized ? 3 : 5); ++n) {
      std::vector<int64_t> counts = {0, n, 7 * n, 97 * n};
      if (!exactMode(m)) counts.insert(counts.end(), {int64_t(1), int64_t(n + 1), int64_t(37)});
      for (int64_t numel : counts)
        for (int ci = 0; ci < kNumConfigs; ++ci)
          for (int slots = 1; slots <= 4; ++slots)
            for (bool gather : {false, true})
              expectOk(m, n, numel, kConfigs[ci], slots, (slots + ci) % 2 ? 16 : 64, gather, slots != 3,
                       17 * n + slots, 1);
    }
  }
}

// For each (mode, n, count), several configurations rotating through every option.
static void sweep(Mode m) {
  uint64_t seed = 1000 * static_cast<uint64_t>(m);
  for (int n : worldSizes()) {
    std::vector<int64_t> counts = {0, n, 7 * n, 97 * n};
    if (!exactMode(m)) counts.insert(counts.end(), {int64_t(1), int64_t(n + 1), int64_t(61)});
    for (int64_t numel : counts) {
      const int k_max = rrtest::kSanitized ? 2 : (n <= 9 ? 6 : 3);
      for (int k = 0; k < k_max; ++k) {
        const Config& c = kConfigs[(k * 3 + n + static_cast<int>(numel)) % kNumConfigs];
        const int slots = 1 + (k + n) % 4;
        const int64_t seg = kSegBytes[(k + n) % 4];
        expectOk(m, n, numel, c, slots, seg, k % 2 == 1, k % 3 != 2, ++seed, 1);
      }
    }
    // Many segments: small segments on a larger tensor.
    if (rrtest::kSanitized && n > 3) continue;
    const int64_t big = n * (n <= 9 ? int64_t(1021) : int64_t(251));
    expectOk(m, n, big, kConfigs[n % kNumConfigs], 1 + n % 4, 16, n % 2 == 0, true, ++seed, 1);
    expectOk(m, n, big, kConfigs[(n + 2) % kNumConfigs], 1 + (n + 1) % 4, 64, n % 2 == 1, true, ++seed, 1);
  }
}

TEST_CASE(checker_sweep_reduce_scatter) { sweep(Mode::kReduceScatter); }
TEST_CASE(checker_sweep_all_gather) { sweep(Mode::kAllGather); }
TEST_CASE(checker_sweep_rs_stage) { sweep(Mode::kRsStage); }
TEST_CASE(checker_sweep_ag_stage) { sweep(Mode::kAgStage); }
TEST_CASE(checker_sweep_full_divisor) { sweep(Mode::kFullDivisor); }
TEST_CASE(checker_sweep_full_shifted) { sweep(Mode::kFullShifted); }

TEST_CASE(checker_many_trials_random_timing) {
  for (Mode m : kModes)
    for (int n : {2, 3, 5})
      for (int slots : {1, 2, 4})
        expectOk(m, n, 40 * n, {DType::kFloat16, true}, slots, 16, slots == 2, true, 99 + n, 8);
}

// ------------------------------------------------------------------------------------------------
// 2. Concrete facts.

TEST_CASE(shift_minus_one_exact_blocks) {
  // reduce_scatter / all_gather: rank r owns chunk r, which is exactly the caller's block r, for
  // any dtype (no 16-byte rounding), and the final reduces of a reduce-scatter write exactly it.
  for (int n : worldSizes()) {
    for (int64_t numel : {int64_t(0), int64_t(n), int64_t(7 * n), int64_t(97 * n), int64_t(1021 * n)}) {
      for (DType t : {DType::kFloat32, DType::kFloat16, DType::kInt8, DType::kFloat64}) {
        for (Mode m : {Mode::kReduceScatter, Mode::kAllGather}) {
          PlanOptions o = modeOptions(m, n);
          o.max_segment_bytes = 64;
          for (int r = 0; r < n; ++r) {
            const Plan p = buildPlan(n, r, numel, t, o);
            CHECK_EQ(p.sched.ownedChunk(r), r);
            const Range own = p.sched.chunkRange(r);
            CHECK_EQ(own.begin, r * numel / n);
            CHECK_EQ(own.end, (r + 1) * numel / n);
            for (int c = 0; c < n; ++c) CHECK_EQ(p.sched.chunkRange(c).size(), numel / n);
            if (m != Mode::kReduceScatter || n == 1) continue;
            int64_t next = own.begin;  // final reduces cover the block in segment order
            for (const Op& op : p.ops) {
              if (op.kind != OpKind::kReduce || !op.final) continue;
              CHECK(op.dst.buf == BufKind::kData);
              CHECK_EQ(op.dst.offset, next);
              next = op.dst.offset + op.dst.count;
            }
            CHECK_EQ(next, own.end);
          }
        }
      }
    }
  }
}

TEST_CASE(default_shift_owner_map_unchanged) {
  // The hierarchical stages keep the all-reduce's map: rank r owns chunk r + 1.
  for (int n : {2, 3, 5, 8}) {
    PlanOptions o;
    o.phases = kPhaseReduceScatter;
    for (int r = 0; r < n; ++r) CHECK_EQ(buildPlan(n, r, 100, DType::kFloat32, o).sched.ownedChunk(r), (r + 1) % n);
  }
}

TEST_CASE(half_plans_hold_only_their_exchanges) {
  for (int n : worldSizes()) {
    if (n == 1) continue;
    for (int64_t numel : {int64_t(n), int64_t(7 * n), int64_t(97 * n)}) {
      for (DType t : {DType::kFloat32, DType::kFloat16, DType::kInt8, DType::kFloat64}) {
        for (int64_t seg : {int64_t(16), int64_t(64), int64_t(1) << 20}) {
          for (bool exact : {true, false}) {
            for (uint8_t phases : {uint8_t(kPhaseReduceScatter), uint8_t(kPhaseAllGather)}) {
              PlanOptions o;
              o.phases = phases;
              o.exact_chunks = exact;
              o.owner_shift = exact ? -1 : 0;
              o.max_segment_bytes = seg;
              o.accum_float32 = t == DType::kFloat16;
              const Phase want = phases == kPhaseReduceScatter ? Phase::kReduceScatter : Phase::kAllGather;
              for (int r = 0; r < n; ++r) {
                const Plan p = buildPlan(n, r, numel, t, o);
                const int32_t grid = (n - 1) * p.sched.nsegs;
                CHECK_EQ(p.num_exchanges, grid);
                CHECK_EQ(static_cast<int32_t>(p.exchanges.size()), grid);
                CHECK(p.phases == phases);
                for (const ExchangeInfo& x : p.exchanges) CHECK(x.phase == want);
                int ex = 0, reduces = 0, copies = 0, finals = 0;
                for (const Op& op : p.ops) {
                  ex += op.kind == OpKind::kExchange;
                  reduces += op.kind == OpKind::kReduce;
                  copies += op.kind == OpKind::kCopy;
                  finals += op.kind == OpKind::kReduce && op.final;
                }
                // Exact blocks are all alike: no exchange of the grid is empty and skipped.
                if (exact) CHECK_EQ(ex, grid);
                CHECK(ex <= grid);
                // Every receive into staging is consumed: reduced (reduce-scatter) or copied.
                if (phases == kPhaseReduceScatter) {
                  CHECK_EQ(copies, 0);
                  CHECK(exact ? reduces == ex : reduces <= ex);
                  if (exact) CHECK_EQ(finals, p.sched.nsegs);
                } else {
                  CHECK_EQ(reduces, 0);
                  CHECK(exact ? copies == ex : copies <= ex);
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE(bad_half_options_are_value_errors) {
  PlanOptions o;
  o.exact_chunks = true;
  std::string what;
  CHECK(kindOf([&] { buildPlan(3, 0, 10, DType::kFloat32, o); }, &what) == ErrorKind::kValue);
  CHECK_MSG(contains(what, "equal blocks"), what);
  CHECK(kindOf([&] { buildPlan(4, 1, 6, DType::kInt8, o); }) == ErrorKind::kValue);
  CHECK(kindOf([&] { buildPlan(2, 1, 1, DType::kFloat64, o); }) == ErrorKind::kValue);
  buildPlan(3, 0, 0, DType::kFloat32, o);   // 0 = 3 x 0
  buildPlan(3, 2, 12, DType::kFloat32, o);  // fine
  for (uint8_t bad : {uint8_t(0), uint8_t(4), uint8_t(7), uint8_t(255)}) {
    PlanOptions b;
    b.phases = bad;
    CHECK(kindOf([&] { buildPlan(2, 0, 16, DType::kFloat32, b); }, &what) == ErrorKind::kValue);
    CHECK_MSG(contains(what, "phase mask"), what);
    CHECK(kindOf([&] { buildPlan(1, 0, 16, DType::kFloat32, b); }) == ErrorKind::kValue);
  }
  PlanOptions d;
  d.avg_divisor = -2;
  CHECK(kindOf([&] { buildPlan(2, 0, 16, DType::kFloat32, d); }) == ErrorKind::kValue);
}

TEST_CASE(default_and_explicit_divisor) {
  PlanOptions o;
  CHECK_EQ(buildPlan(4, 0, 64, DType::kFloat32, o).avg_divisor, 4);
  o.avg_divisor = 12;
  CHECK_EQ(buildPlan(4, 0, 64, DType::kFloat32, o).avg_divisor, 12);
}

// ------------------------------------------------------------------------------------------------
// 3. The checker's half-specific checks have teeth.

namespace {

struct HalfSetup {
  Mode mode;
  int n;
  int64_t numel;
  DType dtype;
  int slots;
  bool accum;
  bool gather;
  bool avg;
};

const HalfSetup kHalfSetups[] = {
    {Mode::kReduceScatter, 2, 2 * 19, DType::kFloat32, 2, false, false, true},
    {Mode::kReduceScatter, 4, 4 * 23, DType::kFloat16, 3, true, false, true},
    {Mode::kReduceScatter, 5, 5 * 9, DType::kInt8, 1, false, false, false},
    {Mode::kAllGather, 2, 2 * 19, DType::kFloat32, 2, false, false, true},
    {Mode::kAllGather, 3, 3 * 21, DType::kFloat64, 1, false, true, true},
    {Mode::kAllGather, 4, 4 * 13, DType::kInt8, 4, false, false, false},
    {Mode::kRsStage, 3, 50, DType::kBFloat16, 2, true, false, false},
    {Mode::kAgStage, 3, 50, DType::kFloat16, 3, false, true, true},
    {Mode::kAgStage, 4, 61, DType::kFloat32, 2, false, false, true},
    {Mode::kFullDivisor, 3, 40, DType::kFloat32, 2, false, false, true},
    {Mode::kFullShifted, 4, 4 * 11, DType::kFloat16, 2, true, true, true},
};

PlanOptions setupOptions(const HalfSetup& s) {
  PlanOptions o = modeOptions(s.mode, s.n);
  o.max_segment_bytes = 16;
  o.num_slots = s.slots;
  o.accum_float32 = s.accum;
  o.gather_into_data = s.gather;
  o.average = s.avg;
  return o;
}

std::vector<Plan> build(const HalfSetup& s) { return buildAll(s.n, s.numel, s.dtype, setupOptions(s)); }

std::string setupText(const HalfSetup& s) {
  return detail::concat(modeName(s.mode), " n=", s.n, " numel=", s.numel, " ", dtypeName(s.dtype),
                        " slots=", s.slots, s.accum ? " accum" : "", s.gather ? " gather" : "",
                        s.avg ? " avg" : "");
}

// An oracle for deleting a wait (or, with `weaken`, turning a full wait into a recv_only one),
// independent of the checker: is the op that the wait guarded (the first later op of its queue
// that is not a wait; the queue's last op if only waits follow) still after the wait's sources in
// the happens-before graph without them? Nodes: ops, and a receive completion and a send
// completion per (rank, exchange); edges as in Note [One ring, two transports, one plan] (a
// recv_only wait follows the receive completion only).
bool stillOrdered(std::vector<Plan> plans, int rank, int wait_op, bool weaken = false) {
  const Op w = plans[rank].ops[wait_op];
  if (weaken) plans[rank].ops[wait_op].recv_only = true;
  else plans[rank].ops.erase(plans[rank].ops.begin() + wait_op);
  const int n = static_cast<int>(plans.size());
  std::vector<int> op_node(n), done_node(n), sent_node(n);
  int nodes = 0;
  for (int r = 0; r < n; ++r) {
    op_node[r] = nodes;
    nodes += static_cast<int>(plans[r].ops.size());
    done_node[r] = nodes;  // receive completions
    nodes += plans[r].num_exchanges;
    sent_node[r] = nodes;  // send completions
    nodes += plans[r].num_exchanges;
  }
  std::vector<std::vector<int>> succ(static_cast<size_t>(nodes));
  for (int r = 0; r < n; ++r) {
    const Plan& p = plans[r];
    const Plan& prev = plans[p.prev];
    int last[2] = {-1, -1};
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
      const Op& o = p.ops[i];
      const int q = o.queue == Queue::kComm ? 1 : 0;
      if (last[q] >= 0) succ[op_node[r] + last[q]].push_back(op_node[r] + i);
      last[q] = i;
      if (o.kind == OpKind::kWait && p.isExchangeEvent(o.event)) {
        succ[done_node[r] + o.event / 2].push_back(op_node[r] + i);
        if (!o.recv_only) succ[sent_node[r] + o.event / 2].push_back(op_node[r] + i);
      }
      if (o.kind == OpKind::kWait && !p.isExchangeEvent(o.event))
        for (int k = 0; k < static_cast<int>(p.ops.size()); ++k)
          if (p.ops[k].kind == OpKind::kRecord && p.ops[k].event == o.event)
            succ[op_node[r] + k].push_back(op_node[r] + i);
      if (o.kind == OpKind::kExchange) {
        succ[op_node[r] + i].push_back(done_node[r] + o.exchange);
        succ[op_node[r] + i].push_back(sent_node[r] + o.exchange);
        if (!o.recv.empty())
          for (int k = 0; k < static_cast<int>(prev.ops.size()); ++k)
            if (prev.ops[k].kind == OpKind::kExchange && prev.ops[k].exchange == o.exchange)
              succ[op_node[p.prev] + k].push_back(done_node[r] + o.exchange);
      }
    }
  }
  const Plan& p = plans[rank];
  int guarded = -1;
  for (int k = weaken ? wait_op + 1 : wait_op; k < static_cast<int>(p.ops.size()); ++k) {
    if (p.ops[k].queue != w.queue) continue;
    guarded = k;
    if (p.ops[k].kind != OpKind::kWait) break;
  }
  if (guarded < 0) return false;
  std::vector<int> sources;
  if (p.isExchangeEvent(w.event)) {
    if (!weaken) sources.push_back(done_node[rank] + w.event / 2);
    if (!w.recv_only) sources.push_back(sent_node[rank] + w.event / 2);
  } else {
    for (int k = 0; k < static_cast<int>(p.ops.size()); ++k)
      if (p.ops[k].kind == OpKind::kRecord && p.ops[k].event == w.event) sources.push_back(op_node[rank] + k);
  }
  if (sources.empty()) return false;
  for (int source : sources) {
    std::vector<char> seen(static_cast<size_t>(nodes), 0);
    std::vector<int> stack = {source};
    seen[source] = 1;
    bool reached = false;
    while (!stack.empty() && !reached) {
      const int v = stack.back();
      stack.pop_back();
      reached = v == op_node[rank] + guarded;
      for (int u : succ[v])
        if (!seen[u]) {
          seen[u] = 1;
          stack.push_back(u);
        }
    }
    if (!reached) return false;
  }
  return true;
}

int mutateAll(const HalfSetup& s, const char* what, const std::function<bool(Plan&, int)>& mutate) {
  const std::vector<Plan> base = build(s);
  int tried = 0;
  for (int r = 0; r < s.n; ++r) {
    for (int i = 0; i < static_cast<int>(base[r].ops.size()); ++i) {
      std::vector<Plan> plans = base;
      if (!mutate(plans[r], i)) continue;
      ++tried;
      const std::string err = check(plans, s.avg);
      CHECK_MSG(!err.empty(), what << " at rank " << r << " " << describeOp(base[r], i) << " went unnoticed ("
                                   << setupText(s) << ")\n" << base[r].describe());
    }
  }
  return tried;
}

}  // namespace

TEST_CASE(mutation_setups_pass_unmutated) {
  for (const HalfSetup& s : kHalfSetups) {
    const std::string err = check(build(s), s.avg);
    CHECK_MSG(err.empty(), setupText(s) << ": " << err);
  }
}

TEST_CASE(mutation_delete_any_wait) {
  for (const HalfSetup& s : kHalfSetups) {
    const std::vector<Plan> base = build(s);
    int needed = 0, implied = 0;
    for (int r = 0; r < s.n; ++r) {
      for (int i = 0; i < static_cast<int>(base[r].ops.size()); ++i) {
        if (base[r].ops[i].kind != OpKind::kWait) continue;
        const bool ok = stillOrdered(base, r, i);
        std::vector<Plan> plans = base;
        plans[r].ops.erase(plans[r].ops.begin() + i);
        const std::string err = check(plans, s.avg);
        if (ok) {
          ++implied;
          CHECK_MSG(err.empty(), "deleting an implied wait was reported (" << setupText(s) << "): " << err);
        } else {
          ++needed;
          CHECK_MSG(!err.empty(), "deleting rank " << r << " " << describeOp(base[r], i) << " went unnoticed ("
                                                   << setupText(s) << ")\n" << base[r].describe());
        }
      }
    }
    CHECK(needed > 0);
    std::printf("  %s: %d needed waits caught, %d implied waits\n", setupText(s).c_str(), needed, implied);
  }
}

TEST_CASE(mutation_weaken_any_full_wait) {
  // A full wait turned into a recv_only one, on either queue: caught unless the send completion
  // is known some other way. With float32 partials (accum setups of n >= 4) that includes the
  // reduce into the kAccum segment its own exchange sends.
  for (const HalfSetup& s : kHalfSetups) {
    const std::vector<Plan> base = build(s);
    int needed = 0, implied = 0;
    for (int r = 0; r < s.n; ++r) {
      for (int i = 0; i < static_cast<int>(base[r].ops.size()); ++i) {
        const Op& w = base[r].ops[i];
        if (w.kind != OpKind::kWait || w.event % 2 != 0 || w.recv_only) continue;
        const bool ok = stillOrdered(base, r, i, true);
        std::vector<Plan> plans = base;
        plans[r].ops[i].recv_only = true;
        const std::string err = check(plans, s.avg);
        if (ok) {
          ++implied;
          CHECK_MSG(err.empty(), "weakening an implied full wait was reported (" << setupText(s) << "): " << err);
        } else {
          ++needed;
          CHECK_MSG(!err.empty(), "weakening rank " << r << " " << describeOp(base[r], i) << " went unnoticed ("
                                                    << setupText(s) << ")\n" << base[r].describe());
        }
      }
    }
    CHECK(needed > 0);
    std::printf("  %s: %d needed full waits caught when weakened, %d implied\n", setupText(s).c_str(), needed,
                implied);
  }
}

TEST_CASE(mutation_drop_final_reduce_in_reduce_scatter) {
  for (const HalfSetup& s : kHalfSetups) {
    if (modeOptions(s.mode, s.n).phases != kPhaseReduceScatter) continue;
    const int tried = mutateAll(s, "dropping a final reduce", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kReduce || !p.ops[i].final) return false;
      p.ops.erase(p.ops.begin() + i);
      return true;
    });
    CHECK(tried > 0);
    // Any reduce at all: its contribution never reaches the owner.
    mutateAll(s, "dropping a reduce", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kReduce) return false;
      p.ops.erase(p.ops.begin() + i);
      return true;
    });
    if (s.avg) {
      mutateAll(s, "clearing AVG's final divide", [](Plan& p, int i) {
        if (p.ops[i].kind != OpKind::kReduce || !p.ops[i].final) return false;
        p.ops[i].final = false;
        return true;
      });
    }
  }
}

TEST_CASE(mutation_drop_copy_in_all_gather) {
  for (const HalfSetup& s : kHalfSetups) {
    if (modeOptions(s.mode, s.n).phases != kPhaseAllGather) continue;
    const int tried = mutateAll(s, "dropping a copy", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kCopy) return false;
      p.ops.erase(p.ops.begin() + i);
      return true;
    });
    CHECK(s.gather ? tried == 0 : tried > 0);
    mutateAll(s, "dropping an exchange", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kExchange) return false;
      p.ops.erase(p.ops.begin() + i);
      return true;
    });
    mutateAll(s, "receiving into a neighbouring segment", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kExchange || o.recv.buf != BufKind::kData || o.recv.offset == 0) return false;
      o.recv.offset -= 1;
      return true;
    });
  }
}

TEST_CASE(mutation_drop_any_op) {
  // Records nobody waits on are the only non-wait ops whose loss is harmless.
  for (const HalfSetup& s : kHalfSetups) {
    const int tried = mutateAll(s, "dropping an op", [](Plan& p, int i) {
      const Op& o = p.ops[i];
      if (o.kind == OpKind::kWait) return false;
      if (o.kind == OpKind::kRecord) {
        for (const Op& x : p.ops)
          if (x.kind == OpKind::kWait && x.event == o.event) {
            p.ops.erase(p.ops.begin() + i);
            return true;
          }
        return false;
      }
      p.ops.erase(p.ops.begin() + i);
      return true;
    });
    CHECK(tried > 0);
  }
}

TEST_CASE(mutation_ranks_disagree_on_the_phase_mask) {
  for (const HalfSetup& s : kHalfSetups) {
    const PlanOptions o = setupOptions(s);
    for (uint8_t other : {uint8_t(kPhaseReduceScatter), uint8_t(kPhaseAllGather), uint8_t(kPhaseBoth)}) {
      if (other == o.phases) continue;
      for (int r = 0; r < s.n; ++r) {
        // Rank r built for another collective: a different grid of exchanges, too.
        std::vector<Plan> plans = build(s);
        PlanOptions x = o;
        x.phases = other;
        plans[r] = buildPlan(s.n, r, s.numel, s.dtype, x);
        std::string err = check(plans, s.avg);
        CHECK_MSG(contains(err, "disagree on the phase mask"), setupText(s) << " rank " << r << ": " << err);
        // Only the field differs: the ranks still disagree on what they compute.
        plans = build(s);
        plans[r].phases = other;
        err = check(plans, s.avg);
        CHECK_MSG(contains(err, "disagree on the phase mask"), setupText(s) << " rank " << r << ": " << err);
      }
    }
  }
}

TEST_CASE(mutation_ranks_disagree_on_shift_and_divisor) {
  for (const HalfSetup& s : kHalfSetups) {
    const PlanOptions o = setupOptions(s);
    for (int r = 0; r < s.n; ++r) {
      std::vector<Plan> plans = build(s);
      PlanOptions x = o;
      x.owner_shift = o.owner_shift + 1;
      plans[r] = buildPlan(s.n, r, s.numel, s.dtype, x);
      std::string err = check(plans, s.avg);
      CHECK_MSG(contains(err, "disagree on the owner map"), setupText(s) << " rank " << r << ": " << err);
      plans = build(s);
      plans[r].avg_divisor += 1;
      err = check(plans, s.avg);
      CHECK_MSG(contains(err, "disagree on the AVG divisor"), setupText(s) << " rank " << r << ": " << err);
    }
    // Every rank with a divisor below the ring's size.
    std::vector<Plan> plans = build(s);
    for (Plan& p : plans) p.avg_divisor = s.n - 1;
    const std::string err = check(plans, s.avg);
    CHECK_MSG(contains(err, "smaller than its ring's size"), setupText(s) << ": " << err);
  }
}

TEST_CASE(mutation_owner_map_relabelled) {
  // Plans built for one owner map but labelled with another (every rank agrees): a reduce-scatter
  // finishes chunks on ranks that do not own them; an all-gather starts sending chunks its ranks
  // do not hold, and the copies (or direct receives) bring unfinished data.
  for (const HalfSetup& s : kHalfSetups) {
    std::vector<Plan> plans = build(s);
    for (Plan& p : plans) p.sched.shift = (p.sched.shift + 1) % s.n;
    const std::string err = check(plans, s.avg);
    CHECK_MSG(!err.empty(), setupText(s) << ": relabelled owner map went unnoticed");
    const uint8_t phases = plans[0].phases;
    if (phases == kPhaseReduceScatter || phases == kPhaseBoth)
      CHECK_MSG(contains(err, "final reduce of element"), setupText(s) << ": " << err);
    if (phases == kPhaseAllGather)
      CHECK_MSG(contains(err, s.gather ? "receives unfinished element" : "before it is finished"),
                setupText(s) << ": " << err);
  }
}

TEST_CASE(mutation_wrong_phase_ops) {
  // A copy in a reduce-scatter-only plan, a reduce in an all-gather-only one, an exchange of the
  // other half: each is refused before any simulation.
  for (const HalfSetup& s : kHalfSetups) {
    const uint8_t phases = modeOptions(s.mode, s.n).phases;
    if (phases == kPhaseBoth) continue;
    const int tried = mutateAll(s, "turning a reduce into a copy or a copy into a reduce", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind == OpKind::kReduce) {
        o.kind = OpKind::kCopy;
        return true;
      }
      if (o.kind == OpKind::kCopy) {
        o.kind = OpKind::kReduce;
        o.a = o.dst;
        return true;
      }
      return false;
    });
    CHECK(s.gather || tried > 0);
    std::vector<Plan> plans = build(s);
    plans[1].exchanges[0].phase =
        phases == kPhaseReduceScatter ? Phase::kAllGather : Phase::kReduceScatter;
    const std::string err = check(plans, s.avg);
    CHECK_MSG(contains(err, "exchange in a plan that runs") || contains(err, "consumes"), setupText(s) << ": " << err);
  }
}

TEST_CASE(one_rank_ring_with_a_larger_divisor) {
  // A hierarchical all-reduce's full ring over one node, or its reduce-scatter stage with an AVG
  // divisor: the ring of one rank has no final reduce, so nothing divides by the divisor. Either
  // buildPlan refuses it or the checker reports the missing division; it must never pass.
  for (uint8_t phases : {uint8_t(kPhaseBoth), uint8_t(kPhaseReduceScatter)}) {
    PlanOptions o;
    o.phases = phases;
    o.average = true;
    o.avg_divisor = 4;
    const std::string err = checkPlans(1, 64, DType::kFloat32, o, 1, 1);
    CHECK_MSG(!err.empty(), "a one-rank AVG ring with divisor 4 passed the checker");
    std::printf("  one rank, divisor 4, %s: %s\n", phases == kPhaseBoth ? "full" : "reduce-scatter only",
                err.c_str());
  }
  // The default divisor (1) and SUM are fine.
  PlanOptions o;
  o.average = true;
  CHECK_EQ(checkPlans(1, 64, DType::kFloat32, o, 1, 1), std::string());
  o.average = false;
  o.avg_divisor = 4;
  CHECK_EQ(checkPlans(1, 64, DType::kFloat32, o, 1, 1), std::string());
}

// ------------------------------------------------------------------------------------------------
// 4. Real execution: the CPU executor over the in-process transport (threads as ranks).

namespace {

InprocRunOptions runOptions(const PlanOptions& plan, int64_t seg, int slots, uint64_t seed) {
  InprocRunOptions ro;
  ro.plan = plan;
  ro.plan.max_segment_bytes = seg;
  ro.plan.num_slots = slots;
  ro.transport.timeout = std::chrono::milliseconds(20000);
  ro.transport.max_delay_us = 30;
  ro.transport.seed = seed;
  return ro;
}

void expectRanksOk(const std::vector<InprocRankResult>& res, const std::string& what) {
  for (size_t r = 0; r < res.size(); ++r) CHECK_MSG(res[r].error.empty(), what << " rank " << r << ": " << res[r].error);
}

template <typename T>
T at(const std::vector<uint8_t>& buf, int64_t i) {
  T v;
  std::memcpy(&v, buf.data() + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}
template <typename T>
void put(std::vector<uint8_t>& buf, int64_t i, T v) {
  std::memcpy(buf.data() + i * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
}

// Small integers: sums of a few of them are exact in float64 whatever the order.
int64_t value(int r, int64_t i) { return static_cast<int64_t>((i * 7 + r * 13 + (i * r) % 5) % 41) - 20; }

std::vector<std::vector<uint8_t>> inputs(int n, int64_t numel, size_t es, bool is_double) {
  std::vector<std::vector<uint8_t>> data(static_cast<size_t>(n), std::vector<uint8_t>(static_cast<size_t>(numel) * es));
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < numel; ++i) {
      if (is_double) put<double>(data[r], i, static_cast<double>(value(r, i)));
      else put<int32_t>(data[r], i, static_cast<int32_t>(value(r, i)));
    }
  return data;
}

}  // namespace

TEST_CASE(run_reduce_scatter_blocks) {
  // Rank r ends with SUM / AVG (default and larger divisor) / MAX of everyone's block r.
  struct Case {
    DType dtype;
    RedOp op;
    int divisor;
  };
  const Case kCases[] = {{DType::kFloat64, RedOp::kSum, 0}, {DType::kFloat64, RedOp::kAvg, 0},
                         {DType::kFloat64, RedOp::kAvg, 7}, {DType::kInt32, RedOp::kSum, 0},
                         {DType::kInt32, RedOp::kMax, 0}};
  uint64_t seed = 1;
  for (int n : {1, 2, 3, 4, 5, 7}) {
    for (int64_t blk : {int64_t(0), int64_t(1), int64_t(5), int64_t(37), int64_t(300)}) {
      for (const Case& c : kCases) {
        const int64_t numel = blk * n;
        const int slots = 1 + static_cast<int>(seed % 4);
        PlanOptions po;
        po.phases = kPhaseReduceScatter;
        po.owner_shift = -1;
        po.exact_chunks = true;
        po.avg_divisor = c.divisor > 0 ? c.divisor * n : 0;
        if (n == 1 && po.avg_divisor > 1) continue;  // one_rank_ring_with_a_larger_divisor
        const bool dbl = c.dtype == DType::kFloat64;
        auto data = inputs(n, numel, dtypeSize(c.dtype), dbl);
        const auto res = runInprocAllReduce(n, numel, c.dtype, c.op, data,
                                            runOptions(po, seed % 2 ? 16 : 64, slots, seed));
        ++seed;
        const std::string what = detail::concat("reduce_scatter n=", n, " block=", blk, " ", dtypeName(c.dtype), " ",
                                                redOpName(c.op), " divisor=", po.avg_divisor);
        expectRanksOk(res, what);
        const int divisor = po.avg_divisor > 0 ? po.avg_divisor : n;
        int bad = 0;
        for (int r = 0; r < n; ++r) {
          for (int64_t i = r * blk; i < (r + 1) * blk; ++i) {
            int64_t sum = 0, mx = INT64_MIN;
            for (int q = 0; q < n; ++q) {
              sum += value(q, i);
              mx = std::max(mx, value(q, i));
            }
            if (dbl) {
              const double want = c.op == RedOp::kAvg && n > 1 ? static_cast<double>(sum) / divisor
                                                                : static_cast<double>(sum);
              if (at<double>(data[r], i) != want) ++bad;
            } else {
              const int64_t want = c.op == RedOp::kMax ? mx : sum;
              if (at<int32_t>(data[r], i) != want) ++bad;
            }
          }
        }
        CHECK_MSG(bad == 0, what << ": " << bad << " wrong elements in the owned blocks");
      }
    }
  }
}

TEST_CASE(run_all_gather_blocks) {
  // Each rank fills only its block r (the rest holds garbage); every rank ends with the
  // concatenation of the blocks.
  uint64_t seed = 100;
  for (int n : {1, 2, 3, 4, 6, 8}) {
    for (int64_t blk : {int64_t(0), int64_t(1), int64_t(3), int64_t(41), int64_t(257)}) {
      for (DType t : {DType::kFloat64, DType::kInt32}) {
        const int64_t numel = blk * n;
        const size_t es = dtypeSize(t);
        std::vector<std::vector<uint8_t>> data(static_cast<size_t>(n),
                                               std::vector<uint8_t>(static_cast<size_t>(numel) * es, 0xcd));
        auto block = [&](int r, int64_t i) { return 1000 * r + i % 997 + 1; };
        for (int r = 0; r < n; ++r)
          for (int64_t i = r * blk; i < (r + 1) * blk; ++i) {
            if (t == DType::kFloat64) put<double>(data[r], i, static_cast<double>(block(r, i)) + 0.25);
            else put<int32_t>(data[r], i, static_cast<int32_t>(block(r, i)));
          }
        PlanOptions po;
        po.phases = kPhaseAllGather;
        po.owner_shift = -1;
        po.exact_chunks = true;
        const int slots = 1 + static_cast<int>(seed % 4);
        const auto res = runInprocAllReduce(n, numel, t, RedOp::kSum, data,
                                            runOptions(po, seed % 2 ? 16 : 64, slots, seed));
        ++seed;
        const std::string what = detail::concat("all_gather n=", n, " block=", blk, " ", dtypeName(t));
        expectRanksOk(res, what);
        int bad = 0;
        for (int r = 0; r < n; ++r)
          for (int64_t i = 0; i < numel; ++i) {
            const int owner = static_cast<int>(i / blk);
            if (t == DType::kFloat64) bad += at<double>(data[r], i) != static_cast<double>(block(owner, i)) + 0.25;
            else bad += at<int32_t>(data[r], i) != static_cast<int32_t>(block(owner, i));
          }
        CHECK_MSG(bad == 0, what << ": " << bad << " wrong elements");
      }
    }
  }
}

TEST_CASE(run_hierarchical_all_reduce) {
  // The three stages of a hierarchical all-reduce over `nodes` x `local` ranks (rank = node *
  // local + l): reduce-scatter on each node's ring (SUM, default map), a full AVG/SUM ring over the
  // nodes on each local rank's owned chunk with the whole group's size as divisor, all-gather on
  // each node's ring. Every rank must end with the global result.
  uint64_t seed = 500;
  for (int nodes : {2, 3}) {
    for (int local : {1, 2, 3, 4}) {
      for (int64_t numel : {int64_t(1), int64_t(10), int64_t(37), int64_t(1000)}) {
        for (RedOp op : {RedOp::kSum, RedOp::kAvg}) {
          const int world = nodes * local;
          auto data = inputs(world, numel, 8, true);
          const int64_t seg = seed % 2 ? 16 : 64;
          const int slots = 1 + static_cast<int>(seed % 4);
          const std::string what = detail::concat("hierarchical nodes=", nodes, " local=", local, " numel=", numel,
                                                  " ", redOpName(op));
          // Stage 1: reduce-scatter on every node.
          PlanOptions rs;
          rs.phases = kPhaseReduceScatter;
          for (int nd = 0; nd < nodes; ++nd) {
            std::vector<std::vector<uint8_t>> node(data.begin() + nd * local, data.begin() + (nd + 1) * local);
            expectRanksOk(runInprocAllReduce(local, numel, DType::kFloat64, RedOp::kSum, node,
                                             runOptions(rs, seg, slots, ++seed)),
                          what + " stage 1");
            std::copy(node.begin(), node.end(), data.begin() + nd * local);
          }
          // Stage 2: a full ring over the nodes on each local rank's owned chunk.
          const Plan shape = buildPlan(local, 0, numel, DType::kFloat64, rs);
          PlanOptions full;
          full.avg_divisor = world;
          for (int l = 0; l < local; ++l) {
            const Range own = shape.sched.chunkRange(shape.sched.ownedChunk(l));
            std::vector<std::vector<uint8_t>> part(static_cast<size_t>(nodes));
            for (int nd = 0; nd < nodes; ++nd)
              part[nd].assign(data[nd * local + l].begin() + own.begin * 8, data[nd * local + l].begin() + own.end * 8);
            expectRanksOk(runInprocAllReduce(nodes, own.size(), DType::kFloat64, op, part,
                                             runOptions(full, seg, slots, ++seed)),
                          what + " stage 2");
            for (int nd = 0; nd < nodes; ++nd)
              std::copy(part[nd].begin(), part[nd].end(), data[nd * local + l].begin() + own.begin * 8);
          }
          // Stage 3: all-gather on every node.
          PlanOptions ag;
          ag.phases = kPhaseAllGather;
          for (int nd = 0; nd < nodes; ++nd) {
            std::vector<std::vector<uint8_t>> node(data.begin() + nd * local, data.begin() + (nd + 1) * local);
            expectRanksOk(runInprocAllReduce(local, numel, DType::kFloat64, RedOp::kSum, node,
                                             runOptions(ag, seg, slots, ++seed)),
                          what + " stage 3");
            std::copy(node.begin(), node.end(), data.begin() + nd * local);
          }
          int bad = 0;
          for (int64_t i = 0; i < numel; ++i) {
            int64_t sum = 0;
            for (int q = 0; q < world; ++q) sum += value(q, i);
            const double want = op == RedOp::kAvg ? static_cast<double>(sum) / world : static_cast<double>(sum);
            for (int r = 0; r < world; ++r) bad += at<double>(data[r], i) != want;
          }
          CHECK_MSG(bad == 0, what << ": " << bad << " wrong elements");
        }
      }
    }
  }
}

TEST_MAIN()
