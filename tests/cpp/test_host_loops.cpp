// The host loops (csrc/cpu/host_reduce.cpp, Note [Host loops]) against the scalar functors they
// replace, bit for bit, under every instruction set this CPU runs (Note [Host loop instruction sets]):
// widening of all 65536 16-bit patterns; narrowing of specials, subnormals, every tie between
// adjacent 16-bit values and its neighbours, values near overflow, a sweep and random patterns;
// every operand-type triple x op x scaling kind of the dispatch (none, predivide, AVG divisor,
// postscale, extra divisor, round_sum, wire rounding) on odd counts, misaligned and in-place
// operands, with the memory around dst untouched; and hostReduceInOrder alike under each set.
//
// The one difference allowed: where both operands of an addition or a multiplication are NaN, IEEE
// leaves open which one the result carries, and compilers swap the operands of commutative
// operations, so there the result must be a NaN (a 16-bit one canonical, 0x7fc0 or 0x7e00 with a
// sign) with any payload and sign.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "core/functors.h"
#include "cpu/host_isa.h"
#include "cpu/host_reduce.h"

using namespace rr;

namespace {

std::vector<HostIsa> isas() {
  std::vector<HostIsa> out = {HostIsa::kPortable};
  for (HostIsa isa : {HostIsa::kAvx2, HostIsa::kAvx512})
    if (hostIsaSupported(isa)) out.push_back(isa);
  return out;
}

// Restores the detected instruction set when a case ends.
struct IsaGuard {
  HostIsa saved = hostIsa();
  ~IsaGuard() { setHostIsa(saved); }
};

template <typename T>
uint64_t bitsOf(const T& v) {
  uint64_t out = 0;
  std::memcpy(&out, &v, sizeof(T) < 8 ? sizeof(T) : 8);
  return out;
}

template <typename T>
bool sameBits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// Whether a value (of any storage type) is a floating NaN, per component for complex.
bool isNan(float v) { return v != v; }
bool isNan(double v) { return v != v; }
bool isNan(Half v) { return (v.bits & 0x7fffu) > 0x7c00u; }
bool isNan(BFloat16 v) { return (v.bits & 0x7fffu) > 0x7f80u; }
template <typename R>
bool isNan(Complex<R> v) {
  return isNan(v.re) || isNan(v.im);
}
template <typename T>
bool isNan(T) {
  return false;
}
bool canonicalNan(Half v) { return (v.bits & 0x7fffu) == 0x7e00u; }
bool canonicalNan(BFloat16 v) { return v.bits == 0x7fc0u; }
template <typename T>
bool canonicalNan(T v) {
  return isNan(v);
}

// ---- Operand data: random values of each storage type, with specials, subnormals and ties.

float floatFrom(uint32_t bits) { return bitCast<float>(bits); }

struct Gen {
  std::mt19937_64 rng{12345};
  uint32_t u32() { return static_cast<uint32_t>(rng()); }
  int pick(int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); }

  float f32() {
    const uint32_t sign = (u32() & 1u) << 31;
    switch (pick(10)) {
      case 0: return floatFrom(u32());                                               // any pattern
      case 1: return floatFrom(sign | (u32() & 0x7fffffu));                           // float subnormal
      case 2: {                                                                       // specials
        const uint32_t s[] = {0x7f800000u, 0x7fc00000u, 0x7f800001u, 0x7fa00000u, 0x7fffffffu, 0u, 0x7f7fffffu};
        return floatFrom(sign | s[pick(7)]);
      }
      case 3: return floatFrom(sign | (static_cast<uint32_t>(103 + pick(40)) << 23) | (u32() & 0x7fffffu));  // half range
      case 4: return floatFrom(sign | ((u32() & 0x7fffe000u) | 0x1000u));             // a float16 tie
      case 5: return floatFrom(sign | ((u32() & 0x7fff0000u) | 0x8000u));             // a bfloat16 tie
      case 6: return floatFrom(sign | (0x477fe000u + (u32() & 0x3fffu)));             // near 65504
      default: return floatFrom(sign | (static_cast<uint32_t>(117 + pick(20)) << 23) | (u32() & 0x7fffffu));
    }
  }
  uint16_t h16() {
    switch (pick(8)) {
      case 0: return static_cast<uint16_t>(u32());
      case 1: return static_cast<uint16_t>((u32() & 0x8000u) | (u32() & 0x3ffu));     // subnormal (fp16)
      default: return static_cast<uint16_t>((u32() & 0x8000u) | ((11u + u32() % 10u) << 10) | (u32() & 0x3ffu));
    }
  }
  uint16_t b16() {
    switch (pick(8)) {
      case 0: return static_cast<uint16_t>(u32());
      case 1: return static_cast<uint16_t>((u32() & 0x8000u) | (u32() & 0x7fu));
      default: return static_cast<uint16_t>((u32() & 0x8000u) | ((117u + u32() % 20u) << 7) | (u32() & 0x7fu));
    }
  }

