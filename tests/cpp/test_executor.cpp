// The CPU executor + host reduce loops over the in-process transport, without torch: exact,
// position-dependent data for n = 1..6, awkward counts, every dtype and op, tiny segments, 1..4
// staging slots; results equal a double/wrapping reference bit for bit and agree across ranks.
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "check.h"
#include "core/call_tags.h"
#include "core/error.h"
#include "core/functors.h"
#include "support/inproc_transport.h"

using namespace rr;

namespace {

const DType kDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                         DType::kInt8,    DType::kInt16,   DType::kInt32,   DType::kInt64,
                         DType::kUInt8,   DType::kBool,    DType::kComplex64, DType::kComplex128};
const RedOp kOps[] = {RedOp::kSum, RedOp::kAvg, RedOp::kMax, RedOp::kMin, RedOp::kProduct};

uint64_t hashPos(int r, int64_t i) {
  uint64_t x = static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(r) * 0xc2b2ae3d27d4eb4full;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 32);
}

// Floating values exact in every float type for sums of <= 6 terms (|sum| <= 24, step 0.5) and
// products (powers of two).
double floatValue(RedOp op, int r, int64_t i, int component) {
  const uint64_t h = hashPos(r + 17 * component, i);
  if (op == RedOp::kProduct) {
    static const double kPow[] = {1.0, 2.0, -1.0, 0.5, -2.0, 1.0, -0.5, 4.0};
    return kPow[h % 8];
  }
  return (static_cast<double>(h % 17) - 8.0) * 0.5;
}

// ---- Reading and writing one element as double / integer.
double getF(DType t, const uint8_t* p, int64_t i, int comp = 0) {
  switch (t) {
    case DType::kFloat32: { float v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case DType::kFloat64: { double v; std::memcpy(&v, p + 8 * i, 8); return v; }
    case DType::kFloat16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return halfBitsToFloat(v); }
    case DType::kBFloat16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return bf16BitsToFloat(v); }
    case DType::kComplex64: { float v; std::memcpy(&v, p + 8 * i + 4 * comp, 4); return v; }
    case DType::kComplex128: { double v; std::memcpy(&v, p + 16 * i + 8 * comp, 8); return v; }
    default: return 0;
  }
}
void setF(DType t, uint8_t* p, int64_t i, double d, int comp = 0) {
  switch (t) {
    case DType::kFloat32: { float v = static_cast<float>(d); std::memcpy(p + 4 * i, &v, 4); break; }
    case DType::kFloat64: std::memcpy(p + 8 * i, &d, 8); break;
    case DType::kFloat16: { uint16_t v = floatToHalfBits(static_cast<float>(d)); std::memcpy(p + 2 * i, &v, 2); break; }
    case DType::kBFloat16: { uint16_t v = floatToBf16Bits(static_cast<float>(d)); std::memcpy(p + 2 * i, &v, 2); break; }
    case DType::kComplex64: { float v = static_cast<float>(d); std::memcpy(p + 8 * i + 4 * comp, &v, 4); break; }
    case DType::kComplex128: std::memcpy(p + 16 * i + 8 * comp, &d, 8); break;
    default: break;
  }
}
int64_t getI(DType t, const uint8_t* p, int64_t i) {
  switch (t) {
    case DType::kInt8: return static_cast<int8_t>(p[i]);
    case DType::kUInt8: return p[i];
    case DType::kBool: return p[i] != 0;
    case DType::kInt16: { int16_t v; std::memcpy(&v, p + 2 * i, 2); return v; }
    case DType::kInt32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case DType::kInt64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); return v; }
    default: return 0;
  }
}
void setI(DType t, uint8_t* p, int64_t i, uint64_t v) {  // truncating (two's complement) store
  switch (t) {
    case DType::kInt8: case DType::kUInt8: p[i] = static_cast<uint8_t>(v); break;
    case DType::kBool: p[i] = v != 0; break;
    case DType::kInt16: { uint16_t x = static_cast<uint16_t>(v); std::memcpy(p + 2 * i, &x, 2); break; }
    case DType::kInt32: { uint32_t x = static_cast<uint32_t>(v); std::memcpy(p + 4 * i, &x, 4); break; }
    case DType::kInt64: std::memcpy(p + 8 * i, &v, 8); break;
    default: break;
  }
}

