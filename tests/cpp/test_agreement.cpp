// The one frame all-gather (csrc/core/agreement.h) over the in-process transport: straight to
// every peer up to kDirectFrameRanks ranks, around the ring beyond, and around the ring on a
// transport that asks for neighbours only (Note [Frames around the ring]), also through a
// rank-list sub-ring (RankMapTransport). Every rank must get every rank's frame at its ring index.
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "core/agreement.h"
#include "core/error.h"
#include "support/inproc_transport.h"

using namespace rr;

namespace {

// Records the peers a rank sends to; says neighboursOnly() when asked to.
class PeerLog final : public Transport {
 public:
  PeerLog(Transport& t, bool neighbours_only, std::set<std::pair<int, int>>& pairs, std::mutex& mu)
      : t_(t), neighbours_only_(neighbours_only), pairs_(pairs), mu_(mu) {}
  int rank() const override { return t_.rank(); }
  int size() const override { return t_.size(); }
  int64_t isend(const void* d, size_t b, int peer, int tag) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pairs_.insert({t_.rank(), peer});
    }
    return t_.isend(d, b, peer, tag);
  }
  int64_t irecv(void* d, size_t b, int peer, int tag) override { return t_.irecv(d, b, peer, tag); }
  void wait(int64_t q) override { t_.wait(q); }
  void abandon() override { t_.abandon(); }
  bool neighboursOnly() const override { return neighbours_only_; }

 private:
  Transport& t_;
  bool neighbours_only_;
  std::set<std::pair<int, int>>& pairs_;
  std::mutex& mu_;
};

Frame frameOf(int rank) {
  Frame f;
  f.rank = rank;
  f.seq = 11;
  f.numel = 1000 + rank;
  return f;
}

struct Outcome {
  std::vector<std::vector<Frame>> frames;       // by group rank (empty for ranks that did not call)
  std::set<std::pair<int, int>> pairs;          // (sender, receiver), group ranks
  std::vector<std::string> errors;
};

// n ranks as threads; `members` (empty: all) is the ring over group ranks that calls.
Outcome exchange(int n, bool neighbours_only, const std::vector<int>& members = {}) {
  InprocOptions o;
  o.timeout = std::chrono::milliseconds(10000);
  o.max_delay_us = 50;
  o.seed = 5;
  auto hub = std::make_shared<InprocHub>(n, o);
  Outcome out;
  out.frames.resize(static_cast<size_t>(n));
  out.errors.resize(static_cast<size_t>(n));
  std::mutex mu;
  std::vector<int> ring = members;
  if (ring.empty())
    for (int r = 0; r < n; ++r) ring.push_back(r);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ring.size(); ++i) {
    const int r = ring[i];
    threads.emplace_back([&, r, i] {
      try {
        InprocTransport t(hub, r);
        PeerLog log(t, neighbours_only, out.pairs, mu);
        if (members.empty()) {
          out.frames[static_cast<size_t>(r)] = exchangeFrames(log, frameOf(r), 3);
        } else {
          RankMapTransport sub(log, members, static_cast<int>(i));
          out.frames[static_cast<size_t>(r)] = exchangeFrames(sub, frameOf(r), 3);
        }
      } catch (const std::exception& e) {
        out.errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

void checkFrames(const Outcome& out, const std::vector<int>& ring) {
  for (int r : ring) {
    CHECK_MSG(out.errors[static_cast<size_t>(r)].empty(), out.errors[static_cast<size_t>(r)]);
    const auto& got = out.frames[static_cast<size_t>(r)];
    CHECK_EQ(got.size(), ring.size());
    for (size_t i = 0; i < got.size() && i < ring.size(); ++i) {
      CHECK_EQ(got[i].rank, ring[i]);
      CHECK_EQ(got[i].numel, int64_t(1000 + ring[i]));
      CHECK_EQ(got[i].seq, uint64_t(11));
    }
  }
}

std::vector<int> iota(int n) {
  std::vector<int> v;
  for (int r = 0; r < n; ++r) v.push_back(r);
  return v;
}

}  // namespace

TEST_CASE(direct_frames_up_to_sixteen_ranks) {
  const Outcome out = exchange(5, false);
  checkFrames(out, iota(5));
  CHECK_EQ(out.pairs.size(), size_t(5 * 4));  // every ordered pair
}

TEST_CASE(ring_frames_beyond_sixteen_ranks) {
  const int n = kDirectFrameRanks + 2;
  const Outcome out = exchange(n, false);
  checkFrames(out, iota(n));
  CHECK_EQ(out.pairs.size(), size_t(n));  // r -> r + 1 only
  for (const auto& p : out.pairs) CHECK_EQ(p.second, (p.first + 1) % n);
}

TEST_CASE(neighbours_only_transport_gets_ring_frames) {
  const Outcome out = exchange(5, true);
  checkFrames(out, iota(5));
  CHECK_EQ(out.pairs.size(), size_t(5));
  for (const auto& p : out.pairs) CHECK_EQ(p.second, (p.first + 1) % 5);
}

TEST_CASE(sub_ring_forwards_neighbours_only) {
  const std::vector<int> members = {4, 1, 3};  // ring order 4 -> 1 -> 3 -> 4; ranks 0, 2 idle
  const Outcome out = exchange(5, true, members);
  checkFrames(out, members);
  const std::set<std::pair<int, int>> expect = {{4, 1}, {1, 3}, {3, 4}};
  CHECK(out.pairs == expect);
}

TEST_CASE(frame_agreement_refuses_a_neighbours_only_transport) {
  auto hub = std::make_shared<InprocHub>(2, InprocOptions{});
  InprocTransport t(hub, 0);
  std::set<std::pair<int, int>> pairs;
  std::mutex mu;
  PeerLog log(t, true, pairs, mu);
  FrameAgreement agreement(2, 0, 3, false);
  std::string what;
  try {
    agreement.send(log, frameOf(0));
  } catch (const Error& e) {
    what = e.what();
  }
  CHECK_MSG(what.find("internal error") != std::string::npos, what);
  CHECK(pairs.empty());
}

TEST_MAIN()
