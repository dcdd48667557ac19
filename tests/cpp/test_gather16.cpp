// Note [16-bit all-gather] (plan.h): a 16-bit wire whose all-gather moves 16 bits too. The plans'
// shape (what each all-gather exchange sends and receives), the plan checker on many shapes (it must
// accept them) and on broken ones (it must reject them), and the CPU executor on exact data: the
// result is the float32 all-gather's result rounded once to the wire type, on every rank the same bits.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "core/functors.h"
#include "core/plan.h"
#include "support/inproc_transport.h"
#include "support/plan_checker.h"

using namespace rr;

namespace {

constexpr DType kWires[] = {DType::kBFloat16, DType::kFloat16};

PlanOptions options16(DType wire, int slots, int64_t seg, bool avg, double pre = 0) {
  PlanOptions o;
  o.wire_dtype = wire;
  o.wire_gather16 = true;
  o.num_slots = slots;
  o.max_segment_bytes = seg;
  o.average = avg;
  o.pre_factor = o.post_factor = pre;
  return o;
}

std::vector<Plan> buildAll(int n, int64_t numel, const PlanOptions& o) {
  std::vector<Plan> plans;
  for (int r = 0; r < n; ++r) plans.push_back(buildPlan(n, r, numel, DType::kFloat32, o));
  return plans;
}

CheckOptions checkOptions(bool avg) {
  CheckOptions co;
  co.average = avg;
  co.trials = 2;
  return co;
}

float widenBits(DType wire, uint16_t bits) { return wire == DType::kBFloat16 ? bf16BitsToFloat(bits) : halfBitsToFloat(bits); }
float roundWire(DType wire, float v) {
  return wire == DType::kBFloat16 ? bf16BitsToFloat(floatToBf16Bits(v)) : halfBitsToFloat(floatToHalfBits(v));
}

}  // namespace

TEST_CASE(all_gather_moves_the_wire_type) {
  for (DType wire : kWires) {
    for (int n : {2, 3, 5}) {
      for (int slots : {1, 2, 4, kAutoSlots}) {
        const PlanOptions o = options16(wire, slots, 64, true);
        const Plan p = buildPlan(n, 1 % n, 1000, DType::kFloat32, o);
        CHECK(p.gather16 && p.wire16);
        int converts = 0;
        for (const Op& op : p.ops) {
          if (op.kind == OpKind::kConvert && p.exchanges[op.exchange].phase == Phase::kAllGather) ++converts;
          if (op.kind != OpKind::kExchange || p.exchanges[op.exchange].phase != Phase::kAllGather) continue;
          // Every all-gather send reads 16 bits from kAccum; every receive lands 16 bits in staging.
          if (!op.send.empty()) CHECK(op.send.type == wire && op.send.buf == BufKind::kAccum);
          if (!op.recv.empty()) CHECK(op.recv.type == wire && op.recv.buf == BufKind::kStaging);
        }
        CHECK(converts >= 1);  // the owner's rounded segments, and the forwarded ones
        // The final reduce rounds through the wire type; without the option nothing does.
        CHECK_EQ(p.finalScaling(RedOp::kAvg).wire_round, static_cast<int32_t>(wire));
        PlanOptions plain = o;
        plain.wire_gather16 = false;
        CHECK_EQ(buildPlan(n, 0, 1000, DType::kFloat32, plain).finalScaling(RedOp::kAvg).wire_round, -1);
      }
    }
  }
  // Only a full ring with a 16-bit wire: halves and plain float32 plans ignore the option.
  PlanOptions half = options16(DType::kBFloat16, 2, 64, false);
  half.phases = kPhaseAllGather;
  CHECK(!buildPlan(3, 0, 300, DType::kFloat32, half).gather16);
  PlanOptions nowire = options16(DType::kBFloat16, 2, 64, false);
  nowire.wire_dtype.reset();
  CHECK(!buildPlan(3, 0, 300, DType::kFloat32, nowire).gather16);
  // The GPU's direct all-gather cannot forward from staging: refused.
  PlanOptions direct = options16(DType::kBFloat16, 2, 64, false);
  direct.gather_into_data = true;
  bool threw = false;
  try {
    buildPlan(3, 0, 300, DType::kFloat32, direct);
  } catch (const Error& e) {
    threw = e.kind() == ErrorKind::kValue;
  }
  CHECK(threw);
}