struct Inputs {
  std::vector<std::vector<uint8_t>> data;
  std::vector<uint8_t> want;
};

double roundStore(DType t, double v) {  // the value a store of v into t keeps
  uint8_t buf[16];
  setF(t, buf, 0, v);
  return getF(t, buf, 0);
}

Inputs makeInputs(int n, int64_t numel, DType t, RedOp op) {
  Inputs in;
  const size_t es = dtypeSize(t);
  in.data.assign(static_cast<size_t>(n), std::vector<uint8_t>(static_cast<size_t>(numel) * es));
  in.want.assign(static_cast<size_t>(numel) * es, 0);
  const bool cplx = isComplexType(t);
  if (isFloatingType(t) || cplx) {
    for (int comp = 0; comp < (cplx ? 2 : 1); ++comp) {
      const DType part = t == DType::kComplex64 ? DType::kComplex64 : t;
      for (int64_t i = 0; i < numel; ++i) {
        double acc = 0;
        for (int r = 0; r < n; ++r) {
          const double v = floatValue(op, r, i, comp);
          setF(part, in.data[r].data(), i, v, comp);
          if (r == 0) acc = v;
          else if (op == RedOp::kProduct) acc *= v;
          else if (op == RedOp::kMax) acc = std::max(acc, v);
          else if (op == RedOp::kMin) acc = std::min(acc, v);
          else acc += v;
        }
        if (op == RedOp::kAvg && n > 1) {
          // sum / n in float32 for half types and float32 (complex64 too), float64 otherwise.
          const bool narrow = t == DType::kFloat32 || isHalfType(t) || t == DType::kComplex64;
          acc = narrow ? static_cast<double>(static_cast<float>(acc) / static_cast<float>(n)) : acc / n;
        }
        setF(part, in.want.data(), i, acc, comp);
      }
    }
    return in;
  }
  const int bits = static_cast<int>(8 * es);
  for (int64_t i = 0; i < numel; ++i) {
    uint64_t acc = 0;
    int64_t mx = 0, mn = 0;
    for (int r = 0; r < n; ++r) {
      const uint64_t h = hashPos(r, i);
      uint64_t raw = t == DType::kBool ? (h % 3 == 0) : (bits == 64 ? h : h % (1ull << bits));
      setI(t, in.data[r].data(), i, raw);
      const int64_t v = getI(t, in.data[r].data(), i);
      const uint64_t uv = static_cast<uint64_t>(v);
      if (r == 0) {
        acc = uv;
        mx = mn = v;
      } else {
        acc = op == RedOp::kProduct ? acc * uv : acc + uv;
        mx = std::max(mx, v);
        mn = std::min(mn, v);
      }
    }
    uint64_t w = acc;
    if (op == RedOp::kMax) w = static_cast<uint64_t>(mx);
    if (op == RedOp::kMin) w = static_cast<uint64_t>(mn);
    if (t == DType::kBool) {
      // SUM/MAX = or, MIN/PRODUCT = and.
      bool any = false, all = true;
      for (int r = 0; r < n; ++r) {
        any = any || in.data[r][static_cast<size_t>(i)];
        all = all && in.data[r][static_cast<size_t>(i)];
      }
      w = (op == RedOp::kMin || op == RedOp::kProduct) ? all : any;
    }
    setI(t, in.want.data(), i, w);
  }
  return in;
}

struct Case {
  int n;
  int64_t numel;
  DType dtype;
  RedOp op;
  int slots;
  int64_t seg;
  bool accum = false;
  int64_t delay_us = 0;
  bool eager = false;
  int64_t lead_room = 0;  // > 0: PlanRun::postLeading(lead_room, lead_max_send) first
  int64_t lead_max_send = 0;
  int wire = -1;          // a 16-bit wire's DType code (Note [First hop] in plan.h), -1: none
  double pre = 0;         // predivide factor (pre and post), 0: none
};

