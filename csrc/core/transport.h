// ringreduce core: the Transport seam between the plan executor and a point-to-point backend
// (gloo: csrc/cpu/c10d_transport.h; NCCL frames: csrc/cuda/nccl_frame_transport.h; tests/support).
// Ranks are the group's. Messages with equal (peer, tag) match in posting order. Requests may stay
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

  // Posts a send/receive; returns a request id for wait(). The buffer must stay valid and untouched
  // until wait() returned for it (after a failure, forever: see abandon()).
  virtual int64_t isend(const void* data, size_t bytes, int peer, int tag) = 0;
  virtual int64_t irecv(void* data, size_t bytes, int peer, int tag) = 0;

  // Blocks until the request completed; throws rr::Error(kBackend) on a failure, a dead peer or the
  // timeout. Waiting twice for one request is allowed.
  virtual void wait(int64_t request) = 0;

  // After a failure: forget every pending request without freeing what it may still write into
  // (the caller keeps the receive buffers alive).
  virtual void abandon() = 0;

  // How long wait() waits before it throws (set per call).
  virtual void setTimeout(std::chrono::milliseconds timeout) { (void)timeout; }

  // Whether a send leaves only once the receiver posted its receive (gloo): Note [Pre-posted frame
  // receives] in agreement.h.
  virtual bool rendezvousSends() const { return false; }

  // Whether messages should go to ring neighbours only (NCCL): Note [Frames around the ring].
  virtual bool neighboursOnly() const { return false; }

  // The end of a call: the requests it waited for may be released now.
  virtual void callDone() {}

  // From any thread (Ctrl-C): every wait(), pending or future, and every later post throws
  // rr::Error(kBackend) with `reason`. Transports that cannot interrupt a wait ignore it.
  virtual void interrupt(const std::string& reason) { (void)reason; }

  // Once no thread uses the transport any more (its ring's worker joined): drops every request it
  // still holds, pending or abandoned, and returns true when nothing can write into their buffers
  // afterwards; false (the default) when it cannot promise that, and the caller then keeps them
  // (Note [Releasing a ring's buffers] in csrc/cpu/group_runtime.h). Nothing may be posted after it.
  virtual bool close() { return false; }
};

// Note [Sub-rings by rank list]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A ring over some ranks of a parent group (a DeviceMesh dimension, a node's ranks) runs over the
// parent's transport: ring index i is parent rank members[i]. No process group is created for it:
// torch's new_group is collective over the world and hangs when only some ranks reach it.
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
// Payload bytes (not frames) sent to each rank of the group, which the benchmark's traffic mode
// reports. The runtime posts payload through this decorator and frames around it.
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
