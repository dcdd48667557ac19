// ringreduce GPU: one elementwise reduce as the ring driver asks for it and the kernels' launcher takes
// it (launchReduce, reduce_kernels.cuh). Plain C++, no CUDA: the driver is tested on the host.
#pragma once

#include <cstdint>

#include "../core/dtype.h"
#include "../core/functors.h"

namespace rr {

// dst = a (op) b, each operand of its own type. b null: a convert (Note [First hop] in plan.h),
// dst = a / scaling.predivide in dst's type.
struct ReduceLaunch {
  const void* a;
  DType a_type;
  const void* b;
  DType b_type;
  void* dst;
  DType dst_type;
  int64_t count;
  Scaling scaling;  // Plan::scaling(): predivide, and AVG's (or a post factor's) final scaling
  RedOp op;         // the stage's reduction (a hierarchical AVG sums in its first stage)
};

}  // namespace rr
