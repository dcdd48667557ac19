// ringreduce CPU: the instruction set the host loops (host_reduce.cpp) run with, chosen at run time.
//
// Note [Host loop instruction sets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The build has no -march flag (the extension must run on every x86-64 CPU, and elsewhere), so the
// host loops are compiled twice: portable (the baseline instruction set: SSE2 on x86-64) and, on x86,
// for AVX2 with F16C (functions with target attributes, csrc/cpu/half_vector.h). The first loop picks
// AVX2 where the CPU and its OS support both (__builtin_cpu_supports), else portable. Both give the
// bits of the scalar functors (Note [Reduction contract] in csrc/core/functors.h); the C++ test
// tests/cpp/test_host_loops.cpp runs every loop under each and compares them with the functors.
#pragma once

namespace rr {

enum class HostIsa : int {
  kPortable = 0,
  kAvx2 = 1,  // AVX2 + F16C (x86)
};

// The instruction set the host loops run with now (detected once, or the last setHostIsa).
HostIsa hostIsa();
// Whether this CPU and build can run `isa`'s loops.
bool hostIsaSupported(HostIsa isa);
// Makes the host loops run with `isa` (tests and bench_host_loops compare the two); rr::Error(kValue)
// for one that hostIsaSupported denies. Set it before loops run on other threads, never during.
void setHostIsa(HostIsa isa);
const char* hostIsaName(HostIsa isa);  // "portable", "avx2+f16c"

}  // namespace rr
