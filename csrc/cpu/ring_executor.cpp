#include "ring_executor.h"

#include <cstring>

#include "../core/error.h"
#include "host_reduce.h"

namespace rr {

namespace {

char* spanPtr(const Plan& plan, const RingBuffers& b, const Span& s) {
  const int64_t elem = spanElemSize(plan, s);
  char* base = nullptr;
  switch (s.buf) {
    case BufKind::kData: base = static_cast<char*>(b.data); break;
    case BufKind::kAccum: base = static_cast<char*>(b.accum); break;
    case BufKind::kStaging: base = static_cast<char*>(b.slots.at(static_cast<size_t>(s.slot))); break;
    case BufKind::kNone: break;
  }
  RR_CHECK(base != nullptr, kRuntime, "ringreduce internal error: plan names a missing buffer");
  return base + s.offset * elem;
}

size_t spanBytes(const Plan& plan, const Span& s) {
  return static_cast<size_t>(s.count * spanElemSize(plan, s));
}

}  // namespace

PlanRun::PlanRun(const Plan& plan, RedOp op, Transport& t, const RingBuffers& buffers, int tag)
    : plan_(plan), op_(op), t_(t), buffers_(buffers), tag_(tag), pending_(static_cast<size_t>(plan.num_exchanges)) {
  // Note [Receives posted early]
  // gloo's send is a rendezvous, so a receive posted with its exchange's send (as the plan lists
  // them) costs a round trip to every exchange whose send waited for a reduce. A receive's slot is
  // free once the last compute that reads it has run (computes run inline, in list order), so each
  // receive is posted right after that op (after the first exchange for a slot not read before), in
  // exchange order, and the exchange op posts only its send. Only the moment a receive is posted
  // moves, never before its slot is free (the executor tests also check eager delivery).
  const int64_t nops = static_cast<int64_t>(plan.ops.size());
  post_after_.resize(static_cast<size_t>(nops + 1));  // index i+1: after op i; index 0: before op 0
  bool sends_from_staging = false;  // never in plans; a send would read the slot until it completes
  for (const Op& o : plan.ops)
    if (o.kind == OpKind::kExchange && !o.send.empty() && o.send.buf == BufKind::kStaging) sends_from_staging = true;
  if (!sends_from_staging) {
    std::vector<int64_t> last_reader(static_cast<size_t>(plan.num_slots), -1);
    std::vector<int64_t> last_receiver(static_cast<size_t>(plan.num_slots), -1);
    int64_t first_exchange = -1;  // op index of the first exchange that receives
    for (int64_t i = 0; i < nops; ++i) {
      const Op& o = plan.ops[static_cast<size_t>(i)];
      if ((o.kind == OpKind::kReduce || o.kind == OpKind::kCopy) && o.recv.buf == BufKind::kStaging)
        last_reader[static_cast<size_t>(o.recv.slot)] = i;
      // Note [16-bit all-gather] (plan.h): a convert also reads a slot, to forward it.
      if (o.kind == OpKind::kConvert && o.a.buf == BufKind::kStaging) last_reader[static_cast<size_t>(o.a.slot)] = i;
      if (o.kind != OpKind::kExchange || o.recv.empty() || o.recv.buf != BufKind::kStaging) continue;
      const size_t k = static_cast<size_t>(o.recv.slot);
      // A slot received into and not yet read (never in a valid plan): post with the exchange.
      const bool free_early = last_receiver[k] <= last_reader[k];
      if (first_exchange < 0) first_exchange = i;
      int64_t at = free_early ? last_reader[k] + 1 : i;
      // The first exchange goes out first; receives that could go at the very start follow it.
      if (at <= first_exchange) at = i == first_exchange ? i : first_exchange + 1;
      post_after_[static_cast<size_t>(at)].push_back(o.exchange);
      last_receiver[k] = i;
    }
  }
  exchange_op_.assign(static_cast<size_t>(plan.num_exchanges), nullptr);
  for (const Op& o : plan.ops)
    if (o.kind == OpKind::kExchange) exchange_op_[static_cast<size_t>(o.exchange)] = &o;
  // The leading exchange: the first, when only records, or converts (Note [First hop]) and the
  // waits for them, precede it; with converts its send waits for run(), after the verdict.
  for (int64_t i = 0; i < nops; ++i) {
    const Op& o = plan.ops[static_cast<size_t>(i)];
    if (o.kind == OpKind::kRecord) continue;
    if (o.kind == OpKind::kConvert || (o.kind == OpKind::kWait && !plan.isExchangeEvent(o.event))) {
      lead_send_allowed_ = false;
      continue;
    }
    if (o.kind == OpKind::kExchange) lead_op_ = i;
    break;
  }
}

std::vector<int> PlanRun::postLeading(size_t recv_room, size_t max_send) {
  std::vector<int> slots;
  if (lead_op_ < 0) return slots;
  for (int64_t at = 0; at <= lead_op_; ++at)
    for (int32_t e : post_after_[static_cast<size_t>(at)])
      if (postReceive(e, recv_room)) slots.push_back(exchange_op_[static_cast<size_t>(e)]->recv.slot);
  const Op& first = plan_.ops[static_cast<size_t>(lead_op_)];
  Pending& p = pending_.at(static_cast<size_t>(first.exchange));
  if (lead_send_allowed_ && !first.send.empty() && spanBytes(plan_, first.send) <= max_send) {
    p.send = t_.isend(spanPtr(plan_, buffers_, first.send), spanBytes(plan_, first.send), plan_.next,
                      tag_ + (first.exchange % kTagsPerCall));
    p.send_posted = true;
    lead_send_ = p.send;
  }
  return slots;
}

bool PlanRun::postsLeadingReceive() const {
  for (int64_t at = 0; at <= lead_op_; ++at)
    for (int32_t e : post_after_[static_cast<size_t>(at)]) {
      const Pending& p = pending_.at(static_cast<size_t>(e));
      if (!p.recv_posted && !exchange_op_[static_cast<size_t>(e)]->recv.empty()) return true;
    }
  return false;
}

bool PlanRun::postReceive(int32_t e, size_t room) {
  const Op& o = *exchange_op_[static_cast<size_t>(e)];
  Pending& p = pending_.at(static_cast<size_t>(e));
  if (p.recv_posted || o.recv.empty()) return false;
  const size_t bytes = spanBytes(plan_, o.recv);
  if (room < bytes) room = bytes;
  const int64_t offset = o.recv.offset * spanElemSize(plan_, o.recv);
  const size_t slot = static_cast<size_t>(o.recv.slot);
  RR_CHECK(room == bytes || (o.recv.buf == BufKind::kStaging && slot < buffers_.slot_room.size() &&
                             buffers_.slot_room[slot] - offset >= static_cast<int64_t>(room)),
           kRuntime, "ringreduce internal error: a leading receive needs ", room, " bytes of staging");
  p.recv = t_.irecv(spanPtr(plan_, buffers_, o.recv), room, plan_.prev, tag_ + (e % kTagsPerCall));
  p.recv_posted = true;
  return true;
}

void PlanRun::postReceives(int64_t at) {
  for (int32_t e : post_after_[static_cast<size_t>(at)]) postReceive(e, 0);
}

void PlanRun::run() {
  // A recv_only wait (Note [One ring, two transports, one plan]) waits the receive request only;
  // a full wait also the send request, whenever it comes.
  auto waitExchange = [&](int32_t e, bool recv_only) {
    Pending& p = pending_.at(static_cast<size_t>(e));
    if (!p.recv_waited) {
      if (p.recv >= 0) t_.wait(p.recv);
      p.recv_waited = true;
    }
    if (recv_only || p.send_waited) return;
    if (p.send >= 0) t_.wait(p.send);
    p.send_waited = true;
  };
  postReceives(0);
  int64_t op_index = 0;
  for (const Op& o : plan_.ops) {
    switch (o.kind) {
      case OpKind::kExchange: {
        Pending& p = pending_.at(static_cast<size_t>(o.exchange));
        // Receive first. One tag per exchange (mod kTagsPerCall): exchanges in flight on one tag
        // make gloo match them strictly one after another, each paying a full round trip.
        const int xtag = tag_ + (o.exchange % kTagsPerCall);
        postReceive(o.exchange, 0);
        if (!o.send.empty() && !p.send_posted)
          p.send = t_.isend(spanPtr(plan_, buffers_, o.send), spanBytes(plan_, o.send), plan_.next, xtag);
        break;
      }
      case OpKind::kWait:
        // Exchange events wait for requests; compute events name ops that already ran inline.
        if (plan_.isExchangeEvent(o.event)) waitExchange(o.event / 2, o.recv_only);
        break;
      case OpKind::kRecord:
        break;
      case OpKind::kReduce:
        hostReduce(op_, spanPtr(plan_, buffers_, o.a), o.a.type, spanPtr(plan_, buffers_, o.recv), o.recv.type,
                   spanPtr(plan_, buffers_, o.dst), o.dst.type, o.dst.count, plan_.scaling(op_, o));
        break;
      case OpKind::kConvert:
        hostConvert(spanPtr(plan_, buffers_, o.a), o.a.type, spanPtr(plan_, buffers_, o.dst), o.dst.type, o.dst.count,
                    plan_.convertPredivide(o));
        break;
      case OpKind::kCopy:
        if (o.recv.type != o.dst.type) {  // Note [16-bit all-gather] (plan.h): 16 bits received, widened
          hostConvert(spanPtr(plan_, buffers_, o.recv), o.recv.type, spanPtr(plan_, buffers_, o.dst), o.dst.type,
                      o.dst.count, 0);
          break;
        }
        std::memcpy(spanPtr(plan_, buffers_, o.dst), spanPtr(plan_, buffers_, o.recv), spanBytes(plan_, o.dst));
        break;
    }
    postReceives(++op_index);
  }
  // The plan ends with full waits for every exchange; this only checks it.
  for (int32_t e = 0; e < plan_.num_exchanges; ++e) {
    const Pending& p = pending_[static_cast<size_t>(e)];
    RR_CHECK((p.send < 0 || p.send_waited) && (p.recv < 0 || p.recv_waited), kRuntime,
             "ringreduce internal error: plan left the ", p.recv >= 0 && !p.recv_waited ? "receive" : "send",
             " of exchange ", e, " unwaited");
  }
}

void executePlan(const Plan& plan, RedOp op, Transport& t, const RingBuffers& buffers, int tag) {
  PlanRun(plan, op, t, buffers, tag).run();
}

}  // namespace rr
