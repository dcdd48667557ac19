// The checker has teeth: every deliberate break of a correct plan set is reported. Each mutation
// alters one rank's plan (or one op of it) and checkPlanSet must return a non-empty message.
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "core/plan.h"
#include "support/plan_checker.h"

using namespace rr;

namespace {

struct Setup {
  int n;
  int64_t numel;
  DType dtype;
  int slots;
  int64_t seg;
  bool accum;
  bool gather;
  bool avg;
  int wire = -1;     // a 16-bit wire's DType code, -1: none (Note [First hop] in plan.h)
  double pre = 0;    // the predivide factor (pre and post), 0: none
};

const Setup kSetups[] = {
    {2, 37, DType::kFloat32, 2, 16, false, false, true},
    {3, 50, DType::kFloat16, 3, 16, true, false, true},
    {3, 50, DType::kBFloat16, 1, 16, false, true, false},
    {4, 61, DType::kInt32, 4, 16, false, false, false},
    {4, 100, DType::kFloat16, 2, 16, true, true, true},
    {5, 23, DType::kFloat64, 3, 16, false, true, true},
    {2, 9, DType::kInt8, 1, 16, false, false, false},
    {3, 50, DType::kFloat32, 2, 16, false, false, true, static_cast<int>(DType::kBFloat16)},
    {2, 37, DType::kFloat32, 3, 16, false, true, false, static_cast<int>(DType::kFloat16), 4.0},
    {4, 61, DType::kFloat32, 2, 16, false, false, true, -1, 2.0},
    {3, 40, DType::kFloat16, 2, 16, true, true, false, -1, 3.0},
};

std::vector<Plan> build(const Setup& s) {
  PlanOptions o;
  o.max_segment_bytes = s.seg;
  o.num_slots = s.slots;
  o.accum_float32 = s.accum;
  o.gather_into_data = s.gather;
  o.average = s.avg;
  if (s.wire >= 0) o.wire_dtype = static_cast<DType>(s.wire);
  o.pre_factor = o.post_factor = s.pre;
  std::vector<Plan> plans;
  for (int r = 0; r < s.n; ++r) plans.push_back(buildPlan(s.n, r, s.numel, s.dtype, o));
  return plans;
}

std::string check(const std::vector<Plan>& plans, const Setup& s) {
  CheckOptions co;
  co.average = s.avg;
  co.seed = 5;
  co.trials = 1;  // element values do not depend on timing; races are found exactly
  return checkPlanSet(plans, co);
}

std::string setupText(const Setup& s) {
  return detail::concat("n=", s.n, " numel=", s.numel, " ", dtypeName(s.dtype), " slots=", s.slots,
                        " seg=", s.seg, s.accum ? " accum" : "", s.gather ? " gather" : "", s.avg ? " avg" : "",
                        s.wire >= 0 ? detail::concat(" wire=", dtypeName(static_cast<DType>(s.wire))) : std::string(),
                        s.pre > 0 ? detail::concat(" pre=", s.pre) : std::string());
}

// Applies `mutate` to rank r's plan at op index i for every (r, i) it accepts (returns true);
// every mutated set must fail. Returns the number of mutations tried.
int mutateAll(const Setup& s, const char* what, const std::function<bool(Plan&, int)>& mutate,
              std::vector<int> ranks = {}) {
  const std::vector<Plan> base = build(s);
  if (ranks.empty())
    for (int r = 0; r < s.n; ++r) ranks.push_back(r);
  int tried = 0;
  for (int r : ranks) {
    for (int i = 0; i < static_cast<int>(base[r].ops.size()); ++i) {
      std::vector<Plan> plans = base;
      if (!mutate(plans[r], i)) continue;
      ++tried;
      const std::string err = check(plans, s);
      CHECK_MSG(!err.empty(), what << " at rank " << r << " " << describeOp(base[r], i) << " went unnoticed ("
                                   << setupText(s) << ")\n" << base[r].describe());
    }
  }
  return tried;
}

// Position of the next op after i on the same queue, -1 if none.
int nextOnQueue(const Plan& p, int i) {
  for (int k = i + 1; k < static_cast<int>(p.ops.size()); ++k)
    if (p.ops[k].queue == p.ops[i].queue) return k;
  return -1;
}

bool eventWaited(const Plan& p, int32_t event) {
  for (const Op& o : p.ops)
    if (o.kind == OpKind::kWait && o.event == event) return true;
  return false;
}

// What a mutation does to one wait: delete it, or turn a full wait into a recv_only one.
enum class WaitCut { kDelete, kWeaken };

// An independent oracle for delete_any_wait and weaken_any_full_wait: an explicit happens-before
// graph (op nodes, receive and send completion nodes per exchange) searched backwards. Deleting
// wait W is harmless when the first op after W on its queue that is not itself a wait (or, when
// only waits follow, the queue's last op) still happens after W's sources without W: then every
// op's ordering is as before. Weakening a full wait W is harmless when that op still happens after
// the send completion W no longer waits for.
bool waitIsImplied(const std::vector<Plan>& base_plans, int rank, int wait_op, WaitCut cut = WaitCut::kDelete) {
  std::vector<Plan> plans = base_plans;
  const Op w = plans[rank].ops[wait_op];
  if (cut == WaitCut::kDelete) plans[rank].ops.erase(plans[rank].ops.begin() + wait_op);
  else plans[rank].ops[wait_op].recv_only = true;
  const int n = static_cast<int>(plans.size());
  std::vector<int> base(n), cbase(n), sbase(n);  // ops, receive completions, send completions
  int total = 0;
  for (int r = 0; r < n; ++r) {
    base[r] = total;
    total += static_cast<int>(plans[r].ops.size());
  }
  for (int r = 0; r < n; ++r) {
    cbase[r] = total;
    total += plans[r].num_exchanges;
    sbase[r] = total;
    total += plans[r].num_exchanges;
  }
  std::vector<std::vector<int>> preds(static_cast<size_t>(total));
  for (int r = 0; r < n; ++r) {
    const Plan& p = plans[r];
    std::vector<int> rec(static_cast<size_t>(p.num_events), -1);
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i)
      if (p.ops[i].kind == OpKind::kRecord) rec[p.ops[i].event] = i;
    int last[2] = {-1, -1};
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
      const Op& o = p.ops[i];
      const int q = o.queue == Queue::kComm ? 0 : 1;
      if (last[q] >= 0) preds[base[r] + i].push_back(base[r] + last[q]);
      last[q] = i;
      if (o.kind == OpKind::kWait) {
        if (p.isExchangeEvent(o.event)) {
          preds[base[r] + i].push_back(cbase[r] + o.event / 2);
          if (!o.recv_only) preds[base[r] + i].push_back(sbase[r] + o.event / 2);
        } else {
          preds[base[r] + i].push_back(base[r] + rec[o.event]);
        }
      }
      if (o.kind == OpKind::kExchange) {
        preds[cbase[r] + o.exchange].push_back(base[r] + i);
        preds[sbase[r] + o.exchange].push_back(base[r] + i);  // eager: the send needs nothing else
        if (!o.recv.empty()) {
          const Plan& pp = plans[p.prev];
          for (int k = 0; k < static_cast<int>(pp.ops.size()); ++k)
            if (pp.ops[k].kind == OpKind::kExchange && pp.ops[k].exchange == o.exchange)
              preds[cbase[r] + o.exchange].push_back(base[p.prev] + k);
        }
      }
    }
  }
  const Plan& p = plans[rank];
  int target = -1;
  for (int k = cut == WaitCut::kDelete ? wait_op : wait_op + 1; k < static_cast<int>(p.ops.size()); ++k) {
    if (p.ops[k].queue != w.queue) continue;
    target = k;
    if (p.ops[k].kind != OpKind::kWait) break;
  }
  if (target < 0) return false;
  std::vector<int> sources;
  if (p.isExchangeEvent(w.event)) {
    if (cut == WaitCut::kDelete) sources.push_back(cbase[rank] + w.event / 2);
    if (!w.recv_only) sources.push_back(sbase[rank] + w.event / 2);
  } else {
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i)
      if (p.ops[i].kind == OpKind::kRecord && p.ops[i].event == w.event) sources.push_back(base[rank] + i);
  }
  std::vector<char> seen(static_cast<size_t>(total), 0);
  std::vector<int> stack = {base[rank] + target};
  seen[stack[0]] = 1;
  while (!stack.empty()) {
    const int v = stack.back();
    stack.pop_back();
    for (int u : preds[v])
      if (!seen[u]) {
        seen[u] = 1;
        stack.push_back(u);
      }
  }
  for (int src : sources)
    if (!seen[src]) return false;
  return !sources.empty();
}

}  // namespace

