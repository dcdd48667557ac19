// The CPU host loops (csrc/cpu/host_reduce.h) against memcpy of the same bytes, torch-free.
//
//   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build --target bench_host_loops
//   build/bench_host_loops [--bytes 64K,1M,16M] [--seconds 0.2] [--filter NAME] [--isa portable|avx2|avx512]
//
// Each row: one loop over a tensor of `bytes` bytes of `dtype` (the operands the all-reduce gives it:
// the same bytes, the tensor's element count), its time per call (us), its rate (bytes of the tensor
// per second), one memcpy of those bytes (us; the `floor` of python -m ringreduce.bench) and the
// loop's time over the memcpy's. A reduce reads two operands and writes one, a memcpy reads one and
// writes one: a reduce at memory speed takes about 1.5x the memcpy once the operands leave the caches.
// Times: loop and memcpy in 7 alternating repetitions, each as many back-to-back calls as fill
// --seconds / 7, the best repetition of each (bestSeconds). --isa portable runs the portable loops
// (Note [Host loop instruction sets]).
#include <sys/utsname.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/functors.h"
#include "cpu/host_isa.h"
#include "cpu/host_reduce.h"

using namespace rr;

namespace {

struct Buffer {
  explicit Buffer(size_t bytes) : data(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64))) {}
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data;
};

// Random finite values of `dtype`, of magnitudes around 1 (what gradients look like to these loops).
void fill(void* p, DType dtype, int64_t count, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < count; ++i) {
    const float v = dist(gen);
    switch (dtype) {
      case DType::kFloat32: static_cast<float*>(p)[i] = v; break;
      case DType::kFloat64: static_cast<double*>(p)[i] = v; break;
      case DType::kFloat16: static_cast<uint16_t*>(p)[i] = floatToHalfBits(v); break;
      case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = floatToBf16Bits(v); break;
      default: std::memset(static_cast<char*>(p) + i * dtypeSize(dtype), static_cast<int>(gen() & 0x7f), dtypeSize(dtype));
    }
  }
}

// Seconds per call of `loop` and of `baseline`, timed in alternating repetitions (each as many
// back-to-back calls as fill budget / kReps), the best repetition of each: on a shared machine the
// best is the loop's own speed, and the two are measured under the same load.
constexpr int kReps = 7;

std::pair<double, double> bestSeconds(const std::function<void()>& loop, const std::function<void()>& baseline,
                                      double budget) {
  using Clock = std::chrono::steady_clock;
  auto once = [](const std::function<void()>& f, int64_t calls) {
    const Clock::time_point s = Clock::now();
    for (int64_t i = 0; i < calls; ++i) f();
    return std::chrono::duration<double>(Clock::now() - s).count() / static_cast<double>(calls);
  };
  loop();  // warm: page faults, caches
  baseline();
  const double one = std::max(1e-7, once(loop, 1) + once(baseline, 1));
  const int64_t calls = std::max<int64_t>(1, static_cast<int64_t>(budget / kReps / one));
  double best_loop = 1e30, best_base = 1e30;
  for (int r = 0; r < kReps; ++r) {
    best_loop = std::min(best_loop, once(loop, calls));
    best_base = std::min(best_base, once(baseline, calls));
  }
  return {best_loop, best_base};
}

int64_t parseBytes(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  const char u = end && *end ? static_cast<char>(std::toupper(*end)) : 0;
  const double scale = u == 'K' ? 1024.0 : u == 'M' ? 1048576.0 : u == 'G' ? 1073741824.0 : 1.0;
  return static_cast<int64_t>(v * scale);
}

std::string formatBytes(int64_t b) {
  if (b % (1 << 20) == 0) return std::to_string(b >> 20) + "M";
  if (b % (1 << 10) == 0) return std::to_string(b >> 10) + "K";
  return std::to_string(b);
}

// One loop of the table: what it runs on buffers of `bytes` bytes of its tensor type.
struct Loop {
  std::string name;
  DType dtype;  // the tensor's
  std::string what;
  std::function<void(int64_t count, std::vector<char*>& in, char* out, void* scratch)> run;
  std::vector<DType> inputs;  // the operands' types (a wire's partial: 16 bits)
};