std::string caseText(const Case& c) {
  return detail::concat("n=", c.n, " numel=", c.numel, " ", dtypeName(c.dtype), " ", redOpName(c.op), " slots=", c.slots,
                        " seg=", c.seg, c.accum ? " accum" : "", c.delay_us ? " delayed" : "", c.eager ? " eager" : "",
                        c.lead_room ? detail::concat(" lead_room=", c.lead_room, " lead_max_send=", c.lead_max_send) : "",
                        c.wire >= 0 ? detail::concat(" wire=", dtypeName(static_cast<DType>(c.wire))) : "",
                        c.pre > 0 ? detail::concat(" pre=", c.pre) : "");
}

void runCase(const Case& c, const Inputs* given = nullptr) {
  Inputs in = given ? *given : makeInputs(c.n, c.numel, c.dtype, c.op);
  InprocRunOptions o;
  o.plan.num_slots = c.slots;
  o.plan.max_segment_bytes = c.seg;
  o.plan.accum_float32 = c.accum;
  if (c.wire >= 0) o.plan.wire_dtype = static_cast<DType>(c.wire);
  o.plan.pre_factor = o.plan.post_factor = c.pre;
  o.transport.timeout = std::chrono::milliseconds(20000);
  o.transport.max_delay_us = c.delay_us;
  o.transport.eager = c.eager;
  o.transport.short_messages = c.lead_room > 0;
  o.lead_room = c.lead_room;
  o.lead_max_send = c.lead_max_send;
  o.transport.seed = static_cast<uint64_t>(c.numel * 31 + c.n);
  const std::vector<InprocRankResult> res = runInprocAllReduce(c.n, c.numel, c.dtype, c.op, in.data, o);
  for (int r = 0; r < c.n; ++r) CHECK_MSG(res[r].error.empty(), caseText(c) << " rank " << r << ": " << res[r].error);
  const size_t es = dtypeSize(c.dtype);
  for (int r = 0; r < c.n; ++r) {
    if (in.data[r] == in.want) continue;
    size_t k = 0;
    while (k < in.want.size() && in.data[r][k] == in.want[k]) ++k;
    const int64_t i = static_cast<int64_t>(k / es);
    CHECK_MSG(false, caseText(c) << ": rank " << r << " element " << i << " differs from the reference (got "
                                 << (isIntegralType(c.dtype) ? getI(c.dtype, in.data[r].data(), i)
                                                             : getF(c.dtype, in.data[r].data(), i))
                                 << ", want "
                                 << (isIntegralType(c.dtype) ? getI(c.dtype, in.want.data(), i)
                                                             : getF(c.dtype, in.want.data(), i))
                                 << ")");
    return;
  }
  for (int r = 1; r < c.n; ++r) CHECK_MSG(in.data[r] == in.data[0], caseText(c) << ": ranks differ");
}

}  // namespace

TEST_CASE(every_dtype_and_op_small_rings) {
  int k = 0;
  for (int n = 1; n <= 6; ++n) {
    const int64_t counts[] = {0, 1, n > 1 ? n - 1 : 2, n + 1, 37, 263};
    for (int64_t numel : counts) {
      for (DType t : kDTypes) {
        for (RedOp op : kOps) {
          if (unsupportedReason(t, op)) continue;
          ++k;
          const int slots = 1 + k % 4;
          const int64_t seg = (k % 3 == 0) ? 16 : (k % 3 == 1 ? 32 : 1 << 20);
          runCase({n, numel, t, op, slots, seg, false, 0});
          if (isHalfType(t) && (op == RedOp::kSum || op == RedOp::kAvg))
            runCase({n, numel, t, op, slots, seg, true, 0});
        }
      }
    }
  }
}