TEST_CASE(unmutated_plans_pass) {
  for (const Setup& s : kSetups) {
    const std::string err = check(build(s), s);
    CHECK_MSG(err.empty(), err);
  }
}

TEST_CASE(delete_any_wait) {
  // Every wait whose ordering is not already implied must be missed when deleted. A wait that is
  // implied by others (an independent breadth-first search over the happens-before graph says
  // so) may go: the builder's drain emits a few of those when the all-gather lands in kData.
  // recv_only waits included: every reduce of these plans waits its own receive that way.
  for (const Setup& s : kSetups) {
    const std::vector<Plan> base = build(s);
    int needed = 0, redundant = 0, needed_recv_only = 0;
    for (int r = 0; r < s.n; ++r) {
      for (int i = 0; i < static_cast<int>(base[r].ops.size()); ++i) {
        if (base[r].ops[i].kind != OpKind::kWait) continue;
        const bool implied = waitIsImplied(base, r, i);
        std::vector<Plan> plans = base;
        plans[r].ops.erase(plans[r].ops.begin() + i);
        const std::string err = check(plans, s);
        if (implied) {
          ++redundant;
          CHECK_MSG(err.empty(), "deleting an implied wait was reported: " << err);
        } else {
          ++needed;
          needed_recv_only += base[r].ops[i].recv_only;
          CHECK_MSG(!err.empty(), "deleting rank " << r << " " << describeOp(base[r], i) << " went unnoticed ("
                                                   << setupText(s) << ")\n" << base[r].describe());
        }
      }
    }
    CHECK(needed > 0);
    CHECK(needed_recv_only > 0);
    std::printf("  %s: %d needed waits caught (%d recv_only), %d implied waits\n", setupText(s).c_str(), needed,
                needed_recv_only, redundant);
  }
}

