// ringreduce CPU: executes a Plan over a Transport on the calling thread.
#pragma once

#include <vector>

#include "../core/plan.h"
#include "../core/transport.h"

namespace rr {

struct RingBuffers {
  void* data = nullptr;            // numel contiguous elements of plan.dtype
  void* accum = nullptr;           // plan.accumBytes() (may be null when 0)
  std::vector<void*> slots;        // plan.num_slots buffers of plan.slot_elems widest elements
  std::vector<int64_t> slot_room;  // bytes each slot holds, when larger than the plan needs (empty: exact)
};

// Exchange e of a call uses tag + (e mod kTagsPerCall).
constexpr int kTagsPerCall = 4096;

// One execution of a plan, in two steps: postLeading while the caller still waits for the frames
// (Note [Receives before the verdict] in group_runtime.cpp), then run(). `plan`, `transport` and
// `buffers` must outlive the PlanRun.
class PlanRun {
 public:
  PlanRun(const Plan& plan, RedOp op, Transport& transport, const RingBuffers& buffers, int tag);
  // Posts what run() would post first: the receives of the first exchange (and of those posted with
  // it), each with room for at least `recv_room` bytes (RingBuffers::slot_room), and the first
  // exchange's send when it is at most `max_send` bytes and only records precede it. Returns the
  // staging slots the receives land in. Once, before run().
  std::vector<int> postLeading(size_t recv_room, size_t max_send);
  // Whether postLeading would post at least one receive (known before it is called).
  bool postsLeadingReceive() const;
  // The first exchange's send request, when postLeading posted it (else -1).
  int64_t leadingSend() const { return lead_send_; }
  // Runs every op in list order (see executePlan). Once per PlanRun.
  void run();

 private:
  struct Pending {  // requests of one exchange (-1: that half is empty)
    int64_t send = -1;
    int64_t recv = -1;
    bool send_waited = false;
    bool recv_waited = false;
    bool recv_posted = false;  // posted early (Note [Receives posted early])
    bool send_posted = false;  // posted by postLeading
  };
  // Posts exchange e's receive unless posted (or empty), with room for at least `room` bytes;
  // returns whether it posted.
  bool postReceive(int32_t e, size_t room);
  void postReceives(int64_t at);  // the receives posted after op at-1

  const Plan& plan_;
  RedOp op_;
  Transport& t_;
  const RingBuffers& buffers_;
  int tag_;
  std::vector<Pending> pending_;
  std::vector<std::vector<int32_t>> post_after_;  // index i+1: receives posted after op i
  std::vector<const Op*> exchange_op_;
  int64_t lead_op_ = -1;    // the leading exchange's op (see the constructor), or -1
  bool lead_send_allowed_ = true;  // no op but records precedes it: postLeading may send
  int64_t lead_send_ = -1;
};

// Runs every op of `plan` in list order: exchanges are posted (several in flight), waits block on
// the exchange's requests (recv_only: the receive alone), computes run inline. Throws whatever the
// transport throws; the caller then abandons the transport and keeps `buffers` alive.
void executePlan(const Plan& plan, RedOp op, Transport& transport, const RingBuffers& buffers, int tag);

}  // namespace rr
