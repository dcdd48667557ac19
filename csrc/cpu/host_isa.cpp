#include "host_isa.h"

#include <atomic>

#include "../core/error.h"

namespace rr {

namespace {

HostIsa detect() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return HostIsa::kAvx512;
  if (avx2) return HostIsa::kAvx2;
#endif
  return HostIsa::kPortable;
}

// -1 until the first hostIsa(); loops read it once per call (relaxed: any value they see is valid).
std::atomic<int> g_isa{-1};

}  // namespace

HostIsa hostIsa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = static_cast<int>(detect());
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return static_cast<HostIsa>(isa);
}

// The instruction sets nest: a CPU with AVX-512's loops runs AVX2's too.
bool hostIsaSupported(HostIsa isa) { return static_cast<int>(isa) <= static_cast<int>(detect()); }

void setHostIsa(HostIsa isa) {
  RR_CHECK(hostIsaSupported(isa), kValue, "ringreduce: this CPU cannot run the ", hostIsaName(isa), " host loops");
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

const char* hostIsaName(HostIsa isa) {
  switch (isa) {
    case HostIsa::kAvx512: return "avx512";
    case HostIsa::kAvx2: return "avx2+f16c";
    case HostIsa::kPortable: break;
  }
  return "portable";
}

}  // namespace rr
