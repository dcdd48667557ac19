// ringreduce tests: a C entry point to the GPU driver's host-testable logic, loaded with ctypes by
// tests/test_cuda_logic.py (built there with the host compiler; no torch, no CUDA).
//
//   rr_kernel_reduce   the reduce kernel's body (ReduceBody through reduce_dispatch.h; ConvertBody
//                      when b is null) on a simulated grid of threads
//   rr_sim_allreduce   whole ring all-reduces of n ranks through enqueueRingCall() (the GPU
//                      driver) on the simulated streams of sim_device.h
//   rr_sim_ring        the stages of every GPU collective (ring_executor.h: flat ring, reduce-scatter
//                      only, all-gather only, hierarchical) over rank lists of one simulated
//                      communicator, several rings side by side, reporting the peers each rank used
//   rr_gpu_pipeline    the pipeline rule (gpu_pipeline.h) for a call
//   rr_sim_mixed       calls that are one-shot all-reduces (enqueueOneShot) or rings, back to back
//                      on one simulated device (shared staging and events)
//   rr_sim_direct      direct all-reduces (enqueueDirect, direct_executor.h) or their one-shots,
//                      back to back on one simulated device
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../../../csrc/core/error.h"
#include "../../../csrc/core/plan.h"
#include "../../../csrc/core/direct.h"
#include "../../../csrc/cuda/direct_executor.h"
#include "../../../csrc/cuda/gpu_pipeline.h"
#include "../../../csrc/cuda/ring_executor.h"
#include "sim_device.h"

namespace {
void putError(const std::string& msg, char* err, int errlen) {
  if (err == nullptr || errlen <= 0) return;
  std::strncpy(err, msg.c_str(), static_cast<size_t>(errlen - 1));
  err[errlen - 1] = '\0';
}

// The guard bytes (0x5A) around each simulated tensor of `bytes` bytes at offset `pad`: "" when
// untouched, else which side of which buffer (`what` names the index) was written.
std::string guardDamage(const std::vector<std::vector<unsigned char>>& data, size_t pad, size_t bytes,
                        const char* what) {
  for (size_t i = 0; i < data.size(); ++i) {
    for (size_t k = 0; k < data[i].size(); ++k) {
      if ((k < pad || k >= pad + bytes) && data[i][k] != 0x5A)
        return std::string("memory ") + (k < pad ? "before" : "after") + " the tensor was modified (" + what + " " +
               std::to_string(i) + ")";
    }
  }
  return "";
}
}  // namespace

