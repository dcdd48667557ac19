#include "host_reduce.h"

#include <cstring>
#include <type_traits>

#include "../core/error.h"
#include "../core/functors.h"
#include "../core/reduce_dispatch.h"

namespace rr {

namespace {

// dst[i] = ReduceStep(a[i], b[i]) (functors.h, Note [Reduction contract]) over plain loops the
// compiler vectorizes; the storage types come from the one dispatch table the kernels use too.
struct HostLoop {
  const void* a;
  const void* b;
  void* dst;
  int64_t count;
  Scaling sc;

  template <typename TA, typename TB, typename TD, RedOp op>
  void run() const {
    const TA* __restrict__ pa = static_cast<const TA*>(a);
    const TB* __restrict__ pb = static_cast<const TB*>(b);
    TD* pd = static_cast<TD*>(dst);  // may alias pa (in-place reduce)
    if (sc.predivide > 0 || sc.divisor > 0 || sc.postscale > 0) {
      for (int64_t i = 0; i < count; ++i) pd[i] = ReduceStep<TA, TB, TD, op>::apply(pa[i], pb[i], sc);
    } else {
      const Scaling none;  // a constant the compiler folds: the plain loop vectorizes
      for (int64_t i = 0; i < count; ++i) pd[i] = ReduceStep<TA, TB, TD, op>::apply(pa[i], pb[i], none);
    }
  }
};

struct HostConvert {
  const void* a;
  void* dst;
  int64_t count;
  double predivide;

  template <typename TS, typename TD>
  void convert() const {
    const TS* pa = static_cast<const TS*>(a);
    TD* pd = static_cast<TD*>(dst);  // may alias pa (an in-place predivide)
    if (predivide > 0) {
      for (int64_t i = 0; i < count; ++i) pd[i] = ConvertStep<TS, TD>::apply(pa[i], predivide);
    } else {
      for (int64_t i = 0; i < count; ++i) pd[i] = ConvertStep<TS, TD>::apply(pa[i], 0);
    }
  }
};

// Note [One-pass reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~
// hostReduceInOrder's steps element by element: the partial of a lane of kOnePassLanes elements
// stays in registers (or L1) across all n inputs, and each result is stored once, where the steps
// run n - 1 loops over a block and pass the partials through scratch memory. The same ReduceStep
// calls in the same order give the same bits: step k (1 <= k < n - 1) is ReduceStep<T, P, P>(input k,
// partial), the last ReduceStep<T, P, T>(input n - 1, partial, scaling); the first partial is input 0
// loaded exactly (P is T, or float32 for a half type: Note [Half types in shared memory] in
// shm_ring.h). It reads n x count elements and writes count, instead of about 3 (n - 1) x count
// moved through scratch, and needs no scratch; its bfloat16 store has no branch, so it vectorizes.
// The rule (onePassFits): SUM and AVG of float32 and float64 on three or more ranks, of float16
// and bfloat16 on two or more, with partials of the tensor's type or, for half types, float32, and
// no predivide factor (whose first hop converts); anything else takes the steps (two float32 or
// float64 inputs make one loop there anyway).
constexpr int64_t kOnePassLanes = 64;

// Convert<float, BFloat16>::store without a branch (the same bits: round to nearest even, NaN to the
// canonical quiet NaN), so that the store loop vectorizes.
template <typename T, typename Acc>
inline T storeLane(Acc v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    const uint32_t bits = bitCast<uint32_t>(v);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return BFloat16{static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded)};
  } else {
    return Convert<Acc, T>::store(v);
  }
}

// kRound: partials of the tensor's own (half) type, rounded after every step; otherwise they stay in
// the accumulation type (float32 for half types). SUM and AVG combine alike (the AVG division is
// the last step's scaling).
template <typename T, bool kRound>
void onePass(const std::vector<const char*>& in, void* dst, int64_t count, const Scaling& last) {
  using Acc = typename AccOf<T>::type;
  const size_t n = in.size();
  T* out = static_cast<T*>(dst);  // may be in[0] (each lane is read before it is written)
  const bool scales = last.divisor > 0 || last.postscale > 0;
  Acc acc[kOnePassLanes];
  for (int64_t at = 0; at < count; at += kOnePassLanes) {
    const int64_t m = count - at < kOnePassLanes ? count - at : kOnePassLanes;
    const T* first = reinterpret_cast<const T*>(in[0]) + at;
    for (int64_t j = 0; j < m; ++j) acc[j] = Convert<Acc, T>::load(first[j]);
    for (size_t k = 1; k + 1 < n; ++k) {
      const T* x = reinterpret_cast<const T*>(in[k]) + at;
      for (int64_t j = 0; j < m; ++j) {
        const Acc sum = Convert<Acc, T>::load(x[j]) + acc[j];  // ReduceStep: input (op) partial
        acc[j] = kRound ? roundTo<Acc, T>(sum) : sum;
      }
    }
    const T* x = reinterpret_cast<const T*>(in[n - 1]) + at;
    if (scales) {
      for (int64_t j = 0; j < m; ++j) out[at + j] = storeLane<T>(scaleFinal<T>(Convert<Acc, T>::load(x[j]) + acc[j], last));
    } else {
      for (int64_t j = 0; j < m; ++j) out[at + j] = storeLane<T>(Convert<Acc, T>::load(x[j]) + acc[j]);
    }
  }
}

