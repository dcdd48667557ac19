// ringreduce core: the body of the GPU reduce kernel, written once for device and host.
//
// Note [Vectorized reduce with scalar head and tail]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// dst[i] = ReduceStep<TA, TB, TD, op>(a[i], b[i]) for i < count; dst may alias a (in-place
// reduce-scatter). ConvertBody (dst[i] = ConvertStep(a[i])) is the same loop without b. The operands
// need not share an alignment (a and dst are at the tensor's storage offset, b in staging), so:
//   * V = 16 / (largest element size) elements form a vector, stored as one aligned Pack<TD, V>;
//   * head = elements until dst is Pack-aligned (all of them if dst is not even TD-aligned), then
//     whole vectors, then the tail;
//   * a and b are checked separately at the body's start: an unaligned one loads element-wise.
// Threads split the work grid-stride; each element is computed by one thread with the same functor,
// so the result does not depend on the launch shape. CUDA-free: the kernel
// (csrc/cuda/reduce_kernels.cu) and the host tests (every simulated thread of a small grid) run it.
#pragma once

#include <cstdint>

#include "common.h"
#include "functors.h"

namespace rr {

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename TA, typename TB, typename TD>
struct VectorShape {
  static constexpr size_t kMax = sizeof(TA) > sizeof(TB) ? (sizeof(TA) > sizeof(TD) ? sizeof(TA) : sizeof(TD))
                                                         : (sizeof(TB) > sizeof(TD) ? sizeof(TB) : sizeof(TD));
  static constexpr int V = kMax >= 16 ? 1 : static_cast<int>(16 / kMax);
};

template <typename T, int V>
RR_HD_INLINE bool packAligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * V)) == 0;
}

// Elements before dst reaches Pack<TD, V> alignment (count when it never does).
template <typename TD, int V>
RR_HD_INLINE int64_t headElements(const void* dst, int64_t count) {
  const uintptr_t bytes = sizeof(TD) * V;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) % bytes;
  if (mis % sizeof(TD) != 0) return count;
  const int64_t h = static_cast<int64_t>(((bytes - mis) % bytes) / sizeof(TD));
  return h < count ? h : count;
}

template <typename TA, typename TB, typename TD, RedOp op>
struct ReduceBody {
  static constexpr int V = VectorShape<TA, TB, TD>::V;
  using Step = ReduceStep<TA, TB, TD, op>;

  // Vectors [0, nvec) of the body; dst is Pack-aligned, a/b are when kVecA/kVecB.
  template <bool kVecA, bool kVecB>
  RR_HD_INLINE static void body(const TA* va, const TB* vb, TD* vd, int64_t nvec, const Scaling& sc, int64_t thread,
                                int64_t nthreads) {
    for (int64_t k = thread; k < nvec; k += nthreads) {
      Pack<TD, V> pd;
      if constexpr (kVecA && kVecB) {
        const Pack<TA, V> pa = reinterpret_cast<const Pack<TA, V>*>(va)[k];
        const Pack<TB, V> pb = reinterpret_cast<const Pack<TB, V>*>(vb)[k];
        for (int u = 0; u < V; ++u) pd.v[u] = Step::apply(pa.v[u], pb.v[u], sc);
      } else if constexpr (kVecA) {
        const Pack<TA, V> pa = reinterpret_cast<const Pack<TA, V>*>(va)[k];
        for (int u = 0; u < V; ++u) pd.v[u] = Step::apply(pa.v[u], vb[k * V + u], sc);
      } else {
        static_assert(!kVecB, "b is loaded as a vector only together with a");
        for (int u = 0; u < V; ++u) pd.v[u] = Step::apply(va[k * V + u], vb[k * V + u], sc);
      }
      reinterpret_cast<Pack<TD, V>*>(vd)[k] = pd;
    }
  }

  // The elements of [0, count) that belong to `thread` of `nthreads`.
  RR_HD_INLINE static void run(const TA* a, const TB* b, TD* dst, int64_t count, const Scaling& sc,
                               int64_t thread, int64_t nthreads) {
    const int64_t head = headElements<TD, V>(dst, count);
    const int64_t nvec = (count - head) / V;
    const int64_t tail = head + nvec * V;
    for (int64_t i = thread; i < head; i += nthreads) dst[i] = Step::apply(a[i], b[i], sc);
    if (nvec > 0) {
      // Separate loop versions, not a branch per vector: with both loads in one body a compiler may
      // merge them into the aligned one (GCC does) and fault on misaligned operands. The rare
      // "b aligned, a not" takes the scalar-load version.
      const bool a_vec = packAligned<TA, V>(a + head);
      const bool b_vec = packAligned<TB, V>(b + head);
      if (a_vec && b_vec) {
        body<true, true>(a + head, b + head, dst + head, nvec, sc, thread, nthreads);
      } else if (a_vec) {
        body<true, false>(a + head, b + head, dst + head, nvec, sc, thread, nthreads);
      } else {
        body<false, false>(a + head, b + head, dst + head, nvec, sc, thread, nthreads);
      }
    }
    for (int64_t i = tail + thread; i < count; i += nthreads)
      dst[i] = Step::apply(a[i], b[i], sc);
  }
};

// dst[i] = ConvertStep<TS, TD>(a[i], predivide) for i < count, split like ReduceBody (a may be dst:
// an in-place predivide).
template <typename TS, typename TD>
struct ConvertBody {
  static constexpr int V = VectorShape<TS, TS, TD>::V;
  using Step = ConvertStep<TS, TD>;

  RR_HD_INLINE static void run(const TS* a, TD* dst, int64_t count, double predivide, int64_t thread,
                               int64_t nthreads) {
    const int64_t head = headElements<TD, V>(dst, count);
    const int64_t nvec = (count - head) / V;
    const int64_t tail = head + nvec * V;
    for (int64_t i = thread; i < head; i += nthreads) dst[i] = Step::apply(a[i], predivide);
    if (nvec > 0) {
      const TS* va = a + head;
      TD* vd = dst + head;
      if (packAligned<TS, V>(va)) {
        for (int64_t k = thread; k < nvec; k += nthreads) {
          const Pack<TS, V> pa = reinterpret_cast<const Pack<TS, V>*>(va)[k];
          Pack<TD, V> pd;
          for (int u = 0; u < V; ++u) pd.v[u] = Step::apply(pa.v[u], predivide);
          reinterpret_cast<Pack<TD, V>*>(vd)[k] = pd;
        }
      } else {
        for (int64_t k = thread; k < nvec; k += nthreads) {
          Pack<TD, V> pd;
          for (int u = 0; u < V; ++u) pd.v[u] = Step::apply(va[k * V + u], predivide);
          reinterpret_cast<Pack<TD, V>*>(vd)[k] = pd;
        }
      }
    }
    for (int64_t i = tail + thread; i < count; i += nthreads) dst[i] = Step::apply(a[i], predivide);
  }
};

}  // namespace rr
