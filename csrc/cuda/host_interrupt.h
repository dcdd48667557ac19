// ringreduce GPU: Ctrl-C during the host waits of a CUDA call (torch-free, CUDA-free).
//
// Note [Interrupting a host wait on CUDA]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// (docs/reliability.md section 11, "How the GPU path waits on the host, and Ctrl-C".) The host waits
// a silent peer can stretch (NcclComm::waitReady(), hostWait(), CudaRing::makeRoom()) run with the
// GIL released, where CPython cannot run its SIGINT handler. So the torch layer opens a
// HostInterruptScope around such a call, whose poll takes the GIL and runs the signal handlers, and
// each wait asks an InterruptCheck at every turn: at most once per kInterruptPoll and never in the
// first, so a prompt hand-off never takes the GIL. On yes, the wait aborts the communicator (every
// lane's, in-flight works failed first) with interruptedReason() and throws kBackend. The answer is
// latched in the scope. The scope belongs to the thread that opened it (the watchdog, which must never
// wait for the GIL, sees none). A wait asks with no NcclComm lock held: a Python thread holding the GIL
// may be waiting for one.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <utility>

namespace rr {

// How often a blocked host wait asks for Ctrl-C, and how long before it asks first.
constexpr std::chrono::milliseconds kInterruptPoll{50};

class HostInterruptScope {
 public:
  // `poll`: true when the wait must stop (it may block briefly, e.g. for the GIL; never throws).
  explicit HostInterruptScope(std::function<bool()> poll) : poll_(std::move(poll)), previous_(current()) {
    current() = this;
  }
  ~HostInterruptScope() { current() = previous_; }
  HostInterruptScope(const HostInterruptScope&) = delete;
  HostInterruptScope& operator=(const HostInterruptScope&) = delete;

  // True once a wait of this scope was told to stop.
  bool interrupted() const { return interrupted_; }

  // The innermost scope of the calling thread, or null.
  static HostInterruptScope*& current() {
    static thread_local HostInterruptScope* scope = nullptr;
    return scope;
  }

 private:
  friend class InterruptCheck;
  std::function<bool()> poll_;
  HostInterruptScope* previous_;
  bool interrupted_ = false;
};

// One host wait's questions: construct it when the wait starts, ask requested() at each turn.
class InterruptCheck {
 public:
  InterruptCheck()
      : scope_(HostInterruptScope::current()), next_(std::chrono::steady_clock::now() + kInterruptPoll) {}

  bool requested() {
    if (scope_ == nullptr) return false;
    if (scope_->interrupted_) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_ || !scope_->poll_) return false;
    next_ = now + kInterruptPoll;
    if (scope_->poll_()) scope_->interrupted_ = true;
    return scope_->interrupted_;
  }

 private:
  HostInterruptScope* scope_;
  std::chrono::steady_clock::time_point next_;
};

// Why communicator `name` was aborted when `what` was interrupted; every later call reports it.
inline std::string interruptedReason(const std::string& name, const std::string& what) {
  return "ringreduce: " + name + " was interrupted on this rank (Ctrl-C or another signal while " + what +
         " waited for its peers); the group is unusable for ringreduce on this rank: destroy the process group "
         "(torch.distributed.destroy_process_group()) and create a new one to go on";
}

}  // namespace rr
