// ringreduce CPU: what a ring's call carries from its caller (csrc/torch/cpu_ops.cpp implements it) to
// the media that move its bytes (group_runtime.h over gloo point-to-point, shm_path.h through shared
// memory). Torch-free.
#pragma once

#include <cstdint>
#include <string>

#include "../core/dtype.h"
#include "../core/error.h"
#include "../core/frame.h"

namespace rr {

// The memory a call's rings run over: `numel` contiguous elements of `dtype`.
struct CallBuffer {
  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
};

// Where a completed call spent its time (RINGREDUCE_DEBUG=DETAIL logs it).
struct CallTiming {
  double check_us = 0;  // the agreement frames (0 with the check off)
  double ring_us = 0;   // the stages, copies included
};

// The caller's side of one call: its memory and its completion (the torch glue implements it).
class CallBody {
 public:
  virtual ~CallBody() = default;
  // This rank's agreement frame; the runtime fills in rank and sequence number.
  virtual Frame frame() const = 0;
  // On the worker, before the frames are compared (never for a locally refused call): the buffer
  // the rings run over. It may not change anything the caller can see (a working copy, a private
  // copy of the input, or a fresh output).
  virtual CallBuffer prepare(int ring_rank, int ring_size) = 0;
  // On the worker, after every ring succeeded: results to where the caller expects them.
  virtual void finish(int ring_rank, int ring_size) = 0;
  // Exactly once, when the call is over (on the worker, or on the submitting thread when the
  // group is already unusable). Must not throw.
  virtual void complete(bool ok, ErrorKind kind, const std::string& message, const CallTiming& timing) = 0;
};

}  // namespace rr
