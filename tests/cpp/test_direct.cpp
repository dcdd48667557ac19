// The direct all-reduce (Note [Direct all-reduce], csrc/core/direct.h) without torch: the plan's
// shape (rounds cover every chunk, buffers within the staging), the CPU exchange
// (csrc/cpu/direct_exchange.cpp) on n threads over the in-process transport with random delivery
// times, for every dtype and op, n = 1..5, awkward counts and tiny segments and staging: exact data
// gives the exact result; any data gives, on every rank, the bits of one in-order reduction of the
// n inputs (what shared memory and the one-shot compute), whatever the pipeline; half types add in
// float32 in rank order and round once; a float32 tensor's 16-bit wire rounds each contribution once.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "core/direct.h"
#include "core/error.h"
#include "core/functors.h"
#include "cpu/direct_exchange.h"
#include "cpu/host_reduce.h"
#include "support/inproc_transport.h"

using namespace rr;

namespace {

const DType kAllTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                           DType::kInt8,    DType::kInt16,   DType::kInt32,   DType::kInt64,
                           DType::kUInt8,   DType::kBool,    DType::kComplex64, DType::kComplex128};
const RedOp kAllOps[] = {RedOp::kSum, RedOp::kAvg, RedOp::kMax, RedOp::kMin, RedOp::kProduct};

bool supported(DType t, RedOp op) {
  try {
    checkSupported(t, op);
    return true;
  } catch (const Error&) {
    return false;
  }
}

using Bytes = std::vector<uint8_t>;

// An exact value of rank r at position i: half-integers in [-4, 4] (sums of 5 stay exact in every
// floating type), powers of two for PRODUCT, integers up to 100 (int8/uint8 sums and products wrap).
double exactValue(RedOp op, int r, int64_t i, int comp) {
  const uint64_t h = static_cast<uint64_t>(i * 7 + r * 5 + comp * 3);
  if (op == RedOp::kProduct) {
    static const double kPow[] = {1.0, 2.0, -1.0, 0.5, -2.0, 1.0, -0.5, 4.0};
    return kPow[h % 8];
  }
  return (static_cast<double>(h % 17) - 8.0) * 0.5;
}
int64_t exactInt(int r, int64_t i) { return (i * 37 + r * 11 + 5) % 100 - 40; }

// The element types, for typed access to raw bytes.
template <typename F>
void withType(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat64: return f(double{});
    case DType::kFloat16: return f(Half{});
    case DType::kBFloat16: return f(BFloat16{});
    case DType::kInt8: return f(int8_t{});
    case DType::kInt16: return f(int16_t{});
    case DType::kInt32: return f(int32_t{});
    case DType::kInt64: return f(int64_t{});
    case DType::kUInt8: return f(uint8_t{});
    case DType::kBool: return f(Bool8{});
    case DType::kComplex64: return f(Complex<float>{});
    case DType::kComplex128: return f(Complex<double>{});
  }
}

template <typename T>
T fromDouble(double re, double im) {
  if constexpr (std::is_same<T, Half>::value || std::is_same<T, BFloat16>::value) {
    return Convert<float, T>::store(static_cast<float>(re));
  } else if constexpr (std::is_same<T, Bool8>::value) {
    return Bool8{static_cast<uint8_t>(re > 0)};
  } else if constexpr (std::is_same<T, Complex<float>>::value) {
    return T{static_cast<float>(re), static_cast<float>(im)};
  } else if constexpr (std::is_same<T, Complex<double>>::value) {
    return T{re, im};
  } else {
    return static_cast<T>(re);
  }
}