TEST_CASE(weaken_any_full_wait) {
  // A full wait on an exchange event turned into a recv_only one: unless the send completion is
  // known some other way (the oracle), the op it guarded now races with the send, or the plan ends
  // with a send still in flight. The builder emits full waits only for such needs.
  for (const Setup& s : kSetups) {
    const std::vector<Plan> base = build(s);
    int needed = 0, redundant = 0, before_compute = 0;
    for (int r = 0; r < s.n; ++r) {
      const Plan& p = base[r];
      for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
        const Op& w = p.ops[i];
        if (w.kind != OpKind::kWait || !p.isExchangeEvent(w.event) || w.recv_only) continue;
        const bool implied = waitIsImplied(base, r, i, WaitCut::kWeaken);
        std::vector<Plan> plans = base;
        plans[r].ops[i].recv_only = true;
        const std::string err = check(plans, s);
        if (implied) {
          ++redundant;
          CHECK_MSG(err.empty(), "weakening an implied full wait was reported: " << err);
          continue;
        }
        ++needed;
        const int k = nextOnQueue(p, i);
        before_compute += k >= 0 && (p.ops[k].kind == OpKind::kReduce || p.ops[k].kind == OpKind::kCopy);
        CHECK_MSG(!err.empty(), "weakening rank " << r << " " << describeOp(p, i) << " to recv_only went unnoticed ("
                                                  << setupText(s) << ")\n" << p.describe());
      }
    }
    CHECK(needed > 0);
    // Not only the drain: a compute that overwrites what an exchange sent needs the full wait (the
    // copies of the all-gather over the tensor's sent segments, the float32 partials of accum mode).
    if (!s.gather) CHECK_MSG(before_compute > 0, setupText(s));
    std::printf("  %s: %d needed full waits caught when weakened (%d right before a reduce/copy), %d implied\n",
                setupText(s).c_str(), needed, before_compute, redundant);
  }
}

