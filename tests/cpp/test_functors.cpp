// The reduction functors and host loops against an independent reference: every dtype x op on edge
// values (wrapping integers computed in unsigned arithmetic, NaN propagation, fp16 overflow, half
// rounding ties-to-even, AVG = round(sum) / n for half types without float32 partials).
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "core/functors.h"
#include "cpu/host_reduce.h"

using namespace rr;

namespace {

// ---- Independent half-type reference conversions (double based, no bit tricks shared with the core).
double halfToDouble(uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0) v = std::ldexp(static_cast<double>(m), -24);
  else v = std::ldexp(static_cast<double>(m + 1024), e - 25);
  return sign ? -v : v;
}

// Rounds x to a binary format with `mant` fraction bits, minimum normal exponent `emin`, largest
// finite exponent `emax`; returns the rounded value (inf on overflow), ties to even.
double roundToFormat(double x, int mant, int emin, int emax) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  const double ax = std::fabs(x);
  int e = std::ilogb(ax);
  if (e < emin) e = emin;
  const double q = std::ldexp(1.0, e - mant);
  const double m = std::nearbyint(ax / q);  // default rounding mode: ties to even
  double v = m * q;
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -mant), emax);
  if (v > max_finite) v = std::numeric_limits<double>::infinity();
  return x < 0 ? -v : v;
}

uint16_t doubleToHalf(double x) {
  if (std::isnan(x)) return 0x7e00;
  const double v = roundToFormat(x, 10, -14, 15);
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (std::isinf(a)) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(a / std::ldexp(1.0, -24));
  const int e = std::ilogb(a);
  const int m = static_cast<int>(a / std::ldexp(1.0, e - 10)) - 1024;
  return sign | static_cast<uint16_t>(((e + 15) << 10) | m);
}

double bf16ToDouble(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t doubleToBf16(double x) {
  if (std::isnan(x)) return 0x7fc0;
  const float f = static_cast<float>(roundToFormat(x, 7, -126, 127));  // exact in float
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// hostReduce with the operand widths of the float32-partial mode (a wide operand holds float32) and
// AVG's divisor (0: none), as the plan's reduces of half types call it.
void hostReduceWide(DType t, RedOp op, const void* a, bool a_wide, const void* b, bool b_wide, void* dst,
                    bool dst_wide, int64_t count, int divisor, bool round_sum) {
  Scaling sc;
  sc.divisor = op == RedOp::kAvg ? divisor : 0;
  sc.round_sum = round_sum;
  hostReduce(op, a, a_wide ? DType::kFloat32 : t, b, b_wide ? DType::kFloat32 : t, dst,
             dst_wide ? DType::kFloat32 : t, count, sc);
}

// ---- Reference semantics.
template <typename T>
T wrapRef(RedOp op, T a, T b) {
  const uint64_t ua = static_cast<uint64_t>(static_cast<int64_t>(a));
  const uint64_t ub = static_cast<uint64_t>(static_cast<int64_t>(b));
  const uint64_t r = op == RedOp::kProduct ? ua * ub : ua + ub;
  return static_cast<T>(r);  // two's complement truncation (defined since C++20, GCC always)
}

double floatRef(RedOp op, double a, double b) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return a + b;
    case RedOp::kProduct: return a * b;
    case RedOp::kMax: return (std::isnan(a) || std::isnan(b)) ? std::nan("") : std::max(a, b);
    case RedOp::kMin: return (std::isnan(a) || std::isnan(b)) ? std::nan("") : std::min(a, b);
  }
  return 0;
}

const RedOp kOps[] = {RedOp::kSum, RedOp::kAvg, RedOp::kMax, RedOp::kMin, RedOp::kProduct};

template <typename T>
void runLoop(DType t, RedOp op, const std::vector<T>& a, const std::vector<T>& b, std::vector<T>& out,
             int divisor, bool round_sum) {
  out.assign(a.size(), T{});
  hostReduceWide(t, op, a.data(), false, b.data(), false, out.data(), false, static_cast<int64_t>(a.size()), divisor,
             round_sum);
}

template <typename T>
void pairs(const std::vector<T>& vals, std::vector<T>& a, std::vector<T>& b) {
  for (const T& x : vals)
    for (const T& y : vals) {
      a.push_back(x);
      b.push_back(y);
    }
}

