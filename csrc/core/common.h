// ringreduce core: the host/device macros and small arithmetic helpers. csrc/core is free of torch
// and CUDA runtime headers; headers shared with device code use RR_HD_INLINE.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define RR_HD_INLINE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Forced as on the device: the host reduce loops vectorize only when every step is inlined, which
// GCC's own limits stop doing once a loop body grows.
#define RR_HD_INLINE inline __attribute__((always_inline))
#else
#define RR_HD_INLINE inline
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
