// ringreduce torch layer: the CPU collectives' glue between tensors and the torch-free group runtime
// (csrc/cpu/group_runtime.h): which memory a call reduces, its agreement frame, its completion as a
// torch future, and the registry of runtimes (one per process group and rank list).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
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
  friend std::shared_ptr<CpuCall> submitCpu(const c10::intrusive_ptr<c10d::ProcessGroup>&, const std::string&,
                                            const std::vector<int>&, const at::Tensor&, const at::Tensor&,
                                            const CallOptions&, const c10::intrusive_ptr<c10d::Store>&, bool,
                                            std::function<bool()>, bool);
  at::Tensor tensor_;  // the caller's tensor (undefined for a locally refused call)
  at::Tensor output_;  // reduce_scatter / all_gather: the result (the future's value)
  at::Tensor work_;    // the contiguous buffer the rings run over, when it is not tensor_
  CallOptions opt_;
  uint64_t seq_ = 0;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Submits a CPU call on the ring `members` (ranks of `pg`; empty: the whole group) of `pg`, whose
// runtime is created on first use. `tensor` may be undefined for a local refusal; `output`:
// reduce_scatter's output block or all_gather's concatenated result; `store`: the group's c10d
// store, where its ranks agree on shared memory (may be null: then never); `synchronous`: the caller
// waits for the call (Note [Synchronous calls in shared memory]); `interrupted`: Ctrl-C for a call that
// runs on the calling thread (GroupRuntime::submit).
std::shared_ptr<CpuCall> submitCpu(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& name,
                                   const std::vector<int>& members, const at::Tensor& tensor, const at::Tensor& output,
                                   const CallOptions& opt, const c10::intrusive_ptr<c10d::Store>& store,
                                   bool synchronous, std::function<bool()> interrupted = nullptr,
                                   bool with_future = true);

DType toDType(at::ScalarType t);  // throws kType for unsupported dtypes

}  // namespace rr
