// ringreduce CPU: the Transport over the point-to-point calls of a c10d backend (gloo send/recv of
// the caller's own process group), the transport of every CPU ring; and the group's c10d store as the
// runtime's KeyValueStore.
//
// Note [gloo pair locks]
// ~~~~~~~~~~~~~~~~~~~~~~
// gloo's send is a rendezvous: a message leaves once the receiver's "receive posted" notice arrived.
// Every post takes the pair's lock and writes a notice under it, and gloo's I/O thread only
// try-locks a pair and returns to level-triggered epoll: a notice arriving while a worker posts or
// writes a segment makes the I/O thread spin, taking the CPU the lock holder needs on an
// oversubscribed host. Hence the runtime posts receives as early as it can (Note [Staging slots] in
// csrc/core/plan.h; Note [Pre-posted frame receives] in csrc/core/agreement.h).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../core/transport.h"
#include "shm_segment.h"

namespace rr {

class C10dTransport final : public Transport {
 public:
  // `backend`: the group's CPU backend; rank/size: the group's; `group`: its name, for messages.
  C10dTransport(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size, std::string group);
  ~C10dTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int64_t isend(const void* data, size_t bytes, int peer, int tag) override;
  int64_t irecv(void* data, size_t bytes, int peer, int tag) override;
  void wait(int64_t request) override;
  void abandon() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  bool rendezvousSends() const override { return true; }
  void callDone() override;
  void interrupt(const std::string& reason) override;
  bool close() override;

  // The backend's own timeout (the process group's), or 30 minutes when it has none.
  std::chrono::milliseconds defaultTimeout() const;

 private:
  template <typename F>
  int64_t post(F&& f, const char* verb, int peer);

  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_;
  int size_;
  std::string group_;
  std::chrono::milliseconds timeout_{std::chrono::minutes(30)};
  struct Request {
    c10::intrusive_ptr<c10d::Work> work;
    bool waited = false;
  };
  // Note [Interrupting a wait]: requests_ is shared with interrupt(), which runs on another thread.
  std::mutex mu_;
  std::unordered_map<int64_t, Request> requests_;
  // abandon()'s requests, which may still be pending inside gloo: kept until close()
  std::vector<c10::intrusive_ptr<c10d::Work>> abandoned_;
  int64_t next_id_ = 0;
  std::string interrupted_;  // non-empty once interrupt() ran: why
  bool closed_ = false;
  bool released_ = true;  // what close() returned
};

// The process group's c10d store as the runtime's KeyValueStore (Note [Shared-memory segments]).
class C10dKeyValue final : public KeyValueStore {
 public:
  explicit C10dKeyValue(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  bool tryGet(const std::string& key, std::string* value) override {
    if (!store_->check({key})) return false;
    const std::vector<uint8_t> v = store_->get(key);
    value->assign(v.begin(), v.end());
    return true;
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace rr