// Rank r's exact inputs and the exact result of `op` over n ranks.
void exactCase(int n, int64_t numel, DType t, RedOp op, std::vector<Bytes>& in, Bytes& want) {
  const size_t es = dtypeSize(t);
  in.assign(static_cast<size_t>(n), Bytes(static_cast<size_t>(numel) * es));
  want.assign(static_cast<size_t>(numel) * es, 0);
  withType(t, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = 0; i < numel; ++i) {
      T w{};
      if constexpr (std::is_integral<T>::value) {  // wrapping, as the unsigned type of the width
        uint64_t acc = 0;
        int64_t extreme = 0;
        for (int r = 0; r < n; ++r) {
          const T v = static_cast<T>(t == DType::kUInt8 ? exactInt(r, i) + 40 : exactInt(r, i));
          std::memcpy(in[static_cast<size_t>(r)].data() + i * es, &v, es);
          const int64_t x = static_cast<int64_t>(v);
          acc = r == 0 ? static_cast<uint64_t>(x)
                       : op == RedOp::kProduct ? acc * static_cast<uint64_t>(x) : acc + static_cast<uint64_t>(x);
          extreme = r == 0 ? x : op == RedOp::kMax ? std::max(extreme, x) : std::min(extreme, x);
        }
        w = op == RedOp::kMax || op == RedOp::kMin ? static_cast<T>(extreme) : static_cast<T>(acc);
      } else if constexpr (std::is_same<T, Bool8>::value) {  // SUM/MAX: or; MIN/PRODUCT: and
        bool acc = false;
        for (int r = 0; r < n; ++r) {
          const bool b = (i * 3 + r) % 4 == 0;
          const T v{static_cast<uint8_t>(b)};
          std::memcpy(in[static_cast<size_t>(r)].data() + i * es, &v, es);
          acc = r == 0 ? b : op == RedOp::kSum || op == RedOp::kMax ? (acc || b) : (acc && b);
        }
        w = T{static_cast<uint8_t>(acc)};
      } else {
        double acc[2] = {0, 0};
        for (int r = 0; r < n; ++r) {
          const double x[2] = {exactValue(op, r, i, 0), exactValue(op, r, i, 1)};
          const T v = fromDouble<T>(x[0], x[1]);
          std::memcpy(in[static_cast<size_t>(r)].data() + i * es, &v, es);
          for (int c = 0; c < 2; ++c) {
            if (r == 0) acc[c] = x[c];
            else if (op == RedOp::kProduct) acc[c] *= x[c];
            else if (op == RedOp::kMax) acc[c] = std::max(acc[c], x[c]);
            else if (op == RedOp::kMin) acc[c] = std::min(acc[c], x[c]);
            else acc[c] += x[c];
          }
        }
        if (op == RedOp::kAvg) {  // the exact sum divided once: in float32, float64 for the 64-bit types
          const bool wide = t == DType::kFloat64 || t == DType::kComplex128;
          for (double& a : acc) a = wide ? a / n : static_cast<double>(static_cast<float>(a) / static_cast<float>(n));
        }
        w = fromDouble<T>(acc[0], acc[1]);
      }
      std::memcpy(want.data() + i * es, &w, es);
    }
  });
}

DirectOptions options(RedOp op, int64_t segment, int64_t staging) {
  DirectOptions o;
  o.op = op;
  o.max_segment_bytes = segment;
  o.staging_bytes = staging;
  return o;
}

