// ringreduce core: the one host/device macro family and small arithmetic helpers.
//
// Everything under csrc/core is free of torch and of CUDA runtime headers. Headers that are shared
// with device code use RR_HD_INLINE so that nvcc compiles the same arithmetic for both sides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define RR_HD_INLINE __host__ __device__ __forceinline__
#define RR_HD __host__ __device__
#elif defined(__GNUC__)
// Forced as on the device: the host reduce loops vectorize only when every step is inlined, and
// GCC's own limits stopped doing that once a loop body grew (64 MiB AVG took 2-4x as long).
#define RR_HD_INLINE inline __attribute__((always_inline))
#define RR_HD
#else
#define RR_HD_INLINE inline
#define RR_HD
#endif

namespace rr {

template <typename To, typename From>
RR_HD_INLINE To bitCast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bitCast needs equal sizes");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

RR_HD_INLINE int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
RR_HD_INLINE int64_t roundUp(int64_t a, int64_t b) { return ceilDiv(a, b) * b; }
RR_HD_INLINE int64_t minI64(int64_t a, int64_t b) { return a < b ? a : b; }
RR_HD_INLINE int64_t maxI64(int64_t a, int64_t b) { return a > b ? a : b; }
RR_HD_INLINE int modRing(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

}  // namespace rr