bool onePassFits(DType dtype, DType partial, RedOp op, const Scaling& scaling, size_t n) {
  const bool half = isHalfType(dtype);
  const bool type_ok = dtype == DType::kFloat32 || dtype == DType::kFloat64 || half;
  // Two float32/float64 inputs: the steps are one loop already (measured no slower).
  return (n >= 3 || (n == 2 && half)) && (op == RedOp::kSum || op == RedOp::kAvg) && type_ok && scaling.predivide <= 0 &&
         (partial == dtype || (half && partial == DType::kFloat32));
}

void onePassDispatch(DType dtype, DType partial, const std::vector<const char*>& in, void* dst, int64_t count,
                     const Scaling& last) {
  const bool round = partial == dtype;  // half types: partials of their own type (accum_dtype named it)
  switch (dtype) {
    case DType::kFloat32: return onePass<float, false>(in, dst, count, last);
    case DType::kFloat64: return onePass<double, false>(in, dst, count, last);
    case DType::kFloat16:
      return round ? onePass<Half, true>(in, dst, count, last) : onePass<Half, false>(in, dst, count, last);
    case DType::kBFloat16:
      return round ? onePass<BFloat16, true>(in, dst, count, last) : onePass<BFloat16, false>(in, dst, count, last);
    default: break;
  }
  RR_THROW(kRuntime, "ringreduce internal error: a one-pass reduce of ", dtypeName(dtype));
}

}  // namespace

void hostReduce(RedOp op, const void* a, DType a_type, const void* b, DType b_type, void* dst, DType dst_type,
                int64_t count, const Scaling& scaling) {
  checkSupported(a_type, op);
  if (count <= 0) return;
  HostLoop loop{a, b, dst, count, scaling};
  dispatchReduce(op, a_type, b_type, dst_type, loop);
}

void hostConvert(const void* a, DType a_type, void* dst, DType dst_type, int64_t count, double predivide) {
  if (count <= 0) return;
  HostConvert c{a, dst, count, predivide};
  dispatchConvert(a_type, dst_type, c);
}

void hostReduceInOrder(DType dtype, DType partial, RedOp op, const std::vector<const void*>& inputs, void* dst,
                       int64_t count, const Scaling& scaling, void* scratch) {
  const size_t n = inputs.size();
  RR_CHECK(n >= 1, kRuntime, "ringreduce internal error: a reduction of no inputs");
  if (count <= 0) return;
  if (onePassFits(dtype, partial, op, scaling, n)) {  // Note [One-pass reduce]
    std::vector<const char*> in(n);
    for (size_t k = 0; k < n; ++k) in[k] = static_cast<const char*>(inputs[k]);
    onePassDispatch(dtype, partial, in, dst, count, scaling);
    return;
  }
  const size_t elem = dtypeSize(dtype);
  const size_t pelem = std::max(elem, dtypeSize(partial));
  // Float32 partials of a half type start narrow (the ring's first hop sends the tensor's elements);
  // a 16-bit wire or a predivide converts the first input (Note [First hop] in plan.h).
  const bool wide = isHalfType(dtype) && partial == DType::kFloat32;
  const bool convert_first = (partial != dtype && !wide) || scaling.predivide > 0;
  Scaling hop;
  hop.predivide = scaling.predivide;
  char* s[2] = {static_cast<char*>(scratch), static_cast<char*>(scratch) + kReduceInOrderBlock * pelem};
  std::vector<const char*> in(n);
  for (int64_t at = 0; at < count; at += kReduceInOrderBlock) {
    const int64_t m = count - at < kReduceInOrderBlock ? count - at : kReduceInOrderBlock;
    const size_t off = static_cast<size_t>(at) * elem;
    for (size_t k = 0; k < n; ++k) in[k] = static_cast<const char*>(inputs[k]) + off;
    char* out_last = static_cast<char*>(dst) + off;
    if (n == 1) {
      RR_CHECK(scaling.predivide == 0 && scaling.divisor <= 1 && scaling.postscale == 0, kRuntime,
               "ringreduce internal error: a one-input reduction that scales");
      if (out_last != in[0]) std::memcpy(out_last, in[0], static_cast<size_t>(m) * elem);
      continue;
    }
    // The partial is the second operand, which must never be what the last step writes (dst may
    // alias only the first): a first input that is dst starts as a copy.
    const void* acc = in[0];
    DType acc_type = dtype;
    if (convert_first) {
      const DType first = wide ? dtype : partial;
      hostConvert(in[0], dtype, s[0], first, m, scaling.predivide);
      acc = s[0];
      acc_type = first;
    } else if (acc == out_last) {
      std::memcpy(s[0], in[0], static_cast<size_t>(m) * elem);
      acc = s[0];
    }
    for (size_t k = 1; k < n; ++k) {
      const bool last = k + 1 == n;
      void* out = last ? static_cast<void*>(out_last) : s[k % 2];
      const DType out_type = last ? dtype : partial;
      hostReduce(op, in[k], dtype, acc, acc_type, out, out_type, m, last ? scaling : hop);
      acc = out;
      acc_type = out_type;
    }
  }
}

}  // namespace rr
