// ringreduce torch layer: the CPU collectives' glue between tensors and the torch-free group runtime
// (csrc/cpu/group_runtime.h): which memory a call reduces, its agreement frame, its completion as a
// torch future, and the ring's runtime (one per process group and rank list: runtime_registry.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../cpu/call_status.h"
#include "../cpu/group_runtime.h"

namespace rr {

// One submitted CPU call: what Python's Work wraps ("CallHandle" in Python).
class CpuCall final : public CallBody, public CallStatus {
 public:
  // `with_future`: whether future() exists (a synchronous call's handle never hands one out).
  CpuCall(at::Tensor tensor, at::Tensor output, CallOptions opt, bool with_future = true);

  uint64_t seq() const { return seq_; }
  c10::intrusive_ptr<c10::ivalue::Future> future() const { return future_; }

  // CallBody
  Frame frame() const override;
  CallBuffer prepare(int ring_rank, int ring_size) override;
  void finish(int ring_rank, int ring_size) override;
  void complete(bool ok, ErrorKind kind, const std::string& message, const CallTiming& timing) override;

 private:
  friend class CpuRing;
  at::Tensor tensor_;  // the caller's tensor (undefined for a locally refused call)
  at::Tensor output_;  // reduce_scatter / all_gather: the result (the future's value)
  at::Tensor work_;    // the contiguous buffer the rings run over, when it is not tensor_
  CallOptions opt_;
  uint64_t seq_ = 0;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The ring `members` (ranks of `pg`; empty: all) of `pg` (ringreduce._C.CpuRing), `name` in messages;
// `store`: the group's c10d store, where its ranks agree on shared memory (null: they never do).
//
// Note [A bound ring]
// ~~~~~~~~~~~~~~~~~~~
// Each Python ring (ringreduce/_rings/cpu.py CpuRing) binds one when it is made, so that a call neither
// converts the group, name, rank list and store from Python nor looks the ring's runtime up in the
// registry (runtime_registry.h). It holds its runtime weakly: a released ring (its group destroyed)
// is freed as if no Python ring held it (shared memory, worker, sockets), and a call after that looks
// the registry up again.
class CpuRing {
 public:
  CpuRing(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string name, std::vector<int> members,
          c10::intrusive_ptr<c10d::Store> store);
  // Submits a call (the runtime is made at the ring's first). `tensor`: undefined for a local refusal;
  // `output`: reduce_scatter's block, all_gather's result; `synchronous`: the caller waits (Note
  // [Synchronous calls in shared memory]); `interrupted`: Ctrl-C for an inline call (GroupRuntime::submit).
  std::shared_ptr<CpuCall> submit(const at::Tensor& tensor, const at::Tensor& output, const CallOptions& opt,
                                  bool synchronous, std::function<bool()> interrupted, bool with_future);

 private:
  std::shared_ptr<GroupRuntime> runtime();  // the bound runtime, or the registry's (then bound)
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::string name_;
  std::vector<int> members_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::mutex mu_;  // guards rt_ (calls from several threads)
  std::weak_ptr<GroupRuntime> rt_;
};

DType toDType(at::ScalarType t);  // throws kType for unsupported dtypes

}  // namespace rr