TEST_CASE(larger_counts_and_every_slot_count) {
  for (int slots = kAutoSlots; slots <= 4; ++slots) {
    runCase({4, 4099, DType::kFloat32, RedOp::kAvg, slots, 64});
    runCase({3, 1021, DType::kBFloat16, RedOp::kSum, slots, 16, true});
    runCase({5, 2053, DType::kInt8, RedOp::kProduct, slots, 48});
    runCase({6, 997, DType::kComplex128, RedOp::kAvg, slots, 256});
  }
  runCase({3, (1 << 18) + 3, DType::kFloat16, RedOp::kAvg, 4, 1 << 20, true});
  runCase({2, (1 << 20) + 3, DType::kFloat32, RedOp::kSum, 4, 1 << 20});
}

TEST_CASE(random_delivery_delays) {
  for (int n : {2, 3, 5}) {
    runCase({n, 300, DType::kFloat32, RedOp::kSum, 2, 16, false, 200});
    runCase({n, 300, DType::kFloat16, RedOp::kAvg, 3, 32, true, 200});
    runCase({n, 300, DType::kInt16, RedOp::kMax, 1, 16, false, 200});
  }
}

TEST_CASE(eager_delivery) {
  // Every message lands the moment both sides have posted it: a receive the executor posts early
  // (Note [Receives posted early]) into a staging slot that is still being read corrupts the result.
  // Small segments and few slots make every slot serve many exchanges.
  for (int n : {2, 3, 4, 5}) {
    for (int slots = kAutoSlots; slots <= 5; ++slots) {  // kAutoSlots: every receive posted at the start
      runCase({n, 997, DType::kFloat32, RedOp::kSum, slots, 16, false, 0, true});
      runCase({n, 1500, DType::kFloat16, RedOp::kAvg, slots, 32, true, 0, true});
      runCase({n, 613, DType::kInt32, RedOp::kMax, slots, 64, false, 0, true});
    }
  }
}

TEST_CASE(fp16_overflows_and_accum_rounds_once) {
  // fp16 SUM overflows to inf where the exact sum exceeds 65504 (documented); a pre-divide would not.
  {
    const int n = 3;
    const int64_t numel = 50;
    Inputs in;
    in.data.assign(n, std::vector<uint8_t>(numel * 2));
    in.want.assign(numel * 2, 0);
    for (int64_t i = 0; i < numel; ++i) {
      for (int r = 0; r < n; ++r) setF(DType::kFloat16, in.data[r].data(), i, 30000.0);
      setF(DType::kFloat16, in.want.data(), i, std::numeric_limits<double>::infinity());
    }
    runCase({n, numel, DType::kFloat16, RedOp::kSum, 2, 16}, &in);
    // AVG of the same: (inf) / 3 = inf, since AVG is SUM followed by one division.
    runCase({n, numel, DType::kFloat16, RedOp::kAvg, 2, 16}, &in);
  }
  // With float32 partials, 0.5-steps below the half resolution survive until the single final
  // rounding: 2048 + 3 * 0.5 = 2049.5 rounds to 2050, independent of the position in the ring.
  {
    const int n = 4;
    const int64_t numel = 77;
    Inputs in;
    in.data.assign(n, std::vector<uint8_t>(numel * 2));
    in.want.assign(numel * 2, 0);
    for (int64_t i = 0; i < numel; ++i) {
      for (int r = 0; r < n; ++r) setF(DType::kFloat16, in.data[r].data(), i, r == i % n ? 2048.0 : 0.5);
      setF(DType::kFloat16, in.want.data(), i, 2050.0);
    }
    runCase({n, numel, DType::kFloat16, RedOp::kSum, 3, 16, true}, &in);
  }
  (void)roundStore;
}