template <typename T>
void checkIntegral(DType t, const std::vector<T>& vals) {
  std::vector<T> a, b, out;
  pairs(vals, a, b);
  for (RedOp op : kOps) {
    if (unsupportedReason(t, op)) continue;
    runLoop(t, op, a, b, out, 0, false);
    for (size_t i = 0; i < a.size(); ++i) {
      T want;
      if (op == RedOp::kMax) want = a[i] > b[i] ? a[i] : b[i];
      else if (op == RedOp::kMin) want = a[i] < b[i] ? a[i] : b[i];
      else want = wrapRef(op, a[i], b[i]);
      CHECK_MSG(out[i] == want, dtypeName(t) << " " << redOpName(op) << "(" << int64_t(a[i]) << ", " << int64_t(b[i])
                                             << ") = " << int64_t(out[i]) << ", want " << int64_t(want));
    }
  }
}

template <typename T>
void checkFloat(DType t, const std::vector<T>& vals) {
  std::vector<T> a, b, out;
  pairs(vals, a, b);
  for (RedOp op : kOps) {
    for (int divisor : {0, 3}) {
      if (divisor && op != RedOp::kAvg) continue;
      runLoop(t, op, a, b, out, divisor, true);
      for (size_t i = 0; i < a.size(); ++i) {
        double w = floatRef(op, a[i], b[i]);
        T want = static_cast<T>(w);
        if (divisor) want = static_cast<T>(static_cast<T>(w) / static_cast<T>(divisor));
        // MAX/MIN of +0 and -0 may return either zero (both compare equal; ranks still agree).
        const bool minmax = op == RedOp::kMax || op == RedOp::kMin;
        const bool ok = (std::isnan(want) && std::isnan(out[i])) || std::memcmp(&want, &out[i], sizeof(T)) == 0 ||
                        (minmax && want == out[i]);
        CHECK_MSG(ok, dtypeName(t) << " " << redOpName(op) << "/" << divisor << "(" << a[i] << ", " << b[i]
                                   << ") = " << out[i] << ", want " << want);
      }
    }
  }
}

// Half types: H is Half or BFloat16; toD/fromD the reference conversions.
template <typename H>
void checkHalf(DType t, const std::vector<double>& dvals, double (*toD)(uint16_t), uint16_t (*fromD)(double)) {
  std::vector<H> vals;
  for (double d : dvals) vals.push_back(H{fromD(d)});
  std::vector<H> a, b, out;
  pairs(vals, a, b);
  for (RedOp op : kOps) {
    for (int divisor : {0, 3}) {
      if (divisor && op != RedOp::kAvg) continue;
      for (bool round_sum : {true, false}) {
        runLoop(t, op, a, b, out, divisor, round_sum);
        for (size_t i = 0; i < a.size(); ++i) {
          double w = floatRef(op, toD(a[i].bits), toD(b[i].bits));
          if (divisor) {
            if (round_sum) w = toD(fromD(w));
            w = static_cast<double>(static_cast<float>(w) / static_cast<float>(divisor));
          }
          const uint16_t want = fromD(w);
          const bool minmax = op == RedOp::kMax || op == RedOp::kMin;
          const bool ok = (std::isnan(toD(want)) && std::isnan(toD(out[i].bits))) || want == out[i].bits ||
                          (minmax && toD(want) == toD(out[i].bits));
          CHECK_MSG(ok, dtypeName(t) << " " << redOpName(op) << "/" << divisor << (round_sum ? " rounded" : "")
                                     << "(" << toD(a[i].bits) << ", " << toD(b[i].bits) << ") = "
                                     << toD(out[i].bits) << ", want " << toD(want));
        }
      }
    }
  }
}

double nan() { return std::numeric_limits<double>::quiet_NaN(); }
double inf() { return std::numeric_limits<double>::infinity(); }

}  // namespace