  void fill(float* p, int64_t n) { for (int64_t i = 0; i < n; ++i) p[i] = f32(); }
  void fill(double* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const int k = pick(8);
      p[i] = k == 0 ? bitCast<double>(rng()) : k == 1 ? std::nan("") : static_cast<double>(f32()) * (1.0 + 1e-12 * pick(7));
    }
  }
  void fill(Half* p, int64_t n) { for (int64_t i = 0; i < n; ++i) p[i].bits = h16(); }
  void fill(BFloat16* p, int64_t n) { for (int64_t i = 0; i < n; ++i) p[i].bits = b16(); }
  void fill(Bool8* p, int64_t n) {
    const uint8_t v[] = {0, 1, 2, 255};
    for (int64_t i = 0; i < n; ++i) p[i].bits = v[pick(4)];
  }
  template <typename R>
  void fill(Complex<R>* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      fill(&p[i].re, 1);
      fill(&p[i].im, 1);
    }
  }
  template <typename T>
  void fill(T* p, int64_t n) {  // integers: any bits
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t r = rng();
      std::memcpy(&p[i], &r, sizeof(T));
    }
  }
};

// A buffer of `n` T at `offset` elements past a 64-byte boundary, with canary bytes around it.
template <typename T>
struct Span {
  static constexpr size_t kGuard = 64;
  std::vector<unsigned char> raw;
  T* p = nullptr;
  int64_t n = 0;
  Span(int64_t count, int offset) : raw(2 * kGuard + 64 + static_cast<size_t>(count + offset) * sizeof(T), 0xa5), n(count) {
    uintptr_t base = reinterpret_cast<uintptr_t>(raw.data()) + kGuard;
    base = (base + 63) / 64 * 64;
    p = reinterpret_cast<T*>(base + static_cast<size_t>(offset) * sizeof(T));
  }
  bool guardsIntact() const {
    const unsigned char* lo = raw.data();
    const unsigned char* first = reinterpret_cast<const unsigned char*>(p);
    const unsigned char* last = reinterpret_cast<const unsigned char*>(p + n);
    for (const unsigned char* c = lo; c < first; ++c) if (*c != 0xa5) return false;
    for (const unsigned char* c = last; c < raw.data() + raw.size(); ++c) if (*c != 0xa5) return false;
    return true;
  }
};

template <typename T>
DType dtypeOf();
template <> DType dtypeOf<float>() { return DType::kFloat32; }
template <> DType dtypeOf<double>() { return DType::kFloat64; }
template <> DType dtypeOf<Half>() { return DType::kFloat16; }
template <> DType dtypeOf<BFloat16>() { return DType::kBFloat16; }
template <> DType dtypeOf<int8_t>() { return DType::kInt8; }
template <> DType dtypeOf<int16_t>() { return DType::kInt16; }
template <> DType dtypeOf<int32_t>() { return DType::kInt32; }
template <> DType dtypeOf<int64_t>() { return DType::kInt64; }
template <> DType dtypeOf<uint8_t>() { return DType::kUInt8; }
template <> DType dtypeOf<Bool8>() { return DType::kBool; }
template <> DType dtypeOf<Complex<float>>() { return DType::kComplex64; }
template <> DType dtypeOf<Complex<double>>() { return DType::kComplex128; }