std::vector<Loop> loops() {
  std::vector<Loop> all;
  const DType kTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64};
  for (DType t : kTypes) {
    const bool half = isHalfType(t);
    // The shared-memory path's partials (Note [Half types in shared memory]): float32 for half types.
    const DType shm_partial = half ? DType::kFloat32 : t;
    all.push_back({"sum", t, "dst = a + b (a hop)", [t](int64_t n, std::vector<char*>& in, char* out, void*) {
                     hostReduce(RedOp::kSum, in[0], t, in[1], t, out, t, n, Scaling{});
                   }, {t, t}});
    all.push_back({"avg-final", t, "dst = round(a + b) / 2 (the ring's last hop, tensor-type partials)",
                   [t](int64_t n, std::vector<char*>& in, char* out, void*) {
                     hostReduce(RedOp::kAvg, in[0], t, in[1], t, out, t, n, finalScaling(RedOp::kAvg, 2, 1, 0, 0, true));
                   }, {t, t}});
    for (int ranks : {2, 4}) {
      all.push_back({"shm-avg-" + std::to_string(ranks), t, "shared memory's reduce of every rank's copy",
                     [t, shm_partial, ranks, half](int64_t n, std::vector<char*>& in, char* out, void* scratch) {
                       std::vector<const void*> inputs(in.begin(), in.end());
                       hostReduceInOrder(t, shm_partial, RedOp::kAvg, inputs, out, n,
                                         finalScaling(RedOp::kAvg, ranks, 1, 0, 0, !half), scratch);
                     }, std::vector<DType>(static_cast<size_t>(ranks), t)});
    }
    all.push_back({"shm-sum-2", t, "the same, SUM", [t, shm_partial, half](int64_t n, std::vector<char*>& in, char* out,
                                                                          void* scratch) {
                     std::vector<const void*> inputs(in.begin(), in.end());
                     hostReduceInOrder(t, shm_partial, RedOp::kSum, inputs, out, n,
                                       finalScaling(RedOp::kSum, 2, 1, 0, 0, !half), scratch);
                   }, {t, t}});
    all.push_back({"predivide", t, "dst = a / 3 (predivide_factor)", [t](int64_t n, std::vector<char*>& in, char* out, void*) {
                     hostConvert(in[0], t, out, t, n, 3.0);
                   }, {t}});
  }
  for (DType w : {DType::kBFloat16, DType::kFloat16}) {
    const std::string wn = w == DType::kBFloat16 ? "bf16" : "fp16";
    all.push_back({"to-" + wn, DType::kFloat32, "float32 -> 16-bit wire (first hop)",
                   [w](int64_t n, std::vector<char*>& in, char* out, void*) {
                     hostConvert(in[0], DType::kFloat32, out, w, n, 0);
                   }, {DType::kFloat32}});
    all.push_back({"from-" + wn, DType::kFloat32, "16-bit wire -> float32 (16-bit all-gather)",
                   [w](int64_t n, std::vector<char*>& in, char* out, void*) {
                     hostConvert(in[0], w, out, DType::kFloat32, n, 0);
                   }, {w}});
    all.push_back({"wire-hop-" + wn, DType::kFloat32, "16-bit partial = round(a + widen(b))",
                   [w](int64_t n, std::vector<char*>& in, char* out, void*) {
                     hostReduce(RedOp::kSum, in[0], DType::kFloat32, in[1], w, out, w, n, Scaling{});
                   }, {DType::kFloat32, w}});
    all.push_back({"wire-avg-" + wn, DType::kFloat32, "float32 = through16((a + widen(b)) / 2) (16-bit all-gather's owner)",
                   [w](int64_t n, std::vector<char*>& in, char* out, void*) {
                     Scaling s = finalScaling(RedOp::kAvg, 2, 1, 0, 0, true);
                     s.wire_round = static_cast<int32_t>(w);
                     hostReduce(RedOp::kAvg, in[0], DType::kFloat32, in[1], w, out, DType::kFloat32, n, s);
                   }, {DType::kFloat32, w}});
  }
  return all;
}