// Every rank's executeDirect over one in-process hub; data[r] is rank r's tensor, reduced in place.
// Returns "" or the first rank's error.
std::string runDirect(int n, int64_t numel, DType t, const DirectOptions& o, std::vector<Bytes>& data,
                      uint64_t seed, const std::vector<int>& absent = {}) {
  InprocOptions io;
  io.max_delay_us = 50;
  io.seed = seed;
  io.timeout = std::chrono::milliseconds(absent.empty() ? 20000 : 300);
  auto hub = std::make_shared<InprocHub>(n, io);
  std::vector<std::string> errors(static_cast<size_t>(n));
  // Each rank's staging and scratch outlive its thread: a rank that failed abandons requests that
  // may still deliver into them (Note [Failed calls keep their buffers]).
  std::vector<std::vector<Bytes>> staging(static_cast<size_t>(n));
  std::vector<Bytes> scratch(static_cast<size_t>(n), Bytes(kReduceInOrderScratchBytes));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    if (std::find(absent.begin(), absent.end(), r) != absent.end()) continue;
    threads.emplace_back([&, r] {
      InprocTransport transport(hub, r);
      try {
        const DirectPlan plan = buildDirectPlan(n, r, numel, t, o);
        std::vector<Bytes>& mine = staging[static_cast<size_t>(r)];
        mine.assign(static_cast<size_t>(plan.numBuffers()), Bytes(static_cast<size_t>(plan.buffer_bytes)));
        DirectBuffers b;
        b.data = data[static_cast<size_t>(r)].data();
        for (Bytes& s : mine) b.buffers.push_back(s.data());
        b.scratch = scratch[static_cast<size_t>(r)].data();
        executeDirect(plan, transport, b, 100, 200);
      } catch (const std::exception& e) {
        transport.abandon();
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const std::string& e : errors)
    if (!e.empty()) return e;
  return "";
}

// The in-order reduction of every rank's input on one thread (shared memory's and the one-shot's).
Bytes inOrder(int n, int64_t numel, DType t, const DirectOptions& o, const std::vector<Bytes>& in) {
  Bytes out(static_cast<size_t>(numel) * dtypeSize(t));
  if (n == 1) {
    out = in[0];
    return out;
  }
  std::vector<const void*> inputs;
  for (const Bytes& b : in) inputs.push_back(b.data());
  Bytes scratch(kReduceInOrderScratchBytes);
  hostReduceInOrder(directInOrder(t, n, o), inputs, out.data(), numel, scratch.data());
  return out;
}

std::string caseText(int n, int64_t numel, DType t, RedOp op, int64_t segment, int64_t staging) {
  return detail::concat("n=", n, " numel=", numel, " ", dtypeName(t), " ", redOpName(op), " segment=", segment,
                        " staging=", staging);
}

}  // namespace

// Rounds cover every chunk exactly once, rank r owns chunk r, the buffers of the rounds in flight
// fit the staging, and buffer indices never collide.
TEST_CASE(direct_plan_shapes) {
  for (int n : {2, 3, 5, 8, 17}) {
    for (int64_t numel : {int64_t(0), int64_t(1), int64_t(n + 1), int64_t(1000003)}) {
      for (bool wire : {false, true}) {
        DirectOptions o = options(RedOp::kAvg, 1 << 20, 6 << 20);
        if (wire) o.wire_dtype = DType::kBFloat16;
        const DirectPlan p = buildDirectPlan(n, n - 1, numel, DType::kFloat32, o);
        const std::string what = detail::concat("n=", n, " numel=", numel, " wire=", wire);
        CHECK_MSG(p.stagingBytes() <= o.staging_bytes, what << ": " << p.stagingBytes());
        CHECK_MSG(p.sched.ownedChunk(n - 1) == n - 1, what);
        CHECK_MSG(p.depth >= 1 && (p.rounds < 2 || p.depth >= 2), what << " depth " << p.depth);
        int64_t covered = 0;
        for (int c = 0; c < n; ++c)
          for (int g = 0; g < p.rounds; ++g) covered += p.piece(c, g).size();
        CHECK_MSG(covered == numel, what << ": rounds cover " << covered);
        std::vector<int> used(static_cast<size_t>(p.numBuffers()), 0);
        for (int g = 0; g < std::min(p.depth, p.rounds); ++g) {
          for (int q = 0; q < n; ++q) {
            if (q != p.rank) ++used.at(static_cast<size_t>(p.recvBuffer(g, q)));
            if (wire) ++used.at(static_cast<size_t>(p.convertBuffer(g, q)));
          }
        }
        for (int u : used) CHECK_MSG(u == 1, what << ": a buffer used " << u << " times");
        CHECK_MSG(!wire || p.contrib == DType::kBFloat16, what);
        CHECK_MSG(p.reduce.partial == DType::kFloat32 && p.reduce.dst == DType::kFloat32, what);
      }
    }
  }
  // A 16-bit all-gather moves the wire type; half types sum in float32 unless narrow.
  DirectOptions o = options(RedOp::kSum, 1 << 20, 6 << 20);
  o.wire_dtype = DType::kFloat16;
  o.wire_gather16 = true;
  CHECK(buildDirectPlan(4, 0, 100, DType::kFloat32, o).gather == DType::kFloat16);
  CHECK(directPartial(DType::kBFloat16, RedOp::kSum, false, std::nullopt) == DType::kFloat32);
  CHECK(directPartial(DType::kBFloat16, RedOp::kSum, true, std::nullopt) == DType::kBFloat16);
  CHECK(directPartial(DType::kFloat16, RedOp::kMax, false, std::nullopt) == DType::kFloat16);
  CHECK(directPartial(DType::kFloat32, RedOp::kAvg, false, std::nullopt) == DType::kFloat32);
}

// Exact data: every dtype and op, n = 1..5, counts around the chunk and segment bounds, segments and
// staging small enough for many rounds with few in flight.
TEST_CASE(direct_exact_every_dtype_and_op) {
  uint64_t seed = 1;
  for (int n = 1; n <= 5; ++n) {
    for (int64_t numel : {int64_t(0), int64_t(1), int64_t(n - 1), int64_t(n + 1), int64_t(37), int64_t(1003)}) {
      for (DType t : kAllTypes) {
        for (RedOp op : kAllOps) {
          if (!supported(t, op)) continue;
          if (rrtest::kSanitized && numel > 100 && t != DType::kFloat32 && t != DType::kBFloat16) continue;
          for (int64_t segment : {int64_t(16), int64_t(1 << 20)}) {
            const int64_t staging = segment == 16 ? 256 : (6 << 20);
            std::vector<Bytes> data;
            Bytes want;
            exactCase(n, numel, t, op, data, want);
            const std::string err = runDirect(n, numel, t, options(op, segment, staging), data, seed++);
            const std::string what = caseText(n, numel, t, op, segment, staging);
            CHECK_MSG(err.empty(), what << ": " << err);
            for (int r = 0; r < n && err.empty(); ++r)
              CHECK_MSG(data[static_cast<size_t>(r)] == want, what << ": rank " << r << " is not the exact result");
          }
        }
      }
    }
  }
}

// Random data: on every rank the bits of one in-order reduction of the inputs, for any pipeline.
TEST_CASE(direct_gives_the_in_order_bits_for_any_pipeline) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.f, 3.f);
  uint64_t seed = 100;
  for (int n : {2, 3, 4, 5}) {
    for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
      for (RedOp op : {RedOp::kSum, RedOp::kAvg, RedOp::kProduct}) {
        const int64_t numel = 4099;
        std::vector<Bytes> in(static_cast<size_t>(n), Bytes(static_cast<size_t>(numel) * dtypeSize(t)));
        withType(t, [&](auto tag) {
          using T = decltype(tag);
          for (auto& b : in)
            for (int64_t i = 0; i < numel; ++i) {
              const T v = fromDouble<T>(op == RedOp::kProduct ? 1.0 + normal(rng) / 64 : normal(rng), 0);
              std::memcpy(b.data() + i * sizeof(T), &v, sizeof(T));
            }
        });
        const Bytes want = inOrder(n, numel, t, options(op, 1 << 20, 6 << 20), in);
        for (int64_t segment : {int64_t(16), int64_t(256), int64_t(1 << 20)}) {
          for (int64_t staging : {int64_t(512), int64_t(6 << 20)}) {
            std::vector<Bytes> data = in;
            const std::string err = runDirect(n, numel, t, options(op, segment, staging), data, seed++);
            const std::string what = caseText(n, numel, t, op, segment, staging);
            CHECK_MSG(err.empty(), what << ": " << err);
            for (int r = 0; r < n && err.empty(); ++r)
              CHECK_MSG(data[static_cast<size_t>(r)] == want, what << ": rank " << r << " differs from the in-order bits");
          }
        }
      }
    }
  }
}