template <typename TA, typename TB, typename TD, RedOp op>
TD reference(const TA& a, const TB& b, const Scaling& sc) {
  const TD r = ReduceStep<TA, TB, TD, op>::apply(a, b, sc);
  if constexpr (std::is_same<TD, float>::value) return roundThroughWire(r, sc.wire_round);
  else return r;
}

template <typename T>
struct IsComplex : std::false_type {};
template <typename R>
struct IsComplex<Complex<R>> : std::true_type {};

template <typename TA, typename TB, typename TD>
TD referenceOf(RedOp op, const TA& a, const TB& b, const Scaling& sc) {
  if constexpr (IsComplex<TA>::value) {  // SUM and AVG only
    return op == RedOp::kSum ? reference<TA, TB, TD, RedOp::kSum>(a, b, sc) : reference<TA, TB, TD, RedOp::kAvg>(a, b, sc);
  } else {
    switch (op) {
      case RedOp::kSum: return reference<TA, TB, TD, RedOp::kSum>(a, b, sc);
      case RedOp::kAvg: return reference<TA, TB, TD, RedOp::kAvg>(a, b, sc);
      case RedOp::kMax: return reference<TA, TB, TD, RedOp::kMax>(a, b, sc);
      case RedOp::kMin: return reference<TA, TB, TD, RedOp::kMin>(a, b, sc);
      case RedOp::kProduct: return reference<TA, TB, TD, RedOp::kProduct>(a, b, sc);
    }
    return TD{};
  }
}

std::string describe(const Scaling& sc) {
  return "predivide " + std::to_string(sc.predivide) + " divisor " + std::to_string(sc.divisor) + " postscale " +
         std::to_string(sc.postscale) + " round_sum " + std::to_string(sc.round_sum) + " wire " +
         std::to_string(sc.wire_round);
}

enum class Alias { kNone, kA, kB };

// hostReduce of (TA, TB, TD) with `op` and `sc` on `n` elements against the functor, element by
// element; a, b, dst at the given element offsets from 64-byte alignment, or dst being a or b.
template <typename TA, typename TB, typename TD>
void checkReduce(Gen& gen, RedOp op, const Scaling& sc, int64_t n, int offset_a, int offset_b, int offset_d,
                 Alias alias, const char* isa) {
  Span<TA> a(n, offset_a);
  Span<TB> b(n, offset_b);
  Span<TD> d(n, offset_d);
  gen.fill(a.p, n);
  gen.fill(b.p, n);
  std::vector<TD> want(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] = referenceOf<TA, TB, TD>(op, a.p[i], b.p[i], sc);
  const std::vector<TA> a0(a.p, a.p + n);
  const std::vector<TB> b0(b.p, b.p + n);
  TD* out = d.p;
  if constexpr (std::is_same<TA, TD>::value) {
    if (alias == Alias::kA) out = a.p;
  }
  if constexpr (std::is_same<TB, TD>::value) {
    if (alias == Alias::kB) out = b.p;
  }
  hostReduce(op, a.p, dtypeOf<TA>(), b.p, dtypeOf<TB>(), out, dtypeOf<TD>(), n, sc);
  int bad = 0;
  const bool commutative_nan = op == RedOp::kSum || op == RedOp::kAvg || op == RedOp::kProduct;
  for (int64_t i = 0; i < n && bad < 3; ++i) {
    const TD& got = out[i];
    const TD& w = want[static_cast<size_t>(i)];
    if (sameBits(got, w)) continue;
    const bool both_nan = isNan(a0[static_cast<size_t>(i)]) && isNan(b0[static_cast<size_t>(i)]);
    if (commutative_nan && both_nan && isNan(got) && isNan(w) && canonicalNan(got)) continue;
    ++bad;
    CHECK_MSG(false, isa << " " << dtypeName(dtypeOf<TA>()) << "," << dtypeName(dtypeOf<TB>()) << "->"
                         << dtypeName(dtypeOf<TD>()) << " " << redOpName(op) << " " << describe(sc) << " n " << n
                         << " element " << i << ": a " << std::hex << bitsOf(a0[static_cast<size_t>(i)]) << " b "
                         << bitsOf(b0[static_cast<size_t>(i)]) << " got " << bitsOf(got) << " want " << bitsOf(w)
                         << std::dec);
  }
  CHECK(bad == 0);
  if (alias == Alias::kNone) {
    CHECK(d.guardsIntact());
    // inputs untouched (n == 0 has nothing to compare: an empty vector's data() may be null)
    CHECK(n == 0 || std::memcmp(a.p, a0.data(), static_cast<size_t>(n) * sizeof(TA)) == 0);
    CHECK(n == 0 || std::memcmp(b.p, b0.data(), static_cast<size_t>(n) * sizeof(TB)) == 0);
  }
}