void usage() {
  std::fprintf(stderr,
               "usage: bench_host_loops [--bytes 64K,1M,16M] [--seconds S] [--filter SUBSTRING] [--isa portable|avx2|avx512]\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {64 << 10, 1 << 20, 16 << 20};
  double seconds = 0.2;
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) {
      usage();
      return 2;
    }
    const std::string value = argv[++i];
    if (arg == "--bytes") {
      sizes.clear();
      size_t at = 0;
      while (at <= value.size()) {
        const size_t comma = value.find(',', at);
        sizes.push_back(parseBytes(value.substr(at, comma == std::string::npos ? std::string::npos : comma - at)));
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    } else if (arg == "--seconds") {
      seconds = std::atof(value.c_str());
    } else if (arg == "--filter") {
      filter = value;
    } else if (arg == "--isa" && (value == "portable" || value == "avx2" || value == "avx512")) {
      const HostIsa isa = value == "avx512" ? HostIsa::kAvx512 : value == "avx2" ? HostIsa::kAvx2 : HostIsa::kPortable;
      if (!hostIsaSupported(isa)) {
        std::fprintf(stderr, "bench_host_loops: this CPU cannot run the %s loops\n", hostIsaName(isa));
        return 2;
      }
      setHostIsa(isa);
    } else {
      usage();
      return 2;
    }
  }
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) < 0) load[0] = -1;
  std::string model = "unknown CPU";
  if (FILE* f = std::fopen("/proc/cpuinfo", "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, f)) {
      if (std::strncmp(line, "model name", 10) == 0) {
        const char* colon = std::strchr(line, ':');
        model = colon ? std::string(colon + 2) : model;
        model.erase(model.find_last_not_of("\n") + 1);
        break;
      }
    }
    std::fclose(f);
  }
  std::printf("# bench_host_loops: %s, %s loops, load average %.2f at start; %.2f s per loop and size\n",
              model.c_str(), hostIsaName(hostIsa()), load[0], seconds);
  std::printf("# %-14s %-9s %8s %9s %9s %9s %9s\n", "loop", "dtype", "bytes", "us", "GB/s", "memcpy", "/memcpy");
  void* scratch = std::aligned_alloc(64, kReduceInOrderScratchBytes);
  for (const int64_t bytes : sizes) {
    Buffer src(static_cast<size_t>(bytes)), dst(static_cast<size_t>(bytes));
    fill(src.data, DType::kUInt8, bytes, 1);
    const std::function<void()> copy = [&] { std::memcpy(dst.data, src.data, static_cast<size_t>(bytes)); };
    for (Loop& loop : loops()) {
      if (!filter.empty() && loop.name.find(filter) == std::string::npos && filter != dtypeName(loop.dtype)) continue;
      const int64_t count = bytes / static_cast<int64_t>(dtypeSize(loop.dtype));
      std::vector<std::unique_ptr<Buffer>> owned;
      std::vector<char*> in;
      for (size_t k = 0; k < loop.inputs.size(); ++k) {
        const DType t = loop.inputs[k];
        owned.push_back(std::make_unique<Buffer>(static_cast<size_t>(count) * dtypeSize(t)));
        fill(owned.back()->data, t, count, static_cast<unsigned>(7 + k));
        in.push_back(owned.back()->data);
      }
      Buffer out(static_cast<size_t>(count) * 8);
      const auto [s, memcpy_s] = bestSeconds([&] { loop.run(count, in, out.data, scratch); }, copy, seconds);
      std::printf("  %-14s %-9s %8s %9.1f %9.2f %9.1f %9.2f\n", loop.name.c_str(), dtypeName(loop.dtype),
                  formatBytes(bytes).c_str(), s * 1e6, static_cast<double>(bytes) / s / 1e9, memcpy_s * 1e6,
                  s / memcpy_s);
      std::fflush(stdout);
    }
  }
  std::free(scratch);
  if (getloadavg(load, 3) >= 0) std::printf("# load average %.2f at end\n", load[0]);
  return 0;
}