namespace {

// Accum mode, n >= 4: the non-final reduce of a reduce-scatter exchange at step >= 1 writes the
// kAccum segment that the same exchange sends. Its full wait weakened to recv_only lets the
// reduce overwrite the partial while the send may still be reading it.
std::vector<std::pair<int, int>> accumSelfOverwriteWaits(const std::vector<Plan>& plans) {
  std::vector<std::pair<int, int>> out;  // (rank, index of the full wait)
  for (int r = 0; r < static_cast<int>(plans.size()); ++r) {
    const Plan& p = plans[r];
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
      const Op& o = p.ops[i];
      if (o.kind != OpKind::kReduce || o.dst.buf != BufKind::kAccum) continue;
      const Op* ex = nullptr;
      for (const Op& x : p.ops)
        if (x.kind == OpKind::kExchange && x.exchange == o.exchange) ex = &x;
      if (!ex || ex->send.buf != BufKind::kAccum || ex->send.offset != o.dst.offset) continue;
      for (int k = i - 1; k >= 0 && p.ops[k].queue == Queue::kCompute; --k)
        if (p.ops[k].kind == OpKind::kWait && p.ops[k].event == Plan::exchangeEvent(o.exchange) &&
            !p.ops[k].recv_only)
          out.push_back({r, k});
    }
  }
  return out;
}

}  // namespace

TEST_CASE(weaken_the_accum_self_overwrite_wait) {
  for (const Setup& s : {Setup{4, 100, DType::kFloat16, 2, 16, true, false, true},
                         Setup{5, 77, DType::kBFloat16, 3, 16, true, true, false}}) {
    const std::vector<Plan> base = build(s);
    const auto waits = accumSelfOverwriteWaits(base);
    CHECK_MSG(!waits.empty(), setupText(s) << ": no reduce waits its own exchange in full\n" << base[0].describe());
    for (const auto& [r, i] : waits) {
      std::vector<Plan> plans = base;
      plans[r].ops[i].recv_only = true;
      const std::string err = check(plans, s);
      CHECK_MSG(err.find("data race") != std::string::npos && err.find("accum") != std::string::npos,
                "weakening rank " << r << " " << describeOp(base[r], i) << " (" << setupText(s) << "): " << err);
      // The value simulations alone (the CPU list walk, where the send may complete after the
      // receive) see the overwritten partial arrive at the next rank.
      CheckOptions co;
      co.average = s.avg;
      co.seed = 17;
      co.trials = 40;
      co.happens_before = false;
      const std::string sim = checkPlanSet(plans, co);
      CHECK_MSG(sim.find("list-walk") != std::string::npos,
                "the simulation missed rank " << r << " " << describeOp(base[r], i) << " (" << setupText(s)
                                              << "): " << sim);
    }
  }
}

TEST_CASE(recv_only_only_on_exchange_waits) {
  const Setup s{3, 50, DType::kFloat32, 2, 16, false, false, true};
  const std::vector<Plan> base = build(s);
  int tried = 0;
  for (int i = 0; i < static_cast<int>(base[1].ops.size()); ++i) {
    const Op& o = base[1].ops[i];
    if (o.kind == OpKind::kWait && base[1].isExchangeEvent(o.event)) continue;
    std::vector<Plan> plans = base;
    plans[1].ops[i].recv_only = true;
    const std::string err = check(plans, s);
    ++tried;
    CHECK_MSG(err.find("recv_only is only meaningful") != std::string::npos, describeOp(base[1], i) << ": " << err);
  }
  CHECK(tried > 0);
}

TEST_CASE(swap_wait_with_the_op_it_guards) {
  // Move the op that follows a wait on its queue ahead of the wait.
  for (const Setup& s : kSetups) {
    const int tried = mutateAll(s, "swapping a wait with the op after it", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kWait) return false;
      const int k = nextOnQueue(p, i);
      if (k < 0 || p.ops[k].kind == OpKind::kWait || p.ops[k].kind == OpKind::kRecord) return false;
      std::swap(p.ops[i], p.ops[k]);
      return true;
    });
    CHECK(tried > 0);
  }
}

