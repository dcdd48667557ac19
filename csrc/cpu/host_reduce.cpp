#include "host_reduce.h"

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

}  // namespace rr
