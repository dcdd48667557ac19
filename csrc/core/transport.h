// ringreduce core: the Transport seam between the plan executor and a point-to-point backend.
//
// Implementations: the c10d transport (csrc/cpu/c10d_transport.h, gloo send/recv of the caller's
// process group), the NCCL frame transport (csrc/cuda/nccl_frame_transport.h, the GPU path's
// agreement frames) and the in-process transport of the tests (tests/support, threads as ranks).
// Ranks are ranks of the group. Tags identify one call; messages with equal (peer, tag) are
// matched in posting order. A transport lives as long as its group's runtime: requests may stay
// posted from one call to the next (Note [Pre-posted frame receives] in agreement.h).
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace rr {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Post a send/receive of `bytes` bytes. Returns a request id for wait(). The buffer must stay
  // valid and untouched until wait() returned for that request (or, after a failure, forever:
  // see abandon()).
  virtual int64_t isend(const void* data, size_t bytes, int peer, int tag) = 0;
  virtual int64_t irecv(void* data, size_t bytes, int peer, int tag) = 0;

  // Blocks until the request completed. Throws rr::Error(kBackend) on a transport failure, a dead
  // peer, or when the transport's timeout expires. Waiting twice for one request is allowed.
  virtual void wait(int64_t request) = 0;

  // After a failure: forget every pending request without freeing what it may still write into.
  // The caller keeps the receive buffers alive (late messages land there, never in user memory).
  virtual void abandon() = 0;

  // How long wait() waits before it throws (set per call: the group's timeout or an override).
  virtual void setTimeout(std::chrono::milliseconds timeout) { (void)timeout; }

  // Whether a send leaves only once the receiver has posted its receive (gloo's does): the runtime
  // then keeps receives posted ahead (Note [Pre-posted frame receives] in agreement.h).
  virtual bool rendezvousSends() const { return false; }

  // Whether messages should go to ring neighbours only (Note [Frames around the ring] in
  // agreement.h): true on NCCL, which connects a pair of ranks on its first message.
  virtual bool neighboursOnly() const { return false; }

  // The end of a call: the requests it waited for may be released now (a transport may keep them
  // until here when releasing one right after its wait costs more).
  virtual void callDone() {}

  // From any thread: wakes every wait() of this transport, pending or future, which then throws
  // rr::Error(kBackend) with `reason`; later posts throw too (Ctrl-C on a blocked call). Transports
  // that cannot interrupt a wait ignore it.
  virtual void interrupt(const std::string& reason) { (void)reason; }
};

// Note [Sub-rings by rank list]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A ring over some ranks of a parent group (a DeviceMesh dimension, a node of the hierarchical
// all-reduce, the ranks with one local rank across nodes) runs over the parent's transport: ring
// index i is parent rank members[i]. No process group is created for it, so nothing collective
// over the whole world ever happens lazily (torch's new_group is, and hangs when only some ranks
// reach it).
class RankMapTransport final : public Transport {
 public:
  RankMapTransport(Transport& parent, std::vector<int> members, int index)
      : parent_(parent), members_(std::move(members)), index_(index) {}
  int rank() const override { return index_; }
  int size() const override { return static_cast<int>(members_.size()); }
  int64_t isend(const void* data, size_t bytes, int peer, int tag) override {
    return parent_.isend(data, bytes, members_.at(static_cast<size_t>(peer)), tag);
  }
  int64_t irecv(void* data, size_t bytes, int peer, int tag) override {
    return parent_.irecv(data, bytes, members_.at(static_cast<size_t>(peer)), tag);
  }
  void wait(int64_t request) override { parent_.wait(request); }
  void abandon() override { parent_.abandon(); }
  bool neighboursOnly() const override { return parent_.neighboursOnly(); }

 private:
  Transport& parent_;
  std::vector<int> members_;
  int index_;
};

// Note [Traffic counters]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Payload bytes sent to each rank of the group (agreement frames are not payload): what the
// benchmark's traffic mode reports as cross-node bytes of the flat and hierarchical rings. The
// runtime posts payload through this decorator and frames around it.
class CountingTransport final : public Transport {
 public:
  // sent: one counter per rank of `parent` (read by other threads, hence atomic).
  CountingTransport(Transport& parent, std::atomic<int64_t>* sent) : parent_(parent), sent_(sent) {}
  int rank() const override { return parent_.rank(); }
  int size() const override { return parent_.size(); }
  int64_t isend(const void* data, size_t bytes, int peer, int tag) override {
    sent_[peer].fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    return parent_.isend(data, bytes, peer, tag);
  }
  int64_t irecv(void* data, size_t bytes, int peer, int tag) override { return parent_.irecv(data, bytes, peer, tag); }
  void wait(int64_t request) override { parent_.wait(request); }
  void abandon() override { parent_.abandon(); }

 private:
  Transport& parent_;
  std::atomic<int64_t>* sent_;
};

}  // namespace rr