TEST_CASE(swap_exchange_with_its_record_or_next_exchange) {
  for (const Setup& s : kSetups) {
    mutateAll(s, "recording an exchange event before the exchange", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kExchange) return false;
      const int k = nextOnQueue(p, i);
      if (k < 0 || p.ops[k].kind != OpKind::kRecord || !eventWaited(p, p.ops[k].event)) return false;
      std::swap(p.ops[i], p.ops[k]);
      return true;
    });
    mutateAll(s, "swapping two exchanges (message order)", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kExchange) return false;
      for (int k = i + 1; k < static_cast<int>(p.ops.size()); ++k) {
        if (p.ops[k].kind != OpKind::kExchange) continue;
        std::swap(p.ops[i], p.ops[k]);
        return true;
      }
      return false;
    });
  }
}

TEST_CASE(change_a_slot_index) {
  for (const Setup& s : kSetups) {
    if (s.slots < 2) continue;
    mutateAll(s, "changing an exchange's receive slot", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kExchange || o.recv.buf != BufKind::kStaging) return false;
      o.recv.slot = (o.recv.slot + 1) % p.num_slots;
      return true;
    });
    mutateAll(s, "changing a reduce/copy's source slot", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if ((o.kind != OpKind::kReduce && o.kind != OpKind::kCopy) || o.recv.buf != BufKind::kStaging) return false;
      o.recv.slot = (o.recv.slot + 1) % p.num_slots;
      return true;
    });
  }
}

TEST_CASE(change_a_byte_count) {
  for (const Setup& s : kSetups) {
    mutateAll(s, "shrinking a send", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kExchange || o.send.count < 1) return false;
      o.send.count -= 1;
      return true;
    });
    mutateAll(s, "shrinking a receive", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kExchange || o.recv.count < 1) return false;
      o.recv.count -= 1;
      return true;
    });
    mutateAll(s, "shrinking a reduce/copy", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kReduce && o.kind != OpKind::kCopy) return false;
      if (o.dst.count < 2) return false;
      o.dst.count -= 1;
      o.recv.count -= 1;
      o.a.count = o.kind == OpKind::kReduce ? o.a.count - 1 : o.a.count;
      return true;
    });
    mutateAll(s, "sending partials as the tensor's elements", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kExchange || o.send.empty() || o.send.type == p.dtype) return false;
      o.send.type = p.dtype;
      o.send.buf = BufKind::kData;
      return true;
    });
  }
}

TEST_CASE(shift_an_offset) {
  for (const Setup& s : kSetups) {
    mutateAll(s, "shifting a reduce's destination", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kReduce || o.dst.buf != BufKind::kData || o.dst.offset == 0) return false;
      o.dst.offset -= 1;
      return true;
    });
    mutateAll(s, "shifting a send's source", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kExchange || o.send.buf != BufKind::kData || o.send.offset == 0) return false;
      o.send.offset -= 1;
      return true;
    });
  }
}

TEST_CASE(drop_any_op) {
  // Records nobody waits on are the only non-wait ops whose loss is harmless.
  for (const Setup& s : kSetups) {
    const int tried = mutateAll(s, "dropping an op", [](Plan& p, int i) {
      if (p.ops[i].kind == OpKind::kWait) return false;  // delete_any_wait
      if (p.ops[i].kind == OpKind::kRecord && !eventWaited(p, p.ops[i].event)) return false;
      p.ops.erase(p.ops.begin() + i);
      return true;
    });
    CHECK(tried > 0);
  }
}

TEST_CASE(final_flag_and_average) {
  for (const Setup& s : kSetups) {
    if (!s.avg) continue;
    mutateAll(s, "clearing AVG's final divide", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kReduce || !o.final) return false;
      o.final = false;
      return true;
    });
    mutateAll(s, "dividing at a non-final reduce", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kReduce || o.final) return false;
      o.final = true;
      return true;
    });
  }
}

