// ringreduce CPU: an in-process Transport where threads are the ranks, for tests without torch.
//
// InprocHub is the shared mailbox of one "group" of n ranks; InprocTransport is one rank's view.
// Sends and receives are matched per (src, dst, tag) in posting order, like gloo. A matched pair
// is delivered (one memcpy) by whichever side waits first once its random delay has passed (or,
// with InprocOptions::eager, at once when the second side posts), so
// data moves at a random moment between posting and completion: a plan that touches a buffer
// while an exchange on it is in flight shows it (and ThreadSanitizer sees it). A wait that is not
// satisfied within the hub's timeout throws rr::Error(kBackend), as a dead peer would make gloo do.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/plan.h"
#include "core/transport.h"

namespace rr {

struct InprocOptions {
  std::chrono::milliseconds timeout{10000};  // per wait()
  int64_t max_delay_us = 0;                  // each matched message is delivered after U[0, max] us
  uint64_t seed = 1;                         // for the delays
  // Deliver each message the moment its send and receive are both posted (on the posting thread),
  // the earliest any transport could: a receive posted while its buffer is still being read, or a
  // send whose buffer is not final yet, shows up as wrong data.
  bool eager = false;
  // A receive accepts a message smaller than itself, as gloo's does (only a larger one is an
  // error); otherwise any size difference is reported.
  bool short_messages = false;
};

class InprocHub {
 public:
  InprocHub(int nranks, InprocOptions options);
  int size() const { return nranks_; }
  const InprocOptions& options() const { return options_; }

 private:
  friend class InprocTransport;
  struct Request;
  // A matched pair. Requests own their delivery; the delivery only observes them (weak), so a
  // rank that abandons its requests leaves the copy into its (still alive) buffer possible.
  struct Delivery {
    std::weak_ptr<Request> send, recv;
    const void* src = nullptr;
    void* dst = nullptr;
    size_t bytes = 0;
    std::chrono::steady_clock::time_point ready;
    enum State { kPending, kCopying, kDone } state = kPending;
  };
  struct Request {
    int owner = 0;
    bool is_send = false;
    void* data = nullptr;
    size_t bytes = 0;
    int peer = 0;
    int tag = 0;
    bool done = false;
    std::string error;  // set when the request failed (size mismatch)
    std::shared_ptr<Delivery> delivery;
  };
  struct Channel {
    std::deque<std::shared_ptr<Request>> sends, recvs;
  };
  using ChannelKey = std::tuple<int, int, int>;  // src, dst, tag

  int64_t post(int rank, bool is_send, void* data, size_t bytes, int peer, int tag);
  void wait(int rank, int64_t id);
  void abandon(int rank);
  void matchLocked(Channel& ch);
  void deliver(std::unique_lock<std::mutex>& lk, Delivery& d);

  const int nranks_;
  const InprocOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::mt19937_64 rng_;
  std::map<ChannelKey, Channel> channels_;
  std::vector<std::unordered_map<int64_t, std::shared_ptr<Request>>> requests_;  // per rank
  std::vector<int64_t> next_id_;
};

class InprocTransport : public Transport {
 public:
  InprocTransport(std::shared_ptr<InprocHub> hub, int rank);
  int rank() const override { return rank_; }
  int size() const override { return hub_->size(); }
  int64_t isend(const void* data, size_t bytes, int peer, int tag) override;
  int64_t irecv(void* data, size_t bytes, int peer, int tag) override;
  void wait(int64_t request) override;
  void abandon() override;

 private:
  std::shared_ptr<InprocHub> hub_;
  int rank_;
};

// Result of one rank of runInprocAllReduce: "" when it succeeded, else the error text, and the
// error kind when it threw rr::Error.
struct InprocRankResult {
  std::string error;
  bool is_rr_error = false;
  ErrorKind kind = ErrorKind::kRuntime;
  double seconds = 0;
};

struct InprocRunOptions {
  PlanOptions plan;           // plan.average is set from `op`; phases, owner_shift, exact_chunks and
                              // avg_divisor select a half or a stage (Note [Ring halves], plan.h)
  InprocOptions transport;
  int tag = 7;
  std::vector<int> absent;    // ranks that never call (dead peers)
  // > 0: each rank runs PlanRun::postLeading(lead_room, lead_max_send) before run(), with staging
  // slots of at least lead_room bytes (set transport.short_messages).
  int64_t lead_room = 0;
  int64_t lead_max_send = 0;
};

// Runs the ring all-reduce of `op` with executePlan (ring_executor.h) on n threads over one hub:
// data[r] holds rank r's numel elements of `dtype` and is reduced in place. With options.plan
// naming one half, it runs that half instead: reduce-scatter only leaves rank r's owned chunk
// (plan.sched.ownedChunk(r); block r with owner_shift = -1 and exact_chunks) reduced and the rest
// unspecified; all-gather only expects each rank's owned chunk filled beforehand and leaves every
// rank with every chunk. A rank that throws abandons its transport; its staging stays alive until
// every thread has joined.
std::vector<InprocRankResult> runInprocAllReduce(int nranks, int64_t numel, DType dtype, RedOp op,
                                                 std::vector<std::vector<uint8_t>>& data,
                                                 const InprocRunOptions& options);

}  // namespace rr
