#include "ring_executor.h"

#include "../core/error.h"

namespace rr {

namespace {

char* spanAddress(const Plan& plan, const DeviceBuffers& b, const Span& s) {
  char* base = nullptr;
  switch (s.buf) {
    case BufKind::kData: base = static_cast<char*>(b.data); break;
    case BufKind::kAccum: base = static_cast<char*>(b.accum); break;
    case BufKind::kStaging:
      RR_CHECK(s.slot >= 0 && static_cast<size_t>(s.slot) < b.slots.size(), kRuntime,
               "ringreduce internal error: plan names staging slot ", s.slot, " of ", b.slots.size());
      base = static_cast<char*>(b.slots[static_cast<size_t>(s.slot)]);
      break;
    case BufKind::kNone: break;
  }
  RR_CHECK(base != nullptr, kRuntime, "ringreduce internal error: plan names a missing buffer");
  return base + s.offset * spanElemSize(plan, s);
}

size_t spanBytes(const Plan& plan, const Span& s) {
  return s.empty() ? 0 : static_cast<size_t>(s.count * spanElemSize(plan, s));
}

// Every span must lie inside its buffer, checked before anything is enqueued: a planning bug is an
// exception here, never an out-of-bounds write on the device.
void checkSpan(const Plan& plan, const DeviceBuffers& b, const Span& s) {
  if (s.empty()) return;
  const int64_t end = (s.offset + s.count) * spanElemSize(plan, s);
  switch (s.buf) {
    case BufKind::kData:
      RR_CHECK(b.data != nullptr && s.type == plan.dtype &&
                   end <= plan.sched.numel * static_cast<int64_t>(dtypeSize(plan.dtype)),
               kRuntime, "ringreduce internal error: data span out of range");
      break;
    case BufKind::kAccum:
      RR_CHECK(b.accum != nullptr && s.type == plan.partial && s.offset + s.count <= plan.accum_elems, kRuntime,
               "ringreduce internal error: accum span out of range");
      break;
    case BufKind::kStaging:
      RR_CHECK(s.offset == 0 && end <= static_cast<int64_t>(b.slot_bytes), kRuntime,
               "ringreduce internal error: staging span of ", end, " bytes in a slot of ", b.slot_bytes);
      break;
    case BufKind::kNone:
      RR_THROW(kRuntime, "ringreduce internal error: non-empty span without a buffer");
  }
}

// Maps plan event ids to dense indices: only events some op waits for get one.
struct EventMap {
  std::vector<int32_t> dense;  // per plan event: dense index or -1 (never waited: not recorded)
  int32_t count = 0;
};

EventMap mapWaitedEvents(const Plan& plan) {
  EventMap m;
  m.dense.assign(static_cast<size_t>(plan.num_events), -1);
  for (const Op& o : plan.ops) {
    if (o.kind != OpKind::kWait) continue;
    RR_CHECK(o.event >= 0 && o.event < plan.num_events, kRuntime,
             "ringreduce internal error: wait for unknown event ", o.event);
    int32_t& d = m.dense[static_cast<size_t>(o.event)];
    if (d < 0) d = m.count++;
  }
  return m;
}

}  // namespace

void beginCall(DeviceBackend& be, int32_t lanes) {
  be.record(Stream::kCaller, kCallStartEvent);
  for (int32_t lane = 0; lane < lanes; ++lane) {
    be.setLane(lane);
    be.wait(Stream::kComm, kCallStartEvent);
    be.wait(Stream::kCompute, kCallStartEvent);
    be.wait(Stream::kComm, kPrevCallDoneEvent);
  }
}

void endCall(DeviceBackend& be, bool caller_waits) {
  be.finish();
  be.record(Stream::kCompute, kCallDoneEvent);
  if (caller_waits) be.wait(Stream::kCaller, kCallDoneEvent);
}

PlanOptions gpuPlanOptions(RedOp op, bool accum_float32, int64_t max_segment_bytes, int32_t num_slots,
                           int64_t slot_bytes) {
  RR_CHECK(max_segment_bytes >= 16, kValue, "ringreduce: the segment size must be at least 16 bytes, got ",
           max_segment_bytes);
  PlanOptions o;
  o.max_segment_bytes = maxI64(16, minI64(max_segment_bytes, slot_bytes));
  o.num_slots = num_slots;
  o.accum_float32 = accum_float32;
  o.gather_into_data = true;
  o.average = op == RedOp::kAvg;
  // One CUDA event covers both halves of an NCCL group, so a receive-only wait would be a full
  // wait anyway; the plan without them has fewer waits on the streams.
  o.recv_only_waits = false;
  return o;
}

bool handsOffEveryExchange(const Plan& plan) {
  const RingSchedule& sc = plan.sched;
  for (int c = 0; c < sc.nranks; ++c)
    if (sc.segmentRange(c, plan.lane).empty()) return true;
  return false;
}

size_t slotBytesFor(const Plan& plan) {
  if (plan.num_slots == 0) return 0;
  return static_cast<size_t>(plan.stagingBytes() / plan.num_slots);
}

void enqueueRingStages(const std::vector<RingStage>& stages, const DeviceBuffers& buffers, DeviceBackend& be,
                       bool caller_waits) {
  RR_CHECK(!stages.empty(), kRuntime, "ringreduce internal error: a call without a ring");
  // Every check before anything is enqueued (never a half-enqueued ring on the device).
  std::vector<DeviceBuffers> bufs(stages.size());
  std::vector<EventMap> events(stages.size());
  int32_t num_events = 0;
  int32_t lanes = 1;
  for (const RingStage& st : stages) {
    RR_CHECK(st.lane >= 0 && st.lane == st.plan.lane && st.plan.lanes >= 1 && st.lane < st.plan.lanes, kRuntime,
             "ringreduce internal error: a stage on lane ", st.lane, " with a plan for lane ", st.plan.lane, " of ",
             st.plan.lanes);
    lanes = std::max(lanes, st.lane + 1);
  }
  // Note [Lanes]: lane k's staging slots are slots [k x per_lane, (k + 1) x per_lane).
  const size_t per_lane = lanes > 1 ? static_cast<size_t>(buffers.slots_per_lane) : buffers.slots.size();
  for (size_t k = 0; k < stages.size(); ++k) {
    const RingStage& st = stages[k];
    const Plan& plan = st.plan;
    RR_CHECK(static_cast<int>(st.members.size()) == plan.sched.nranks, kRuntime,
             "ringreduce internal error: a ring of ", plan.sched.nranks, " ranks with ", st.members.size(),
             " members");
    // Note [Hierarchical 16-bit wire] (csrc/core/collectives.cpp): on GPUs the stages hold no
    // partials buffer, so a wire on the cross-node ring is refused here (cuda_ops.cpp refuses it first).
    RR_CHECK(stages.size() == static_cast<size_t>(lanes) || !plan.wire16, kValue,
             "ringreduce: on GPUs a 16-bit wire (wire_dtype) runs on the flat ring only; use algorithm=\"ring\" "
             "(or \"auto\")");
    RR_CHECK(st.offset >= 0 && (stages.size() == static_cast<size_t>(lanes) || plan.accum_elems == 0), kRuntime,
             "ringreduce internal error: malformed stage ", k);
    RR_CHECK(per_lane >= static_cast<size_t>(plan.num_slots) &&
                 buffers.slots.size() >= per_lane * static_cast<size_t>(st.lane + 1),
             kRuntime, "ringreduce internal error: plan needs ", plan.num_slots, " staging slots on lane ", st.lane,
             ", have ", buffers.slots.size(), " for ", lanes, " lanes");
    RR_CHECK(buffers.slot_bytes >= slotBytesFor(plan), kRuntime, "ringreduce internal error: staging slots of ",
             buffers.slot_bytes, " bytes, plan needs ", slotBytesFor(plan));
    checkSupported(plan.dtype, st.op);
    DeviceBuffers& b = bufs[k];
    b = buffers;
    b.slots.assign(buffers.slots.begin() + static_cast<std::ptrdiff_t>(per_lane * static_cast<size_t>(st.lane)),
                   buffers.slots.begin() + static_cast<std::ptrdiff_t>(per_lane * static_cast<size_t>(st.lane + 1)));
    if (b.data != nullptr) b.data = static_cast<char*>(b.data) + st.offset * static_cast<int64_t>(dtypeSize(plan.dtype));
    for (const Op& o : plan.ops) {
      checkSpan(plan, b, o.send);
      checkSpan(plan, b, o.recv);
      checkSpan(plan, b, o.a);
      checkSpan(plan, b, o.dst);
    }
    events[k] = mapWaitedEvents(plan);
    if (events[k].count > num_events) num_events = events[k].count;
  }
  be.prepare(num_events, lanes);
  beginCall(be, lanes);

  std::vector<int> stages_on_lane(static_cast<size_t>(lanes), 0);
  for (size_t k = 0; k < stages.size(); ++k) {
    const RingStage& st = stages[k];
    const Plan& plan = st.plan;
    const DeviceBuffers& b = bufs[k];
    const EventMap& ev = events[k];
    be.setLane(st.lane);
    // Note [Sub-rings on one communicator]: the plan's neighbours as communicator ranks.
    const int next_peer = st.members[static_cast<size_t>(plan.next)];
    const int prev_peer = st.members[static_cast<size_t>(plan.prev)];
    // Note [Which exchanges hand off]: a lane's first grid exchange is its own first segment's.
    const bool hand_off_all = handsOffEveryExchange(plan);
    if (stages_on_lane[static_cast<size_t>(st.lane)]++ > 0) {
      // The lane's previous stage is complete on kCompute (its plan ended waiting all its exchanges).
      be.record(Stream::kCompute, kStageDoneEvent);
      be.wait(Stream::kComm, kStageDoneEvent);
    }
    for (const Op& o : plan.ops) {
      const Stream s = o.queue == Queue::kComm ? Stream::kComm : Stream::kCompute;
      switch (o.kind) {
        case OpKind::kExchange: {
          const size_t sb = spanBytes(plan, o.send);
          const size_t rb = spanBytes(plan, o.recv);
          be.exchange(sb ? spanAddress(plan, b, o.send) : nullptr, sb, sb ? next_peer : -1,
                      rb ? spanAddress(plan, b, o.recv) : nullptr, rb, rb ? prev_peer : -1,
                      hand_off_all || o.exchange == plan.lane ? Launch::kHandOff : Launch::kQueued);
          break;
        }
        case OpKind::kReduce:   // dst = a (op) received partial; the owned chunk's last reduce scales
        case OpKind::kConvert: {  // Note [First hop]: the first send, rounded to the wire / predivided
          const bool convert = o.kind == OpKind::kConvert;
          be.reduce(ReduceLaunch{spanAddress(plan, b, o.a), o.a.type,
                                 convert ? nullptr : spanAddress(plan, b, o.recv), convert ? o.dst.type : o.recv.type,
                                 spanAddress(plan, b, o.dst), o.dst.type, o.dst.count, plan.scaling(st.op, o), st.op});
          break;
        }
        case OpKind::kCopy:
          be.copy(spanAddress(plan, b, o.dst), spanAddress(plan, b, o.recv), spanBytes(plan, o.dst));
          break;
        case OpKind::kRecord: {
          const int32_t d = ev.dense.at(static_cast<size_t>(o.event));
          if (d >= 0) be.record(s, d);  // nobody waits for it: nothing to record
          break;
        }
        case OpKind::kWait:
          be.wait(s, ev.dense.at(static_cast<size_t>(o.event)));
          break;
      }
    }
  }

  // Join (Note [Lanes]): lane 0's kCompute waits for every other lane's end (covering its exchanges).
  for (int32_t lane = 1; lane < lanes; ++lane) {
    be.setLane(lane);
    be.record(Stream::kCompute, laneDoneEvent(lane));
    be.setLane(0);
    be.wait(Stream::kCompute, laneDoneEvent(lane));
  }
  be.setLane(0);
  endCall(be, caller_waits);
}

OneShotLaunch ringOneShotLaunch(int n, int64_t numel, DType dtype, RedOp op, const PlanOptions& options) {
  checkSupported(dtype, op);
  // The ring's arithmetic, as buildPlan decides it (Note [GPU one-shot all-reduce]).
  RR_CHECK(!options.wire_dtype || (dtype == DType::kFloat32 && isHalfType(*options.wire_dtype)), kRuntime,
           "ringreduce internal error: a one-shot with a ", dtypeName(*options.wire_dtype), " wire for ",
           dtypeName(dtype));
  RR_CHECK(options.pre_factor >= 0 && options.post_factor >= 0 && options.extra_divisor >= 1, kRuntime,
           "ringreduce internal error: a one-shot with bad scaling");
  const DType partial = partialDType(dtype, n, options.accum_float32, options.wire_dtype);
  const bool wide = isHalfType(dtype) && partial == DType::kFloat32;  // Plan::accum_float32
  OneShotLaunch l;
  l.op = op;
  l.dtype = l.dst = dtype;
  l.partial = partial;
  l.args.n = n;
  l.args.count = numel;
  const int64_t elem = static_cast<int64_t>(dtypeSize(dtype));
  l.args.chunk = makeRingSchedule(n, numel, elem, std::max(elem, static_cast<int64_t>(dtypeSize(partial))), 16).chunk;
  // Plan::finalScaling, which the ring's final reduce uses.
  l.args.scaling = finalScaling(op, options.avg_divisor > 0 ? options.avg_divisor : n, options.extra_divisor,
                                options.post_factor, options.pre_factor, /*round_sum=*/!wide);
  return l;
}

OneShotLaunch directOneShotLaunch(int n, int64_t numel, const InOrderReduce& how) {
  checkSupported(how.dtype, how.op);
  RR_CHECK(how.round_to == how.dtype && how.dst == how.dtype && how.scaling.wire_round < 0, kRuntime,
           "ringreduce internal error: a direct one-shot that rounds to a wire");
  OneShotLaunch l;
  l.op = how.op;
  l.dtype = how.dtype;
  l.partial = how.partial;
  l.dst = how.dst;
  l.args.n = n;
  l.args.count = numel;
  l.args.chunk = 0;  // rank order
  l.args.scaling = how.scaling;
  return l;
}

void enqueueOneShot(const std::vector<int>& members, int index, const OneShotLaunch& launch,
                    const DeviceBuffers& buffers, DeviceBackend& be, bool caller_waits) {
  const int n = static_cast<int>(members.size());
  const int64_t numel = launch.args.count;
  const size_t bytes = static_cast<size_t>(numel) * dtypeSize(launch.dtype);
  RR_CHECK(n >= 2 && n <= kOneShotMaxRanks && index >= 0 && index < n && launch.args.n == n, kValue,
           "ringreduce: a one-shot all-reduce of ", n, " ranks (2..", kOneShotMaxRanks, ") at ring index ", index);
  RR_CHECK(numel > 0 && buffers.data != nullptr && launch.dst == launch.dtype, kRuntime,
           "ringreduce internal error: an empty one-shot all-reduce, or one whose result changes type");
  RR_CHECK(buffers.slots.size() >= static_cast<size_t>(n - 1) && buffers.slot_bytes >= bytes, kRuntime,
           "ringreduce internal error: the one-shot needs ", n - 1, " receive buffers of ", bytes, " bytes, have ",
           buffers.slots.size(), " of ", buffers.slot_bytes);
  // Note [GPU one-shot all-reduce]: every rank's tensor to every other rank, in one group.
  std::vector<PeerOp> ops;
  OneShotLaunch l = launch;
  l.args.dst = buffers.data;
  for (int j = 0; j < n; ++j) {
    if (j == index) {
      l.args.in[j] = buffers.data;
      continue;
    }
    void* slot = buffers.slots[static_cast<size_t>(j < index ? j : j - 1)];
    l.args.in[j] = slot;
    ops.push_back(PeerOp{true, buffers.data, bytes, members[static_cast<size_t>(j)]});
    ops.push_back(PeerOp{false, slot, bytes, members[static_cast<size_t>(j)]});
  }
  for (int j = n; j < kOneShotMaxRanks; ++j) l.args.in[j] = nullptr;
  be.prepare(1, 1);
  beginCall(be, 1);
  be.group(ops, Launch::kHandOff);
  // The reduce reads every received tensor and overwrites the sent one: it waits for the group.
  be.record(Stream::kComm, 0);
  be.wait(Stream::kCompute, 0);
  be.reduceInOrder(l);
  endCall(be, caller_waits);
}

void enqueueRingCall(const Plan& plan, RedOp op, const DeviceBuffers& buffers, DeviceBackend& be, bool caller_waits) {
  std::vector<RingStage> stages(1);
  stages[0].plan = plan;
  stages[0].op = op;
  for (int i = 0; i < plan.sched.nranks; ++i) stages[0].members.push_back(i);
  enqueueRingStages(stages, buffers, be, caller_waits);
}

}  // namespace rr