TEST_CASE(checker_accepts_sixteen_bit_all_gathers) {
  int k = 0;
  for (int n : {2, 3, 4, 5}) {
    for (int64_t numel : {int64_t(1), int64_t(3), int64_t(37), int64_t(100), int64_t(257)}) {
      for (int slots : {1, 2, 3, 4, kAutoSlots}) {
        ++k;
        if (rrtest::kSanitized && k % 3) continue;
        const DType wire = kWires[k % 2];
        const bool avg = k % 3 != 0;
        const double pre = k % 5 == 0 ? 2.0 : 0.0;
        const int64_t seg = k % 2 ? 16 : 64;
        const PlanOptions o = options16(wire, slots, seg, avg, pre);
        const std::string err = checkPlans(n, numel, DType::kFloat32, o, 11 + static_cast<uint64_t>(k), 2);
        CHECK_MSG(err.empty(), "n=" << n << " numel=" << numel << " slots=" << slots << " seg=" << seg << ": " << err);
      }
    }
  }
}

TEST_CASE(checker_rejects_broken_sixteen_bit_all_gathers) {
  const int n = 3;
  const int64_t numel = 100;
  const PlanOptions o = options16(DType::kBFloat16, 3, 16, true);
  CHECK(checkPlanSet(buildAll(n, numel, o), checkOptions(true)).empty());
  // 1. A forwarding convert that reads another slot than the one the segment was received into.
  {
    std::vector<Plan> plans = buildAll(n, numel, o);
    bool changed = false;
    for (Op& op : plans[1].ops)
      if (!changed && op.kind == OpKind::kConvert && op.a.buf == BufKind::kStaging) {
        op.a.slot = (op.a.slot + 1) % plans[1].num_slots;
        changed = true;
      }
    CHECK(changed);
    CHECK(!checkPlanSet(plans, checkOptions(true)).empty());
  }
  // 2. kAccum overwritten while the previous step's send may still read it: the full wait that
  //    orders a forwarding convert after that send made recv_only.
  {
    std::vector<Plan> plans = buildAll(n, numel, o);
    int weakened = 0;
    const std::vector<Op> ops = plans[0].ops;
    for (size_t i = 0; i + 1 < ops.size(); ++i) {
      if (ops[i].kind != OpKind::kWait || ops[i].queue != Queue::kCompute || ops[i].recv_only ||
          !plans[0].isExchangeEvent(ops[i].event) || plans[0].exchanges[ops[i].event / 2].phase != Phase::kAllGather)
        continue;
      size_t k = i + 1;
      while (k < ops.size() && ops[k].kind == OpKind::kWait) ++k;
      if (k < ops.size() && ops[k].kind == OpKind::kConvert && ops[k].a.buf == BufKind::kStaging) {
        plans[0].ops[i].recv_only = true;
        ++weakened;
      }
    }
    CHECK(weakened > 0);
    CHECK(!checkPlanSet(plans, checkOptions(true)).empty());
  }
  // 3. One rank's plan without the 16-bit all-gather (it would send float32 and never round).
  {
    std::vector<Plan> plans = buildAll(n, numel, o);
    PlanOptions plain = o;
    plain.wire_gather16 = false;
    plans[2] = buildPlan(n, 2, numel, DType::kFloat32, plain);
    CHECK(!checkPlanSet(plans, checkOptions(true)).empty());
  }
  // 4. A widening copy that reads the slot as float32 (a copy of the wrong width).
  {
    std::vector<Plan> plans = buildAll(n, numel, o);
    bool changed = false;
    for (Op& op : plans[1].ops)
      if (!changed && op.kind == OpKind::kCopy) {
        op.recv.type = DType::kFloat32;
        changed = true;
      }
    CHECK(changed);
    CHECK(!checkPlanSet(plans, checkOptions(true)).empty());
  }
  // 5. The all-gather's first send taken from the tensor before the owner's final reduce rounded it:
  //    the convert moved to before its waits (swap it with the op before it while that is a wait).
  {
    std::vector<Plan> plans = buildAll(n, numel, o);
    std::vector<Op>& ops = plans[0].ops;
    bool moved = false;
    for (size_t i = 0; i < ops.size() && !moved; ++i) {
      if (ops[i].kind != OpKind::kConvert || plans[0].exchanges[ops[i].exchange].phase != Phase::kAllGather) continue;
      size_t at = i;
      while (at > 0 && ops[at - 1].queue == Queue::kCompute &&
             (ops[at - 1].kind == OpKind::kWait || ops[at - 1].kind == OpKind::kReduce ||
              ops[at - 1].kind == OpKind::kRecord)) {
        std::swap(ops[at - 1], ops[at]);
        --at;
        moved = true;
      }
    }
    CHECK(moved);
    CHECK(!checkPlanSet(plans, checkOptions(true)).empty());
  }
}

