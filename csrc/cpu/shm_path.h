// ringreduce CPU: a ring's shared-memory medium, below GroupRuntime (which keeps the queue, the gloo
// point-to-point medium and failure handling). It owns the ring's segment and its hierarchical node
// stages' segment, sets each up at its first call, and runs a call through the ring's segment.
//
// Note [Two media below the ring]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A CPU ring's bytes move over one of two media. Messages: the group's Transport (gloo's
// point-to-point; csrc/core/transport.h), which the plan executor drives and which works across
// hosts. A segment: the ranks of one host map one shared-memory segment (ShmRing, shm_ring.h), and
// every rank reads all the others' pieces straight from it, one barrier a piece. Shared memory is not
// a Transport: as messages, every hop would copy a piece into the segment and out again, and the
// frames' comparison would take a message round; in a segment a call is one copy in, one in-order
// reduce and one barrier, and the frames are compared at the first barrier (docs/design.md section
// 2.3). So the seam is the call, not the message: GroupRuntime picks the medium per call (the ring's
// segment when every rank is on one host and the segment could be set up, else messages), and per
// ring stage of a hierarchical call (the node stages in the node's segment, the cross-node stage as
// messages). Both media reduce every element in the same order, so a result is bitwise the same on
// either (Note [Shared-memory all-reduce]).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../core/call_options.h"
#include "../core/collectives.h"
#include "call_body.h"
#include "shm_ring.h"
#include "shm_segment.h"

namespace rr {

class ShmPath {
 public:
  // `name`: the ring's, for messages; `ranks`: its group ranks in ring order (this process: `index`);
  // `whole_group`: the ring is the group in rank order; `store`: where ranks agree on segments (null:
  // never); `abort`: polled by every wait (Note [Interrupting a wait]).
  ShmPath(std::string name, std::vector<int> ranks, int index, bool whole_group,
          std::shared_ptr<KeyValueStore> store, AbortCheck abort);
  ShmPath(const ShmPath&) = delete;
  ShmPath& operator=(const ShmPath&) = delete;

  // The ring's first call decides (Note [Shared-memory segments]): a one-node call sets the segment
  // up (`want`: CallOptions::shm) and returns whether the ring runs in it; later calls return that.
  bool ensure(bool want, std::chrono::milliseconds timeout);
  // A call whose ring spans several nodes: says so in info() if nothing was decided yet.
  void spansNodes();
  // Whether the ring runs in its segment (from any thread).
  bool ready() const { return ready_.load(std::memory_order_acquire); }

  // A call through the ring's segment (after ensure() returned true): the frames (`mine`, compared
  // at the first barrier; a verdict raises on every rank), then the collective on `buf`, then
  // `body.finish`. Returns false, with nothing run after the frames, for an all-reduce with
  // algorithm="hierarchical" on one host, whose stages the caller runs. `stages` gives a call's ring
  // stages (GroupRuntime::stagesFor).
  bool run(const CallOptions& opt, const Frame& mine, const CallBuffer& buf, bool refused, uint64_t seq,
           CallBody& body, const std::function<std::vector<RingStage>()>& stages, CallTiming& timing);
  // Before run(): the call's timeout and its barriers' spin cap (short for an async call on the
  // worker, whose spin would take the core of the caller's own work: Note [Synchronous calls in
  // shared memory]).
  void arm(std::chrono::milliseconds timeout, std::chrono::microseconds spin);

  // The node ring of a hierarchical call (`node_stage`: its stage 1) in the node's segment, set up
  // at the first hierarchical call; null when its ranks cannot share memory (the node stages then
  // go as messages).
  ShmRing* node(bool want, const RingStage& node_stage, std::chrono::milliseconds timeout);

  // The segments mapped, in full on every rank that maps them (Note [Shared-memory segments]).
  int64_t memoryBytes();
  // "" before the first call, then "shm", "tcp" or "tcp (<why not>)", plus "; node stages: ..."
  // once a hierarchical call set its node ring up.
  std::string info();

 private:
  // Agrees on and maps one segment for the ring `ranks` (this process: `index`) under the store keys
  // of `ring_id`; null with `why` when it cannot.
  std::unique_ptr<ShmRing> setUp(const std::string& ring_id, const std::vector<int>& ranks, int index, bool want,
                                 std::chrono::milliseconds timeout, std::string* why);

  std::string name_;
  std::vector<int> ranks_;
  int index_;
  int size_;
  bool whole_group_;
  std::shared_ptr<KeyValueStore> store_;
  AbortCheck abort_;
  std::atomic<bool> ready_{false};

  // Worker-owned after setup; the states and the sizes are read by other threads under mu_.
  std::mutex mu_;
  std::unique_ptr<ShmRing> ring_;
  bool tried_ = false;
  std::string state_;  // "" until the ring's first call decided it
  std::unique_ptr<ShmRing> node_;
  std::vector<int> node_members_;
  bool node_tried_ = false;
  std::string node_state_;
};

}  // namespace rr