// float16/bfloat16 SUM and AVG: float32 partials in rank order, rounded once (AVG: the float32 sum
// divided by n, then rounded); accum_narrow rounds every partial.
TEST_CASE(direct_half_types_add_in_float32_in_rank_order) {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    for (RedOp op : {RedOp::kSum, RedOp::kAvg}) {
      for (bool narrow : {false, true}) {
        const int n = 5;
        const int64_t numel = 2001;
        std::vector<Bytes> data(static_cast<size_t>(n), Bytes(static_cast<size_t>(numel) * 2));
        std::vector<std::vector<uint16_t>> bits(static_cast<size_t>(n), std::vector<uint16_t>(static_cast<size_t>(numel)));
        auto toFloat = [&](uint16_t b) { return t == DType::kFloat16 ? halfBitsToFloat(b) : bf16BitsToFloat(b); };
        auto toBits = [&](float f) { return t == DType::kFloat16 ? floatToHalfBits(f) : floatToBf16Bits(f); };
        for (int r = 0; r < n; ++r)
          for (int64_t i = 0; i < numel; ++i) {
            bits[r][i] = toBits(normal(rng) * (1.f + static_cast<float>(r)));
            std::memcpy(data[r].data() + 2 * i, &bits[r][i], 2);
          }
        DirectOptions o = options(op, 64, 1024);
        o.accum_narrow = narrow;
        const std::string err = runDirect(n, numel, t, o, data, 77);
        CHECK_MSG(err.empty(), err);
        int64_t off = 0, differs_from_narrow = 0;
        for (int64_t i = 0; i < numel && err.empty(); ++i) {
          float wide = toFloat(bits[0][i]);
          uint16_t hop = bits[0][i];
          for (int r = 1; r < n; ++r) {
            wide = toFloat(bits[r][i]) + wide;
            hop = toBits(toFloat(bits[r][i]) + toFloat(hop));  // narrow: the sum rounded, then divided
          }
          if (op == RedOp::kAvg) hop = toBits(toFloat(hop) / static_cast<float>(n));
          const uint16_t once = toBits(op == RedOp::kAvg ? wide / static_cast<float>(n) : wide);
          const uint16_t want = narrow ? hop : once;
          differs_from_narrow += once != hop;
          for (int r = 0; r < n; ++r) {
            uint16_t got;
            std::memcpy(&got, data[r].data() + 2 * i, 2);
            off += got != want;
          }
        }
        CHECK_MSG(off == 0, dtypeName(t) << " " << redOpName(op) << " narrow=" << narrow << ": " << off
                                          << " elements off");
        CHECK_MSG(differs_from_narrow > numel / 20, "the data does not tell rounding once from per step");
      }
    }
  }
}

