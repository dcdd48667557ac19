// ringreduce core: the plan checker, which proves the ordering of a set of plans on the CPU.
//
// Note [Plan checker]
// ~~~~~~~~~~~~~~~~~~~
// The GPU transport interprets plans with NCCL calls, kernels and events on two streams; it can
// never run on a machine without GPUs. The checker runs the plans of all n ranks together under
// the execution model of Note [One ring, two transports, one plan] (plan.h) and fails on anything
// a transport could get wrong by following them. It works in three layers:
//
//   1. Static checks. Every op is well formed (queue, buffer, slot, bounds, widths); every event
//      is recorded once, on the queue its id names (exchangeEvent on kComm after its exchange,
//      computeEvent on kCompute), and before every wait on it in list order (the CPU executor
//      walks the list on one thread; cudaStreamWaitEvent on an unrecorded event is a no-op).
//      recv_only appears only on waits for exchange events (on either queue). Transports match
//      messages per (peer, tag) in posting order, so the k-th non-empty send of rank r must be
//      the k-th non-empty receive of rank r+1: same exchange index, same element count, same
//      element width.
//
//   2. Exact happens-before. Nodes: every op of each queue, plus the receive completion and the
//      send completion of each exchange. Edges: queue order (kCompute runs in order; kComm issues
//      in order), exchange issue -> both its completions, the sender's issue -> the receiver's
//      receive completion, the receive completion of exchange e -> every wait on exchangeEvent(e),
//      its send completion -> every full (not recv_only) wait on it, the kCompute record -> every
//      wait on computeEvent(e). Nothing else: a send may complete before its receiver posted
//      (eager transports), a record on kComm is taken to mean only "exchange e complete" (what the
//      CPU executor implements; the GPU stream event knows more), a recv_only wait only "its
//      receive complete" (the CPU executor; the GPU waits for both). A cycle is a deadlock. Vector
//      clocks carry two positions per rank (kCompute, kComm); knowing the receive completion of
//      exchange e reduces to knowing a wait on exchangeEvent(e), knowing its send completion to
//      knowing a full one. An exchange touches its send span (read) from its issue until its send
//      completion and its receive span (write) from its issue until its receive completion; a
//      reduce/copy touches its spans at one point. Any two accesses of one rank to overlapping
//      bytes of one buffer, at least one a write, must be ordered end -> start; otherwise it is a
//      data race (a missing or too weak wait, a staging slot reused before its reduce finished).
//      The plan must also end on kCompute knowing every exchange complete, both halves (the
//      tensor is handed back then).
//
//   3. Randomized simulation of values. Each element carries the set of ranks whose contribution
//      it holds (uint64 bitmask, so n <= 64), its logical index, the number of AVG divisions and a
//      hash of its reduction tree. Ops run with random delays (both the two-queue model of the GPU,
//      where a recv_only wait is a full wait, and the one-thread list walk of the CPU executor,
//      where it waits for the receive alone), sends complete only after the matching receive was
//      posted (the strict rendezvous, so deadlocks show) and independently of the receive of the
//      same exchange (in every other trial long after the receive), message data is read and
//      written at random moments inside the exchange. A write into bytes that a send of the same
//      rank has not finished sending is reported. A reduce must see disjoint masks of the same
//      element; a final reduce must produce the full mask on the chunk's owner and (AVG) divide
//      exactly once; copies must bring finished values; at the end every element of every rank
//      must hold the full mask, the right number of divisions and the same reduction tree.
//
// Halves (Note [Ring halves], plan.h). The phase mask, owner shift and AVG divisor are read from
// the plans; every rank must agree on them, the divisor must be at least the ring's size and the
// plan must hold exactly the exchanges of its halves (reduces consume reduce-scatter receives,
// copies all-gather ones). A reduce-scatter-only set starts like a full one and must end with rank
// r's owned chunk (sched.ownedChunk(r), under the shifted owner map) finished: full mask, and one
// division for AVG; the rest of its tensor is unspecified and not looked at. An all-gather-only set
// starts with rank r's owned chunk finished (full mask, the divisions AVG needs, a value that depends
// on the element only) and every other element empty (no contributions); anything unfinished that
// is copied or received into the tensor is reported, and at the end every element of every rank
// must be that finished value. The divisor itself only changes what the runtime divides by: the
// simulation counts one division per final reduce whatever it is, and AVG needs one unless the
// divisor is 1 (so a ring of one rank with a larger divisor, which has no reduce, is reported).
#pragma once

#include <string>
#include <vector>

#include "core/plan.h"

namespace rr {

struct CheckOptions {
  bool average = false;  // AVG: final reduces divide, finished elements carry exactly one division
  uint64_t seed = 1;
  int trials = 3;        // randomized simulations per execution model (two-queue and CPU list walk)
  bool happens_before = true;  // layer 2; tests turn it off to see what the simulations find alone
};

// Checks the plans of all ranks (plans[r] is rank r's, as built by buildPlan or altered by a
// test). Returns "" when they are correct, else a description of the first failure found.
std::string checkPlanSet(const std::vector<Plan>& plans, const CheckOptions& options);

// Builds the plan of every rank with buildPlan() and checks them; a failure message starts with
// the parameters. `opt.average` selects AVG semantics.
std::string checkPlans(int nranks, int64_t numel, DType dtype, const PlanOptions& opt, uint64_t seed,
                       int trials);

// Note [Lanes] (plan.h): checks the plan set of every lane 0..opt.lanes-1 (each as checkPlans does,
// finishing only its own elements), and that the lanes split the tensor: every element is touched
// by exactly one lane, the lane laneOfElement() names; so is every element of the partials buffer
// (kAccum, shared by the lanes: float32 partials, or a 16-bit wire's), by its chunk position.
std::string checkLanes(int nranks, int64_t numel, DType dtype, const PlanOptions& opt, uint64_t seed, int trials);

// One op of a plan as text ("op #12 compute reduce x5 data[8+4] = data[8+4] + slot1[0+4] final").
std::string describeOp(const Plan& plan, int op_index);

}  // namespace rr