// The scalings a plan gives a reduce (Plan::scaling, CallOptions::flatFinalScaling), and a few it
// never gives (a multiplier alone, a divisor with round_sum off for narrow partials), for the loops'
// kinds: none; predivide (a hop); AVG's divisor with and without a postscale and an extra divisor;
// SUM's postscale and extra divisor; round_sum on and off; each also through a 16-bit wire.
std::vector<Scaling> scalings(RedOp op) {
  std::vector<Scaling> out;
  Scaling none;
  out.push_back(none);
  Scaling pre;
  pre.predivide = 3.0;
  out.push_back(pre);
  pre.predivide = 0.37;
  out.push_back(pre);
  for (int n : {2, 3, 4, 5, 7})
    for (int extra : {1, 3})
      for (double f : {0.0, 3.0, 0.37, 8.0})
        for (bool round_sum : {false, true}) out.push_back(finalScaling(op, n, extra, f, f, round_sum));
  Scaling mul;
  mul.postscale = 2.5;
  out.push_back(mul);
  const size_t plain = out.size();
  for (size_t i = 0; i < plain; ++i) {
    for (DType w : {DType::kBFloat16, DType::kFloat16}) {
      Scaling s = out[i];
      s.wire_round = static_cast<int32_t>(w);
      out.push_back(s);
    }
  }
  return out;
}

template <typename TA, typename TB, typename TD>
void sweepTriple(Gen& gen, const std::vector<RedOp>& ops, const char* isa) {
  for (RedOp op : ops) {
    const std::vector<Scaling> all = scalings(op);
    for (size_t s = 0; s < all.size(); ++s) {
      const Scaling& sc = all[s];
      checkReduce<TA, TB, TD>(gen, op, sc, 1031, 1, 3, 2, Alias::kNone, isa);
      if (s % 7 == 0) {
        checkReduce<TA, TB, TD>(gen, op, sc, 203, 0, 0, 0, Alias::kA, isa);
        checkReduce<TA, TB, TD>(gen, op, sc, 205, 5, 1, 0, Alias::kB, isa);
      }
    }
    // Odd and short counts: no lane at all, one lane and a rest, ... up to a pair of AVX-512 lanes
    // (32 bfloat16 values, Note [Paired bfloat16 lanes]), one lane and a rest.
    for (int64_t n = 0; n <= 72; ++n)
      checkReduce<TA, TB, TD>(gen, op, all[n % all.size()], n, static_cast<int>(n % 5), 1, 3, Alias::kNone, isa);
  }
}

const std::vector<RedOp> kAllOps = {RedOp::kSum, RedOp::kAvg, RedOp::kMax, RedOp::kMin, RedOp::kProduct};
const std::vector<RedOp> kIntOps = {RedOp::kSum, RedOp::kMax, RedOp::kMin, RedOp::kProduct};
const std::vector<RedOp> kSumAvg = {RedOp::kSum, RedOp::kAvg};

// ---- Conversions.

