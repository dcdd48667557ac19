#include "host_reduce.h"

#include <algorithm>
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
    if constexpr (std::is_same<TD, float>::value) {
      if (sc.wire_round >= 0) {  // the owner's final reduce of a 16-bit all-gather (Note [16-bit all-gather])
        for (int64_t i = 0; i < count; ++i)
          pd[i] = roundThroughWire(ReduceStep<TA, TB, TD, op>::apply(pa[i], pb[i], sc), sc.wire_round);
        return;
      }
    }
    if (sc.predivide > 0 || sc.divisor > 0 || sc.postscale > 0) {
      const Scaling scaled = sc;  // a local copy: no store through pd can change it
      for (int64_t i = 0; i < count; ++i) pd[i] = ReduceStep<TA, TB, TD, op>::apply(pa[i], pb[i], scaled);
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
  InOrderReduce r;
  r.dtype = r.round_to = r.dst = dtype;
  r.partial = partial;
  r.op = op;
  r.scaling = scaling;
  hostReduceInOrder(r, inputs, dst, count, scratch);
}

void hostReduceInOrder(const InOrderReduce& r, const std::vector<const void*>& inputs, void* dst, int64_t count,
                       void* scratch) {
  const size_t n = inputs.size();
  RR_CHECK(n >= 1, kRuntime, "ringreduce internal error: a reduction of no inputs");
  // Inputs rounded to a 16-bit wire first (Note [Direct all-reduce]): the steps read the rounded
  // values, which carry the predivide already.
  const bool rounds = r.round_to != r.dtype;
  const DType in_type = r.round_to;
  const size_t elem = dtypeSize(r.dtype);
  const size_t dst_elem = dtypeSize(r.dst);
  const size_t celem = dtypeSize(in_type);
  const size_t pelem = std::max(celem, dtypeSize(r.partial));
  Scaling last = r.scaling;
  if (rounds) last.predivide = 0;
  // Float32 partials of a half type start narrow (the ring's first hop sends the tensor's elements);
  // a 16-bit wire or a predivide converts the first input (Note [First hop] in plan.h).
  const bool wide = isHalfType(in_type) && r.partial == DType::kFloat32;
  const bool convert_first = rounds || (r.partial != in_type && !wide) || last.predivide > 0;
  Scaling hop;
  hop.predivide = last.predivide;
  char* s[2] = {static_cast<char*>(scratch), static_cast<char*>(scratch) + kReduceInOrderBlock * pelem};
  char* rounded = static_cast<char*>(scratch) + 2 * kReduceInOrderBlock * pelem;  // an input rounded to in_type
  RR_CHECK(!rounds || (2 * pelem + celem) * kReduceInOrderBlock <= kReduceInOrderScratchBytes, kRuntime,
           "ringreduce internal error: in-order scratch too small");
  std::vector<const char*> in(n);
  for (int64_t at = 0; at < count; at += kReduceInOrderBlock) {
    const int64_t m = count - at < kReduceInOrderBlock ? count - at : kReduceInOrderBlock;
    for (size_t k = 0; k < n; ++k) in[k] = static_cast<const char*>(inputs[k]) + static_cast<size_t>(at) * elem;
    char* out_last = static_cast<char*>(dst) + static_cast<size_t>(at) * dst_elem;
    if (n == 1) {
      RR_CHECK(r.scaling.predivide == 0 && r.scaling.divisor <= 1 && r.scaling.postscale == 0 && !rounds &&
                   r.dst == r.dtype,
               kRuntime, "ringreduce internal error: a one-input reduction that scales or converts");
      if (out_last != in[0]) std::memcpy(out_last, in[0], static_cast<size_t>(m) * elem);
      continue;
    }
    // The partial (second operand) must never be what the last step writes: a first input that is
    // dst starts as a copy.
    const void* acc = in[0];
    DType acc_type = in_type;
    if (convert_first) {
      const DType first = rounds || wide ? in_type : r.partial;
      hostConvert(in[0], r.dtype, s[0], first, m, r.scaling.predivide);
      acc = s[0];
      acc_type = first;
    } else if (acc == out_last) {
      std::memcpy(s[0], in[0], static_cast<size_t>(m) * elem);
      acc = s[0];
    }
    for (size_t k = 1; k < n; ++k) {
      const bool is_last = k + 1 == n;
      const void* a = in[k];
      if (rounds) {
        hostConvert(in[k], r.dtype, rounded, in_type, m, r.scaling.predivide);
        a = rounded;
      }
      void* out = is_last ? static_cast<void*>(out_last) : s[k % 2];
      const DType out_type = is_last ? r.dst : r.partial;
      hostReduce(r.op, a, in_type, acc, acc_type, out, out_type, m, is_last ? last : hop);
      acc = out;
      acc_type = out_type;
    }
  }
}

}  // namespace rr