TEST_CASE(dead_peer_raises_backend_error_within_timeout) {
  for (int absent : {0, 2}) {
    const int n = 4;
    const int64_t numel = 1000;
    Inputs in = makeInputs(n, numel, DType::kFloat32, RedOp::kSum);
    InprocRunOptions o;
    o.plan.max_segment_bytes = 64;
    o.transport.timeout = std::chrono::milliseconds(300);
    o.absent = {absent};
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<InprocRankResult> res = runInprocAllReduce(n, numel, DType::kFloat32, RedOp::kSum, in.data, o);
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (int r = 0; r < n; ++r) {
      if (r == absent) continue;
      CHECK_MSG(res[r].is_rr_error && res[r].kind == ErrorKind::kBackend, "rank " << r << ": " << res[r].error);
      CHECK_MSG(res[r].seconds < 5.0, res[r].seconds);
    }
    CHECK_MSG(total < 10.0, total);
  }
}

TEST_CASE(unsupported_pair_raises_type_error_on_every_rank) {
  const int n = 3;
  Inputs in = makeInputs(n, 10, DType::kInt32, RedOp::kSum);
  const std::vector<uint8_t> before = in.data[1];
  InprocRunOptions o;
  o.transport.timeout = std::chrono::milliseconds(300);
  const std::vector<InprocRankResult> res = runInprocAllReduce(n, 10, DType::kInt32, RedOp::kAvg, in.data, o);
  for (int r = 0; r < n; ++r) CHECK(res[r].is_rr_error && res[r].kind == ErrorKind::kType);
  CHECK(in.data[1] == before);  // tensor unchanged
}

TEST_CASE(sixteen_bit_wire_and_predivide) {
  constexpr int kBf16 = static_cast<int>(DType::kBFloat16);
  constexpr int kF16 = static_cast<int>(DType::kFloat16);
  // Small integers: every partial is exact in 16 bits, so the wire changes nothing; multiples of 4:
  // x / f is exact for f in {2, 4}, so a predivide factor changes nothing either.
  auto exact = [](int n, int64_t numel, RedOp op, double f) {
    Inputs in;
    in.data.assign(static_cast<size_t>(n), std::vector<uint8_t>(static_cast<size_t>(numel) * 4));
    in.want.assign(static_cast<size_t>(numel) * 4, 0);
    for (int64_t i = 0; i < numel; ++i) {
      double s = 0;
      for (int r = 0; r < n; ++r) {
        const double v = static_cast<double>(((i * 7 + r * 5) % 17) - 6) * 4;
        setF(DType::kFloat32, in.data[static_cast<size_t>(r)].data(), i, v);
        s += v;
      }
      if (op == RedOp::kAvg) s = f > 0 ? (s / f) / (n / f) : s / n;
      setF(DType::kFloat32, in.want.data(), i, static_cast<double>(static_cast<float>(s)));
    }
    return in;
  };
  int k = 0;
  for (int n : {2, 3, 5}) {
    for (RedOp op : {RedOp::kSum, RedOp::kAvg}) {
      for (int wire : {-1, kBf16, kF16}) {
        for (double f : {0.0, 2.0, 4.0}) {
          if (wire < 0 && f == 0) continue;
          ++k;
          const int64_t numel = 37 + 50 * (k % 4);
          const Inputs in = exact(n, numel, op, f);
          Case c{n, numel, DType::kFloat32, op, 1 + k % 4, k % 2 ? 16 : 64, false, k % 3 == 0 ? 100 : 0, k % 3 == 1};
          c.wire = wire;
          c.pre = f;
          runCase(c, &in);
        }
      }
    }
  }
  // Where the rounding happens: on two ranks, the first hop's partial is rank c's value rounded to
  // bfloat16, and the owner adds its float32 value to it. 1 + 2^-10 is not a bfloat16 (it rounds to
  // 1), so chunk 0 (rank 0's value first) ends 1 and chunk 1 (rank 0's value last) 1 + 2^-10.
  {
    const int64_t numel = 64;
    Inputs in;
    in.data.assign(2, std::vector<uint8_t>(numel * 4, 0));
    in.want.assign(numel * 4, 0);
    const double x = 1.0 + std::ldexp(1.0, -10);
    const int64_t chunk = 32;  // (n, numel) = (2, 64): two chunks of 32
    for (int64_t i = 0; i < numel; ++i) {
      setF(DType::kFloat32, in.data[0].data(), i, x);
      setF(DType::kFloat32, in.data[1].data(), i, 0.0);
      setF(DType::kFloat32, in.want.data(), i, i < chunk ? 1.0 : x);
    }
    Case c{2, numel, DType::kFloat32, RedOp::kSum, 2, 32};
    c.wire = kBf16;
    runCase(c, &in);
  }
  // fp16 AVG with predivide_factor = n: the sum of 3 x 30000 overflows fp16, the pre-divided one
  // does not (Horovod's reason for the factor).
  {
    const int n = 3;
    const int64_t numel = 40;
    Inputs in;
    in.data.assign(n, std::vector<uint8_t>(numel * 2));
    in.want.assign(numel * 2, 0);
    for (int64_t i = 0; i < numel; ++i) {
      for (int r = 0; r < n; ++r) setF(DType::kFloat16, in.data[r].data(), i, 30000.0);
      setF(DType::kFloat16, in.want.data(), i, 30000.0);
    }
    Case c{n, numel, DType::kFloat16, RedOp::kAvg, 2, 16};
    c.pre = 3.0;
    runCase(c, &in);
  }
}