extern "C" {

// out[0..3]: max segment bytes, slots, slot bytes, lanes of gpuPipeline(); out[4]: the one-shot
// threshold. Knobs as GpuKnobs (0 / -1: the rule). Returns 0, or -1 with the message in err.
int rr_gpu_pipeline(int nranks, long long numel, int dtype, int accum_float32, long long staging_bytes,
                    long long segment_bytes, int slots, int lanes, long long one_shot_bytes, int max_lanes,
                    long long* out, char* err, int errlen) {
  try {
    rr::GpuKnobs k;
    k.segment_bytes = segment_bytes;
    k.slots = slots;
    k.lanes = lanes;
    k.one_shot_bytes = one_shot_bytes;
    const rr::GpuPipeline p =
        rr::gpuPipeline(nranks, numel, static_cast<rr::DType>(dtype), accum_float32 != 0, staging_bytes, k, max_lanes);
    out[0] = p.max_segment_bytes;
    out[1] = p.slots;
    out[2] = p.slot_bytes;
    out[3] = p.lanes;
    out[4] = rr::gpuOneShotBytes(nranks, staging_bytes, k);
    return 0;
  } catch (const std::exception& e) {
    putError(e.what(), err, errlen);
    return -1;
  }
}

// Returns 0, or -1 with the message in err (rr::Error kind in *kind).
// Operand types are DType codes; b null: a convert (ConvertBody, predivide only).
int rr_kernel_reduce(int op, const void* a, int a_type, const void* b, int b_type, void* dst, int dst_type,
                     long long count, int divisor, double postscale, double predivide, int round_sum, int nthreads,
                     int* kind, char* err, int errlen) {
  try {
    rr::Scaling sc;
    sc.divisor = divisor;
    sc.postscale = postscale;
    sc.predivide = predivide;
    sc.round_sum = round_sum != 0;
    rr::sim::hostKernelReduce(static_cast<rr::RedOp>(op), a, static_cast<rr::DType>(a_type), b,
                              static_cast<rr::DType>(b_type), dst, static_cast<rr::DType>(dst_type), count, sc,
                              nthreads);
    return 0;
  } catch (const rr::Error& e) {
    if (kind) *kind = static_cast<int>(e.kind());
    putError(e.what(), err, errlen);
  } catch (const std::exception& e) {
    if (kind) *kind = -1;
    putError(e.what(), err, errlen);
  }
  return -1;
}

// Runs `ncalls` all-reduces on a simulated ring of `nranks`. inputs/outputs: ncalls * nranks host
// buffers of `numel` elements (call c, rank r at index c * nranks + r). Call c is asynchronous
// when bit c of async_mask is set: its Work.wait() is enqueued on the caller stream only after
// every call was enqueued. `data_offset` elements of padding precede each rank's device tensor
// (misaligned storage offsets); the padding must be untouched at the end. Returns 0, or -1 with
// the first failure (race, deadlock, mismatch, exception) in err. wire_dtype: a 16-bit wire's DType
// code (-1: none); predivide: the predivide factor (0: none).
int rr_sim_allreduce(int nranks, long long numel, int dtype, int op, int accum_float32, int wire_dtype,
                     double predivide, long long segment_bytes,
                     int num_slots, long long slot_bytes, int ncalls, unsigned long long async_mask,
                     unsigned long long seed, int fault, int data_offset, int gather_into_data, int lanes,
                     const void* const* inputs,
                     void* const* outputs, char* err, int errlen) {
  try {
    const rr::DType dt = static_cast<rr::DType>(dtype);
    const rr::RedOp rop = static_cast<rr::RedOp>(op);
    const size_t elem = rr::dtypeSize(dt);
    const size_t pad = static_cast<size_t>(data_offset) * elem;
    const size_t bytes = static_cast<size_t>(numel) * elem;
    // Note [Lanes]: `lanes` lanes of num_slots slots each.
    rr::sim::SimDevice dev(nranks, num_slots * lanes, static_cast<size_t>(slot_bytes), seed);
    // Device memory of every call and rank: padding, tensor, padding (0x5A sentinels).
    std::vector<std::vector<unsigned char>> data(static_cast<size_t>(ncalls * nranks));
    std::vector<std::vector<float>> accum(static_cast<size_t>(ncalls * nranks));
    std::vector<rr::sim::SimCall> calls(static_cast<size_t>(ncalls * nranks));
    rr::PlanOptions opts = rr::gpuPlanOptions(rop, accum_float32 != 0, segment_bytes, num_slots, slot_bytes);
    if (wire_dtype >= 0) opts.wire_dtype = static_cast<rr::DType>(wire_dtype);
    opts.pre_factor = opts.post_factor = predivide;
    // gather_into_data = 0 runs the CPU transport's plan shape (all-gather through staging and
    // kCopy) through the GPU driver: the driver must be correct for any valid plan.
    opts.gather_into_data = gather_into_data != 0;
    opts.lanes = lanes;
    std::vector<int> members;
    for (int r = 0; r < nranks; ++r) members.push_back(r);

    for (int c = 0; c < ncalls; ++c) {
      const bool async = (async_mask >> c) & 1u;
      for (int r = 0; r < nranks; ++r) {
        const size_t i = static_cast<size_t>(c * nranks + r);
        data[i].assign(pad + bytes + 64, 0x5A);
        unsigned char* tensor = data[i].data() + pad;
        const void* in = inputs[i];
        // The producer: the caller's kernel that writes the tensor right before the call.
        dev.callerOp(r, "producer of call " + std::to_string(c), {}, {{tensor, bytes}},
                     [tensor, in, bytes]() { std::memcpy(tensor, in, bytes); });
        const std::vector<rr::RingStage> stages =
            rr::flatRingStages(rr::resolveRing(members, nranks, r), numel, dt, rop, opts);
        const int64_t accum_elems = stages[0].plan.accum_elems;  // lanes share it (disjoint segments)
        accum[i].assign(static_cast<size_t>(accum_elems) + 16, -12345.0f);
        rr::DeviceBuffers buf;
        buf.data = tensor;
        buf.accum = accum_elems > 0 ? accum[i].data() : nullptr;
        buf.slot_bytes = dev.rank(r).slot_bytes;
        buf.slots_per_lane = num_slots;
        for (auto& s : dev.rank(r).slots) buf.slots.push_back(s.data());
        {
          auto be = dev.backend(r, dt, static_cast<rr::sim::Fault>(fault), &calls[i]);
          rr::enqueueRingStages(stages, buf, *be, /*caller_waits=*/!async);
        }
        if (!async) {
          void* out = outputs[i];
          dev.callerOp(r, "consumer of call " + std::to_string(c), {{tensor, bytes}}, {},
                       [tensor, out, bytes]() { std::memcpy(out, tensor, bytes); });
        }
      }
    }
    for (int c = 0; c < ncalls; ++c) {
      if (!((async_mask >> c) & 1u)) continue;
      for (int r = 0; r < nranks; ++r) {
        const size_t i = static_cast<size_t>(c * nranks + r);
        unsigned char* tensor = data[i].data() + pad;
        void* out = outputs[i];
        dev.callerWait(r, calls[i]);
        dev.callerOp(r, "consumer of call " + std::to_string(c), {{tensor, bytes}}, {},
                     [tensor, out, bytes]() { std::memcpy(out, tensor, bytes); });
      }
    }
    const std::string failure = dev.run();
    if (!failure.empty()) {
      putError(failure, err, errlen);
      return -1;
    }
    const std::string damage = guardDamage(data, pad, bytes, "call/rank");
    if (!damage.empty()) {
      putError(damage, err, errlen);
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {
    putError(std::string("exception: ") + e.what(), err, errlen);
    return -1;
  }
}

// Runs `ncalls` synchronous calls on `nrings` disjoint rings of `ring_size` ranks each, side by side
// on one simulated communicator of `comm_size` ranks (ranks in no ring stay idle). members:
// nrings * ring_size communicator ranks, ring by ring in ring order. mode: 0 the flat all-reduce
// (avg_divisor > 0 overrides AVG's divisor), 1 reduce-scatter only, 2 all-gather only, 3 the
// hierarchical all-reduce with local_size ranks per node (members ordered node by node).
// inputs/outputs: ncalls * nrings * ring_size host buffers of numel elements (call c, ring k,
// index i at (c * nrings + k) * ring_size + i): what the producer writes into the tensor, what the
// tensor holds after the call. peers_out: comm_size * 16 ints, the distinct communicator ranks
// each rank sent to (first 8) and received from (last 8), -1 padded. Returns 0, or -1 with the
// first failure in err.
int rr_sim_ring(int comm_size, int nrings, int ring_size, const int* members, int mode, int local_size,
                long long numel, int dtype, int op, int accum_float32, int wire_dtype, double predivide,
                long long segment_bytes, int num_slots,
                long long slot_bytes, int avg_divisor, int ncalls, unsigned long long seed, int fault,
                const void* const* inputs, void* const* outputs, int* peers_out, char* err, int errlen) {
  try {
    const rr::DType dt = static_cast<rr::DType>(dtype);
    const rr::RedOp rop = static_cast<rr::RedOp>(op);
    const size_t bytes = static_cast<size_t>(numel) * rr::dtypeSize(dt);
    rr::sim::SimDevice dev(comm_size, num_slots, static_cast<size_t>(slot_bytes), seed);
    rr::PlanOptions base = rr::gpuPlanOptions(rop, accum_float32 != 0, segment_bytes, num_slots, slot_bytes);
    base.avg_divisor = avg_divisor;
    if (wire_dtype >= 0) base.wire_dtype = static_cast<rr::DType>(wire_dtype);
    base.pre_factor = base.post_factor = predivide;
    const size_t nbuf = static_cast<size_t>(ncalls) * static_cast<size_t>(nrings) * static_cast<size_t>(ring_size);
    std::vector<std::vector<unsigned char>> data(nbuf);
    std::vector<std::vector<float>> accum(nbuf);
    std::vector<rr::sim::SimCall> calls(nbuf);
    for (int c = 0; c < ncalls; ++c) {
      for (int k = 0; k < nrings; ++k) {
        const std::vector<int> ring_ranks(members + k * ring_size, members + (k + 1) * ring_size);
        for (int i = 0; i < ring_size; ++i) {
          const int r = ring_ranks[static_cast<size_t>(i)];
          const rr::RingMembers ring = rr::resolveRing(ring_ranks, comm_size, r);
          std::vector<rr::RingStage> stages;
          switch (mode) {
            case 0: stages = rr::flatRingStages(ring, numel, dt, rop, base); break;
            case 1: stages = rr::ringHalfStages(ring, numel, dt, rop, base, rr::kPhaseReduceScatter); break;
            case 2: stages = rr::ringHalfStages(ring, numel, dt, rop, base, rr::kPhaseAllGather); break;
            case 3: stages = rr::hierarchicalStages(ring, local_size, numel, dt, rop, base); break;
            default: putError("unknown mode " + std::to_string(mode), err, errlen); return -1;
          }
          const size_t b = (static_cast<size_t>(c) * static_cast<size_t>(nrings) + static_cast<size_t>(k)) *
                               static_cast<size_t>(ring_size) + static_cast<size_t>(i);
          data[b].assign(bytes + 64, 0x5A);  // the tensor, then sentinels
          const int64_t accum_elems = stages.size() == 1 ? stages[0].plan.accum_elems : 0;
          accum[b].assign(static_cast<size_t>(accum_elems) + 16, -12345.0f);
          rr::sim::enqueueSyncCall(dev, r, dt, stages, data[b].data(), bytes, inputs[b], outputs[b],
                                   accum_elems > 0 ? accum[b].data() : nullptr,
                                   static_cast<rr::sim::Fault>(fault), &calls[b]);
        }
      }
    }
    const std::string failure = dev.run();
    for (int r = 0; r < comm_size; ++r) {
      std::vector<int> sends, recvs;
      for (const auto& p : dev.peersUsed(r)) {
        if (p.send_peer >= 0 && std::find(sends.begin(), sends.end(), p.send_peer) == sends.end())
          sends.push_back(p.send_peer);
        if (p.recv_peer >= 0 && std::find(recvs.begin(), recvs.end(), p.recv_peer) == recvs.end())
          recvs.push_back(p.recv_peer);
      }
      for (int j = 0; j < 8; ++j) {
        peers_out[r * 16 + j] = j < static_cast<int>(sends.size()) ? sends[static_cast<size_t>(j)] : -1;
        peers_out[r * 16 + 8 + j] = j < static_cast<int>(recvs.size()) ? recvs[static_cast<size_t>(j)] : -1;
      }
    }
    if (!failure.empty()) {
      putError(failure, err, errlen);
      return -1;
    }
    const std::string damage = guardDamage(data, 0, bytes, "buffer");
    if (!damage.empty()) {
      putError(damage, err, errlen);
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {
    putError(std::string("exception: ") + e.what(), err, errlen);
    return -1;
  }
}

// Runs `ncalls` synchronous flat all-reduces on a simulated ring of `nranks` (ring index = rank):
// call c is a one-shot (Note [GPU one-shot all-reduce]) when bit c of one_shot_mask is set, else
// the ring with the given segment and slots; both with the same arithmetic options (accum_float32,
// wire_dtype: a DType code or -1, predivide: 0 none, extra_divisor: 1 none). inputs/outputs as
// rr_sim_allreduce's. Staging: max(n - 1, num_slots) slots of max(slot_bytes, the tensor) bytes.
// Returns 0, or -1 with the first failure.
int rr_sim_mixed(int nranks, long long numel, int dtype, int op, int accum_float32, int wire_dtype, double predivide,
                 int extra_divisor, long long segment_bytes, int num_slots, long long slot_bytes, int ncalls,
                 unsigned long long one_shot_mask,
                 unsigned long long seed, int fault, const void* const* inputs, void* const* outputs, int* hand_offs,
                 char* err, int errlen) {
  try {
    const rr::DType dt = static_cast<rr::DType>(dtype);
    const rr::RedOp rop = static_cast<rr::RedOp>(op);
    const size_t bytes = static_cast<size_t>(numel) * rr::dtypeSize(dt);
    const size_t slot = std::max(static_cast<size_t>(slot_bytes), (bytes + 255) / 256 * 256);
    rr::sim::SimDevice dev(nranks, std::max(nranks - 1, num_slots), slot, seed);
    rr::PlanOptions opts = rr::gpuPlanOptions(rop, accum_float32 != 0, segment_bytes, num_slots, slot_bytes);
    if (wire_dtype >= 0) opts.wire_dtype = static_cast<rr::DType>(wire_dtype);
    opts.pre_factor = opts.post_factor = predivide;
    opts.extra_divisor = extra_divisor;
    std::vector<std::vector<unsigned char>> data(static_cast<size_t>(ncalls * nranks));
    std::vector<std::vector<float>> accum(static_cast<size_t>(ncalls * nranks));
    std::vector<rr::sim::SimCall> calls(static_cast<size_t>(ncalls * nranks));
    std::vector<int> members;
    for (int r = 0; r < nranks; ++r) members.push_back(r);
    for (int c = 0; c < ncalls; ++c) {
      const bool one_shot = (one_shot_mask >> c) & 1u;
      for (int r = 0; r < nranks; ++r) {
        const size_t i = static_cast<size_t>(c * nranks + r);
        data[i].assign(bytes + 64, 0x5A);
        unsigned char* tensor = data[i].data();
        const void* in = inputs[i];
        void* out = outputs[i];
        dev.callerOp(r, "producer of call " + std::to_string(c), {}, {{tensor, bytes}},
                     [tensor, in, bytes]() { std::memcpy(tensor, in, bytes); });
        rr::DeviceBuffers buf;
        buf.data = tensor;
        buf.slot_bytes = dev.rank(r).slot_bytes;
        for (auto& sl : dev.rank(r).slots) buf.slots.push_back(sl.data());
        {
          auto be = dev.backend(r, dt, static_cast<rr::sim::Fault>(fault), &calls[i]);
          if (one_shot) {
            rr::enqueueOneShot(members, r, rr::ringOneShotLaunch(nranks, numel, dt, rop, opts), buf, *be,
                               /*caller_waits=*/true);
          } else {
            const rr::Plan plan = rr::buildPlan(nranks, r, numel, dt, opts);
            accum[i].assign(static_cast<size_t>(plan.accum_elems) + 16, -12345.0f);
            buf.accum = plan.accum_elems > 0 ? accum[i].data() : nullptr;
            rr::enqueueRingCall(plan, rop, buf, *be, /*caller_waits=*/true);
          }
        }
        dev.callerOp(r, "consumer of call " + std::to_string(c), {{tensor, bytes}}, {},
                     [tensor, out, bytes]() { std::memcpy(out, tensor, bytes); });
      }
    }
    const std::string failure = dev.run();
    for (int r = 0; r < nranks; ++r) hand_offs[r] = dev.handOffs(r);
    if (!failure.empty()) {
      putError(failure, err, errlen);
      return -1;
    }
    const std::string damage = guardDamage(data, 0, bytes, "call/rank");
    if (!damage.empty()) {
      putError(damage, err, errlen);
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {
    putError(std::string("exception: ") + e.what(), err, errlen);
    return -1;
  }
}

// One rr_sim_direct run (tests/test_cuda_logic.py mirrors it as a ctypes.Structure).
struct RrSimDirect {
  int nranks;
  long long numel;
  int dtype;
  int op;
  int accum_narrow;
  int wire_dtype;  // a DType code, or -1
  double predivide;
  int extra_divisor;
  long long segment_bytes;
  long long staging_bytes;
  int ncalls;
  unsigned long long one_shot_mask;  // call c is the direct one-shot when bit c is set
  unsigned long long seed;
  int fault;
};

// Runs a->ncalls synchronous direct all-reduces (Note [Direct all-reduce]) on a simulated group of
// a->nranks (call c the direct one-shot when bit c of one_shot_mask is set, else the direct
// exchange with the given segment and staging), back to back on one device. inputs/outputs as
// rr_sim_allreduce's; hand_offs: per rank. Returns 0, or -1 with the first failure.
int rr_sim_direct(const RrSimDirect* a, const void* const* inputs, void* const* outputs, int* hand_offs, char* err,
                  int errlen) {
  try {
    const int n = a->nranks;
    const rr::DType dt = static_cast<rr::DType>(a->dtype);
    const size_t bytes = static_cast<size_t>(a->numel) * rr::dtypeSize(dt);
    rr::DirectOptions d;
    d.op = static_cast<rr::RedOp>(a->op);
    d.accum_narrow = a->accum_narrow != 0;
    if (a->wire_dtype >= 0) d.wire_dtype = static_cast<rr::DType>(a->wire_dtype);
    d.pre_factor = a->predivide;
    d.extra_divisor = a->extra_divisor;
    d.max_segment_bytes = a->segment_bytes;
    d.staging_bytes = a->staging_bytes;
    d.buffer_align = 256;
    d.gather_into_data = true;
    const rr::DirectPlan shape = rr::buildDirectPlan(n, 0, a->numel, dt, d);  // every rank's buffers are alike
    const size_t slot = std::max(static_cast<size_t>(shape.buffer_bytes), (bytes + 255) / 256 * 256);
    rr::sim::SimDevice dev(n, std::max(n - 1, shape.numBuffers()), slot, a->seed);
    std::vector<std::vector<unsigned char>> data(static_cast<size_t>(a->ncalls * n));
    std::vector<rr::sim::SimCall> calls(static_cast<size_t>(a->ncalls * n));
    std::vector<int> members;
    for (int r = 0; r < n; ++r) members.push_back(r);
    for (int c = 0; c < a->ncalls; ++c) {
      const bool one_shot = (a->one_shot_mask >> c) & 1u;
      for (int r = 0; r < n; ++r) {
        const size_t i = static_cast<size_t>(c * n + r);
        data[i].assign(bytes + 64, 0x5A);
        unsigned char* tensor = data[i].data();
        const void* in = inputs[i];
        void* out = outputs[i];
        dev.callerOp(r, "producer of call " + std::to_string(c), {}, {{tensor, bytes}},
                     [tensor, in, bytes]() { std::memcpy(tensor, in, bytes); });
        rr::DeviceBuffers buf;
        buf.data = tensor;
        buf.slot_bytes = dev.rank(r).slot_bytes;
        for (auto& sl : dev.rank(r).slots) buf.slots.push_back(sl.data());
        {
          auto be = dev.backend(r, dt, static_cast<rr::sim::Fault>(a->fault), &calls[i]);
          if (one_shot) {
            rr::enqueueOneShot(members, r, rr::directOneShotLaunch(n, a->numel, rr::directInOrder(dt, n, d)), buf, *be,
                               /*caller_waits=*/true);
          } else {
            const rr::DirectPlan plan = rr::buildDirectPlan(n, r, a->numel, dt, d);
            rr::DirectCall call;
            call.plan = &plan;
            call.members = members;
            call.buffers = buf;
            rr::enqueueDirect(call, *be);
          }
        }
        dev.callerOp(r, "consumer of call " + std::to_string(c), {{tensor, bytes}}, {},
                     [tensor, out, bytes]() { std::memcpy(out, tensor, bytes); });
      }
    }
    const std::string failure = dev.run();
    for (int r = 0; r < n; ++r) hand_offs[r] = dev.handOffs(r);
    if (!failure.empty()) {
      putError(failure, err, errlen);
      return -1;
    }
    const std::string damage = guardDamage(data, 0, bytes, "call/rank");
    if (!damage.empty()) {
      putError(damage, err, errlen);
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {
    putError(std::string("exception: ") + e.what(), err, errlen);
    return -1;
  }
}

}  // extern "C"
