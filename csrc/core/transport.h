// ringreduce core: the Transport seam between the plan executor and a point-to-point backend.
//
// Implementations: the c10d ProcessGroup transport (csrc/torch/c10d_transport.cpp, gloo send/recv
// of the caller's group) and in-process fakes for tests (threads as ranks). Ranks are ranks of
// the group. Tags identify one call; messages with equal (peer, tag) are matched in posting order.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

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

}  // namespace rr