TEST_MAIN()

TEST_CASE(leading_messages) {
  // PlanRun::postLeading (Note [Receives before the verdict], csrc/cpu/group_runtime.h): the first exchange's
  // receive is posted with more room than its message, and its send goes before run() when it
  // fits in lead_max_send. Eager delivery lands each message the moment both sides posted it;
  // random delays reorder the rest. Results must stay exact, whatever is posted early.
  for (int n : {2, 3, 4, 5}) {
    for (int64_t max_send : {int64_t{0}, int64_t{64}, int64_t{1} << 20}) {
      for (bool eager : {false, true}) {
        const int64_t delay = eager ? 0 : 100;
        Case a{n, 997, DType::kFloat32, RedOp::kSum, 2, 64, false, delay, eager};
        a.lead_room = 4096;
        a.lead_max_send = max_send;
        runCase(a);
        Case b{n, 1500, DType::kBFloat16, RedOp::kAvg, 3, 32, true, delay, eager};
        b.lead_room = 1024;
        b.lead_max_send = max_send;
        runCase(b);
        Case c{n, 4099, DType::kInt64, RedOp::kMax, 4, 1 << 20, false, delay, eager};
        c.lead_room = 1 << 16;
        c.lead_max_send = max_send;
        runCase(c);
        Case d{n, 1, DType::kFloat64, RedOp::kAvg, 1, 16, false, delay, eager};  // ranks without data
        d.lead_room = 256;
        d.lead_max_send = max_send;
        runCase(d);
        Case e{n, 5000, DType::kFloat32, RedOp::kAvg, kAutoSlots, 1 << 20, false, delay, eager};  // a slot per receive
        e.lead_room = 1 << 16;
        e.lead_max_send = max_send;
        runCase(e);
      }
    }
  }
}

TEST_CASE(retired_tag_groups) {
  CallTagGroups g(4);
  CHECK_EQ(g.next(), 0);
  CHECK_EQ(g.next(), 1);
  g.retire(1);
  g.retire(1);  // twice is once
  CHECK_EQ(g.retired(), 1);
  CHECK_EQ(g.next(), 2);
  CHECK_EQ(g.next(), 3);
  CHECK_EQ(g.next(), 0);  // wraps around and skips the retired group
  CHECK_EQ(g.next(), 2);
  g.retire(0);
  g.retire(3);
  for (int i = 0; i < 5; ++i) CHECK_EQ(g.next(), 2);
  g.retire(2);
  bool threw = false;
  try {
    g.next();
  } catch (const Error& e) {
    threw = std::string(e.what()).find("Create a new process group") != std::string::npos;
  }
  CHECK_MSG(threw, "every group retired must raise");
}
