#include "direct.h"

#include <algorithm>

#include "error.h"

namespace rr {

namespace {

// Partials wider than the inputs make AVG divide the unrounded sum (Note [Reduction contract]).
bool roundsSum(DType inputs, DType partial) { return !(isHalfType(inputs) && partial == DType::kFloat32); }

Scaling directFinal(DType inputs, DType partial, int nranks, const DirectOptions& o, double predivide) {
  Scaling s = finalScaling(o.op, nranks, o.extra_divisor, o.pre_factor, predivide, roundsSum(inputs, partial));
  if (o.wire_dtype && o.wire_gather16) s.wire_round = static_cast<int32_t>(*o.wire_dtype);
  return s;
}

}  // namespace

DType directPartial(DType dtype, RedOp op, bool accum_narrow, const std::optional<DType>& wire) {
  const bool sum = op == RedOp::kSum || op == RedOp::kAvg;
  if (wire && dtype == DType::kFloat32 && isHalfType(*wire) && sum) return DType::kFloat32;
  if (isHalfType(dtype) && sum && !accum_narrow) return DType::kFloat32;
  return dtype;
}

InOrderReduce directInOrder(DType dtype, int nranks, const DirectOptions& o) {
  InOrderReduce r;
  r.dtype = dtype;
  r.round_to = o.wire_dtype ? *o.wire_dtype : dtype;
  r.partial = directPartial(dtype, o.op, o.accum_narrow, o.wire_dtype);
  r.dst = dtype;
  r.op = o.op;
  r.scaling = directFinal(r.round_to, r.partial, nranks, o, o.pre_factor);
  return r;
}

int32_t DirectPlan::numBuffers() const {
  const int32_t per_round = (nranks - 1) + (wire() ? nranks : 0);
  return nranks > 1 && rounds > 0 ? depth * per_round : 0;
}

int32_t DirectPlan::recvBuffer(int round, int peer) const {
  const int32_t per_round = (nranks - 1) + (wire() ? nranks : 0);
  return (round % depth) * per_round + (peer < rank ? peer : peer - 1);
}

int32_t DirectPlan::convertBuffer(int round, int chunk) const {
  const int32_t per_round = (nranks - 1) + nranks;
  return (round % depth) * per_round + (nranks - 1) + chunk;
}

bool DirectPlan::handsOffEveryRound() const {
  for (int c = 0; c < nranks; ++c)
    if (piece(c, 0).empty()) return true;
  return false;
}

DirectPlan buildDirectPlan(int nranks, int rank, int64_t numel, DType dtype, const DirectOptions& o) {
  RR_CHECK(nranks >= 1 && rank >= 0 && rank < nranks, kValue, "ringreduce: rank ", rank, " of a group of ", nranks);
  RR_CHECK(numel >= 0, kValue, "ringreduce: numel must be >= 0, got ", numel);
  RR_CHECK(o.max_segment_bytes >= 16 && o.staging_bytes >= 16 && o.buffer_align >= 1, kValue,
           "ringreduce: a direct all-reduce needs segments and staging of at least 16 bytes");
  RR_CHECK(!o.wire_dtype || (dtype == DType::kFloat32 && isHalfType(*o.wire_dtype) &&
                             (o.op == RedOp::kSum || o.op == RedOp::kAvg)),
           kValue, "ringreduce: a 16-bit wire (float16/bfloat16) applies to float32 SUM and AVG, got ",
           o.wire_dtype ? dtypeName(*o.wire_dtype) : "", " for ", dtypeName(dtype), " ", redOpName(o.op));
  RR_CHECK(!(o.wire_gather16 && o.gather_into_data), kValue,
           "ringreduce: a 16-bit all-gather cannot receive straight into the tensor");
  RR_CHECK(o.pre_factor >= 0 && o.extra_divisor >= 1, kValue, "ringreduce: bad scaling (pre ", o.pre_factor,
           ", divisor ", o.extra_divisor, ")");
  RR_CHECK(o.pre_factor == 0 || !isIntegralType(dtype), kValue,
           "ringreduce: a predivide factor needs a floating or complex tensor, got ", dtypeName(dtype));
  checkSupported(dtype, o.op);
  DirectPlan p;
  p.nranks = nranks;
  p.rank = rank;
  p.dtype = dtype;
  p.contrib = o.wire_dtype ? *o.wire_dtype : dtype;
  p.gather = o.wire_dtype && o.wire_gather16 ? *o.wire_dtype : dtype;
  p.gather_into_data = o.gather_into_data;
  const int64_t elem = static_cast<int64_t>(dtypeSize(dtype));
  const int64_t widest = static_cast<int64_t>(std::max(dtypeSize(p.contrib), dtypeSize(p.gather)));
  const int64_t per_round = (nranks - 1) + (p.wire() ? nranks : 0);
  // Two rounds of buffers fit the staging (each buffer rounded up to buffer_align).
  const int64_t fit = o.staging_bytes / (2 * std::max<int64_t>(per_round, 1)) / o.buffer_align * o.buffer_align;
  p.sched = makeRingSchedule(nranks, numel, elem, widest, std::max<int64_t>(16, std::min(o.max_segment_bytes, fit)),
                             /*exact_chunks=*/false, /*shift=*/-1);
  p.rounds = nranks > 1 ? p.sched.nsegs : 0;
  p.buffer_bytes = roundUp(std::max<int64_t>(p.sched.segment * widest, 1), o.buffer_align);
  const int64_t rounds_fit = per_round > 0 ? o.staging_bytes / (per_round * p.buffer_bytes) : 1;
  p.depth = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(rounds_fit, std::max(p.rounds, 1))));
  p.reduce.dtype = p.reduce.round_to = p.contrib;
  p.reduce.partial = directPartial(dtype, o.op, o.accum_narrow, o.wire_dtype);
  p.reduce.dst = dtype;
  p.reduce.op = o.op;
  // With a wire the sender's convert divides (Note [First hop]'s ConvertStep), so the reduction does not.
  p.convert_predivide = p.wire() ? o.pre_factor : 0;
  p.reduce.scaling = directFinal(p.contrib, p.reduce.partial, nranks, o, p.wire() ? 0 : o.pre_factor);
  return p;
}

}  // namespace rr
