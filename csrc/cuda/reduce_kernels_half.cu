// ringreduce GPU: the float16/bfloat16 reduce kernels (see reduce_launch.cuh for the split).
#include "reduce_launch.cuh"

namespace rr {

#define RR_INST_PREFIX template
RR_INST_HALF_TYPES
#undef RR_INST_PREFIX

}  // namespace rr