TEST_CASE(first_hop_converts) {
  // Note [First hop] (plan.h): the convert must exist, write what the exchange sends, in the wire's
  // type, and divide each contribution exactly once.
  int tried = 0;
  for (const Setup& s : kSetups) {
    if (s.wire < 0 && s.pre <= 0) continue;
    tried += mutateAll(s, "dropping a convert", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kConvert) return false;
      p.ops.erase(p.ops.begin() + i);
      return true;
    });
    mutateAll(s, "a convert that keeps the tensor's type", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kConvert || o.dst.buf != BufKind::kAccum) return false;
      o.dst.type = p.dtype;
      return true;
    });
    mutateAll(s, "a convert into the wrong accumulator segment", [](Plan& p, int i) {
      Op& o = p.ops[i];
      if (o.kind != OpKind::kConvert || o.dst.buf != BufKind::kAccum || o.dst.offset == 0) return false;
      o.dst.offset = 0;
      return true;
    });
    mutateAll(s, "a plan that forgets its predivide factor", [&](Plan& p, int i) {
      if (i != 0 || p.pre_factor <= 0) return false;
      p.pre_factor = 0;
      return true;
    });
  }
  CHECK(tried > 0);
  // A predivide plan whose convert runs twice on one segment divides a contribution twice.
  const Setup s{4, 61, DType::kFloat32, 2, 16, false, false, true, -1, 2.0};
  const std::vector<Plan> base = build(s);
  for (int i = 0; i < static_cast<int>(base[1].ops.size()); ++i) {
    if (base[1].ops[i].kind != OpKind::kConvert) continue;
    std::vector<Plan> plans = base;
    plans[1].ops.insert(plans[1].ops.begin() + i, base[1].ops[i]);
    const std::string err = check(plans, s);
    CHECK_MSG(err.find("predivided") != std::string::npos || err.find("raw") != std::string::npos,
              "a repeated convert: " << err);
    break;
  }
}

TEST_CASE(move_a_wait_later) {
  // A wait moved after the op it guards, by one position in the list (the CPU executor's order).
  for (const Setup& s : kSetups) {
    mutateAll(s, "moving a wait behind the next op of its queue", [](Plan& p, int i) {
      if (p.ops[i].kind != OpKind::kWait) return false;
      const int k = nextOnQueue(p, i);
      if (k < 0 || p.ops[k].kind == OpKind::kWait || p.ops[k].kind == OpKind::kRecord) return false;
      const Op w = p.ops[i];
      p.ops.erase(p.ops.begin() + i);
      p.ops.insert(p.ops.begin() + k, w);  // k shifted down by one: lands right after the guarded op
      return true;
    });
  }
}

TEST_CASE(hand_made_failures_are_described) {
  // Specific messages for specific faults.
  const Setup s{3, 50, DType::kFloat32, 2, 16, false, false, true};
  {
    std::vector<Plan> plans = build(s);
    // Rank 1's first receive expects one element less than rank 0 sends.
    for (Op& o : plans[1].ops) {
      if (o.kind == OpKind::kExchange && o.recv.count > 1) {
        o.recv.count -= 1;
        break;
      }
    }
    const std::string err = check(plans, s);
    CHECK_MSG(err.find("send/recv mismatch") != std::string::npos, err);
  }
  {
    // Reuse one slot for everything: slot index changes on every receive and its reduce.
    std::vector<Plan> plans = build(s);
    for (Op& o : plans[2].ops) {
      if (o.recv.buf == BufKind::kStaging) o.recv.slot = 0;
    }
    const std::string err = check(plans, s);
    CHECK_MSG(err.find("staging slot 0 reused") != std::string::npos || err.find("data race") != std::string::npos, err);
  }
  {
    std::vector<Plan> plans = build(s);
    for (size_t i = 0; i < plans[0].ops.size(); ++i) {
      if (plans[0].ops[i].kind == OpKind::kReduce) {
        plans[0].ops.erase(plans[0].ops.begin() + static_cast<long>(i));
        break;
      }
    }
    const std::string err = check(plans, s);
    CHECK_MSG(!err.empty(), "dropped reduce");
  }
  {
    // A send with no receive at all on the peer.
    std::vector<Plan> plans = build(s);
    for (Op& o : plans[1].ops) {
      if (o.kind == OpKind::kExchange && !o.recv.empty()) {
        o.recv.count = 0;
        break;
      }
    }
    const std::string err = check(plans, s);
    CHECK_MSG(err.find("send/recv mismatch") != std::string::npos, err);
  }
}

TEST_MAIN()
