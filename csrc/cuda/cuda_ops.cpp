#include "cuda_ops.h"

#include "../core/collectives.h"
#include "../core/error.h"

namespace rr {

namespace {

// The call's frame (callFrame) with `algorithm` (its Frame::algorithm); a refusal's (`req` null)
// carries only the kind, op and error.
Frame makeFrame(const CudaCallRequest* req, CallKind kind, RedOp op, int error, int rank, uint64_t seq,
                int32_t algorithm = 0) {
  Frame f;
  if (req != nullptr && error == 0) {
    // The segment is the pipeline's override: ranks must agree on it.
    f = callFrame(req->options, req->options.segment_bytes, algorithm);
    describeTensor(f, req->dtype, req->numel, req->shape, 1);
  }
  f.rank = rank;
  f.seq = seq;
  f.kind = static_cast<int32_t>(kind);
  f.op = static_cast<int32_t>(op);
  f.error = error;
  f.device_type = 1;
  return f;
}

void agree(CudaRing& ring, const Frame& mine, const RingMembers& members, const std::string& group_name) {
  const std::vector<Frame> frames = ring.exchangeFrames(mine, members);
  const std::string verdict = compareFrames(frames, group_name);
  if (!verdict.empty()) throw Error(ErrorKind::kRuntime, verdict);
}

const char* nameOf(const CudaCallRequest& req, bool hier, bool direct) {
  switch (req.options.kind) {
    case CallKind::kReduceScatter: return "reduce-scatter";
    case CallKind::kAllGather: return "all-gather";
    default: return direct ? "direct all-reduce" : hier ? "hierarchical all-reduce" : "all-reduce";
  }
}

// Frame::algorithm: ranks whose one-shot thresholds differ would otherwise pair a one-shot group with
// ring (or direct) exchanges, and a direct call's arithmetic differs from the ring's.
int32_t frameAlgorithm(bool direct, bool one_shot, int32_t local_size) {
  if (direct) return one_shot ? kFrameAlgorithmDirectOneShot : kFrameAlgorithmDirect;
  return one_shot ? -1 : local_size;
}

}  // namespace

std::shared_ptr<CudaWork> runCudaCall(CudaRing& ring, const CudaCallRequest& req, CudaCallBuffers& buf) {
  const CallOptions& opt = req.options;
  // The GPU pipeline's overrides (Note [GPU pipeline rule], gpu_pipeline.h).
  const GpuKnobs knobs{opt.segment_bytes, opt.num_slots, opt.lanes, opt.one_shot_bytes};
  const bool scatter = opt.kind == CallKind::kReduceScatter;
  const bool gather = opt.kind == CallKind::kAllGather;
  const RingMembers rm = resolveRing(req.members, ring.size(), ring.rank());
  const int n = rm.size();
  const bool direct = opt.directAllReduce();  // Note [Direct all-reduce] (csrc/core/direct.h)
  const bool hier = !scatter && !gather && !direct && opt.local_size > 1 && opt.local_size < n;
  const std::string what = nameOf(req, hier, direct);
  ring.checkNotCapturing(req.caller, what);  // 1
  const RedOp op = gather ? RedOp::kSum : opt.op;
  checkSupported(req.dtype, op);  // 2
  if (scatter) {
    RR_CHECK(req.numel == req.out_numel * n, kValue, "ringreduce.reduce_scatter: input has ", req.numel,
             " elements, but ", n, " ranks x output's ", req.out_numel, " = ", req.out_numel * n);
  } else if (gather) {
    RR_CHECK(req.out_numel == req.numel * n, kValue, "ringreduce.all_gather: output has ", req.out_numel,
             " elements, but ", n, " ranks x input's ", req.numel, " = ", req.numel * n);
  }
  RR_CHECK(!hier || n % opt.local_size == 0, kValue, "ringreduce: hierarchical all-reduce over ", n,
           " ranks needs equal nodes, got ", opt.local_size, " ranks per node");
  RR_CHECK(!direct || n <= kOneShotMaxRanks, kValue, "ringreduce: the direct all-reduce on GPUs runs on up to ",
           kOneShotMaxRanks, " ranks, got ", n, "; use algorithm=\"ring\"");
  RR_CHECK(!opt.wire_dtype || (!hier && !scatter && !gather), kValue,
           "ringreduce: a 16-bit wire (wire_dtype) runs on the flat all-reduce ring only");
  RR_CHECK(!opt.wire_gather16, kValue,
           "ringreduce: a 16-bit all-gather (RINGREDUCE_WIRE_GATHER=16) runs on CPU rings only; on GPUs the "
           "all-gather of a 16-bit wire moves float32 (unset RINGREDUCE_WIRE_GATHER or set it to 32)");
  const std::vector<int> key = ringKey(req.members, ring.size());
  const int64_t bytes = req.numel * static_cast<int64_t>(dtypeSize(req.dtype));
  // No one-shot on the simplest path (Note [NCCL versions, environment and the simplest path]).
  // A direct all-reduce with a wire sends its 16-bit pieces: the one-shot would move float32 tensors.
  const bool one_shot = !scatter && !gather && !hier && opt.one_shot && !ring.comm().simplePath() &&
                        n <= kOneShotMaxRanks && !(direct && opt.wire_dtype) &&
                        bytes <= gpuOneShotBytes(n, ring.stagingBytes(), knobs);
  if (opt.check) {
    agree(ring, makeFrame(&req, opt.kind, op, 0, ring.rank(), ring.nextSeq(key),
                          frameAlgorithm(direct, one_shot, opt.local_size)),
          rm, req.group_name);  // 3
  }
  if (req.numel == 0 || n == 1) {  // 4
    if (req.numel > 0 && buf.trivial) buf.trivial();
    return nullptr;
  }
  // 5. The working buffer, in the stages' dtype (stagesDType: a float32 copy for hierarchical + accum).
  const DType wdtype = stagesDType(req.dtype, hier, opt.accum_float32);
  void* data = buf.data(wdtype, rm.index);
  if (direct) {
    const DirectOptions d = ring.directOptions(opt.directOptions(req.dtype), opt.segment_bytes);
    if (buf.protect) buf.protect();  // 6
    if (one_shot)  // the direct exchange's bits in one group (Note [GPU one-shot all-reduce])
      return ring.enqueueOneShot(rm, directOneShotLaunch(n, req.numel, directInOrder(req.dtype, n, d)), data, key,
                                 what, req.caller, !req.async_op, buf.epilogue);  // 7
    return ring.enqueueDirect(buildDirectPlan(n, rm.index, req.numel, req.dtype, d), rm, data, key, what, req.caller,
                              !req.async_op, buf.epilogue);  // 7
  }
  const bool partials32 = opt.accum_float32 && !hier && !scatter && !gather;
  PlanOptions base = ring.planOptions(op, partials32, n, gather ? req.out_numel : req.numel, wdtype, knobs);
  // Note [Reduction contract] (csrc/core/functors.h): the wire, the predivide factor, the divisor.
  base.wire_dtype = opt.wire_dtype;
  base.pre_factor = base.post_factor = opt.predivide;
  base.extra_divisor = opt.extra_divisor;
  if (one_shot) {
    // The flat ring's arithmetic, wire and scaling included (Note [GPU one-shot all-reduce]).
    if (buf.protect) buf.protect();  // 6
    return ring.enqueueOneShot(rm, ringOneShotLaunch(n, req.numel, wdtype, op, base), data, key, what, req.caller,
                               !req.async_op, buf.epilogue);  // 7
  }
  std::vector<RingStage> stages;
  if (scatter) {
    stages = ringHalfStages(rm, req.numel, req.dtype, op, base, kPhaseReduceScatter);
  } else if (gather) {
    stages = ringHalfStages(rm, req.out_numel, req.dtype, RedOp::kSum, base, kPhaseAllGather);
  } else {
    stages = hier ? hierarchicalStages(rm, opt.local_size, req.numel, wdtype, op, base)
                  : flatRingStages(rm, req.numel, wdtype, op, base);
  }
  // The flat ring's partials (one chunk of float32, or of 16-bit values with a wire), shared by its
  // lanes (Note [Lanes]); the hierarchical stages never carry any.
  const int64_t accum_bytes = hier ? 0 : stages[0].plan.accumBytes();
  void* accum = accum_bytes > 0 ? buf.accum(ceilDiv(accum_bytes, static_cast<int64_t>(sizeof(float)))) : nullptr;
  if (buf.protect) buf.protect();  // 6
  return ring.enqueue(stages, data, accum, key, what, req.caller, !req.async_op, buf.epilogue);  // 7
}

void sendCudaRefusal(CudaRing& ring, CallKind kind, int error, RedOp op, const std::string& group_name,
                     const std::vector<int>& members) {
  const RingMembers rm = resolveRing(members, ring.size(), ring.rank());
  agree(ring, makeFrame(nullptr, kind, op, error, ring.rank(), ring.nextSeq(ringKey(members, ring.size()))), rm,
        group_name);
}

}  // namespace rr
