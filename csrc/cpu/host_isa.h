// ringreduce CPU: the instruction set the host loops (host_reduce.cpp) run with, chosen at run time.
//
// Note [Host loop instruction sets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The build has no -march flag (the extension must run on every x86-64 CPU, and elsewhere), so the
// host loops are compiled three times: portable (the baseline instruction set: SSE2 on x86-64) and,
// on x86, for AVX2 with F16C and for AVX-512 F + BW + VL (functions with target attributes,
// csrc/cpu/half_vector.h). The first loop picks the widest the CPU and its OS support
// (__builtin_cpu_supports, which checks the OS saves the registers), else portable. All give the bits
// of the scalar functors (Note [Reduction contract] in csrc/core/functors.h); the C++ test
// tests/cpp/test_host_loops.cpp runs every loop under each this CPU has and compares them with the
// functors. AVX-512 pays for the 16-bit types: widening, narrowing and rounding 16 lanes at a time,
// with masks where AVX2 blends (bench_host_loops --isa compares them).
#pragma once

namespace rr {

enum class HostIsa : int {
  kPortable = 0,
  kAvx2 = 1,    // AVX2 + F16C (x86)
  kAvx512 = 2,  // AVX-512 F + BW + VL, with AVX2 and F16C (x86)
};

// The instruction set the host loops run with now (detected once, or the last setHostIsa).
HostIsa hostIsa();
// Whether this CPU and build can run `isa`'s loops.
bool hostIsaSupported(HostIsa isa);
// Makes the host loops run with `isa` (tests and bench_host_loops compare them); rr::Error(kValue)
// for one that hostIsaSupported denies. Set it before loops run on other threads, never during.
void setHostIsa(HostIsa isa);
const char* hostIsaName(HostIsa isa);  // "portable", "avx2+f16c", "avx512"

}  // namespace rr