template <typename TS, typename TD>
void checkConvert(const std::vector<TS>& in, double predivide, int offset_a, int offset_d, bool in_place,
                  const char* isa) {
  const int64_t n = static_cast<int64_t>(in.size());
  Span<TS> a(n, offset_a);
  Span<TD> d(n, offset_d);
  if (n > 0) std::memcpy(a.p, in.data(), in.size() * sizeof(TS));  // an empty vector's data() may be null
  TD* out = d.p;
  if constexpr (std::is_same<TS, TD>::value) {
    if (in_place) out = a.p;
  }
  hostConvert(a.p, dtypeOf<TS>(), out, dtypeOf<TD>(), n, predivide);
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 3; ++i) {
    const TD want = ConvertStep<TS, TD>::apply(in[static_cast<size_t>(i)], predivide);
    if (sameBits(out[i], want)) continue;
    ++bad;
    CHECK_MSG(false, isa << " convert " << dtypeName(dtypeOf<TS>()) << "->" << dtypeName(dtypeOf<TD>()) << " predivide "
                         << predivide << " element " << i << " of " << n << ": in " << std::hex
                         << bitsOf(in[static_cast<size_t>(i)]) << " got " << bitsOf(out[i]) << " want "
                         << bitsOf(want) << std::dec);
  }
  CHECK(bad == 0);
  if (!in_place) CHECK(d.guardsIntact());
}

template <typename T>
std::vector<T> allSixteenBitPatterns() {
  std::vector<T> out(65536);
  for (uint32_t i = 0; i < 65536; ++i) out[i].bits = static_cast<uint16_t>(i);
  return out;
}

// Float patterns for narrowing: specials, NaN payloads, float subnormals, every exact tie between
// adjacent values of T (and the floats just below and above it) in both signs, a strided sweep of
// all 2^32 patterns and random ones.
template <typename T>
std::vector<float> narrowingPatterns() {
  std::vector<uint32_t> bits = {0u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u,
                                0xff800001u, 0x7fa00000u, 0x7f802000u, 0x7f801fffu, 0x7fbfffffu, 0x7fffffffu,
                                0xffffffffu, 0x7f7fffffu, 0xff7fffffu, 1u, 2u, 0x007fffffu, 0x80000001u,
                                0x00400000u, 0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477ff001u, 0x47800000u,
                                0x33000000u, 0x33000001u, 0x337fffffu, 0x38800000u, 0x387fffffu, 0x387fe000u};
  for (uint32_t h = 0; h < 0x8000u; ++h) {
    T lo, hi;
    lo.bits = static_cast<uint16_t>(h);
    hi.bits = static_cast<uint16_t>(h + 1);
    const float a = Convert<float, T>::load(lo), b = Convert<float, T>::load(hi);
    if (!(std::isfinite(a) && std::isfinite(b))) continue;
    const float mid = static_cast<float>((static_cast<double>(a) + static_cast<double>(b)) / 2);  // exact
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), a}) {
      bits.push_back(bitCast<uint32_t>(v));
      bits.push_back(bitCast<uint32_t>(v) | 0x80000000u);
    }
  }
  for (uint64_t v = 0; v < (1ull << 32); v += 4099) bits.push_back(static_cast<uint32_t>(v));
  std::mt19937 rng(7);
  for (int i = 0; i < (1 << 18); ++i) bits.push_back(rng());
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bitCast<float>(bits[i]);
  return out;
}

}  // namespace

TEST_CASE(widening_every_sixteen_bit_pattern) {
  IsaGuard guard;
  const std::vector<Half> halves = allSixteenBitPatterns<Half>();
  const std::vector<BFloat16> bf16s = allSixteenBitPatterns<BFloat16>();
  for (HostIsa isa : isas()) {
    setHostIsa(isa);
    for (int offset : {0, 1, 7}) {
      checkConvert<Half, float>(halves, 0, offset, (offset + 3) % 8, false, hostIsaName(isa));
      checkConvert<BFloat16, float>(bf16s, 0, offset, (offset + 5) % 8, false, hostIsaName(isa));
    }
    // To itself: NaNs made canonical, every other value kept; with a predivide, divided and rounded.
    for (double p : {0.0, 3.0, 0.37}) {
      checkConvert<Half, Half>(halves, p, 1, 2, false, hostIsaName(isa));
      checkConvert<BFloat16, BFloat16>(bf16s, p, 3, 0, true, hostIsaName(isa));
    }
  }
}

