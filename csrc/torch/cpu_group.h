// ringreduce torch layer: the CPU path. One GroupRuntime per c10d process group: a worker thread
// with a queue that runs calls in submission order over the group's gloo backend (send/recv of
// the caller's own ProcessGroup), and the ringreduce-owned staging memory they receive into.
//
// Note [Why one worker per group]
// A single global worker deadlocks when ranks order async calls on two groups differently: rank 0
// runs group A's ring and waits for rank 1, which is stuck behind group B's ring in the same queue.
// With one queue per group, each group's calls run in the order every rank submitted them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/dtype.h"
#include "../core/error.h"
#include "../core/frame.h"

namespace rr {

// Reserved tag range: frames travel on kFrameTag (matched in order, so a rank that skipped a call
// is reported by sequence number); the payload of call #seq on kPayloadTagBase + seq mod range.
constexpr int kFrameTag = 1 << 30;
constexpr int kPayloadTagBase = (1 << 30) + 1;
constexpr int kPayloadTagRange = (1 << 30) - 2;

struct CallOptions {
  RedOp op = RedOp::kSum;
  bool accum_float32 = false;
  int32_t kind = 0;           // CallKind
  int32_t local_error = 0;    // FrameError: this rank refuses; exchange frames only
  int32_t ntensors = 1;
  bool check = true;          // exchange agreement frames first
  int64_t segment_bytes = 1 << 20;
  int32_t num_slots = 4;
  int64_t timeout_ms = -1;    // <0: the group's own timeout
};

// One submitted call: what Python's Work wraps.
class CallHandle {
 public:
  // Blocks (the caller releases the GIL) until done or until timeout_ms (<0: forever).
  bool wait(int64_t timeout_ms);
  bool isCompleted();
  bool ok();
  int errorKind();  // ErrorKind as int; valid when completed and !ok()
  std::string errorMessage();
  uint64_t seq() const { return seq_; }
  c10::intrusive_ptr<c10::ivalue::Future> future() const { return future_; }

 private:
  friend class GroupRuntime;
  void finish(bool ok, int kind, const std::string& msg);

  at::Tensor tensor_;
  CallOptions opt_;
  uint64_t seq_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool ok_ = false;
  int error_kind_ = 0;
  std::string error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class GroupRuntime {
 public:
  GroupRuntime(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string name);
  ~GroupRuntime();

  // Submit a call (tensor may be undefined for a local refusal); assigns the sequence number.
  // With run_inline, a call that would run next anyway (queue empty, worker idle) runs on the
  // calling thread (which has released the GIL): a synchronous call then costs no thread handoff.
  // Otherwise the call is queued for the worker, behind the calls submitted before it.
  std::shared_ptr<CallHandle> submit(const at::Tensor& tensor, const CallOptions& opt, bool run_inline);
  void shutdown();  // finish queued calls, join the worker
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  void loop();
  void execute(CallHandle& call);  // run() + timing + completion, never throws
  void run(CallHandle& call);
  std::chrono::milliseconds timeoutFor(const CallOptions& opt) const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<CallHandle>> queue_;
  bool stop_ = false;
  bool busy_ = false;  // a call is executing (on the worker or inline)
  uint64_t next_seq_ = 0;
  bool poisoned_ = false;
  std::string poison_reason_;
  std::thread worker_;

  // Worker-owned memory (never touched by the submitting thread).
  std::vector<std::unique_ptr<char[]>> slots_;
  int64_t slot_bytes_ = 0;
  std::vector<float> accum_;
};

// The registry: one runtime per ProcessGroup object, created on first use.
std::shared_ptr<GroupRuntime> runtimeFor(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                         const std::string& name);
void shutdownAll();

DType toDType(at::ScalarType t);  // throws kType for unsupported dtypes

}  // namespace rr
