// ringreduce core: the Transport seam between the plan executor and a point-to-point backend.
//
// Implementations: the c10d ProcessGroup transport (csrc/torch/c10d_transport.cpp, gloo send/recv
// of the caller's group) and in-process fakes for tests (threads as ranks). Ranks are ranks of
// the group. Tags identify one call; messages with equal (peer, tag) are matched in posting order.
#pragma once

#include <chrono>
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

 private:
  Transport& parent_;
  std::vector<int> members_;
  int index_;
};

}  // namespace rr