TEST_CASE(executor_rounds_once_and_every_rank_gets_the_same_bits) {
  // Random float32 data; the same call with a float32 all-gather is the reference: with a 16-bit
  // all-gather every element must be that result rounded once to the wire type, on every rank.
  int k = 0;
  for (DType wire : kWires) {
    for (int n : {2, 3, 4}) {
      for (RedOp op : {RedOp::kSum, RedOp::kAvg}) {
        ++k;
        const int64_t numel = 61 + 97 * (k % 3);
        std::vector<std::vector<uint8_t>> data(static_cast<size_t>(n), std::vector<uint8_t>(numel * 4));
        uint64_t h = 0x12345u + static_cast<uint64_t>(k);
        for (int r = 0; r < n; ++r)
          for (int64_t i = 0; i < numel; ++i) {
            h = h * 6364136223846793005ull + 1442695040888963407ull;
            const float v = static_cast<float>(static_cast<int64_t>(h >> 40) - (int64_t(1) << 23)) / 1048576.0f;
            std::memcpy(data[r].data() + 4 * i, &v, 4);
          }
        std::vector<std::vector<uint8_t>> ref = data;
        InprocRunOptions o;
        o.plan.wire_dtype = wire;
        o.plan.max_segment_bytes = k % 2 ? 16 : 64;
        o.plan.num_slots = 1 + k % 4;
        o.plan.pre_factor = o.plan.post_factor = k % 3 == 0 ? 2.0 : 0.0;
        o.transport.timeout = std::chrono::milliseconds(20000);
        o.transport.max_delay_us = k % 2 ? 50 : 0;
        o.transport.seed = static_cast<uint64_t>(k);
        std::vector<InprocRankResult> res = runInprocAllReduce(n, numel, DType::kFloat32, op, ref, o);
        for (int r = 0; r < n; ++r) CHECK_MSG(res[r].error.empty(), res[r].error);
        o.plan.wire_gather16 = true;
        res = runInprocAllReduce(n, numel, DType::kFloat32, op, data, o);
        for (int r = 0; r < n; ++r) CHECK_MSG(res[r].error.empty(), res[r].error);
        int bad = 0;
        for (int64_t i = 0; i < numel && bad == 0; ++i) {
          float want, got;
          std::memcpy(&want, ref[0].data() + 4 * i, 4);
          std::memcpy(&got, data[0].data() + 4 * i, 4);
          const float rounded = roundWire(wire, want);
          if (std::memcmp(&got, &rounded, 4) != 0) {
            ++bad;
            CHECK_MSG(false, "n=" << n << " " << dtypeName(wire) << " " << redOpName(op) << " element " << i
                                  << ": got " << got << ", want round(" << want << ") = " << rounded);
          }
        }
        for (int r = 1; r < n; ++r) CHECK_MSG(data[r] == data[0], "n=" << n << ": ranks differ");
        for (int r = 0; r < n; ++r) CHECK_MSG(ref[r] == ref[0], "n=" << n << ": float32-gather ranks differ");
      }
    }
  }
  // Hand-made: on two ranks chunk 1 is rank 1's 0 + rank 0's 1 + 2^-10 (rank 0's value last, added
  // in float32 by the owner): 1 + 2^-10 with a float32 all-gather, 1 (its bfloat16 rounding) here.
  {
    const int64_t numel = 64;
    std::vector<std::vector<uint8_t>> data(2, std::vector<uint8_t>(numel * 4, 0));
    const float x = 1.0f + std::ldexp(1.0f, -10);
    for (int64_t i = 0; i < numel; ++i) std::memcpy(data[0].data() + 4 * i, &x, 4);
    InprocRunOptions o;
    o.plan.wire_dtype = DType::kBFloat16;
    o.plan.wire_gather16 = true;
    o.plan.max_segment_bytes = 32;
    o.plan.num_slots = 2;
    o.transport.timeout = std::chrono::milliseconds(20000);
    const std::vector<InprocRankResult> res = runInprocAllReduce(2, numel, DType::kFloat32, RedOp::kSum, data, o);
    for (int r = 0; r < 2; ++r) CHECK_MSG(res[r].error.empty(), res[r].error);
    for (int r = 0; r < 2; ++r)
      for (int64_t i = 0; i < numel; ++i) {
        float got;
        std::memcpy(&got, data[r].data() + 4 * i, 4);
        CHECK_MSG(got == 1.0f, "rank " << r << " element " << i << ": " << got);
      }
    CHECK_EQ(widenBits(DType::kBFloat16, floatToBf16Bits(x)), 1.0f);
  }
}

TEST_MAIN()
