// ringreduce CPU runtime: the completion of one call as its handle reports it. Set exactly once
// (CallBody::complete, on the worker or the submitting thread), read from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "group_runtime.h"

namespace rr {

class CallStatus {
 public:
  // Blocks until the call is over or timeout_ms passed (< 0: forever); false on timeout.
  bool wait(int64_t timeout_ms) {
    std::unique_lock<std::mutex> lk(mu_);
    if (timeout_ms < 0) {
      cv_.wait(lk, [&] { return done_; });
      return true;
    }
    return cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return done_; });
  }
  bool isCompleted() { return read([&] { return done_; }); }
  bool ok() { return read([&] { return ok_; }); }
  ErrorKind errorKind() { return read([&] { return kind_; }); }  // valid once completed and !ok()
  std::string errorMessage() { return read([&] { return message_; }); }
  CallTiming timing() { return read([&] { return timing_; }); }

 protected:
  void setDone(bool ok, ErrorKind kind, const std::string& message, const CallTiming& timing) {
    {
      std::lock_guard<std::mutex> g(mu_);
      done_ = true;
      ok_ = ok;
      kind_ = kind;
      message_ = message;
      timing_ = timing;
    }
    cv_.notify_all();
  }

 private:
  template <typename F>
  auto read(F f) -> decltype(f()) {
    std::lock_guard<std::mutex> g(mu_);
    return f();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool ok_ = false;
  ErrorKind kind_ = ErrorKind::kRuntime;
  std::string message_;
  CallTiming timing_;
};

}  // namespace rr