TEST_CASE(narrowing_specials_ties_and_sweep) {
  IsaGuard guard;
  const std::vector<float> for_half = narrowingPatterns<Half>();
  const std::vector<float> for_bf16 = narrowingPatterns<BFloat16>();
  CHECK(for_half.size() > 1000000 && for_bf16.size() > 1000000);
  for (HostIsa isa : isas()) {
    setHostIsa(isa);
    checkConvert<float, Half>(for_half, 0, 1, 3, false, hostIsaName(isa));
    checkConvert<float, BFloat16>(for_bf16, 0, 2, 1, false, hostIsaName(isa));
    const std::vector<float> some(for_half.begin(), for_half.begin() + 200000);
    checkConvert<float, Half>(some, 3.0, 0, 0, false, hostIsaName(isa));
    checkConvert<float, BFloat16>(some, 0.37, 5, 3, false, hostIsaName(isa));
    checkConvert<float, float>(some, 3.0, 1, 2, false, hostIsaName(isa));
    checkConvert<float, float>(some, 0.37, 1, 1, true, hostIsaName(isa));
  }
}

TEST_CASE(conversions_of_every_count) {
  IsaGuard guard;
  Gen gen;
  for (HostIsa isa : isas()) {
    setHostIsa(isa);
    for (int n = 0; n <= 72; ++n) {  // through a pair of AVX-512 lanes, a lane and a rest
      std::vector<float> f(static_cast<size_t>(n));
      gen.fill(f.data(), n);
      std::vector<Half> h(static_cast<size_t>(n));
      gen.fill(h.data(), n);
      std::vector<BFloat16> b(static_cast<size_t>(n));
      gen.fill(b.data(), n);
      std::vector<double> x(static_cast<size_t>(n));
      gen.fill(x.data(), n);
      std::vector<Complex<float>> c(static_cast<size_t>(n));
      gen.fill(c.data(), n);
      checkConvert<float, Half>(f, n % 2 ? 3.0 : 0.0, n % 8, 1, false, hostIsaName(isa));
      checkConvert<float, BFloat16>(f, n % 3 ? 0.0 : 5.0, 1, n % 8, false, hostIsaName(isa));
      checkConvert<Half, float>(h, 0, n % 8, 2, false, hostIsaName(isa));
      checkConvert<BFloat16, float>(b, 0, 3, n % 8, false, hostIsaName(isa));
      checkConvert<Half, Half>(h, 3.0, n % 8, 0, n % 2 == 0, hostIsaName(isa));
      checkConvert<BFloat16, BFloat16>(b, n % 2 ? 0.37 : 3.0, n % 8, 1, n % 3 == 0, hostIsaName(isa));
      checkConvert<double, double>(x, n % 2 ? 3.0 : 0.0, 1, n % 4, n % 3 == 0, hostIsaName(isa));
      checkConvert<Complex<float>, Complex<float>>(c, 0.37, 0, 1, false, hostIsaName(isa));
    }
  }
}

TEST_CASE(half_type_reduces_every_op_and_scaling) {
  IsaGuard guard;
  for (HostIsa isa : isas()) {
    setHostIsa(isa);
    Gen gen;
    const char* name = hostIsaName(isa);
    sweepTriple<Half, Half, Half>(gen, kAllOps, name);
    sweepTriple<BFloat16, BFloat16, BFloat16>(gen, kAllOps, name);
    // Float32 partials (accum_dtype=float32, shared memory): b and/or dst wide.
    sweepTriple<Half, Half, float>(gen, kAllOps, name);
    sweepTriple<Half, float, float>(gen, kAllOps, name);
    sweepTriple<Half, float, Half>(gen, kAllOps, name);
    sweepTriple<BFloat16, BFloat16, float>(gen, kAllOps, name);
    sweepTriple<BFloat16, float, float>(gen, kAllOps, name);
    sweepTriple<BFloat16, float, BFloat16>(gen, kAllOps, name);
  }
}

TEST_CASE(float32_with_sixteen_bit_wires) {
  IsaGuard guard;
  for (HostIsa isa : isas()) {
    setHostIsa(isa);
    Gen gen;
    const char* name = hostIsaName(isa);
    sweepTriple<float, Half, Half>(gen, kSumAvg, name);
    sweepTriple<float, Half, float>(gen, kSumAvg, name);
    sweepTriple<float, BFloat16, BFloat16>(gen, kSumAvg, name);
    sweepTriple<float, BFloat16, float>(gen, kSumAvg, name);
  }
}

