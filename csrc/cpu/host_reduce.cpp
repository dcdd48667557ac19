#include "host_reduce.h"

#include <cstring>

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
  int divisor;
  bool round_sum;

  template <typename TA, typename TB, typename TD, RedOp op>
  void run() const {
    const TA* __restrict__ pa = static_cast<const TA*>(a);
    const TB* __restrict__ pb = static_cast<const TB*>(b);
    TD* pd = static_cast<TD*>(dst);  // may alias pa (in-place reduce)
    if (op == RedOp::kAvg && divisor > 0) {
      for (int64_t i = 0; i < count; ++i) pd[i] = ReduceStep<TA, TB, TD, op>::apply(pa[i], pb[i], divisor, round_sum);
    } else {
      for (int64_t i = 0; i < count; ++i) pd[i] = ReduceStep<TA, TB, TD, op>::apply(pa[i], pb[i], 0, false);
    }
  }
};

}  // namespace

void hostReduce(DType dtype, RedOp op, const void* a, bool a_wide, const void* b, bool b_wide,
                void* dst, bool dst_wide, int64_t count, int divisor, bool round_sum) {
  checkSupported(dtype, op);
  if (count <= 0) return;
  HostLoop loop{a, b, dst, count, divisor, round_sum};
  dispatchReduce(dtype, op, a_wide, b_wide, dst_wide, loop);
}

void hostReduceInOrder(DType dtype, RedOp op, const std::vector<const void*>& inputs, void* dst, int64_t count,
                       int divisor, bool accum_float32, void* scratch) {
  const size_t n = inputs.size();
  RR_CHECK(n >= 1, kRuntime, "ringreduce internal error: a reduction of no inputs");
  const bool wide = accum_float32 && isHalfType(dtype);
  const size_t elem = dtypeSize(dtype);
  const size_t partial = wide ? sizeof(float) : elem;
  char* s[2] = {static_cast<char*>(scratch), static_cast<char*>(scratch) + kReduceInOrderBlock * partial};
  std::vector<const char*> in(n);
  for (int64_t at = 0; at < count; at += kReduceInOrderBlock) {
    const int64_t m = count - at < kReduceInOrderBlock ? count - at : kReduceInOrderBlock;
    const size_t off = static_cast<size_t>(at) * elem;
    for (size_t k = 0; k < n; ++k) in[k] = static_cast<const char*>(inputs[k]) + off;
    char* out_last = static_cast<char*>(dst) + off;
    if (n == 1) {
      if (out_last != in[0]) std::memcpy(out_last, in[0], static_cast<size_t>(m) * elem);
      continue;
    }
    // The partial is the second operand, which must never be what the last step writes (dst may
    // alias only the first): a first input that is dst starts as a copy.
    const void* acc = in[0];
    if (acc == out_last) {
      std::memcpy(s[0], in[0], static_cast<size_t>(m) * elem);
      acc = s[0];
    }
    bool acc_wide = false;
    for (size_t k = 1; k < n; ++k) {
      const bool last = k + 1 == n;
      void* out = last ? static_cast<void*>(out_last) : s[k % 2];
      const bool out_wide = wide && !last;
      hostReduce(dtype, op, in[k], false, acc, acc_wide, out, out_wide, m, last && op == RedOp::kAvg ? divisor : 0,
                 /*round_sum=*/!wide);
      acc = out;
      acc_wide = out_wide;
    }
  }
}

}  // namespace rr