// A float32 tensor with a 16-bit wire: each contribution rounded once to the wire (after the
// predivide), summed in float32 in rank order, scaled once; with a 16-bit all-gather the result
// rounded once more to the wire.
TEST_CASE(direct_wire_rounds_each_contribution_once) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (DType wire : {DType::kBFloat16, DType::kFloat16}) {
    for (RedOp op : {RedOp::kSum, RedOp::kAvg}) {
      for (double f : {0.0, 4.0}) {
        for (bool gather16 : {false, true}) {
          const int n = 4;
          const int64_t numel = 3001;
          std::vector<Bytes> data(static_cast<size_t>(n), Bytes(static_cast<size_t>(numel) * 4));
          std::vector<std::vector<float>> x(static_cast<size_t>(n), std::vector<float>(static_cast<size_t>(numel)));
          for (int r = 0; r < n; ++r)
            for (int64_t i = 0; i < numel; ++i) {
              x[r][i] = normal(rng) * (1.f + static_cast<float>(r));
              std::memcpy(data[r].data() + 4 * i, &x[r][i], 4);
            }
          auto through = [&](float v) {
            return wire == DType::kFloat16 ? halfBitsToFloat(floatToHalfBits(v)) : bf16BitsToFloat(floatToBf16Bits(v));
          };
          DirectOptions o = options(op, 128, 2048);
          o.wire_dtype = wire;
          o.wire_gather16 = gather16;
          o.pre_factor = f;
          const std::vector<Bytes> in = data;
          const std::string err = runDirect(n, numel, DType::kFloat32, o, data, 31);
          CHECK_MSG(err.empty(), err);
          const Bytes one_thread = inOrder(n, numel, DType::kFloat32, o, in);
          int64_t off = 0;
          for (int64_t i = 0; i < numel && err.empty(); ++i) {
            const float ff = static_cast<float>(f);
            float sum = 0;
            for (int r = 0; r < n; ++r) {
              const float c = through(f > 0 ? x[r][i] / ff : x[r][i]);
              sum = r == 0 ? c : c + sum;
            }
            float want = sum;
            if (op == RedOp::kAvg) want = sum / (f > 0 ? static_cast<float>(n) / ff : static_cast<float>(n));
            else if (f > 0) want = sum * ff;
            if (gather16) want = through(want);
            for (int r = 0; r < n; ++r) {
              float got;
              std::memcpy(&got, data[r].data() + 4 * i, 4);
              off += std::memcmp(&got, &want, 4) != 0;
            }
            float shm;
            std::memcpy(&shm, one_thread.data() + 4 * i, 4);
            off += std::memcmp(&shm, &want, 4) != 0;
          }
          CHECK_MSG(off == 0, dtypeName(wire) << " " << redOpName(op) << " f=" << f << " gather16=" << gather16 << ": "
                                               << off << " elements off");
        }
      }
    }
  }
}

// A peer that never calls: every other rank fails with a transport error (kBackend), none hangs.
TEST_CASE(direct_dead_peer_fails_every_other_rank) {
  std::vector<Bytes> data;
  Bytes want;
  exactCase(3, 1000, DType::kFloat32, RedOp::kSum, data, want);
  const std::string err = runDirect(3, 1000, DType::kFloat32, options(RedOp::kSum, 64, 1024), data, 3, {1});
  CHECK_MSG(!err.empty(), "a direct all-reduce with a dead peer succeeded");
}

TEST_MAIN()