TEST_CASE(same_type_reduces_every_dtype) {
  IsaGuard guard;
  for (HostIsa isa : isas()) {
    setHostIsa(isa);
    Gen gen;
    const char* name = hostIsaName(isa);
    sweepTriple<float, float, float>(gen, kAllOps, name);  // with scalings through a wire as well
    sweepTriple<double, double, double>(gen, kAllOps, name);
    sweepTriple<Complex<float>, Complex<float>, Complex<float>>(gen, kSumAvg, name);
    sweepTriple<Complex<double>, Complex<double>, Complex<double>>(gen, kSumAvg, name);
    sweepTriple<int8_t, int8_t, int8_t>(gen, kIntOps, name);
    sweepTriple<int16_t, int16_t, int16_t>(gen, kIntOps, name);
    sweepTriple<int32_t, int32_t, int32_t>(gen, kIntOps, name);
    sweepTriple<int64_t, int64_t, int64_t>(gen, kIntOps, name);
    sweepTriple<uint8_t, uint8_t, uint8_t>(gen, kIntOps, name);
    sweepTriple<Bool8, Bool8, Bool8>(gen, kIntOps, name);
  }
}

// The ring's order over n inputs (shared memory's and the one-shot's reduce) gives the same bits
// under each instruction set, for the partial types the plans use.
TEST_CASE(reduce_in_order_is_the_same_under_each_instruction_set) {
  IsaGuard guard;
  const std::vector<HostIsa> all = isas();
  Gen gen;
  std::vector<unsigned char> scratch(kReduceInOrderScratchBytes);
  struct Setup {
    DType dtype, partial;
    RedOp op;
  };
  const Setup setups[] = {{DType::kBFloat16, DType::kFloat32, RedOp::kAvg}, {DType::kFloat16, DType::kFloat32, RedOp::kSum},
                          {DType::kBFloat16, DType::kBFloat16, RedOp::kAvg}, {DType::kFloat16, DType::kFloat16, RedOp::kMax},
                          {DType::kFloat32, DType::kBFloat16, RedOp::kAvg}, {DType::kFloat32, DType::kFloat16, RedOp::kSum},
                          {DType::kFloat32, DType::kFloat32, RedOp::kAvg}};
  for (const Setup& s : setups) {
    for (int c = 0; c < 8; ++c) {
      const int n = 2 + c % 4;
      // More than one block of hostReduceInOrder, then under one block: a few vector lanes (paired
      // for bfloat16) and a rest.
      const int64_t count = c < 4 ? 20000 + n : 61 + 7 * n;
      const size_t elem = dtypeSize(s.dtype);
      std::vector<std::vector<unsigned char>> inputs(static_cast<size_t>(n), std::vector<unsigned char>(count * elem));
      // No NaN inputs: two NaNs meeting may give either payload (this file's comment); infinities
      // of both signs still make NaNs.
      for (auto& in : inputs) {
        if (s.dtype == DType::kFloat32) {
          float* p = reinterpret_cast<float*>(in.data());
          gen.fill(p, count);
          for (int64_t i = 0; i < count; ++i) p[i] = isNan(p[i]) ? 1.0f : p[i];
        } else if (s.dtype == DType::kFloat16) {
          Half* p = reinterpret_cast<Half*>(in.data());
          gen.fill(p, count);
          for (int64_t i = 0; i < count; ++i) p[i].bits = isNan(p[i]) ? 0x7c00 : p[i].bits;
        } else {
          BFloat16* p = reinterpret_cast<BFloat16*>(in.data());
          gen.fill(p, count);
          for (int64_t i = 0; i < count; ++i) p[i].bits = isNan(p[i]) ? 0xff80 : p[i].bits;
        }
      }
      std::vector<const void*> ptrs;
      for (auto& in : inputs) ptrs.push_back(in.data());
      Scaling sc = finalScaling(s.op, n, 1, n == 3 ? 2.0 : 0.0, n == 3 ? 2.0 : 0.0, s.partial == s.dtype || c % 2 == 1);
      if (s.dtype == DType::kFloat32 && n == 4) sc.wire_round = static_cast<int32_t>(s.partial);
      std::vector<std::vector<unsigned char>> results;
      for (HostIsa isa : all) {
        setHostIsa(isa);
        std::vector<unsigned char> out(count * elem);
        hostReduceInOrder(s.dtype, s.partial, s.op, ptrs, out.data(), count, sc, scratch.data());
        results.push_back(out);
        // In place: dst is the first input.
        std::vector<unsigned char> first = inputs[0];
        std::vector<const void*> in_place = ptrs;
        in_place[0] = first.data();
        hostReduceInOrder(s.dtype, s.partial, s.op, in_place, first.data(), count, sc, scratch.data());
        CHECK_MSG(first == out,
                  hostIsaName(isa) << " in place " << dtypeName(s.dtype) << " n " << n << " count " << count);
      }
      for (size_t k = 1; k < results.size(); ++k)
        CHECK_MSG(results[k] == results[0], dtypeName(s.dtype) << " partial " << dtypeName(s.partial) << " n " << n
                                                                << " count " << count);
      // The chain step by step, a hostReduce per input through partials of their own (Note [Fused
      // in-order reduce]): input 1 with input 0, then input k with the partial, the last step scaled.
      if (s.partial == s.dtype || s.partial == DType::kFloat32) {
        Scaling hop;
        hop.predivide = sc.predivide;
        std::vector<unsigned char> first(count * elem), partial(count * dtypeSize(s.partial)), want(count * elem);
        const void* in0 = ptrs[0];
        if (sc.predivide > 0) {  // the first input's predivide, in its own type
          hostConvert(ptrs[0], s.dtype, first.data(), s.dtype, count, sc.predivide);
          in0 = first.data();
        }
        if (n == 2) {
          hostReduce(s.op, ptrs[1], s.dtype, in0, s.dtype, want.data(), s.dtype, count, sc);
        } else {
          hostReduce(s.op, ptrs[1], s.dtype, in0, s.dtype, partial.data(), s.partial, count, hop);
          for (int k = 2; k + 1 < n; ++k)
            hostReduce(s.op, ptrs[k], s.dtype, partial.data(), s.partial, partial.data(), s.partial, count, hop);
          hostReduce(s.op, ptrs[n - 1], s.dtype, partial.data(), s.partial, want.data(), s.dtype, count, sc);
        }
        CHECK_MSG(results[0] == want, "step by step: " << dtypeName(s.dtype) << " partial " << dtypeName(s.partial)
                                                        << " n " << n << " count " << count);
      }
    }
  }
}