TEST_CASE(reference_conversions_agree_with_core) {
  // Sanity of the test's own reference against the core on every fp16/bf16 bit pattern.
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const double h = halfToDouble(static_cast<uint16_t>(bits));
    const double c = halfBitsToFloat(static_cast<uint16_t>(bits));
    CHECK((std::isnan(h) && std::isnan(c)) || h == c);
    const double b = bf16ToDouble(static_cast<uint16_t>(bits));
    const double cb = bf16BitsToFloat(static_cast<uint16_t>(bits));
    CHECK((std::isnan(b) && std::isnan(cb)) || b == cb);
  }
  // float -> half rounding on a sweep of float bit patterns (every 4099th)...
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
    float f;
    const uint32_t u32 = static_cast<uint32_t>(u);
    std::memcpy(&f, &u32, 4);
    if (std::isnan(f)) continue;
    CHECK_EQ(floatToHalfBits(f), doubleToHalf(f));
    CHECK_EQ(floatToBf16Bits(f), doubleToBf16(f));
  }
  // ...and on every exact tie between neighbouring half values, and just either side of it.
  for (uint32_t bits = 0; bits < 0x7c00u; ++bits) {
    for (int sign : {1, -1}) {
      const double lo = halfToDouble(static_cast<uint16_t>(bits)), hi = halfToDouble(static_cast<uint16_t>(bits + 1));
      const float mid = static_cast<float>(sign * (lo + hi) / 2);  // exact: 12 significant bits
      CHECK_EQ(floatToHalfBits(mid), doubleToHalf(mid));
      CHECK_EQ(floatToHalfBits(std::nextafter(mid, 0.0f)), doubleToHalf(std::nextafter(mid, 0.0f)));
      CHECK_EQ(floatToHalfBits(std::nextafter(mid, 1e30f * sign)), doubleToHalf(std::nextafter(mid, 1e30f * sign)));
    }
  }
  for (uint32_t bits = 0; bits < 0x7f7fu; ++bits) {
    const double lo = bf16ToDouble(static_cast<uint16_t>(bits)), hi = bf16ToDouble(static_cast<uint16_t>(bits + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: 9 significant bits
    CHECK_EQ(floatToBf16Bits(mid), doubleToBf16(mid));
    CHECK_EQ(floatToBf16Bits(-mid), doubleToBf16(-mid));
  }
}

TEST_CASE(integers_wrap_like_twos_complement) {
  checkIntegral<int8_t>(DType::kInt8, {0, 1, -1, 2, 127, -128, 64, -64, 100, 11});
  checkIntegral<int16_t>(DType::kInt16, {0, 1, -1, 300, 32767, -32768, 256, -255, 181});
  checkIntegral<int32_t>(DType::kInt32, {0, 1, -1, 65536, 2147483647, -2147483647 - 1, 46341, -3});
  checkIntegral<int64_t>(DType::kInt64, {0, 1, -1, int64_t(1) << 32, std::numeric_limits<int64_t>::max(),
                                         std::numeric_limits<int64_t>::min(), 3037000500LL, -7});
  checkIntegral<uint8_t>(DType::kUInt8, {0, 1, 2, 16, 100, 200, 255, 128});
  // Named expectations, independent of the generic reference.
  int8_t a8 = 127, b8 = 1, o8 = 0;
  hostReduceWide(DType::kInt8, RedOp::kSum, &a8, false, &b8, false, &o8, false, 1, 0, false);
  CHECK_EQ(int(o8), -128);
  a8 = -128;
  b8 = -1;
  hostReduceWide(DType::kInt8, RedOp::kProduct, &a8, false, &b8, false, &o8, false, 1, 0, false);
  CHECK_EQ(int(o8), -128);
  int16_t a16 = 300, o16 = 0;
  hostReduceWide(DType::kInt16, RedOp::kProduct, &a16, false, &a16, false, &o16, false, 1, 0, false);
  CHECK_EQ(int(o16), 24464);  // 90000 - 65536
  int32_t a32 = 2147483647, b32 = 1, o32 = 0;
  hostReduceWide(DType::kInt32, RedOp::kSum, &a32, false, &b32, false, &o32, false, 1, 0, false);
  CHECK_EQ(o32, std::numeric_limits<int32_t>::min());
  int64_t a64 = std::numeric_limits<int64_t>::min(), b64 = -1, o64 = 0;
  hostReduceWide(DType::kInt64, RedOp::kSum, &a64, false, &b64, false, &o64, false, 1, 0, false);
  CHECK_EQ(o64, std::numeric_limits<int64_t>::max());
  hostReduceWide(DType::kInt64, RedOp::kProduct, &a64, false, &b64, false, &o64, false, 1, 0, false);
  CHECK_EQ(o64, std::numeric_limits<int64_t>::min());
  uint8_t u1 = 200, u2 = 100, uo = 0;
  hostReduceWide(DType::kUInt8, RedOp::kSum, &u1, false, &u2, false, &uo, false, 1, 0, false);
  CHECK_EQ(int(uo), 44);
}

TEST_CASE(bool_is_or_and) {
  std::vector<Bool8> a = {{0}, {0}, {1}, {1}}, b = {{0}, {1}, {0}, {1}}, out(4);
  const uint8_t want_or[] = {0, 1, 1, 1}, want_and[] = {0, 0, 0, 1};
  for (RedOp op : {RedOp::kSum, RedOp::kMax, RedOp::kMin, RedOp::kProduct}) {
    hostReduceWide(DType::kBool, op, a.data(), false, b.data(), false, out.data(), false, 4, 0, false);
    const bool is_and = op == RedOp::kMin || op == RedOp::kProduct;
    for (int i = 0; i < 4; ++i) CHECK_EQ(int(out[i].bits), int(is_and ? want_and[i] : want_or[i]));
  }
}

TEST_CASE(floats_propagate_nan_and_overflow) {
  const float fmax = std::numeric_limits<float>::max();
  checkFloat<float>(DType::kFloat32, {0.0f, -0.0f, 1.0f, -1.5f, 0.1f, fmax, -fmax, 1e-45f,
                                      std::numeric_limits<float>::infinity(), std::nanf("")});
  checkFloat<double>(DType::kFloat64, {0.0, -0.0, 1.0, -1.5, 0.1, 1e308, -1e308, 5e-324, inf(), nan()});
  // NaN wins MAX/MIN in either position (torch.maximum semantics).
  for (RedOp op : {RedOp::kMax, RedOp::kMin}) {
    float a[2] = {std::nanf(""), 1.0f}, b[2] = {1.0f, std::nanf("")}, o[2];
    hostReduceWide(DType::kFloat32, op, a, false, b, false, o, false, 2, 0, false);
    CHECK(std::isnan(o[0]) && std::isnan(o[1]));
  }
}

TEST_CASE(half_types_round_ties_to_even_and_overflow) {
  const std::vector<double> hv = {0.0, -0.0, 1.0, -1.0, 3.0, 5.0, 2048.0, 2050.0, 65504.0, -65504.0, 16.0, 15.0,
                                  0.1, 6.103515625e-05, 5.9604644775390625e-08, inf(), -inf(), nan(), 1024.5, 255.0};
  checkHalf<Half>(DType::kFloat16, hv, halfToDouble, doubleToHalf);
  const std::vector<double> bv = {0.0, -0.0, 1.0, -1.0, 3.0, 5.0, 256.0, 258.0, 1.0 / 3.0, 3e38, -3e38, 1e-40,
                                  inf(), -inf(), nan(), 255.0, 127.5, 7.0};
  checkHalf<BFloat16>(DType::kBFloat16, bv, bf16ToDouble, doubleToBf16);

  auto h = [](double d) { return Half{doubleToHalf(d)}; };
  auto hsum = [&](double x, double y) {
    Half a = h(x), b = h(y), o{0};
    hostReduceWide(DType::kFloat16, RedOp::kSum, &a, false, &b, false, &o, false, 1, 0, false);
    return halfToDouble(o.bits);
  };
  CHECK_EQ(hsum(65504, 65504), inf());  // fp16 sums overflow where a pre-divide would not
  CHECK_EQ(hsum(65504, 16), inf());     // 65520 is the rounding threshold
  CHECK_EQ(hsum(65504, 15), 65504.0);
  CHECK_EQ(hsum(2048, 1), 2048.0);  // tie -> even
  CHECK_EQ(hsum(2050, 1), 2052.0);  // tie -> even (up)
  auto b = [](double d) { return BFloat16{doubleToBf16(d)}; };
  auto bsum = [&](double x, double y) {
    BFloat16 p = b(x), q = b(y), o{0};
    hostReduceWide(DType::kBFloat16, RedOp::kSum, &p, false, &q, false, &o, false, 1, 0, false);
    return bf16ToDouble(o.bits);
  };
  CHECK_EQ(bsum(256, 1), 256.0);  // 257 is a tie -> 256 (even)
  CHECK_EQ(bsum(258, 1), 260.0);  // 259 is a tie -> 260 (even)
  CHECK_EQ(bsum(255, 1), 256.0);
}

TEST_CASE(avg_divides_the_rounded_sum_once) {
  // fp16: 2048 + 3 = 2051 rounds to 2052; 2052 / 3 = 684. Unrounded 2051 / 3 would give 683.5.
  Half a{doubleToHalf(2048)}, b{doubleToHalf(3)}, o{0};
  hostReduceWide(DType::kFloat16, RedOp::kAvg, &a, false, &b, false, &o, false, 1, 3, true);
  CHECK_EQ(halfToDouble(o.bits), 684.0);
  hostReduceWide(DType::kFloat16, RedOp::kAvg, &a, false, &b, false, &o, false, 1, 3, false);
  CHECK_EQ(halfToDouble(o.bits), 683.5);
  // bf16: 256 + 5 = 261 ties to 260; 260 / 3 = 86.67 -> 86.5. Unrounded 261 / 3 = 87.
  BFloat16 p{doubleToBf16(256)}, q{doubleToBf16(5)}, r{0};
  hostReduceWide(DType::kBFloat16, RedOp::kAvg, &p, false, &q, false, &r, false, 1, 3, true);
  CHECK_EQ(bf16ToDouble(r.bits), 86.5);
  // Without a divisor AVG combines like SUM.
  hostReduceWide(DType::kBFloat16, RedOp::kAvg, &p, false, &q, false, &r, false, 1, 0, true);
  CHECK_EQ(bf16ToDouble(r.bits), 260.0);
  // float32 and float64: sum / n correctly rounded, once.
  float fa = 1.0f, fb = 1.0f, fo = 0;
  hostReduceWide(DType::kFloat32, RedOp::kAvg, &fa, false, &fb, false, &fo, false, 1, 3, true);
  CHECK_EQ(fo, 2.0f / 3.0f);
  double da = 1.0, db = 1.0, dout = 0;
  hostReduceWide(DType::kFloat64, RedOp::kAvg, &da, false, &db, false, &dout, false, 1, 3, true);
  CHECK_EQ(dout, 2.0 / 3.0);
}

TEST_CASE(float32_partials_round_once) {
  // accum mode: half local operand + float32 partial -> float32 partial, then the final store
  // rounds once: 2048 + 0.5 + 0.5 stays exact in float32 and rounds to 2049 -> 2048 (tie, even)
  // only at the end; hop-by-hop rounding would lose both halves.
  Half a{doubleToHalf(2048)}, h05{doubleToHalf(0.5)};
  float partial = 0;
  hostReduceWide(DType::kFloat16, RedOp::kSum, &h05, false, &h05, false, &partial, true, 1, 0, false);
  CHECK_EQ(partial, 1.0f);
  Half out{0};
  hostReduceWide(DType::kFloat16, RedOp::kSum, &a, false, &partial, true, &out, false, 1, 0, false);
  CHECK_EQ(halfToDouble(out.bits), 2048.0);  // 2049 tie -> 2048
  Half a2{doubleToHalf(2050)};
  hostReduceWide(DType::kFloat16, RedOp::kSum, &a2, false, &partial, true, &out, false, 1, 0, false);
  CHECK_EQ(halfToDouble(out.bits), 2052.0);  // 2051 tie -> 2052
  // Final AVG from float32 partials: no intermediate rounding of the sum.
  float p3 = 3.0f;
  hostReduceWide(DType::kFloat16, RedOp::kAvg, &a, false, &p3, true, &out, false, 1, 3, false);
  CHECK_EQ(halfToDouble(out.bits), 683.5);  // 2051 / 3 = 683.67 -> 683.5
  // Partial to partial (middle hops): float32 in, float32 out.
  float p1 = 1e-3f, p2 = 0;
  BFloat16 bl{doubleToBf16(256)};
  hostReduceWide(DType::kBFloat16, RedOp::kSum, &bl, false, &p1, true, &p2, true, 1, 0, false);
  CHECK_EQ(p2, 256.0f + 1e-3f);
}

TEST_CASE(complex_sum_and_avg) {
  Complex<float> a{1.0f, -2.0f}, b{0.5f, 4.0f}, o{0, 0};
  hostReduceWide(DType::kComplex64, RedOp::kSum, &a, false, &b, false, &o, false, 1, 0, false);
  CHECK(o.re == 1.5f && o.im == 2.0f);
  hostReduceWide(DType::kComplex64, RedOp::kAvg, &a, false, &b, false, &o, false, 1, 2, true);
  CHECK(o.re == 0.75f && o.im == 1.0f);
  Complex<double> c{1.0, 1.0}, d{2.0, -4.0}, e{0, 0};
  hostReduceWide(DType::kComplex128, RedOp::kAvg, &c, false, &d, false, &e, false, 1, 3, true);
  CHECK(e.re == 1.0 && e.im == -1.0);
}

TEST_CASE(unsupported_pairs_throw_type_errors) {
  int32_t x = 1;
  for (DType t : {DType::kInt8, DType::kInt32, DType::kUInt8, DType::kBool}) {
    bool threw = false;
    try {
      hostReduceWide(t, RedOp::kAvg, &x, false, &x, false, &x, false, 1, 2, true);
    } catch (const Error& e) {
      threw = e.kind() == ErrorKind::kType;
    }
    CHECK(threw);
  }
  Complex<float> c{1, 1};
  for (RedOp op : {RedOp::kMax, RedOp::kMin, RedOp::kProduct}) {
    bool threw = false;
    try {
      hostReduceWide(DType::kComplex64, op, &c, false, &c, false, &c, false, 1, 0, false);
    } catch (const Error& e) {
      threw = e.kind() == ErrorKind::kType && std::string(e.what()).find("complex64") != std::string::npos;
    }
    CHECK(threw);
  }
}

TEST_CASE(sixteen_bit_partials_and_scaling) {
  // A hop of a 16-bit wire: float32 local + widened bfloat16 partial, added in float32, rounded once
  // to bfloat16 (ties to even). 1 + 2^-8 is exactly halfway between bfloat16 1 and 1 + 2^-7: even.
  const float a = 1.0f;
  const uint16_t half_ulp = doubleToBf16(std::ldexp(1.0, -8));  // 2^-8 is a bfloat16
  uint16_t out = 0;
  hostReduce(RedOp::kSum, &a, DType::kFloat32, &half_ulp, DType::kBFloat16, &out, DType::kBFloat16, 1, Scaling{});
  CHECK_EQ(bf16ToDouble(out), 1.0);
  // The final hop stores float32: no rounding to 16 bits.
  float f = 0;
  hostReduce(RedOp::kSum, &a, DType::kFloat32, &half_ulp, DType::kBFloat16, &f, DType::kFloat32, 1, Scaling{});
  CHECK_EQ(static_cast<double>(f), 1.0 + std::ldexp(1.0, -8));
  // The first hop's convert rounds the float32 value once (to float16 too).
  const float x = static_cast<float>(1.0 + std::ldexp(1.0, -10) + std::ldexp(1.0, -20));
  uint16_t c = 0;
  hostConvert(&x, DType::kFloat32, &c, DType::kBFloat16, 1, 0);
  CHECK_EQ(c, doubleToBf16(x));
  hostConvert(&x, DType::kFloat32, &c, DType::kFloat16, 1, 0);
  CHECK_EQ(c, doubleToHalf(x));
  // A predivide factor: the local operand enters divided (rounded to its type), the convert too.
  hostConvert(&x, DType::kFloat32, &c, DType::kBFloat16, 1, 4.0);
  CHECK_EQ(c, doubleToBf16(static_cast<float>(x / 4.0f)));
  Scaling pre;
  pre.predivide = 3.0;
  const uint16_t h3 = doubleToHalf(3.0), zero = 0;
  uint16_t ho = 0;
  hostReduce(RedOp::kSum, &h3, DType::kFloat16, &zero, DType::kFloat16, &ho, DType::kFloat16, 1, pre);
  CHECK_EQ(halfToDouble(ho), 1.0);
  // The final scaling: AVG divides by n / f, SUM multiplies by f, an extra divisor divides too.
  const float s1 = 6.0f, s2 = 3.0f;
  float r = 0;
  hostReduce(RedOp::kAvg, &s1, DType::kFloat32, &s2, DType::kFloat32, &r, DType::kFloat32, 1,
             finalScaling(RedOp::kAvg, 3, 1, 2.0, 0, true));  // 9 / (3 / 2)
  CHECK_EQ(r, 6.0f);
  hostReduce(RedOp::kSum, &s1, DType::kFloat32, &s2, DType::kFloat32, &r, DType::kFloat32, 1,
             finalScaling(RedOp::kSum, 3, 1, 2.0, 0, true));  // 9 * 2
  CHECK_EQ(r, 18.0f);
  hostReduce(RedOp::kAvg, &s1, DType::kFloat32, &s2, DType::kFloat32, &r, DType::kFloat32, 1,
             finalScaling(RedOp::kAvg, 3, 4, 0, 0, true));  // 9 / 12
  CHECK_EQ(r, 0.75f);
  hostReduce(RedOp::kSum, &s1, DType::kFloat32, &s2, DType::kFloat32, &r, DType::kFloat32, 1,
             finalScaling(RedOp::kSum, 3, 4, 2.0, 0, true));  // 9 / (4 / 2)
  CHECK_EQ(r, 4.5f);
  // MAX ignores the factors (the bindings refuse them): finalScaling gives none.
  const Scaling none = finalScaling(RedOp::kMax, 3, 4, 2.0, 0, true);
  CHECK(none.divisor == 0 && none.postscale == 0);
}

TEST_MAIN()
