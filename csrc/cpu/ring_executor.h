// ringreduce CPU: executes a Plan over a Transport on the calling thread.
#pragma once

#include <vector>

#include "../core/frame.h"
#include "../core/plan.h"
#include "../core/transport.h"

namespace rr {

struct RingBuffers {
  void* data = nullptr;            // numel contiguous elements of plan.dtype
  void* accum = nullptr;           // plan.accum_elems float32 (may be null when 0)
  std::vector<void*> slots;        // plan.num_slots buffers of plan.slot_elems widest elements
};

// Exchange e of a call uses tag + (e mod kTagsPerCall).
constexpr int kTagsPerCall = 4096;

// Runs every op of `plan` in list order: exchanges are posted (several in flight), waits block on
// the requests of the exchange they name (recv_only waits on its receive request alone), reduces
// and copies run inline. All messages use `tag`.
// Throws whatever the transport throws; the caller then abandons the transport and keeps
// `buffers` alive.
void executePlan(const Plan& plan, RedOp op, Transport& transport, const RingBuffers& buffers, int tag);

// Up to this many ranks, frames go straight to every peer (one latency); beyond, around the ring.
constexpr int kDirectFrameRanks = 16;

// All-gather of one fixed-size frame: returns every rank's frame, indexed by rank.
std::vector<Frame> exchangeFrames(Transport& transport, const Frame& mine, int tag);

}  // namespace rr