TEST_CASE(instruction_set_selection) {
  IsaGuard guard;
  CHECK(hostIsaSupported(HostIsa::kPortable));
  setHostIsa(HostIsa::kPortable);
  CHECK(hostIsa() == HostIsa::kPortable);
  CHECK(std::string(hostIsaName(HostIsa::kPortable)) == "portable");
  CHECK(std::string(hostIsaName(HostIsa::kAvx2)) == "avx2+f16c");
  CHECK(std::string(hostIsaName(HostIsa::kAvx512)) == "avx512");
  for (HostIsa isa : {HostIsa::kAvx2, HostIsa::kAvx512}) {
    if (hostIsaSupported(isa)) {
      setHostIsa(isa);
      CHECK(hostIsa() == isa);
    } else {
      bool threw = false;
      try {
        setHostIsa(isa);
      } catch (const Error& e) {
        threw = e.kind() == ErrorKind::kValue;
      }
      CHECK(threw);
    }
  }
  // The sets nest (a CPU with AVX-512's loops runs AVX2's), and the one detected is the widest.
  if (hostIsaSupported(HostIsa::kAvx512)) CHECK(hostIsaSupported(HostIsa::kAvx2));
  CHECK(!hostIsaSupported(HostIsa::kAvx512) || guard.saved == HostIsa::kAvx512);
  std::printf("host loops here: %s\n", hostIsaName(guard.saved));
}

TEST_MAIN()
